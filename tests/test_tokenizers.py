"""Tokenizers (meshtrain.data.tokenizers): every kind against its own library, the checkpoint form, the vocabulary
padding rule, the corpus on a tokenizer file, and ``meshtrain tokenizer train``. The tokenizer files are trained
here on a few KB of Tiny Shakespeare (nothing is downloaded)."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.cli.main import main
from meshtrain.cli.tokenizer import train_bpe
from meshtrain.config.load import load_config
from meshtrain.config.sections import BUNDLED_CORPUS
from meshtrain.errors import ConfigError
from meshtrain.data.tokenizers import (TIKTOKEN_PAT_STR, CharTokenizer, load_tokenizer, model_vocab_size,
                                       padded_vocab_size, tokenizer_from_dict)

TEXT = BUNDLED_CORPUS.read_text(encoding="utf-8")[:6000]
SAMPLE = TEXT[:700] + "  héllo,\twörld 😀 — ½\n\n  <|endoftext|> x"
"""Text each kind must round-trip: Shakespeare, repeated spaces, a tab, non-ASCII, an emoji, a special token's text."""
KINDS = ("char", "hf", "tiktoken", "sentencepiece")


def one_line_error(fn, *args) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args)
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the character a byte-level BPE shows for each byte -> the byte."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(shown), 0
    for b in range(256):
        if b not in shown:
            shown.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(shown, chars)}


def write_tiktoken(path: Path, ranks: dict[bytes, int]) -> Path:
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """One tokenizer file per kind: a BPE from ``meshtrain tokenizer train``'s trainer, its ranks as a
    ``.tiktoken`` file, and a sentencepiece BPE with byte fallback and no normalization (so it round-trips)."""
    import sentencepiece

    folder = tmp_path_factory.mktemp("tokenizers")
    (folder / "corpus.txt").write_text(TEXT)
    hf_file = train_bpe([folder / "corpus.txt"], 400, folder / "tokenizer.json")
    vocab = json.loads(hf_file.read_text())["model"]["vocab"]
    shown = byte_level_decoder()
    merged = [token for token in sorted(vocab, key=vocab.get) if token != "<|endoftext|>"]  # in merge order
    ranks = {bytes(shown[c] for c in token): rank for rank, token in enumerate(merged)}
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines()), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, character_coverage=1.0, minloglevel=2)
    (folder / "sp.model").write_bytes(model.getvalue())
    return {"hf": hf_file, "tiktoken": write_tiktoken(folder / "tiny.tiktoken", ranks),
            "sentencepiece": folder / "sp.model"}


def library_ids(kind: str, path: Path, text: str) -> list[int]:
    """``text``'s ids from the kind's own library, used directly."""
    if kind == "hf":
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(path))
        tok.encode_special_tokens = True
        return tok.encode(text, add_special_tokens=False).ids
    if kind == "sentencepiece":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(path)).encode(text)
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    return tiktoken.Encoding("t", pat_str=TIKTOKEN_PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(path)),
                             special_tokens={}).encode_ordinary(text)


def load(kind: str, files: dict[str, Path]):
    return load_tokenizer("char", TEXT) if kind == "char" else load_tokenizer(str(files[kind]))


@pytest.mark.parametrize("kind", KINDS[1:])
def test_each_kind_matches_its_library_and_round_trips(kind, files):
    tok = load(kind, files)
    ids = tok.encode(SAMPLE)
    assert tok.kind == kind and ids == library_ids(kind, files[kind], SAMPLE)
    assert len(ids) < 0.7 * len(SAMPLE)  # merges were learned
    assert tok.decode(ids) == SAMPLE
    assert max(ids) < tok.vocab_size


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_text_round_trips(files, data):
    """Byte-level kinds take any text; sentencepiece any text without U+2581 (its own space mark); char its
    characters."""
    kind = data.draw(st.sampled_from(KINDS))
    alphabet = {"char": st.sampled_from(sorted(set(TEXT))),
                "sentencepiece": st.characters(codec="utf-8", exclude_characters="\u2581")}.get(
        kind, st.characters(codec="utf-8"))
    text = data.draw(st.text(alphabet, max_size=80))
    tok = load(kind, files)
    assert tok.decode(tok.encode(text)) == text


