"""``meshtrain prepare --format preference`` (:mod:`meshtrain.data.preference`): each {prompt, chosen, rejected}
pair as two documents, chosen then rejected, with completion-only loss masks.

TRL is not a dependency, so its tokenization is not run here; the reference is what TRL's DPO data path computes
from transformers: ``apply_chat_template(prompt, add_generation_prompt=True)`` followed by the rest of
``apply_chat_template(prompt + chosen)`` (conversational), ``tokenizer(prompt) + tokenizer(chosen) + [eos]``
(standard). The tokenizers are the tiny BPEs of tests/test_chat_data.py, built here (nothing is downloaded).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import ROOT, run_cli
from meshtrain.cli.main import main
from meshtrain.errors import ConfigError
from meshtrain.data import preprocess as prep
from meshtrain.data.chat import chat_format
from meshtrain.data.preference import encode_pair
from meshtrain.data.shards import PreparedData
from meshtrain.data.tokenizers import HFTokenizer
from test_chat_data import MARKED, NO_SYSTEM, SENTENCES, auto_tokenizer, folder_bytes, hf_folder, train_bpe, write_jsonl

SHAKESPEARE_LINES = 2000


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pref_tok")
    plain = root / "plain" / "tokenizer.json"
    plain.parent.mkdir()
    train_bpe(["<|endoftext|>"]).save(str(plain))
    return {"marked": hf_folder(root / "marked", MARKED), "no_system": hf_folder(root / "no_system", NO_SYSTEM),
            "plain": plain}


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def reply(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def message_pairs(n: int) -> list[dict]:
    """n conversational pairs: a system turn on every third, distinct chosen and rejected answers."""
    out = []
    for i in range(n):
        prompt = ([{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []) + user(SENTENCES[i % 7])
        out.append({"prompt": prompt, "chosen": reply(f"{SENTENCES[(i + 1) % 7]} {i}"),
                    "rejected": reply(f"{SENTENCES[(i + 3) % 7]} no {i}")})
    return out


def string_pairs(n: int) -> list[dict]:
    return [{"prompt": SENTENCES[i % 7], "chosen": f" yes {i}", "rejected": f" {SENTENCES[(i + 2) % 7]}"}
            for i in range(n)]


def encoder(folder: Path):
    tok = HFTokenizer(folder)
    fmt, files = chat_format(tok, "preference", False)
    assert files == {}
    return tok, fmt


def split_documents(data: PreparedData, split: str) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of every document of ``split``, in order."""
    tokens, masks = data.tokens(split), data.masks(split)
    starts = list(data.documents(split)) + [len(tokens)]
    return [(list(tokens.window(a, b - a)), list(masks.window(a, b - a))) for a, b in zip(starts, starts[1:])]


def is_val(i: int, f: float) -> bool:
    return bool(np.floor((i + 1) * f) > np.floor(i * f))


def test_messages_equal_transformers_render_and_mask_the_completion_only(folders):
    tok, fmt = encoder(folders["marked"])
    reference = auto_tokenizer(folders["marked"])
    for k, record in enumerate(message_pairs(12)):
        docs = encode_pair(tok, fmt, f"pair {k}", record)
        head = list(reference.apply_chat_template(record["prompt"], tokenize=True, return_dict=True,
                                                  add_generation_prompt=True)["input_ids"])
        head_text = reference.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
        for (ids, mask), key in zip(docs, ("chosen", "rejected")):
            whole = list(reference.apply_chat_template(record["prompt"] + record[key], tokenize=True,
                                                       return_dict=True)["input_ids"])
            text = reference.apply_chat_template(record["prompt"] + record[key], tokenize=False)
            completion = reference(text[len(head_text):], add_special_tokens=False)["input_ids"]
            assert ids == whole == head + completion, (k, key)
            assert mask == [0] * len(head) + [1] * len(completion)
            assert ids[-2] == tok.tokenizer.token_to_id("<|im_end|>") and mask[-2:] == [1, 1]  # end of turn learnt


def test_strings_get_the_eos_after_the_completion(folders):
    tok, fmt = encoder(folders["marked"])
    reference = auto_tokenizer(folders["marked"])
    record = {"prompt": "What is two plus two?", "chosen": " It is four.", "rejected": " It is five."}
    prompt = reference(record["prompt"], add_special_tokens=False)["input_ids"]
    for (ids, mask), key in zip(encode_pair(tok, fmt, "r", record), ("chosen", "rejected")):
        completion = reference(record[key], add_special_tokens=False)["input_ids"]
        assert ids == prompt + completion + [tok.eos_id]
        assert mask == [0] * len(prompt) + [1] * (len(completion) + 1)


