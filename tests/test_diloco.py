"""DiLoCo and Streaming DiLoCo (``parallel.sync_mode = "diloco"``) equal what their papers say they compute.

- With inner SGD, H = 1, outer lr 1 and no momentum, an outer step is the mean of the workers' SGD steps: one
  synchronous data-parallel step. Checked against one process (the contract of docs/architecture.md).
- Otherwise every worker's loss of every inner step, and the outer weights at the end, equal a one-process
  simulation of the same workers written here from the papers' algorithms (Douillard et al. 2023,
  arXiv:2311.08105, Algorithm 1; Douillard et al. 2025, arXiv:2501.18512, Algorithm 2), each worker a model copy
  with its own AdamW on its own samples -- 4 workers x H = 8; the same streamed (F = 2 fragments, tau = 1,
  alpha = 0.5); dp2 inside each of 2 workers; tp2 inside each of 2 workers.
- The outer momentum survives a checkpoint: with inner SGD (no inner state) a resumed run is the uninterrupted one.
- The int8 exchange across two gloo ranks equals the quantize/dequantize arithmetic done in one process; its
  error stays within the bound its quantizer promises (property-based).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CONFIG, TINY, assert_close_losses, assert_close_params, final_params, losses, read_records
from diloco_worker import DIVERGES, LOSSES_FILE, STOPPED_FILE
from test_muon_layouts import muon_step_bound
from layout_worker import launch_layouts, reference_run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MODEL = {**TINY, "model.n_head": "4", "model.dropout": "0.0", "batch.micro_batch_size": "2"}
WORKER = Path(__file__).with_name("diloco_worker.py")
DILOCO = {"parallel.sync_mode": "diloco", "diloco.group": "1"}
RUNS = {  # name: (world size, overrides on MODEL, (workers, dp inside a worker))
    "w4-h8": (4, {**DILOCO, "diloco.inner_steps": "8", "train.steps": "16"}, (4, 1)),
    "w4-h8-streaming": (4, {**DILOCO, "diloco.inner_steps": "8", "diloco.fragments": "2",
                            "diloco.delay": "1", "diloco.alpha": "0.5", "train.steps": "16"}, (4, 1)),
    "w2-dp2-h4": (4, {**DILOCO, "diloco.group": "2", "diloco.inner_steps": "4",
                      "train.steps": "8"}, (2, 2)),
    "w2-tp2-h4": (4, {**DILOCO, "diloco.group": "2", "parallel.tp": "2", "diloco.inner_steps": "4",
                      "train.steps": "8"}, (2, 1)),
    # Muon as the inner optimizer (docs/optimizers.md), its tp-sharded matrices orthogonalized by their owners
    "w2-tp2-h4-muon": (4, {**DILOCO, "diloco.group": "2", "parallel.tp": "2", "diloco.inner_steps": "4",
                           "train.steps": "8", "optim.name": "muon", "optim.muon_ns_dtype": "float32"}, (2, 1)),
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Every 4-rank run of :data:`RUNS`, in one torchrun launch."""
    root = tmp_path_factory.mktemp("diloco4")
    launch_layouts(4, root, {n: {**MODEL, **o} for n, (w, o, _) in RUNS.items() if w == 4}, worker=WORKER,
                   results=False)
    return root


def worker_losses(out: Path) -> dict[int, dict[int, float]]:
    """{worker: {step: loss}} recorded by :mod:`diloco_worker`."""
    recorded = json.loads((out / LOSSES_FILE).read_text())
    return {int(w): {i + 1: loss for i, loss in enumerate(values)} for w, values in recorded.items()}