def test_char_is_todays_tokenizer_and_still_importable_from_corpus():
    from meshtrain.data.corpus import CharTokenizer as FromCorpus

    tok = load_tokenizer("char", "hello, world\n")
    assert FromCorpus is CharTokenizer and isinstance(tok, CharTokenizer)
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id) == ("char", 10, None, None)
    assert tok.to_dict() == {"kind": "char", "chars": "\n ,dehlorw"}
    assert "char" in one_line_error(load_tokenizer, "char")  # char needs the text


def test_bos_and_eos_come_from_the_tokenizer(files, tmp_path):
    hf = load_tokenizer(str(files["hf"]))
    assert (hf.bos_id, hf.eos_id) == (None, 0)  # <|endoftext|>, the trainer's one special token
    sp = load_tokenizer(str(files["sentencepiece"]))
    assert (sp.bos_id, sp.eos_id) == (1, 2)  # sentencepiece's defaults: <unk> 0, <s> 1, </s> 2
    tt = load_tokenizer(str(files["tiktoken"]))
    n_ranks = len(files["tiktoken"].read_text().splitlines())
    assert (tt.bos_id, tt.eos_id, tt.vocab_size) == (n_ranks, n_ranks + 1, n_ranks + 256)  # Llama 3's layout
    assert tt.decode([tt.eos_id]) == "<|end_of_text|>"
    # a model folder: tokenizer_config.json names them (here both <|endoftext|>, as GPT-2's does)
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(files["hf"], folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<|endoftext|>", "__type": "AddedToken"}, "eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(str(folder))
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.to_dict()["path"]) == ("hf", 0, 0, str(folder))


@pytest.mark.parametrize("kind", KINDS)
def test_to_dict_round_trips_through_json(kind, files):
    tok = load(kind, files)
    d = json.loads(json.dumps(tok.to_dict()))
    again = tokenizer_from_dict(d)
    assert again.to_dict() == tok.to_dict() and again.encode(SAMPLE[:300]) == tok.encode(SAMPLE[:300])
    if kind != "char":
        assert set(d) == {"kind", "path", "sha256", "vocab_size"} and d["vocab_size"] == tok.vocab_size


def test_a_changed_or_missing_tokenizer_file_is_refused(files, tmp_path):
    path = tmp_path / "copy.tiktoken"
    shutil.copy(files["tiktoken"], path)
    d = load_tokenizer(str(path)).to_dict()
    path.write_text(path.read_text().replace(" 1\n", " 999999\n", 1))
    assert "changed since" in one_line_error(tokenizer_from_dict, d)
    path.unlink()
    assert "is gone" in one_line_error(tokenizer_from_dict, d)
    assert "unknown" in one_line_error(tokenizer_from_dict, {"kind": "bpe"})


def test_bad_specs_are_one_line_errors(tmp_path):
    (tmp_path / "vocab.txt").write_text("a\n")
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "empty").mkdir()
    assert "does not exist" in one_line_error(load_tokenizer, str(tmp_path / "nope.json"))
    assert "'.txt'" in one_line_error(load_tokenizer, str(tmp_path / "vocab.txt"))
    assert "without tokenizer.json" in one_line_error(load_tokenizer, str(tmp_path / "empty"))
    assert "cannot be read as a hf tokenizer" in one_line_error(load_tokenizer, str(tmp_path / "broken.json"))
    message = one_line_error(load_config, None, {"data.tokenizer": "gpt2"})
    assert message.startswith("data.tokenizer = 'gpt2' does not exist") and "*.tiktoken" in message