@pytest.mark.parametrize("kind", ["messages", "strings"])
def test_the_implicit_prompt_is_the_common_start(folders, kind):
    tok, fmt = encoder(folders["marked"])
    if kind == "messages":
        explicit = message_pairs(1)[0]
        implicit = {"chosen": explicit["prompt"] + explicit["chosen"],
                    "rejected": explicit["prompt"] + explicit["rejected"]}
    else:  # TRL's example: the space before the first difference starts the completions
        explicit = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
        implicit = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    assert encode_pair(tok, fmt, "r", implicit) == encode_pair(tok, fmt, "r", explicit)


@pytest.mark.parametrize("kind", ["messages", "strings"])
def test_pairs_are_two_consecutive_documents(tmp_path, folders, kind):
    records = message_pairs(30) if kind == "messages" else string_pairs(30)
    out = tmp_path / "data"
    meta = prep.prepare(str(folders["marked"]), [str(write_jsonl(tmp_path / "p.jsonl", records))], out,
                        data_format="preference", val_fraction=0.1, shard_tokens=101).meta
    assert meta["content"] == "preference" and meta["loss_mask"] is True and meta["split_rule"].startswith("pair i")
    data = PreparedData.open(out)
    assert data.is_preference and data.has_masks
    tok, fmt = encoder(folders["marked"])
    for split in ("train", "val"):
        info = meta["splits"][split]
        want = [doc for i, r in enumerate(records) if is_val(i, 0.1) == (split == "val")
                for doc in encode_pair(tok, fmt, f"r{i}", r)]
        assert split_documents(data, split) == want
        assert info["documents"] == 2 * info["pairs"] == len(want)
        assert info["supervised_tokens"] == sum(sum(mask) for _, mask in want)
    assert meta["splits"]["val"]["pairs"] == 3 and len(meta["splits"]["train"]["shards"]) > 1


@settings(max_examples=25, deadline=None)
@given(pairs=st.integers(1, 60), f=st.floats(0.01, 0.99), task_chars=st.integers(50, 5000))
def test_the_val_split_keeps_pairs_together(tmp_path_factory, folders, pairs, f, task_chars):
    records = string_pairs(pairs)
    val = [i for i in range(pairs) if is_val(i, f)]
    assume(0 < len(val) < pairs)  # an empty split is refused (test_a_bad_input_is_one_line_and_writes_nothing)
    tmp = tmp_path_factory.mktemp("split")
    old, prep.TASK_CHARS = prep.TASK_CHARS, task_chars  # tasks of a few records: pairs meet task edges
    try:
        meta = prep.prepare(str(folders["marked"]), [str(write_jsonl(tmp / "p.jsonl", records))], tmp / "out",
                            data_format="preference", val_fraction=f).meta
    finally:
        prep.TASK_CHARS = old
    data = PreparedData.open(tmp / "out")
    val_docs = split_documents(data, "val")
    assert meta["splits"]["val"]["pairs"] == len(val) and meta["splits"]["train"]["pairs"] == pairs - len(val)
    completions = [(records[i]["chosen"], records[i]["rejected"]) for i in val]
    tok = HFTokenizer(folders["marked"])
    for k, (chosen, rejected) in enumerate(completions):  # val pair k is documents 2k, 2k + 1: that record's
        for (ids, mask), text in zip(val_docs[2 * k:2 * k + 2], (chosen, rejected)):
            assert tok.decode([t for t, m in zip(ids, mask) if m][:-1]) == text


def pc(**record) -> list[dict]:
    """One bad record (line 3) after two good ones."""
    return string_pairs(2) + [record]


