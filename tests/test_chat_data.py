"""``meshtrain prepare --format chat|prompt-completion`` (:mod:`meshtrain.data.chat`): conversations to ids plus a
loss mask.

The reference is transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on the same
tokenizer folder: a tiny byte-level BPE trained here on a few sentences, with ChatML special tokens, wrapped in
``PreTrainedTokenizerFast`` and saved with ``save_pretrained`` (nothing is downloaded). The templates are written
here: ChatML with a Qwen-like default system turn, with and without ``{% generation %}`` markers.
"""

from __future__ import annotations

import base64
import functools
import json
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from meshtrain.cli.main import main
from meshtrain.errors import ConfigError
from meshtrain.data import preprocess as prep
from meshtrain.data.chat import ChatFormat, chat_format, encode_record
from meshtrain.data.shards import PreparedData
from meshtrain.data.tokenizers import HFTokenizer, tokenizer_from_dict

SENTENCES = ["Hello there, how are you today?", "I am fine, thank you very much.", "héllo wörld ✓ 日本語 ünïcödé",
             "The quick brown fox jumps over the lazy dog.", "What is two plus two? It is four.",
             "multi\nline text\nwith three lines", "You are a helpful assistant."]
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TURN = "{{ '<|im_start|>' + m['role'] + '\\n' }}"
SYSTEM = ("{% if not messages or messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}")
GEN_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
MARKED = (SYSTEM + "{% for m in messages %}" + TURN + "{% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}"
          "{{ '\\n' }}{% endfor %}" + GEN_PROMPT)
"""ChatML with a default system turn (Qwen-like), assistant content and its <|im_end|> inside generation markers."""
UNMARKED = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONTENT_ONLY = MARKED.replace("{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}",
                              "{% generation %}{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>' }}")
"""Markers around the content only: an empty assistant content leaves nothing supervised."""
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported')"
             " }}{% endif %}" + TURN + "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}" + GEN_PROMPT)
FAILS = "{% for m in messages %}{% if m['content'] == 'boom' %}{{ m.nothing.nothing }}{% endif %}{% endfor %}" + MARKED
"""Fails to render (an undefined attribute of an undefined value) a conversation with a 'boom' turn."""
CONTENTS = ["Hello there", "héllo wörld ✓ 日本語", "", "x", "multi\nline text", "What is two plus two?",
            "It is four. ", "🙂🙂 emoji"]