def test_padding_rule_megatron():
    """Megatron-LM's ``_vocab_size_with_padding``: up to a multiple of 128 * tp; char and a given V untouched."""
    assert [padded_vocab_size(50257, tp) for tp in (1, 2, 4)] == [50304, 50432, 50688]
    assert padded_vocab_size(32000, 1) == 32000 and padded_vocab_size(128256, 8) == 129024
    assert model_vocab_size("hf", 400, 0, 1) == 512 and model_vocab_size("hf", 400, 0, 4) == 512
    assert model_vocab_size("sentencepiece", 400, 0, 8) == 1024
    assert model_vocab_size("char", 65, 0, 2) == 65 and model_vocab_size("hf", 400, 450, 4) == 450


def test_corpus_planner_and_trainer_use_the_tokenizer(files, tmp_path):
    import torch

    from meshtrain.data.corpus import load_corpus
    from meshtrain.planner.model_specs import corpus_vocab_size
    from meshtrain.train.setup import set_up

    (tmp_path / "t.txt").write_text(TEXT)
    corpus = load_corpus(tmp_path / "t.txt", 0.1, 16, str(files["hf"]))
    ids = torch.cat([corpus.train, corpus.val]).tolist()
    assert corpus.tokenizer.kind == "hf" and ids == library_ids("hf", files["hf"], TEXT)
    cfg = load_config(None, {"data.path": str(tmp_path / "t.txt"), "data.tokenizer": str(files["hf"]),
                             "model.n_layer": "1", "model.n_embd": "32", "model.block_size": "16"})
    assert corpus_vocab_size(cfg) == 512
    run = set_up(cfg, torch.device("cpu"))
    assert run.vocab_size == 512 and run.model.lm_head.weight.shape[0] == 512
    assert corpus_vocab_size(load_config(None, {"data.path": str(tmp_path / "t.txt")})) == len(set(TEXT))


def test_ids_past_65536_fit_the_corpus(tmp_path):
    """A vocabulary past uint16: each byte a token at rank 70000 + byte value."""
    from meshtrain.data.corpus import load_corpus

    spec = write_tiktoken(tmp_path / "wide.tiktoken", {bytes([b]): 70000 + b for b in range(256)})
    (tmp_path / "t.txt").write_text(TEXT[:500])
    corpus = load_corpus(tmp_path / "t.txt", 0.1, 16, str(spec))
    assert corpus.train.dtype.itemsize == 8 and int(corpus.train.min()) >= 70000
    assert corpus.tokenizer.decode(corpus.train.tolist() + corpus.val.tolist()) == TEXT[:500]


def test_resume_compares_tokenizer_contents_not_paths(files, tmp_path):
    from meshtrain.preflight import check_same_model

    cfg = load_config(None, {"data.tokenizer": str(files["hf"])})
    moved = tmp_path / "moved.json"
    shutil.copy(files["hf"], moved)
    meta = {"config": cfg.to_dict(), "vocab_size": 512, "tokenizer": load_tokenizer(str(moved)).to_dict()}
    check_same_model(cfg, meta, load_tokenizer(str(files["hf"])).to_dict(), tmp_path)  # same bytes elsewhere
    message = one_line_error(check_same_model, cfg, meta, load_tokenizer(str(files["tiktoken"])).to_dict(), tmp_path)
    assert f"--data.tokenizer '{moved}'" in message


