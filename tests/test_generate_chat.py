"""``meshtrain generate --chat`` (:func:`meshtrain.cli.generate.chat_prompt`): a conversation rendered with the
tokenizer's chat template, sampling stopped at the end-of-turn token, only the reply printed.

The reference for the prompt ids is transformers' ``apply_chat_template(messages, add_generation_prompt=True)`` on
the same tokenizer folder: a tiny byte-level BPE trained here (nothing is downloaded), extended with ChatML by
:func:`meshtrain.data.chat.chat_format` as ``prepare --format chat`` extends it, or given a Llama-3-like template
of its own. The model whose stop is checked is a tiny Llama built here whose next token is a fixed function of the
current one (identity blocks, one-hot embeddings, a head that maps them), so the reply it writes is known.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_chat_data import hf_folder, train_bpe
from meshtrain.cli.generate import chat_prompt, sample
from meshtrain.cli.main import main as cli_main
from meshtrain.data.chat import CHAT, chat_format
from meshtrain.data.tokenizers import HFTokenizer

LLAMA3 = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")
"""Llama 3's layout without generation markers; its end of turn is the EOS ``<|eot_id|>``."""
CONVERSATIONS = [
    "Hello there",
    json.dumps([{"role": "user", "content": "What is two plus two?"}]),
    json.dumps([{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "It is four."}, {"role": "user", "content": "héllo wörld ✓"}]),
]


def chatml_folder(folder: Path) -> Path:
    """A BPE without ChatML tokens (as ``meshtrain tokenizer train`` makes) extended as prepare extends it: the
    folder holds tokenizer.json with <|im_start|>/<|im_end|> and tokenizer_config.json with the template."""
    folder.mkdir(parents=True)
    (folder / "plain.json").write_text(train_bpe(["<|endoftext|>"]).to_str())
    _, files = chat_format(HFTokenizer(folder / "plain.json"), CHAT, prompt_loss=False)
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "plain.json").unlink()
    return folder


def llama3_folder(folder: Path) -> Path:
    """A transformers tokenizer folder with Llama 3's special tokens and template (chat_template.jinja)."""
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return hf_folder(folder, LLAMA3, special, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_gen")
    return {"chatml": chatml_folder(root / "chatml"), "llama3": llama3_folder(root / "llama3")}


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
@pytest.mark.parametrize("prompt", CONVERSATIONS)
def test_prompt_ids_equal_transformers(folders, kind, prompt):
    from transformers import AutoTokenizer

    from meshtrain.cli.generate import chat_messages

    messages = chat_messages(prompt, None)
    theirs = AutoTokenizer.from_pretrained(folders[kind]).apply_chat_template(messages, add_generation_prompt=True,
                                                                             tokenize=True, return_dict=True)
    ids, stop = chat_prompt(HFTokenizer(folders[kind]), prompt, None)
    assert ids == theirs["input_ids"]
    lib = HFTokenizer(folders[kind]).tokenizer
    end = lib.token_to_id("<|im_end|>" if kind == "chatml" else "<|eot_id|>")
    assert end in stop


def test_system_turn_is_the_first_message(folders):
    from meshtrain.cli.generate import chat_messages

    assert chat_messages("Hi", "Be brief.") == [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}]
    tok = HFTokenizer(folders["chatml"])
    ids, _ = chat_prompt(tok, "Hi", "Be brief.")
    assert tok.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                              "<|im_start|>assistant\n"