def train_bpe(special: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return tok


def hf_folder(folder: Path, template: str | None, special: list[str] = CHATML_SPECIAL, **named: str) -> Path:
    """A transformers tokenizer folder (tokenizer.json, tokenizer_config.json, chat_template.jinja): a BPE with the
    ``special`` tokens, ``named`` ones (``eos_token=...``; ChatML's by default) and ``template``."""
    from transformers import PreTrainedTokenizerFast

    named = named or {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=train_bpe(special), **named)
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_tok")
    return {name: hf_folder(root / name, template) for name, template in
            (("marked", MARKED), ("unmarked", UNMARKED), ("content_only", CONTENT_ONLY), ("no_system", NO_SYSTEM),
             ("fails", FAILS))}


@pytest.fixture(scope="module")
def plain_bpe(tmp_path_factory) -> Path:
    """A tokenizer.json as ``meshtrain tokenizer train`` writes it: <|endoftext|> only, no template."""
    path = tmp_path_factory.mktemp("plain_tok") / "tokenizer.json"
    train_bpe(["<|endoftext|>"]).save(str(path))
    return path


def conversations(n: int = 40, seed: int = 0) -> list[list[dict[str, str]]]:
    """Generated conversations: 1-4 user/assistant exchanges, a system turn or not, a trailing user turn or not."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": rng.choice(CONTENTS)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            messages += [{"role": "user", "content": rng.choice(CONTENTS)},
                         {"role": "assistant", "content": rng.choice(CONTENTS)}]
        if rng.random() < 0.3:
            messages.append({"role": "user", "content": rng.choice(CONTENTS)})
        out.append(messages)
    return out


def fmt_of(spec: Path, content: str = "chat", prompt_loss: bool = False) -> tuple[HFTokenizer, ChatFormat]:
    tok = HFTokenizer(spec)
    fmt, files = chat_format(tok, content, prompt_loss)
    assert files == {}
    return tok, fmt


@functools.cache
def auto_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def transformers_reference(folder: Path, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    out = auto_tokenizer(folder).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def test_ids_and_mask_equal_transformers_with_generation_markers(folders):
    tok, fmt = fmt_of(folders["marked"])
    assert fmt.markers and fmt.source.endswith("chat_template.jinja")
    for k, messages in enumerate(conversations()):
        ids, mask = encode_record(tok, fmt, f"conversation {k}", {"messages": messages})
        assert (ids, mask) == transformers_reference(folders["marked"], messages), messages
        assert sum(mask) >= sum(m["role"] == "assistant" for m in messages)  # each turn's <|im_end|> at least


def test_the_prefix_method_without_markers_gives_the_marked_masks(folders):
    marked, unmarked = fmt_of(folders["marked"]), fmt_of(folders["unmarked"])
    assert not unmarked[1].markers
    for k, messages in enumerate(conversations(seed=1)):
        record = {"messages": messages}
        assert encode_record(*unmarked, f"c{k}", record) == encode_record(*marked, f"c{k}", record), messages


def test_a_template_in_tokenizer_config_is_found(tmp_path, folders):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((folders["marked"] / "tokenizer.json").read_bytes())
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": MARKED}]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": named}))
    tok, fmt = fmt_of(folder / "tokenizer.json")
    assert fmt.template == MARKED and "(default)" in fmt.source
    messages = conversations(1)[0]
    assert encode_record(tok, fmt, "c", {"messages": messages}) == transformers_reference(folders["marked"], messages)


def test_default_chatml_extends_a_tokenizer_without_its_tokens(tmp_path, plain_bpe):
    from transformers import AutoTokenizer

    records = [{"messages": m} for m in conversations(30, seed=2)]
    out = tmp_path / "data"
    result = prep.prepare(str(plain_bpe), [str(write_jsonl(tmp_path / "chat.jsonl", records))], out,
                          data_format="chat", val_fraction=0.1, shard_tokens=97)
    meta = result.meta
    given = HFTokenizer(plain_bpe)
    assert meta["content"] == "chat" and meta["loss_mask"] is True
    assert meta["chat_template"]["source"] == "the default ChatML" and meta["chat_template"]["generation_markers"]
    assert meta["vocab_size"] == given.vocab_size + 2 and meta["source_tokenizer"] == given.to_dict()
    assert meta["tokenizer"]["path"] == str(out / "tokenizer.json")
    extended = tokenizer_from_dict(meta["tokenizer"])  # training loads it: the recorded SHA-256 holds
    assert extended.tokenizer.token_to_id("<|im_end|>") == given.vocab_size + 1
    assert extended.eos_id == given.eos_id
    # the folder is a transformers tokenizer with the template: its apply_chat_template gives the same ids/masks
    data = PreparedData.open(out)
    train, starts = data.tokens("train"), data.documents("train")
    reference = AutoTokenizer.from_pretrained(str(out))
    train_records = [r for i, r in enumerate(records) if not np.floor((i + 1) * 0.1) > np.floor(i * 0.1)]
    for k in range(3):
        want = reference.apply_chat_template(train_records[k]["messages"], tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        end = starts[k + 1]
        assert list(train.window(starts[k], end - starts[k])) == list(want["input_ids"])
        assert list(data.masks("train").window(starts[k], end - starts[k])) == list(want["assistant_masks"])


def test_the_mask_shards_follow_the_token_shards(tmp_path, folders):
    records = [{"messages": m} for m in conversations(30, seed=3)]
    out = tmp_path / "data"
    meta = prep.prepare(str(folders["marked"]), [str(write_jsonl(tmp_path / "c.jsonl", records))], out,
                        data_format="chat", val_fraction=0.1, shard_tokens=64).meta
    data = PreparedData.open(out)
    assert data.has_masks and "source_tokenizer" not in meta
    for split, info in meta["splits"].items():
        assert [s["tokens"] for s in info["mask_shards"]] == [s["tokens"] for s in info["shards"]]
        assert len(info["shards"]) > 1
        masks, tokens = data.masks(split), data.tokens(split)
        assert len(masks) == len(tokens) and int(masks.window(0, len(masks)).sum()) == info["supervised_tokens"]
        ids = tokens.window(0, len(tokens))
        assert set(np.unique(masks.window(0, len(masks)))) <= {0, 1}
        ends = np.append(data.documents(split)[1:], len(tokens)) - 1  # each ends <|im_end|> "\\n"
        assert (ids[ends - 1] == HFTokenizer(folders["marked"]).tokenizer.token_to_id("<|im_end|>")).all()
    (out / meta["splits"]["val"]["mask_shards"][0]["file"]).unlink()
    with pytest.raises(ConfigError, match="val_mask_00000.bin is missing"):
        PreparedData.open(out)


def test_prompt_completion_strings_and_prompt_loss(folders):
    tok, fmt = fmt_of(folders["marked"], "prompt-completion")
    _, with_prompt = fmt_of(folders["marked"], "prompt-completion", prompt_loss=True)
    record = {"prompt": "What is two plus two?", "completion": " It is four."}
    prompt, completion = tok.encode(record["prompt"]), tok.encode(record["completion"])
    want = prompt + completion + [tok.eos_id]
    assert encode_record(tok, fmt, "r", record) == (want, [0] * len(prompt) + [1] * (len(completion) + 1))
    assert encode_record(tok, with_prompt, "r", record) == (want, [1] * len(want))


def test_prompt_completion_messages_and_prompt_loss(folders):
    tok, fmt = fmt_of(folders["marked"], "prompt-completion")
    _, with_prompt = fmt_of(folders["marked"], "prompt-completion", prompt_loss=True)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    completion = [{"role": "assistant", "content": "héllo wörld ✓"}]
    ids, mask = encode_record(tok, fmt, "r", {"prompt": prompt, "completion": completion})
    whole, _ = transformers_reference(folders["marked"], prompt + completion)
    head = auto_tokenizer(folders["marked"]).apply_chat_template(
        prompt, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
    assert ids == whole and ids[:len(head)] == list(head)
    assert mask == [0] * len(head) + [1] * (len(ids) - len(head))
    assert encode_record(tok, with_prompt, "r", {"prompt": prompt, "completion": completion}) == (ids, [1] * len(ids))


def test_prompt_completion_through_prepare(tmp_path, folders):
    records = [{"prompt": SENTENCES[i % 7], "completion": " " + SENTENCES[(i + 1) % 7]} for i in range(20)]
    src = write_jsonl(tmp_path / "pc.jsonl", records)
    for prompt_loss in (False, True):
        out = tmp_path / f"pc{prompt_loss}"
        meta = prep.prepare(str(folders["marked"]), [str(src)], out, data_format="prompt-completion",
                            prompt_loss=prompt_loss, val_fraction=0.1).meta
        assert meta["content"] == "prompt-completion" and meta["options"]["prompt_loss"] is prompt_loss
        info = meta["splits"]["train"]
        assert (info["supervised_tokens"] == info["tokens"]) is prompt_loss


def bad(**record) -> list[dict]:
    """One bad record (line 3) after two good ones."""
    good = {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]}
    return [good, good, record]


def bad_pc(**record) -> list[dict]:
    """One bad prompt-completion record (line 3) after two good ones."""
    return [{"prompt": "Hello", "completion": " Hi"}] * 2 + [record]


BAD = {
    "no assistant": ("chat", "marked", bad(messages=[{"role": "user", "content": "Hello"}]), "has no assistant turn"),
    "unknown role": ("chat", "marked", bad(messages=[{"role": "tool", "content": "x"}]), "valid roles are system"),
    "no messages": ("chat", "marked", bad(text="Hello"), "has no 'messages'"),
    "not a list": ("chat", "marked", bad(messages="Hello"), "must be a non-empty list"),
    "template raises": ("chat", "no_system", bad(messages=[{"role": "system", "content": "x"},
                                                           {"role": "assistant", "content": "y"}]),
                        "refused it: System role not supported"),
    "template fails": ("chat", "fails", bad(messages=[{"role": "user", "content": "boom"},
                                                      {"role": "assistant", "content": "x"}]), "failed on it"),
    "content not a string": ("chat", "marked", bad(messages=[{"role": "user", "content": "x", "name": None},
                                                             {"role": "assistant", "content": 3}]), "string 'content'"),
    "empty completion": ("prompt-completion", "marked", bad_pc(prompt="a", completion=""), "'completion' is empty"),
    "no completion": ("prompt-completion", "marked", bad_pc(prompt="a"), "has no 'completion'"),
    "no prompt": ("prompt-completion", "marked", bad_pc(completion="a"), "has no 'prompt'"),
    "mixed kinds": ("prompt-completion", "marked", bad_pc(prompt="a", completion=[
        {"role": "assistant", "content": "b"}]), "must both be strings or both message lists"),
    "empty completion messages": ("prompt-completion", "marked", bad_pc(
        prompt=[{"role": "user", "content": "a"}], completion=[]), "'completion' must be a non-empty list"),
    "no supervised token": ("chat", "content_only", [{"messages": [{"role": "user", "content": "a"},
                                                                  {"role": "assistant", "content": ""}]}] * 30,
                            "hold no supervised token"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_input_is_one_line_and_writes_nothing(tmp_path, folders, case, capsys):
    content, template, records, message = BAD[case]
    src = write_jsonl(tmp_path / "bad.jsonl", records)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=message) as e:
        prep.prepare(str(folders[template]), [str(src)], out, data_format=content, val_fraction=0.1)
    assert "\n" not in str(e.value)
    if case != "no supervised token":
        assert f"'{src}' line 3" in str(e.value)
    assert not out.exists() and not out.with_name("out.tmp").exists()
    code = main(["prepare", "--tokenizer", str(folders[template]), "--input", str(src), "--out", str(out),
                 "--format", content, "--val-fraction", "0.1", "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_a_template_that_is_not_jinja_is_one_line(tmp_path, folders):
    folder = hf_folder(tmp_path / "broken", "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ConfigError, match="is not valid Jinja"):
        prep.prepare(str(folder), [str(write_jsonl(tmp_path / "c.jsonl", bad()))], tmp_path / "out",
                     data_format="chat")
    assert not (tmp_path / "out").exists()


def tiktoken_file(path: Path) -> Path:
    """A tiktoken file of a BPE trained on :data:`SENTENCES` (its merges as ranks, the 256 bytes first)."""
    from test_tokenizers import byte_level_decoder

    vocab = json.loads(train_bpe([]).to_str())["model"]["vocab"]
    shown = byte_level_decoder()
    ranks = {bytes(shown[c] for c in token): rank for rank, token in enumerate(sorted(vocab, key=vocab.get))}
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    return path


def sentencepiece_file(path: Path) -> Path:
    """A sentencepiece BPE trained on :data:`SENTENCES` with the library's defaults (NFKC, a dummy prefix), byte
    fallback."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SENTENCES * 4), model_writer=model, vocab_size=400,
                                             model_type="bpe", byte_fallback=True, hard_vocab_limit=False,
                                             minloglevel=2)
    path.write_bytes(model.getvalue())
    return path


