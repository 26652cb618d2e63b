"""The DPO example's pairs (scripts/shakespeare_chat.py ``preference_pairs``) and its held-out measure
(scripts/dpo_reward_accuracy.py), on the bundled plays.

Each rule the construction states is checked against the text itself, re-read here from its ``NAME:`` blocks (not
through the script's own helpers): the rejected reply is a speech of the text by someone who does not speak within
``SCENE`` speeches of the pair, it is never any conversation's answer, it is used once, and the user turn is the end of
the real speech. The prepared pairs (the example's 1,024-id BPE, ChatML) leave every sequence a completion token inside
the 129-token training window, so no pair ties by construction. The measure's rewards equal the DPO paper's
``beta * (log pi - log ref)`` computed by hand from transformers' logits.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chat = _load("shakespeare_chat")


def blocks(text: str) -> list[tuple[str, str]]:
    """(speaker, lines) of each ``NAME:`` block, read independently of the script."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) > 1 and lines[0].endswith(":"):
            out.append((lines[0][:-1].strip(), "\n".join(lines[1:]).strip()))
    return out


@pytest.fixture(scope="module")
def plays() -> tuple[str, list[dict]]:
    text = CORPUS.read_text(encoding="utf-8")
    return text, list(chat.preference_pairs(text))


def test_pairs_are_deterministic_and_seeded(plays, tmp_path):
    text, pairs = plays
    assert pairs == list(chat.preference_pairs(text))
    assert pairs != list(chat.preference_pairs(text, seed=1))
    outs = []
    for k in range(2):  # the command line writes the same bytes twice
        out = tmp_path / f"pairs{k}.jsonl"
        subprocess.run([sys.executable, ROOT / "scripts" / "shakespeare_chat.py", "--preference", "--out", out],
                       check=True, capture_output=True)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0].decode().splitlines() == [json.dumps(p) for p in pairs]


def test_rejected_is_a_speech_from_another_scene_never_an_answer_used_once(plays):
    text, pairs = plays
    said = blocks(text)
    where = defaultdict(list)  # a speech's text -> every position it has
    for k, (_, lines) in enumerate(said):
        where[lines].append(k)
    answers = {c["messages"][-1]["content"] for c in chat.conversations(text)}
    assert len(pairs) > 0.95 * len(answers)  # nearly every conversation finds a rejected reply (3,373 of 3,537)
    far = len(said) // chat.FAR_SHARE
    assert far > 1000  # on the bundled text: farther than any play's excerpt (Coriolanus: speeches 0 to ~1,090)
    rejected = [p["rejected"][0]["content"] for p in pairs]
    assert len(set(rejected)) == len(rejected)  # each used once
    assert not set(rejected) & answers  # no rejected text is ever pushed up as a chosen one
    for pair, other in zip(pairs, rejected):
        answerer = pair["prompt"][0]["content"].removeprefix("You are ").removesuffix(".")
        chosen = pair["chosen"][0]["content"]
        user = pair["prompt"][1]["content"]
        here = [k for k in where[chosen] if k > 0 and said[k][0] == answerer and said[k - 1][1].endswith(user)]
        assert here and other != chosen
        k = here[0]  # the conversation's answer (a text said twice by the same speaker after the same words: either)
        scene = {s for s, _ in said[max(0, k - 1 - chat.SCENE):k + 1 + chat.SCENE]}  # the conversation's window
        assert answerer in scene
        assert any(said[j][0] not in scene and abs(j - k) >= far for j in where[other])
        full = said[k - 1][1]  # the speech the reply answers: the user turn is its last lines
        assert full.endswith(user) and (full == user or full[-len(user) - 1] == "\n")
        assert len(user) <= chat.PROMPT_CHARS or "\n" not in user


def test_length_does_not_tell_chosen_from_rejected(plays):
    """The rejected reply is the candidate closest in length to the chosen one: the share of pairs whose chosen is
    the longer stays near one half. With n ~ 3,500 pairs the standard error of a share of 0.5 is
    sqrt(0.25 / n) ~ 0.0085; 0.45-0.55 is about 6 of them, while a construction that drew systematically longer or
    shorter replies would leave it far outside."""
    _, pairs = plays
    longer = [len(p["chosen"][0]["content"]) > len(p["rejected"][0]["content"]) for p in pairs]
    ties = [len(p["chosen"][0]["content"]) == len(p["rejected"][0]["content"]) for p in pairs]
    share = sum(longer) / (len(pairs) - sum(ties))
    assert 0.45 < share < 0.55
    ratio = np.median([len(p["rejected"][0]["content"]) / len(p["chosen"][0]["content"]) for p in pairs])
    assert 0.9 < ratio < 1.1


def test_last_lines():
    assert chat.last_lines("a\nbb\nccc", 6) == "bb\nccc"
    assert chat.last_lines("a\nbb\nccc", 100) == "a\nbb\nccc"
    assert chat.last_lines("a\nbb\nccc", 2) == "ccc"  # the last line alone, though longer