def simulate(overrides: dict[str, str], workers: int, replicas: int) -> tuple[dict[int, dict[int, float]], dict, float]:
    """The run of ``overrides`` as the papers write it, in this process: ``workers`` model copies, each averaging
    the loss of its ``replicas`` dp ranks' samples (the sampler's streams ``w * replicas + i``), clipping its own
    gradient, stepping its own AdamW; fragment ``p`` of F takes its outer step after inner steps t with
    ``t % H == ((p + 1) * H / F) % H`` on the workers' mean pseudo-gradient (outer minus local), by SGD with
    Nesterov momentum, lands tau steps later and is mixed in with alpha; at the end every fragment not synced at
    the last step takes one more outer step, unmixed (the checkpoint's consolidation). With ``diloco_precision =
    "int8"`` each worker's flat pseudo-gradient of a fragment is quantized and dequantized by the exchange's own
    arithmetic (:func:`quantize_int8`, :func:`dequantize_int8`) before the mean. Returns ({worker: {step: loss}}, the
    final outer weights by name, the largest int8 quantization step of any exchange (0 without int8))."""
    from meshtrain.config.load import load_config
    from meshtrain.data.sampler import ShardedSampler
    from meshtrain.optim.build import build_optimizer
    from meshtrain.parallel.diloco import dequantize_int8, quantize_int8
    from meshtrain.train.setup import set_up

    torch.set_num_threads(1)
    cfg = load_config(CONFIG, {**MODEL, **overrides})
    b, T = cfg.batch, cfg.model.block_size
    run = set_up(cfg, torch.device("cpu"))
    dp = workers * replicas
    gbs = b.micro_batch_size * b.gradient_accumulation_steps * dp
    models = [copy.deepcopy(run.model) for _ in range(workers)]
    optims = [build_optimizer(m.named_parameters(), cfg, gbs) for m in models]
    samplers = [[ShardedSampler(run.corpus.train, T, b.micro_batch_size, b.gradient_accumulation_steps, dp,
                                w * replicas + i, cfg.train.seed) for i in range(replicas)] for w in range(workers)]
    H, F, tau, alpha = cfg.diloco.inner_steps, cfg.diloco.fragments, cfg.diloco.delay, cfg.diloco.alpha
    names = [n for n, _ in run.model.named_parameters()]
    L = cfg.model.n_layer  # fragment f: blocks f*L/F .. (f+1)*L/F - 1; the embedding, final norm and head in the first
    block_of = {n: int(n.split(".")[1]) if n.startswith("blocks.") else 0 for n in names}
    groups = [[n for n in names if block_of[n] * F // L == f] for f in range(F)]
    outer = {n: q.detach().clone() for n, q in run.model.named_parameters()}
    momentum = {"momentum": cfg.diloco.outer_momentum, "nesterov": True} if cfg.diloco.outer_momentum else {}
    outer_opts = [torch.optim.SGD([outer[n] for n in g], lr=cfg.diloco.outer_lr, **momentum) for g in groups]
    pending: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
    last_sync = [0] * F
    positions = torch.arange(T)

    largest_step = 0.0

    def pseudo_gradient(f: int) -> dict[str, torch.Tensor]:
        nonlocal largest_step
        params = [dict(m.named_parameters()) for m in models]
        if cfg.diloco.precision != "int8":
            return {n: sum(outer[n] - ps[n].detach() for ps in params) / workers for n in groups[f]}
        sent = []
        for ps in params:  # what each worker sends: its flat pseudo-gradient as int8 codes and fp32 block scales
            flat = torch.cat([(outer[n] - ps[n].detach()).flatten() for n in groups[f]])
            codes, scales = quantize_int8(flat)
            largest_step = max(largest_step, float(scales.max()))
            sent.append(dequantize_int8(codes, scales, flat.numel()))
        mean, start = sum(sent) / workers, 0
        out = {}
        for n in groups[f]:
            out[n], start = mean[start:start + outer[n].numel()].view_as(outer[n]), start + outer[n].numel()
        return out

    def land(f: int, delta: dict[str, torch.Tensor], mix: float) -> None:
        for n in groups[f]:
            outer[n].grad = delta[n]
        outer_opts[f].step()
        outer_opts[f].zero_grad(set_to_none=True)
        with torch.no_grad():
            for m in models:
                ps = dict(m.named_parameters())
                for n in groups[f]:
                    ps[n].copy_(mix * ps[n] + (1 - mix) * outer[n])

    got: dict[int, dict[int, float]] = {w: {} for w in range(workers)}
    for step in range(1, cfg.train.steps + 1):
        for w, (model, (optimizer, scheduler)) in enumerate(zip(models, optims)):
            total = 0.0
            for sampler in samplers[w]:
                micro = sampler.next_step()
                for x, y in micro:
                    loss = torch.nn.functional.cross_entropy(model(x, positions).flatten(0, 1), y.flatten())
                    (loss / (len(micro) * replicas)).backward()
                    total += loss.item() / (len(micro) * replicas)
            got[w][step] = total
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        for f in [f for f, (due, _) in pending.items() if due <= step]:
            land(f, pending.pop(f)[1], alpha)
        for f in range(F):
            if step % H == ((f + 1) * H // F) % H:
                last_sync[f] = step
                pending[f] = (step + tau, pseudo_gradient(f))
                if tau == 0:
                    land(f, pending.pop(f)[1], alpha)
    for f in range(F):  # the last checkpoint's consolidation
        if f in pending:
            land(f, pending.pop(f)[1], 0.0)
        if last_sync[f] < cfg.train.steps:
            land(f, pseudo_gradient(f), 0.0)
    final = copy.deepcopy(run.model)
    with torch.no_grad():
        for n, q in final.named_parameters():
            q.copy_(outer[n])
    return got, {k: v.detach().clone() for k, v in final.state_dict().items()}, largest_step  # a tied head too


def diloco_drift_bound(overrides: dict[str, str], int8_step: float = 0.0) -> float:
    """Largest difference of a weight between two DiLoCo runs that agree up to rounding, derived step by step.

    Inside a round a worker's weights drift by at most 2 * lr_t per AdamW step (:func:`conftest.adamw_drift_bound`),
    ``2 * lr_t * max(1, 1.21 r)`` per Muon step (:func:`test_muon_layouts.muon_drift_bound`'s per-step term).
    An outer step's pseudo-gradient then differs by at most ``e = D + G`` (D: the workers' drift when it is taken,
    G: the outer weights'), the momentum by ``mu * m + e``, the outer weights by ``outer_lr * (e + mu * m)`` more
    (Nesterov SGD's update, linear in both), and a worker mixes to at most ``max(D, G)`` when it lands tau steps
    later. Each fragment's own outer steps, then the final consolidation's; the largest over fragments.

    An int8 exchange (``int8_step``: the largest quantization step, a block's absmax / 127) rounds two pseudo-gradients
    that differ by ``e`` to values that differ by at most ``e + s_a/2 + s_b/2``, where the blocks' steps differ by at
    most ``e/127``: ``e * (1 + 1/254) + int8_step`` per value and worker, so per mean too (one code flipped by
    rounding is the most it adds)."""
    from meshtrain.config.load import load_config
    from meshtrain.optim.schedule import lr_at

    cfg = load_config(CONFIG, {**MODEL, **overrides})
    steps = cfg.train.steps
    H, F, tau = cfg.diloco.inner_steps, cfg.diloco.fragments, cfg.diloco.delay
    per_step = muon_step_bound(cfg) if cfg.optim.name == "muon" else 1.0
    worst = 0.0
    for f in range(F):
        drift = outer = momentum = 0.0
        taken: dict[int, float] = {}  # step it lands after -> the pseudo-gradient's bound

        def land(e: float) -> None:
            nonlocal drift, outer, momentum
            if int8_step:
                e = e * (1 + 1 / 254) + int8_step
            momentum = cfg.diloco.outer_momentum * momentum + e
            outer += cfg.diloco.outer_lr * (e + cfg.diloco.outer_momentum * momentum)
            drift = max(drift, outer)

        last = 0
        for step in range(1, steps + 1):
            drift += 2 * per_step * lr_at(step - 1, cfg.optim, steps)
            if step in taken:
                land(taken.pop(step))
            if step % H == ((f + 1) * H // F) % H:
                taken[step + tau], last = drift + outer, step
                if tau == 0:
                    land(taken.pop(step))
        for e in taken.values():
            land(e)
        if last < steps:
            land(drift + outer)
        worst = max(worst, outer)
    return worst


@pytest.mark.parametrize("name", [n for n, (w, _, _) in RUNS.items() if w == 4])
def test_workers_equal_the_papers_algorithm_simulated_in_one_process(four_ranks, name):
    _, overrides, (workers, replicas) = RUNS[name]
    want_losses, want_params, _ = simulate(overrides, workers, replicas)
    got = worker_losses(four_ranks / name)
    assert sorted(got) == list(range(workers))
    for w in range(workers):
        assert_close_losses(got[w], want_losses[w])
    # the other workers' losses differ from worker 0's: each trained on its own samples
    assert got[1][2] != pytest.approx(got[0][2], rel=1e-4)
    assert_close_params(final_params(four_ranks / name), want_params, atol=diloco_drift_bound(overrides))


SGD_H1 = {**MODEL, "optim.name": "sgd", "optim.lr": "0.5", "optim.grad_clip": "0", "optim.weight_decay": "0.1",
          "train.steps": "6", "batch.micro_batch_size": "4"}
INT8 = {**DILOCO, "diloco.inner_steps": "4", "diloco.precision": "int8", "train.steps": "8"}
ONE_DIVERGES = {**DILOCO, "diloco.inner_steps": "4", "train.max_nonfinite_steps": "2", "train.steps": "8"}
"""Two workers (one rank each, gloo) exchanging int8 pseudo-gradients: 2 outer steps."""
MOMENTUM = {**MODEL, **DILOCO, "optim.name": "sgd", "optim.lr": "0.3", "diloco.inner_steps": "4",
            "train.steps": "12", "checkpoint.interval": "4", "checkpoint.keep": "5"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank runs, in one torchrun launch, in order: DiLoCo as synchronous data parallelism; a 12-step run
    with checkpoints every H = 4 steps; the same resumed from its step-4 checkpoint; the int8 exchange; a run whose
    worker 1 alone goes non-finite (:data:`diloco_worker.DIVERGES`)."""
    root = tmp_path_factory.mktemp("diloco2")
    h1 = {**SGD_H1, **DILOCO, "diloco.inner_steps": "1", "diloco.outer_lr": "1", "diloco.outer_momentum": "0"}
    resumed = {**MOMENTUM, "checkpoint.resume": str(root / "whole" / "checkpoints" / "step_000004")}
    launch_layouts(2, root, {"sgd-h1": h1, "whole": MOMENTUM, "resumed": resumed, "int8": {**MODEL, **INT8},
                             DIVERGES: {**MODEL, **ONE_DIVERGES}}, worker=WORKER, results=False)
    return root


def test_sgd_h1_outer_lr_1_without_momentum_is_synchronous_data_parallelism(two_ranks, tmp_path):
    """Two workers, one rank each: mean(theta - lr * g_w) = theta - lr * mean(g_w), one process's step."""
    want_losses, _, want_params = reference_run(tmp_path / "reference", {**SGD_H1, "batch.micro_batch_size": "8"})
    got = worker_losses(two_ranks / "sgd-h1")
    mean = {step: (got[0][step] + got[1][step]) / 2 for step in got[0]}  # the global batch's mean loss
    assert_close_losses(mean, want_losses)
    # SGD moves a weight by lr_t * g: runs whose gradients agree to rounding differ by far less than lr_t * |g|,
    # and |g| <= the gradient norm the reference logs each step
    norms = {r["step"]: r["grad_norm"] for r in read_records(tmp_path / "reference") if "grad_norm" in r}
    from meshtrain.config.load import load_config
    from meshtrain.optim.schedule import lr_at

    cfg = load_config(CONFIG, SGD_H1)
    bound = sum(lr_at(s - 1, cfg.optim, cfg.train.steps) * norms[s] for s in norms)
    assert_close_params(final_params(two_ranks / "sgd-h1"), want_params, atol=bound)


def test_outer_momentum_survives_a_checkpoint(two_ranks):
    """Inner SGD keeps no state, so with the outer momentum saved a resumed run is the uninterrupted one; a
    momentum lost on resume would change the steps after the first outer step past it (step 9 on)."""
    want = losses(read_records(two_ranks / "whole"))
    got = losses(read_records(two_ranks / "resumed"))
    assert_close_losses({s: got[s] for s in range(5, 13)}, {s: want[s] for s in range(5, 13)})
    # the checkpoint and the summary record the run's dp over both workers (one rank each), and the workers
    meta = json.loads((two_ranks / "whole" / "checkpoints" / "step_000004" / "meta.json").read_text())
    summary = json.loads((two_ranks / "resumed" / "summary.json").read_text())
    for record in (meta, summary):
        assert (record["dp"], record["diloco_workers"], record["world_size"]) == (2, 2, 2)


def test_int8_exchange_across_two_gloo_ranks_is_the_quantized_mean_computed_in_one_process(two_ranks):
    """Two workers on two gloo ranks exchange their pseudo-gradients as int8 codes and fp32 block scales (all-gathered
    as flat buffers: gloo refuses a (W, n) output), dequantize every worker's and average them. The one-process
    simulation quantizes and dequantizes the same flat pseudo-gradients with the same functions: every worker's
    loss of every step agrees to the contract's 1e-5, and the final outer weights to :func:`diloco_drift_bound` with
    the int8 term (a code that rounding flips moves a value by one quantization step). A worker that averaged its own
    codes only, or mixed up the workers' rows or scales, would be off by a pseudo-gradient (~1e-2) at step 5."""
    want_losses, want_params, step = simulate(INT8, 2, 1)
    assert step > 0
    got = worker_losses(two_ranks / "int8")
    assert sorted(got) == [0, 1]
    for w in (0, 1):
        assert_close_losses(got[w], want_losses[w])
    assert_close_params(final_params(two_ranks / "int8"), want_params, atol=diloco_drift_bound(INT8, step))
    # what crossed: per exchange, ceil(n / 256) blocks of 256 one-byte codes and one 4-byte scale (n: the weights),
    # and a 4-byte vote to stop per worker
    from meshtrain.parallel.diloco import INT8_BLOCK

    n = sum(t.numel() for name, t in want_params.items() if name != "lm_head.weight")
    blocks = -(-n // INT8_BLOCK)
    summary = json.loads((two_ranks / "int8" / "summary.json").read_text())["diloco"]
    assert (summary["precision"], summary["outer_steps"]) == ("int8", 2)
    assert summary["sent_bytes"] == 2 * (blocks * (INT8_BLOCK + 4) + 4 * 2), (summary, n)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2000), st.floats(1e-6, 1e3), st.integers(0, 2**31 - 1))
def test_int8_exchange_error_is_at_most_half_a_step_of_its_block(n, scale, seed):
    from meshtrain.parallel.diloco import INT8_BLOCK, dequantize_int8, quantize_int8

    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    codes, scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and codes.numel() == scales.numel() * INT8_BLOCK
    back = dequantize_int8(codes, scales, n)
    step = scales.repeat_interleave(INT8_BLOCK)[:n]
    # round to nearest: |x - q * s| <= s / 2, plus fp32's rounding of x / s and of q * s (a few ulps of |x|)
    assert torch.all((back - x).abs() <= step / 2 + 4 * torch.finfo(torch.float32).eps * x.abs())


def test_a_worker_sends_one_copy_of_its_weights_per_exchange_and_streaming_a_fragment(four_ranks):
    """The bytes the workers exchange (the summary's, summed over a worker's ranks): H times fewer than DDP's
    every-step all-reduce of the gradients, however many replicas a worker holds (dp2: each sends half), and with
    F fragments each exchange is one fragment (its largest: the first, which holds the embeddings too). Beside its
    share each rank sends one fp32 vote to stop per worker."""
    model = json.loads((four_ranks / "w4-h8" / "summary.json").read_text())
    weights = {n: t.numel() for n, t in final_params(four_ranks / "w4-h8").items() if n != "lm_head.weight"}
    total = sum(weights.values())
    for name, padding in (("w4-h8", 0), ("w2-dp2-h4", 1)):  # dp2: the flat share is padded to a multiple of 2
        run = json.loads((four_ranks / name / "summary.json").read_text())["diloco"]
        _, overrides, (workers, replicas) = RUNS[name]
        exchanges = int(overrides["train.steps"]) // int(overrides["diloco.inner_steps"])
        sent = total + workers * replicas  # the weights and every rank's votes
        assert 4 * exchanges * sent <= run["sent_bytes"] <= 4 * exchanges * (sent + padding)
        assert run["largest_exchange_bytes"] in range(4 * sent, 4 * (sent + padding) + 1)
    whole = json.loads((four_ranks / "w2-dp2-h4" / "summary.json").read_text())
    assert (whole["dp"], whole["diloco_workers"]) == (4, 2)  # dp over both workers, each a dp2 replica pair
    streaming = json.loads((four_ranks / "w4-h8-streaming" / "summary.json").read_text())["diloco"]
    first = sum(n for name, n in weights.items() if not name.startswith("blocks.1."))  # 2 blocks, F = 2
    assert streaming["largest_exchange_bytes"] == 4 * (first + 4) < 4 * total  # and the 4 workers' votes
    assert model["diloco"]["workers"] == 4


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """A 2-worker DiLoCo run whose first outer step (outer lr 1e30) makes every worker's weights non-finite."""
    from conftest import override_args, run_cli

    out = tmp_path_factory.mktemp("diverged") / "run"
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--out", str(out),
                   *override_args({**MODEL, **DILOCO, "diloco.inner_steps": "2", "diloco.outer_lr": "1e30",
                                   "train.max_nonfinite_steps": "2", "train.steps": "8"}))
    return proc


def test_a_diverged_diloco_run_says_why_once(diverged):
    """Every worker takes the same outer weights, so all stop at the same step; global rank 0 alone says why."""
    said = [line for line in diverged.stderr.splitlines() if "steps in a row" in line]
    assert diverged.returncode != 0 and "Traceback" not in diverged.stderr, diverged.stderr[-3000:]
    assert len(said) == 1 and said[0].startswith("meshtrain train: error: 2 steps in a row (up to step 4)"), said


def test_a_diverged_diloco_run_ends_with_its_one_line_and_exit_3(diverged):
    lines = [line for line in diverged.stderr.splitlines() if not line.startswith(("step ", "train "))]
    assert diverged.returncode == 3 and "rank(s) failed" not in diverged.stderr, diverged.stderr[-3000:]
    assert [line for line in lines if "exitcode" in line] == []


def test_workers_stop_together_at_the_exchange_after_one_of_them_diverged(two_ranks):
    """Worker 1's weights are NaN after the start (:data:`diloco_worker.DIVERGES`): its steps 1 and 2 are non-finite,
    which is ``train.max_nonfinite_steps``, while worker 0's are finite. Each worker counts its own steps, so the
    vote to stop goes with the next exchange (step 4), where both stop: no worker waits for the other, and no outer step
    takes worker 1's pseudo-gradient (worker 0's weights stay finite). Rank 0, a finite worker, names the one that
    diverged."""
    stopped = json.loads((two_ranks / DIVERGES / STOPPED_FILE).read_text())
    assert [stopped[r]["step"] for r in ("0", "1")] == [4, 4], stopped
    assert stopped["0"]["finite"], stopped
    assert stopped["0"]["message"].startswith("DiLoCo worker 1 of 2 had train.max_nonfinite_steps = 2 steps in a row "
                                              "with a non-finite loss or gradient norm"), stopped
    assert "every worker stopped after step 4" in stopped["0"]["message"], stopped
    assert stopped["1"]["message"].startswith("4 steps in a row (up to step 4) had a non-finite loss (nan)"), stopped
    assert "stopped after step 4 with every worker (DiLoCo worker 1 of 2 diverged)" in stopped["1"]["message"]