def test_a_tokenizer_file_changed_in_place_is_named_as_changed(files, tmp_path):
    """The checkpoint's tokenizer file was replaced at the same path by another tokenizer: the line says the file
    changed (both digests) and to put the old one back, not to pass the path it already has."""
    from meshtrain.preflight import check_same_model

    path = tmp_path / "tokenizer.json"
    shutil.copy(files["hf"], path)
    cfg = load_config(None, {"data.tokenizer": str(path)})
    meta = {"config": cfg.to_dict(), "vocab_size": 512, "tokenizer": load_tokenizer(str(path)).to_dict()}
    data = json.loads(path.read_text())
    data["added_tokens"] = data.get("added_tokens", []) + [
        {"id": 10**5, "content": "<|new|>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}]
    path.write_text(json.dumps(data))  # another tokenizer at the same path
    message = one_line_error(check_same_model, cfg, meta, load_tokenizer(str(path)).to_dict(), tmp_path)
    assert f"tokenizer '{path}', whose file has changed since" in message and "put back the file" in message
    assert "--data.tokenizer" not in message


def test_cli_train_writes_a_loadable_tokenizer(tmp_path, capsys):
    import tokenizers

    (tmp_path / "a.txt").write_text(TEXT[:3000])
    (tmp_path / "b.txt").write_text(TEXT[3000:])
    out = tmp_path / "sub" / "tok.json"
    assert main(["tokenizer", "train", "--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                 "--vocab-size", "300", "--out", str(out), "--min-frequency", "3"]) == 0
    assert "vocab_size 300" in capsys.readouterr().out
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 300 and tok.eos_id == 0
    plain = SAMPLE.replace("<|endoftext|>", "")  # the library alone reads that text as the special token
    assert tok.encode(plain) == tokenizers.Tokenizer.from_file(str(out)).encode(plain).ids
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert sorted(p.name for p in out.parent.iterdir()) == ["tok.json"]  # no temporary file left


@pytest.mark.parametrize("args, fragment", [
    (["--input", "{d}/missing.txt", "--vocab-size", "300", "--out", "{d}/t.json"], "is not a file"),
    (["--input", "{d}/a.txt", "--vocab-size", "256", "--out", "{d}/t.json"], "use >= 257"),
    (["--input", "{d}/a.txt", "--vocab-size", "300", "--out", "{d}/exists.json"], "already exists"),
    (["--input", "{d}/binary.txt", "--vocab-size", "300", "--out", "{d}/t.json"], "UTF-8"),
    (["--input", "{d}/a.txt", "--vocab-size", "many", "--out", "{d}/t.json"], "not an integer"),
    (["--input", "{d}/a.txt", "--vocab-size", "300"], "required: --out"),
])
def test_cli_bad_inputs_one_line_exit_2(tmp_path, capsys, args, fragment):
    (tmp_path / "a.txt").write_text(TEXT[:500])
    (tmp_path / "binary.txt").write_bytes(bytes(range(128, 256)) * 4)
    (tmp_path / "exists.json").write_text("{}")
    try:
        code = main(["tokenizer", "train", *[a.format(d=tmp_path) for a in args]])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "t.json").exists() and (tmp_path / "exists.json").read_text() == "{}"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_generate_streams_pieces_that_add_up_to_the_text(files, data):
    """``meshtrain generate`` writes its text as the tokens come (``cli.generate.TextStream``): for every kind and
    any token sequence, even one that cuts a character's bytes apart, the pieces handed out add up to the decoded
    text, the prompt comes first, and a character tokenizer hands out one piece per token."""
    import torch

    from meshtrain.cli.generate import TextStream

    kind = data.draw(st.sampled_from(KINDS))
    tok = load(kind, files)
    prompt = tok.encode("ROMEO:")
    drawn = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=20) if kind != "char"
                      else st.lists(st.sampled_from(tok.encode(TEXT[:200])), max_size=20))
    pieces: list[str] = []
    stream = TextStream(tok, prompt, pieces.append)
    for token in drawn:
        stream(torch.tensor([[token]]))
    text = tok.decode(prompt + drawn)
    stream.finish(text)
    assert pieces[0] == tok.decode(prompt)
    if text.startswith(tok.decode(prompt)) and all(tok.decode(prompt + drawn[:i]) == text[:len(tok.decode(prompt + drawn[:i]))]
                                                   for i in range(len(drawn))):
        assert "".join(pieces) == text  # decoding only ever appended: nothing lost, nothing twice
    if kind == "char":
        assert len([p for p in pieces if p]) == 1 + len(drawn)