M = {"prompt": user("Hello"), "chosen": reply("Hi"), "rejected": reply("Go away")}
BAD = {
    "no prompt": ("marked", pc(chosen="blue", rejected="green"), "has no 'prompt'"),
    "no chosen": ("marked", pc(prompt="a", rejected="b"), "has no 'chosen'"),
    "no rejected": ("marked", pc(prompt=user("a"), chosen=reply("b")), "has no 'rejected'"),
    "empty chosen": ("marked", pc(prompt="a", chosen="", rejected=" b"), "'chosen' is empty"),
    "empty rejected": ("marked", pc(**(M | {"rejected": []})), "'rejected' is empty"),
    "same ids": ("marked", pc(prompt="a", chosen=" b", rejected=" b"), "give the same"),
    "same messages": ("marked", pc(**(M | {"rejected": M["chosen"]})), "give the same"),
    "mixed kinds": ("marked", pc(prompt=user("a"), chosen=" b", rejected=" c"), "must all be strings or all"),
    "not text": ("marked", pc(prompt="a", chosen=3, rejected=" c"), "must be a string or a list"),
    "unknown role": ("marked", pc(**(M | {"chosen": [{"role": "tool", "content": "x"}]})), "valid roles are"),
    "template refuses": ("no_system", pc(**(M | {"prompt": [{"role": "system", "content": "x"}] + user("a")})),
                         "refused it: System role not supported"),
    "empty val": ("marked", string_pairs(3), "3 pair(s) at --val-fraction 0.1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_input_is_one_line_and_writes_nothing(tmp_path, folders, case, capsys):
    template, records, message = BAD[case]
    src = write_jsonl(tmp_path / "bad.jsonl", records)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        prep.prepare(str(folders[template]), [str(src)], out, data_format="preference", val_fraction=0.1)
    assert "\n" not in str(e.value)
    if case != "empty val":
        assert f"'{src}' line 3" in str(e.value)
    assert not out.exists() and not out.with_name("out.tmp").exists()
    code = main(["prepare", "--tokenizer", str(folders[template]), "--input", str(src), "--out", str(out),
                 "--format", "preference", "--val-fraction", "0.1", "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_prompt_loss_is_refused(tmp_path, folders):
    src = write_jsonl(tmp_path / "p.jsonl", string_pairs(20))
    with pytest.raises(ConfigError, match="--prompt-loss applies to --format prompt-completion only"):
        prep.prepare(str(folders["marked"]), [str(src)], tmp_path / "out", data_format="preference", prompt_loss=True)
    assert not (tmp_path / "out").exists()


def test_the_cli_exits_2_with_one_line(tmp_path, folders):
    src = write_jsonl(tmp_path / "bad.jsonl", pc(prompt="a", chosen=" same", rejected=" same"))
    proc = run_cli("prepare", "--tokenizer", str(folders["marked"]), "--input", str(src), "--out",
                   str(tmp_path / "out"), "--format", "preference", "--workers", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "line 3" in proc.stderr and "the same" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_workers_do_not_change_the_bytes(tmp_path, folders, monkeypatch, capsys):
    monkeypatch.setattr(prep, "TASK_CHARS", 600)  # many tasks, so two workers share them
    src = write_jsonl(tmp_path / "p.jsonl", message_pairs(60))
    metas = []
    for workers in (1, 2):
        args = ["prepare", "--tokenizer", str(folders["plain"]), "--input", str(src), "--out",
                str(tmp_path / f"w{workers}"), "--format", "preference", "--val-fraction", "0.1",
                "--shard-tokens", "300", "--workers", str(workers)]
        assert main(args) == 0
        assert "54 pairs (108 documents)" in capsys.readouterr().out
        metas.append(json.loads((tmp_path / f"w{workers}" / "meta.json").read_text()))
    assert folder_bytes(tmp_path / "w1") == folder_bytes(tmp_path / "w2")
    for meta in metas:
        del meta["tokenizer"]["path"]
    assert metas[0] == metas[1]


def test_shakespeare_pairs_prepare_cleanly(tmp_path, folders):
    spec = importlib.util.spec_from_file_location("shakespeare_chat", ROOT / "scripts" / "shakespeare_chat.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lines = (ROOT / "src/meshtrain/assets/tinyshakespeare.txt").read_text(encoding="utf-8").splitlines(True)
    records = list(script.preference_pairs("".join(lines[:SHAKESPEARE_LINES])))
    assert len(records) > 50
    out = tmp_path / "data"
    meta = prep.prepare(str(folders["plain"]), [str(write_jsonl(tmp_path / "pairs.jsonl", records))], out,
                        data_format="preference", val_fraction=0.05).meta
    assert meta["splits"]["train"]["pairs"] + meta["splits"]["val"]["pairs"] == len(records)
    assert meta["chat_template"]["source"] == "the default ChatML"  # the plain BPE got the ChatML tokens
    data = PreparedData.open(out)
    end_of_turn = HFTokenizer(out / "tokenizer.json").tokenizer.token_to_id("<|im_end|>")
    for split in ("train", "val"):
        docs = split_documents(data, split)
        for (chosen, chosen_mask), (rejected, rejected_mask) in zip(docs[::2], docs[1::2]):
            prompt = chosen_mask.index(1)
            assert chosen[:prompt] == rejected[:prompt] and rejected_mask.index(1) == prompt  # one shared prompt
            for ids, mask in ((chosen, chosen_mask), (rejected, rejected_mask)):
                assert mask == [0] * prompt + [1] * (len(ids) - prompt) and ids[-2] == end_of_turn