def transformers_twin(tok):
    """transformers' tokenizer of the same ids as meshtrain's tiktoken or sentencepiece ``tok`` (its added tokens
    too): tiktoken converted by transformers' ``TikTokenConverter`` (a fast tokenizer), sentencepiece its
    ``SentencePieceBackend`` with the added tokens added as special tokens."""
    from meshtrain.data.tokenizers import TIKTOKEN_PAT_STR

    if tok.kind == "tiktoken":
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        lib = TikTokenConverter(vocab_file=str(tok.path), pattern=TIKTOKEN_PAT_STR,
                                extra_special_tokens=tok.encoding._special_tokens).converted()
        return PreTrainedTokenizerFast(tokenizer_object=lib, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    twin = SentencePieceBackend(vocab_file=str(tok.path), bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    twin.add_special_tokens({"additional_special_tokens": sorted(tok.added, key=tok.added.get)})
    return twin


@pytest.mark.parametrize("kind", ["tiktoken", "sentencepiece"])
def test_default_chatml_on_tiktoken_and_sentencepiece_equals_transformers(tmp_path, kind):
    """A tiktoken or sentencepiece tokenizer without a template gets ChatML as a tokenizer.json does: prepare copies
    the file into DATA_DIR with a tokenizer_config.json that adds <|im_start|>/<|im_end|> after its last id, and the
    ids of every conversation equal transformers' ``apply_chat_template`` of the same template on a transformers
    tokenizer of the same ids (tiktoken: converted to a fast one, which also gives the assistant mask to compare;
    sentencepiece: its slow ``SentencePieceBackend``, which has no offsets for a mask, so the supervised ids are
    checked to be transformers' encoding of each assistant content and its <|im_end|>). Training loads the folder's
    tokenizer (its SHA-256 covering the config) and reads the two ids as added (a model's vocabulary grows by them,
    tests/test_vocab_growth.py), and generate --chat's prompt equals transformers' with the generation prompt."""
    from meshtrain.cli.generate import chat_prompt
    from meshtrain.data.chat import CHATML
    from meshtrain.data.corpus import added_tokens
    from meshtrain.data.tokenizers import load_tokenizer

    given = (tiktoken_file(tmp_path / "t.tiktoken") if kind == "tiktoken"
             else sentencepiece_file(tmp_path / "sp.model"))
    records = [{"messages": m} for m in conversations(30, seed=5)]
    out = tmp_path / "data"
    meta = prep.prepare(str(given), [str(write_jsonl(tmp_path / "chat.jsonl", records))], out, data_format="chat",
                        val_fraction=0.1).meta
    before = load_tokenizer(str(given))
    suffix = ".tiktoken" if kind == "tiktoken" else ".model"
    assert meta["source_tokenizer"] == before.to_dict() and meta["chat_template"]["source"] == "the default ChatML"
    assert meta["tokenizer"]["path"] == str(out / ("tokenizer" + suffix)) and meta["vocab_size"] == before.vocab_size + 2
    assert meta["added_tokens"] == [{"id": before.vocab_size, "content": "<|im_start|>"},
                                    {"id": before.vocab_size + 1, "content": "<|im_end|>"}]
    tok = tokenizer_from_dict(meta["tokenizer"])  # training's load: the recorded SHA-256 (file + config) holds
    assert tok.kind == kind and tok.eos_id == before.eos_id and tok.sha256 != before.sha256
    assert added_tokens(meta, tok, out / "meta.json") == {before.vocab_size: "<|im_start|>",
                                                          before.vocab_size + 1: "<|im_end|>"}
    twin = transformers_twin(tok)
    assert len(twin) == tok.vocab_size and twin.convert_tokens_to_ids("<|im_end|>") == before.vocab_size + 1
    data = PreparedData.open(out)
    train, masks, starts = data.tokens("train"), data.masks("train"), data.documents("train")
    train_records = [r for i, r in enumerate(records) if not np.floor((i + 1) * 0.1) > np.floor(i * 0.1)]
    for k in range(len(starts) - 1):
        messages = train_records[k]["messages"]
        ids = list(train.window(starts[k], starts[k + 1] - starts[k]))
        mask = list(masks.window(starts[k], starts[k + 1] - starts[k]))
        want = twin.apply_chat_template(messages, chat_template=CHATML, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=kind == "tiktoken")
        assert ids == list(want["input_ids"]), k
        if kind == "tiktoken":
            assert mask == list(want["assistant_masks"]), k
        else:
            supervised = [i for i, m in zip(ids, mask) if m]
            assert supervised == [i for m in messages if m["role"] == "assistant"
                                  for i in twin.encode(m["content"] + "<|im_end|>", add_special_tokens=False)], k
    prompt, stop = chat_prompt(tok, "Art thou not Romeo?", "You are JULIET.")
    messages = [{"role": "system", "content": "You are JULIET."}, {"role": "user", "content": "Art thou not Romeo?"}]
    assert prompt == list(twin.apply_chat_template(messages, chat_template=CHATML, tokenize=True,
                                                   add_generation_prompt=True, return_dict=True)["input_ids"])
    assert before.vocab_size + 1 in stop


@pytest.mark.parametrize("case", ["text input", "prompt loss on chat"])
def test_bad_options_are_one_line(tmp_path, folders, case):
    src = write_jsonl(tmp_path / "c.jsonl", bad())
    tokenizer, inputs, kwargs, message = {
        "text input": (str(folders["marked"]), [str(tmp_path / "t.txt")], {}, "is a text file"),
        "prompt loss on chat": (str(folders["marked"]), [str(src)], {"prompt_loss": True}, "applies to --format"),
    }[case]
    (tmp_path / "t.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match=message) as e:
        prep.prepare(tokenizer, inputs, tmp_path / "out", data_format="chat", **kwargs)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_the_cli_exits_2_with_one_line(tmp_path, folders):
    src = write_jsonl(tmp_path / "bad.jsonl", bad(messages=[{"role": "robot", "content": "x"}]))
    proc = run_cli("prepare", "--tokenizer", str(folders["marked"]), "--input", str(src), "--out",
                   str(tmp_path / "out"), "--format", "chat", "--workers", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "'robot'" in proc.stderr and "line 3" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "meta.json"}


def test_workers_do_not_change_the_bytes(tmp_path, plain_bpe, monkeypatch):
    monkeypatch.setattr(prep, "TASK_CHARS", 600)  # many tasks, so two workers share them
    records = [{"messages": m} for m in conversations(60, seed=4)]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    metas = []
    for workers in (1, 2):
        metas.append(prep.prepare(str(plain_bpe), [str(src)], tmp_path / f"w{workers}", data_format="chat",
                                  workers=workers, val_fraction=0.1, shard_tokens=200).meta)
    assert folder_bytes(tmp_path / "w1") == folder_bytes(tmp_path / "w2")
    for meta in metas:
        del meta["tokenizer"]["path"]
    assert metas[0] == metas[1]


def test_the_recipe_includes_the_format(tmp_path, folders, capsys):
    records = [{"prompt": "What is two plus two?", "completion": " It is four."}] * 20
    src = write_jsonl(tmp_path / "pc.jsonl", records)
    args = ["prepare", "--tokenizer", str(folders["marked"]), "--input", str(src), "--out", str(tmp_path / "out"),
            "--format", "prompt-completion", "--val-fraction", "0.1", "--workers", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "conversations" in out and "supervised" in out
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().out
    assert main(args + ["--prompt-loss"]) == 2 and "other options" in capsys.readouterr().err


def test_parquet_rows_are_records_as_jsonl_lines(tmp_path, folders):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"messages": m} for m in conversations(30, seed=5)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    write_jsonl(tmp_path / "c.jsonl", records)
    for name in ("c.parquet", "c.jsonl"):
        prep.prepare(str(folders["marked"]), [str(tmp_path / name)], tmp_path / name.replace(".", "_"),
                     data_format="chat", val_fraction=0.1)
    assert folder_bytes(tmp_path / "c_parquet") == folder_bytes(tmp_path / "c_jsonl")