def chain_model(folder: Path, tok: HFTokenizer, chain: list[int], out: Path) -> Path:
    """A Hugging Face folder of a 1-block Llama that, greedily, follows ``chain``: after ``chain[k]`` comes
    ``chain[k + 1]``. The block adds nothing (its output projections are 0), token ``chain[k]`` embeds as the
    basis vector e_k, and the head's row of ``chain[k + 1]`` is e_k: its logit is sqrt(C), every other is 0."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model
    from meshtrain.models.hf import write_hf_folder

    vocab = 384
    cfg = ModelConfig(type="llama", n_layer=1, n_head=2, n_embd=16, block_size=64, multiple_of=16)
    state = build_model(cfg, vocab).state_dict()
    state["blocks.0.attn.proj.weight"].zero_()
    state["blocks.0.mlp.down.weight"].zero_()
    state["tok_emb.weight"].zero_()
    state["lm_head.weight"].zero_()
    for k, (a, b) in enumerate(zip(chain, chain[1:])):
        state["tok_emb.weight"][a, k] = 1.0
        state["lm_head.weight"][b, k] = 1.0
    write_hf_folder(out, state, cfg, vocab, tok.to_dict(), max_shard_bytes=2**30)
    return out


@pytest.fixture(scope="module")
def chain(folders, tmp_path_factory) -> tuple[Path, str]:
    """(model folder, the reply it writes): after the generation prompt's last token it writes "Hello there",
    then <|im_end|>, then "four" (which a stop at the end of the turn never shows)."""
    tok = HFTokenizer(folders["chatml"])
    ids, _ = chat_prompt(tok, "Hi", None)
    reply = tok.encode_with_special("Hello there")
    tail = tok.encode_with_special("<|im_end|>four")
    assert len(set(ids[-1:] + reply + tail)) == len(ids[-1:] + reply + tail)  # a chain visits each token once
    folder = chain_model(folders["chatml"], tok, ids[-1:] + reply + tail, tmp_path_factory.mktemp("chain") / "m")
    return folder, "Hello there"


def test_generation_stops_at_the_end_of_turn(chain):
    folder, reply = chain
    pieces: list[str] = []
    assert sample(folder, "Hi", 20, temperature=0.0, chat=True, on_text=pieces.append) == reply
    assert "".join(pieces) == reply
    plain = sample(folder, "Hi\n", 8, temperature=0.0)  # without --chat: no stop, the prompt is shown
    assert plain.startswith("Hi\nHello there<|im_end|>four")


def test_cli_prints_only_the_reply(chain, capsys):
    folder, reply = chain
    assert cli_main(["generate", "--checkpoint", str(folder), "--chat", "--prompt", "Hi", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == reply + "\n"


@pytest.mark.parametrize("argv, expected", [
    (["--prompt", "[{\"role\": \"user\""], "--prompt starts with '[' but is not JSON"),
    (["--prompt", "[{\"role\": \"robot\", \"content\": \"x\"}]"],
     "--prompt: messages[0] has role 'robot': valid roles are system, user, assistant"),
    (["--prompt", "[]"], "must be a non-empty list"),
    (["--prompt", "[{\"role\": \"system\", \"content\": \"a\"}]", "--system", "b"], "give the system turn once"),
    ([], "--chat needs --prompt"),
])
def test_bad_chat_inputs_are_one_line(chain, argv, expected, capsys):
    folder, _ = chain
    capsys.readouterr()
    assert cli_main(["generate", "--checkpoint", str(folder), "--chat", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and expected in err, err


def test_system_without_chat_is_refused(chain, capsys):
    folder, _ = chain
    assert cli_main(["generate", "--checkpoint", str(folder), "--prompt", "Hi", "--system", "x"]) == 2
    assert "--system adds a system turn to a conversation: use it with --chat" in capsys.readouterr().err


def test_a_tokenizer_without_template_or_chatml_is_refused(tmp_path, capsys):
    """A model pretrained on a plain BPE (no template, no ChatML tokens) cannot chat: one line, exit 2."""
    from meshtrain.data.tokenizers import load_tokenizer

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(train_bpe(["<|endoftext|>"]).to_str())
    tok = load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    folder = chain_model(tmp_path / "tok", tok, [0, 1], tmp_path / "m")
    assert cli_main(["generate", "--checkpoint", str(folder), "--chat", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no chat template" in err and "no <|im_start|>/<|im_end|> tokens" in err and "\n" not in err, err


# --- the example of docs/posttraining.md in miniature ----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = {"model.n_layer": "1", "model.n_head": "2", "model.n_kv_head": "1", "model.n_embd": "32",
              "model.block_size": "64", "batch.micro_batch_size": "4", "optim.warmup_steps": "2",
              "train.log_interval": "5", "train.eval_steps": "4", "train.dtype": "float32"}


def cli(*argv: str) -> None:
    assert cli_main([str(a) for a in argv]) == 0, argv


def flags(overrides: dict[str, str]) -> list[str]:
    return [tok for key, value in overrides.items() for tok in (f"--{key}", value)]


@pytest.mark.slow  # eight commands, two trainings: about a minute on 2 cores
def test_the_example_in_miniature(tmp_path, capsys):
    """docs/posttraining.md's example, every command through the CLI at a tiny size: a BPE, pretraining with rows
    for the two ChatML tokens prepare adds (model.vocab_size), the export, conversations, prepare --format chat,
    fine-tuning from the export (configs/llama_tiny_sft.toml) whose supervised val loss falls, generate --chat."""
    import subprocess
    import sys

    from conftest import read_records

    text = tmp_path / "plays.txt"
    text.write_text((ROOT / "src/meshtrain/assets/tinyshakespeare.txt").read_text()[:150_000])
    data, runs = tmp_path / "data", tmp_path / "runs"
    cli("tokenizer", "train", "--input", text, "--vocab-size", "300", "--out", data / "bpe.json")
    cli("prepare", "--tokenizer", data / "bpe.json", "--input", text, "--doc-split", "blank-line",
        "--val-fraction", "0.1", "--out", data / "text")
    cli("train", ROOT / "configs/llama_tiny.toml", "--nproc", "1", "--data.path", data / "text", "--out", runs / "pre",
        "--model.vocab_size", "384", "--steps", "20", *flags({**TINY_LLAMA, "train.eval_interval": "0"}))
    cli("export", "--checkpoint", runs / "pre", "--format", "hf", "--out", runs / "pre_hf")
    subprocess.run([sys.executable, ROOT / "scripts/shakespeare_chat.py", "--input", text, "--out",
                    data / "chat.jsonl"], check=True, capture_output=True)
    cli("prepare", "--tokenizer", data / "bpe.json", "--input", data / "chat.jsonl", "--format", "chat",
        "--val-fraction", "0.1", "--out", data / "chat")
    assert HFTokenizer(data / "chat").tokenizer.token_to_id("<|im_end|>") == 301  # after the BPE's 300 ids
    cli("train", ROOT / "configs/llama_tiny_sft.toml", "--nproc", "1", "--model.init_from", runs / "pre_hf",
        "--data.path", data / "chat", "--out", runs / "sft", "--steps", "20",
        *flags({**TINY_LLAMA, "optim.lr": "3e-3", "train.eval_interval": "5"}))
    val = [r["val_loss"] for r in read_records(runs / "sft") if "val_loss" in r]
    assert len(val) == 4 and val[-1] < val[0], val
    capsys.readouterr()
    cli("generate", "--checkpoint", runs / "sft", "--chat", "--system", "You are ROMEO.", "--prompt", "Speak.",
        "--max-new-tokens", "20", "--temperature", "0")
    reply = capsys.readouterr().out
    assert reply.endswith("\n") and "<|im_start|>" not in reply and "Speak." not in reply, reply
