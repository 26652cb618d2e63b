"""LSTM and GRU language models: data and pipeline parallelism compute what one process computes.

The contract of docs/architecture.md for the recurrent models: DDP (dp=2), FSDP2 (dp=2, zero 3) and a 2-stage
pipeline (1F1B over 4 micro-batches) against one process on the same 4-layer model, global batch
(8 samples of 32 tokens) and data order -- every step's loss (1e-5 relative), the step-1 gradients
(1e-5 of the gradient norm) and the final parameters (AdamW's drift bound), as derived in
``conftest.py``. The GRU runs with truncated BPTT (8 of 32 steps), so truncation is checked under
every layout too. Also: truncation itself, stateful sampling, and the configs rnn models reject.
"""

from __future__ import annotations

import pytest
import torch

from conftest import CONFIG, TINY, check_layout, cli_here, override_args
from layout_worker import layout_launcher, reference_run
from meshtrain.models.registry import FAMILIES

MODELS = {
    "lstm": {**TINY, "model.type": "lstm", "model.n_layer": "4", "train.steps": "6",
             "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "2"},
    "gru": {**TINY, "model.type": "gru", "model.n_layer": "4", "model.tbptt_steps": "8", "train.steps": "6",
            "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "2"},
}
LAYOUTS = {  # every one: global batch 8 on 2 ranks
    "dp2-ddp": {},
    "dp2-fsdp2": {"parallel.zero_stage": "3"},
    "pp2-1f1b": {"parallel.pp": "2", "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4"},
}
REFERENCE = {"batch.micro_batch_size": "8", "batch.gradient_accumulation_steps": "1"}


SLOW_KINDS = ("gru",)
"""Models whose layouts run in `make test-slow` (one 2-rank launch of both took 29-33 s here): the LSTM's runs every
layout in `make test`, the GRU's (the same strategies on the other cell, with truncated BPTT) in `make test-slow`."""


def _launch(tmp_path_factory, kinds: tuple[str, ...], name: str):
    layouts = {f"{kind}-{layout}": (2, {**MODELS[kind], **o}) for kind in kinds for layout, o in LAYOUTS.items()}
    return layout_launcher(tmp_path_factory, {}, layouts, name)(2)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The fast models' layouts in one 2-rank launch."""
    return _launch(tmp_path_factory, tuple(k for k in MODELS if k not in SLOW_KINDS), "rnn-world")


@pytest.fixture(scope="module")
def launched_slow(tmp_path_factory):
    return _launch(tmp_path_factory, SLOW_KINDS, "rnn-slow-world")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {kind: reference_run(tmp_path_factory.mktemp(f"ref-{kind}"), {**model, **REFERENCE})
            for kind, model in MODELS.items()}


@pytest.mark.parametrize("kind", [k for k in MODELS if k not in SLOW_KINDS])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rnn_layout_matches_single_process(launched, references, kind, layout):
    check_layout(launched[f"{kind}-{layout}"], references[kind], MODELS[kind])


@pytest.mark.slow
@pytest.mark.parametrize("kind", SLOW_KINDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rnn_layout_matches_single_process_slow(launched_slow, references, kind, layout):
    check_layout(launched_slow[f"{kind}-{layout}"], references[kind], MODELS[kind])


def _model(kind: str, tbptt: int = 0):
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(type=kind, n_layer=2, n_embd=16, block_size=32, tbptt_steps=tbptt), 11)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_truncated_bptt_keeps_the_forward_and_cuts_the_gradient(kind):
    """TBPTT(8, 8): logits equal to full BPTT; the loss at the last position reaches the embedding of the
    tokens of its own segment only (positions 24-31), while full BPTT reaches all 32."""
    full, cut = _model(kind), _model(kind, tbptt=8)
    idx = torch.randint(0, 11, (1, 32), generator=torch.Generator().manual_seed(1))
    reach = {}
    for name, model in (("full", full), ("cut", cut)):
        emb = model.tok_emb.weight.detach()[idx].requires_grad_()  # (1, 32, C)
        x = model.drop(emb)
        for block in model.blocks.values():
            x, _ = block(x)
        model.lm_head(x)[0, -1].sum().backward()
        reach[name] = emb.grad[0].abs().sum(-1) > 0  # (32,) which positions the last output depends on
    assert reach["full"].all()
    assert not reach["cut"][:24].any() and reach["cut"][24:].all()
    torch.testing.assert_close(cut(idx), full(idx), rtol=0, atol=1e-6)  # segments reorder no sum: ~1 ulp


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_stateful_generation_matches_the_whole_sequence(kind):
    """Sampling feeds one token at a time and carries every layer's state: a sequence run in two pieces
    gives the logits of one run over all of it (the same recurrence; the input matmul is batched over
    other time spans, so fp32 rounding of sums of C=16 terms, ~1e-6)."""
    model = _model(kind).eval()
    ids = torch.randint(0, 11, (2, 20), generator=torch.Generator().manual_seed(2))
    whole, _ = model.run(ids)  # (2, 20, V)
    first, states = model.run(ids[:, :12])
    rest, _ = model.run(ids[:, 12:], states)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, rtol=0, atol=1e-5)
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 40, generator=torch.Generator().manual_seed(0))  # longer than block_size
    assert out.shape == (1, 43) and torch.equal(out[:, :3], prompt)


@pytest.mark.parametrize("overrides, message", [
    ({"model.type": "lstm", "parallel.tp": "2"}, "parallel.tp = 2 is not supported for model.type = 'lstm'"),
    ({"model.type": "gru", "parallel.sp": "2"}, "parallel.sp = 2 is not supported for model.type = 'gru'"),
    ({"model.tbptt_steps": "8"}, "model.tbptt_steps = 8 applies to model.type = 'lstm' or 'gru' only"),
    ({"model.type": "lstm", "model.tbptt_steps": "-1"}, "model.tbptt_steps = -1 must be >= 0"),
    ({"model.type": "rnn"}, "model.type = 'rnn' is not supported: use one of " + ", ".join(FAMILIES)),
])
def test_bad_rnn_configs_are_rejected_before_launch(tmp_path, overrides, message):
    proc = cli_here("train", str(CONFIG), "--nproc", "2", "--out", str(tmp_path / "run"),
                    *override_args({**TINY, **overrides}))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_generate_samples_from_an_lstm_checkpoint(tmp_path):
    from conftest import train_here

    train_here(tmp_path / "run", **{"model.type": "lstm", "train.steps": "2"})
    proc = cli_here("generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "40")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) == len("ROMEO:") + 40 + 1  # + the final newline