@pytest.fixture(scope="module")
def prepared(plays, tmp_path_factory) -> Path:
    """The example's data: a 1,024-id BPE trained on the plays, the pairs prepared with it (ChatML added)."""
    from meshtrain.cli.tokenizer import train_bpe
    from meshtrain.data.preprocess import prepare

    _, pairs = plays
    root = tmp_path_factory.mktemp("example_pairs")
    tokenizer = train_bpe([CORPUS], 1024, root / "bpe.json")
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prepare(str(tokenizer), [str(root / "pairs.jsonl")], root / "pairs", data_format="preference", val_fraction=0.1)
    return root / "pairs"


@pytest.mark.slow  # a 1,024-id BPE trained and 3,373 pairs prepared: about 25 s
def test_every_pair_keeps_a_completion_in_the_window(prepared):
    """A sequence whose prompt fills the 128 + 1 tokens of the trainer's window has no completion token left: its
    log-probability is 0 under any model, the pair's rewards tie and count as wrong (TRL's accuracy is chosen >
    rejected). The cut user turn leaves none such, in train or val, and val holds >= 300 pairs."""
    acc = _load("dpo_reward_accuracy")
    for split in ("train", "val"):
        ids, mask = acc.sequences(prepared, split, 128, 0)
        assert len(ids) % 2 == 0 and int((mask[:, 1:].sum(dim=1) == 0).sum()) == 0
    assert len(ids) // 2 >= 300


@pytest.mark.slow  # with the prepared pairs above: about 20 s more
def test_rewards_equal_the_papers_from_transformers_logits(prepared, tmp_path):
    """Two different random tiny Llamas as policy and reference on the first 6 val pairs: the script's accuracy and
    margin equal beta * (sum of masked target log-softmax) computed here token by token in float64 (Rafailov et al.
    2023, Sec. 5). Tolerance: both sides sum the same float32 log-probabilities (~40 terms of magnitude <= ~10);
    1e-9 absolute on a float64 difference of identical float32 inputs leaves room for the summation order only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    acc = _load("dpo_reward_accuracy")
    ids, mask = acc.sequences(prepared, "val", 128, 6)
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1152, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                             max_position_embeddings=128))
        model.save_pretrained(tmp_path / f"m{seed}")
        folders.append(str(tmp_path / f"m{seed}"))
    got = [acc.completion_logps(folder, ids, mask, batch=5) for folder in folders]
    want = []
    for folder in folders:
        model = LlamaForCausalLM.from_pretrained(folder).eval()
        rows = []
        for x, m in zip(ids, mask):
            n = int((x != 0).nonzero().max()) + 1 if (x != 0).any() else 0
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=x[None, :n - 1]).logits[0].double(), dim=-1)
            rows.append(sum(float(logp[t - 1, x[t]]) for t in range(1, n) if m[t] == 1))
        want.append(torch.tensor(rows, dtype=torch.float64))
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-3, rtol=0)
    beta = 0.1
    result = acc.reward_accuracy(got[0], got[1], beta)
    reward = beta * (want[0] - want[1])
    assert result["pairs"] == 6
    assert result["accuracy"] == float((reward[0::2] > reward[1::2]).double().mean())
    assert math.isclose(result["margin"], float((reward[0::2] - reward[1::2]).mean()), abs_tol=1e-4)
    p = result["accuracy"]
    assert math.isclose(result["se"], math.sqrt(p * (1 - p) / 6))


def test_held_out_pairs_are_held_out_conversations(plays):
    """``prepare``'s split rule is positional (item i goes to val when floor((i + 1) f) > floor(i f)): up to the first
    conversation left out (near the end of the text, where the pool of far speeches runs out), pair i is conversation
    i, so each pair the rule holds out at --val-fraction 0.1 is a conversation it holds out of the fine-tuning at 0.1:
    the held-out reward accuracy is measured on answers the reference (the fine-tuned model) never trained on either.
    After it, a few are not (5 of the 337 held-out pairs)."""
    text, pairs = plays
    answers = [(c["messages"][0]["content"], c["messages"][-1]["content"]) for c in chat.conversations(text)]
    f = 0.1

    def held_out(i: int) -> bool:
        return math.floor((i + 1) * f) > math.floor(i * f)

    k, not_held_out = 0, 0
    for i, pair in enumerate(pairs):  # pair i is conversation k >= i, the next one with its system turn and answer
        while answers[k] != (pair["prompt"][0]["content"], pair["chosen"][0]["content"]):
            k += 1
        if k == i:
            assert not held_out(i) or held_out(k)
        else:
            assert k > 0.9 * len(answers)  # the left-out conversations are near the end only
            not_held_out += held_out(i) and not held_out(k)
        k += 1
    assert not_held_out <= 0.02 * sum(held_out(i) for i in range(len(pairs)))
