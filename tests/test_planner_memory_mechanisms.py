"""The planner's activation memory (meshtrain.planner.memory) against what torch allocates, on the CPU.

torch's profiler records every allocation and free of the CPU allocator (``profile_memory=True``); the memory
timeline built from it (``profile._memory_profile().timeline``) gives the bytes of tensors alive at every moment,
so its peak is the *allocated* peak of a function: exact and deterministic, unlike a process's RSS. Tensors that
exist before the function (parameters, pre-allocated gradients) are not counted.

Checked here:

- the loss's bytes per logit (``Framework.loss_backward_bytes`` and, under tensor parallelism, torch's
  ``loss_parallel``, ``Framework.loss_parallel_bytes``, on 2 gloo ranks);
- torchtitan's selective policy (every other GEMM kept) counted operator by operator on a Llama block, equal to
  :func:`meshtrain.planner.memory.alternate_saved_bytes`;
- the peak of one forward + backward of the trainer's models per recompute mode against
  :func:`meshtrain.planner.memory.activation_bytes` (stored layers + the larger of the loss and one layer's
  backward).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from conftest import free_port
from meshtrain.planner.layout import FRAMEWORKS, MESHTRAIN, Layout
from meshtrain.planner.memory import PRECISIONS, activation_bytes, layer_activation_bytes

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"
TOKENS, VOCAB = 1024, 512
PER_TOKEN_EXTRA = 64
"""Bytes per token a cross-entropy may allocate besides its (tokens, vocab) tensors: the int64 targets' masks
and gathered values, the per-token max / log-sum-exp / loss (at most 8 such tensors of <= 8 bytes)."""


PROFILER_TRIES = 5


def profiled_peak(fn: Callable[[], object]) -> int | None:
    """Peak bytes of CPU tensors alive while ``fn`` runs, counting only those it allocates (torch's profiler
    memory timeline: CREATE adds a tensor's bytes, DESTROY removes them); None when torch 2.13's memory profiler
    fails its own consistency check of the trace (``DataFlowGraph.validate``: "duplicate outputs: aten::gather",
    seen in a few percent of ``loss_parallel`` runs on 2 gloo ranks), which leaves no timeline to read."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    try:
        timeline = prof._memory_profile().timeline
    except AssertionError:  # the profiler's check of its own trace, not a measurement
        return None
    alive = peak = 0
    for _, action, _, size in timeline:
        name = str(action)
        if name.endswith("CREATE"):
            alive += size
        elif name.endswith("DESTROY"):
            alive -= size
        peak = max(peak, alive)
    return peak


def allocated_peak(fn: Callable[[], object]) -> int:
    """:func:`profiled_peak`, ``fn`` run and profiled again when the profiler fails its trace check, up to
    :data:`PROFILER_TRIES` times (for one process only: ranks that run collectives must run ``fn`` equally often)."""
    for _ in range(PROFILER_TRIES):
        peak = profiled_peak(fn)
        if peak is not None:
            return peak
    raise AssertionError(f"torch's memory profiler failed its trace check {PROFILER_TRIES} times in a row")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_loss_bytes_per_logit(dtype):
    """``F.cross_entropy(logits.float())`` (meshtrain's and torchtitan's loss) holds ``loss_backward_bytes`` per
    logit at its peak (its backward), besides the logits themselves."""
    torch.manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, dtype=dtype)
    targets = torch.randint(0, VOCAB, (TOKENS,))

    def step():
        leaf = logits.clone().requires_grad_()  # the logits, allocated here: dtype's bytes per logit
        F.cross_entropy(leaf.float(), targets).backward()

    per_logit = allocated_peak(step) / (TOKENS * VOCAB) - logits.element_size()
    want = MESHTRAIN.loss_backward_bytes
    assert want <= per_logit <= want + PER_TOKEN_EXTRA / VOCAB
    assert FRAMEWORKS["torchtitan"].loss_backward_bytes == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_loss_bytes(dtype):
    """The chunked cross-entropy (:func:`meshtrain.cross_entropy.token_nll`, 64 tokens a chunk) holds what
    :attr:`~meshtrain.planner.layout.Framework.loss_chunk_bytes` says at its peak: ``2e`` per logit (the logits it
    keeps and their gradient) and one chunk of fp32 temporaries (two with bf16 logits: their upcast), besides its
    per-token vectors."""
    from dataclasses import replace

    from meshtrain.parallel.reduce import cross_entropy
    from meshtrain.planner.memory import _activation_parts
    from meshtrain.planner.model_specs import ModelSpec

    torch.manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, dtype=dtype)
    targets = torch.randint(0, VOCAB, (TOKENS,))
    chunk = 64 * VOCAB * 4  # bytes of 64 tokens' fp32 logits

    def step():
        leaf = logits.clone().requires_grad_()
        cross_entropy(leaf.unsqueeze(0), targets.unsqueeze(0), chunk_mb=chunk / 2**20).backward()

    measured = allocated_peak(step)
    framework = replace(MESHTRAIN, loss_chunk_bytes=chunk)
    spec = ModelSpec("logits", layers=1, hidden=64, heads=1, vocab=VOCAB, seq_len=TOKENS)
    precision = PRECISIONS["bf16-autocast" if dtype == torch.bfloat16 else "fp32"]
    planned = _activation_parts(spec, Layout(dp=1, micro_batch_size=1), precision, framework, False).loss
    assert planned <= measured <= planned + PER_TOKEN_EXTRA * TOKENS


@pytest.mark.slow  # torch.compile's C++ code generation on the CPU: ~30 s
def test_a_compiled_loss_holds_only_the_logits_gradient():
    """OLMo-core's loss (``compile_loss = True``: ``torch.compile`` of cross-entropy on ``logits.float()`` plus its
    z-loss, ``olmo_core/nn/functional/cross_entropy_loss.py`` at e27ba74) holds ``FRAMEWORKS["olmo-core"]
    .loss_backward_bytes`` per logit at its peak besides the logits: the 16-bit gradient. Which tensors backward keeps
    is the compiler's partition of the graph, the same on every device; eager, the same function holds 20."""
    torch.manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, dtype=torch.bfloat16)
    targets = torch.randint(0, VOCAB, (TOKENS,))

    def olmo_loss(x, y):
        x = x.float()
        return F.cross_entropy(x, y) + 1e-5 * x.logsumexp(-1).pow(2).mean()

    compiled = torch.compile(olmo_loss)

    def step(fn):
        leaf = logits.clone().requires_grad_()
        fn(leaf, targets).backward()

    step(compiled)  # compiles outside the measurement
    want = FRAMEWORKS["olmo-core"].loss_backward_bytes
    per_logit = allocated_peak(lambda: step(compiled)) / (TOKENS * VOCAB) - logits.element_size()
    assert want <= per_logit <= want + PER_TOKEN_EXTRA / VOCAB
    assert allocated_peak(lambda: step(olmo_loss)) / (TOKENS * VOCAB) - logits.element_size() > 10 * want


LOSS_PARALLEL_RUNS = 8


def _loss_parallel_worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        logits = torch.randn(TOKENS, VOCAB, dtype=torch.bfloat16)
        targets = torch.randint(0, VOCAB, (TOKENS,))

        def step():
            leaf = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()  # this rank's VOCAB/2 columns
            with loss_parallel():
                F.cross_entropy(leaf.float(), targets).backward()

        step()  # the first call sets up DTensor's sharding caches, which would count as allocations
        # every rank runs step() equally often (its collectives pair up); a trace the profiler rejects gives None
        torch.save([profiled_peak(step) for _ in range(LOSS_PARALLEL_RUNS)], Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 2 spawned ranks, several profiled runs each: ~17 s
def test_loss_parallel_bytes_per_logit(tmp_path):
    """Under tp = 2, torch's ``loss_parallel`` on vocab-sharded logits holds ``loss_parallel_bytes`` per logit of
    the rank's slice at its peak, besides the logits themselves (2 gloo ranks, :data:`LOSS_PARALLEL_RUNS` runs each,
    at least 3 of them measured: :func:`profiled_peak`). A measurement
    may hold one fp32 copy of the slice more (4 bytes per logit): a temporary of the all-reduce that gloo has not
    released yet when the next one is allocated, which depends on the two ranks' timing."""
    mp.spawn(_loss_parallel_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    local, want = TOKENS * VOCAB / 2, MESHTRAIN.loss_parallel_bytes
    extra = PER_TOKEN_EXTRA / (VOCAB / 2)
    for rank in range(2):
        peaks = [peak for peak in torch.load(tmp_path / f"rank{rank}.pt") if peak is not None]
        assert len(peaks) >= 3, f"rank {rank}: the profiler rejected {LOSS_PARALLEL_RUNS - len(peaks)} traces"
        per_logit = [peak / local - 2 for peak in peaks]  # bf16 logits
        assert want <= min(per_logit) <= want + extra
        assert max(per_logit) <= want + 4 + extra


def _llama(layers: int, vocab: int):
    from meshtrain.config.load import load_config

    return load_config(CONFIG, {"model.type": "llama", "model.n_layer": str(layers), "model.n_head": "4",
                                "model.n_kv_head": "2", "model.n_embd": "128", "model.block_size": "64",
                                "model.multiple_of": "16", "model.dropout": "0.0", "model.vocab_size": str(vocab)})


def test_torchtitan_policy_keeps_what_the_planner_counts(monkeypatch):
    """torchtitan's op-level policy (``_custom_policy``: keep matmul, attention and reduce-scatter outputs, but
    recompute every second matmul counted per block) applied to the trainer's Llama block, whose GEMMs run in
    torchtitan's order (q, k, v, out-projection, gate, up, down): block input + kept outputs =
    :func:`meshtrain.planner.memory.layer_activation_bytes` for ``FRAMEWORKS["torchtitan"]`` (fp32), exactly."""
    from collections import defaultdict

    import meshtrain.parallel.recompute as rc
    from meshtrain.models.build import build_model
    from meshtrain.planner.model_specs import from_config

    kept: list[int] = []
    counts: dict[str, int] = defaultdict(int)
    mm = torch.ops.aten.mm.default

    def torchtitan_policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        counts[mode] += func == mm
        keep = func in rc.SAVED_OPS and func != torch.ops.aten.addmm.default and not (func == mm and counts[mode] % 2 == 0)
        if keep and not ctx.is_recompute:
            kept.extend(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(ctx.op_output)
                        if isinstance(t, torch.Tensor))
        return rc.CheckpointPolicy.MUST_SAVE if keep else rc.CheckpointPolicy.PREFER_RECOMPUTE

    monkeypatch.setattr(rc, "_selective_policy", torchtitan_policy)
    cfg = _llama(1, 50)
    model = build_model(cfg.model, 50)
    rc.apply_recompute(model.blocks, "selective")
    b, T = 3, cfg.model.block_size
    model(torch.randint(0, 50, (b, T))).sum().backward()
    assert counts["forward"] == 7  # the block's seven GEMMs (the policy sees only the checkpointed block)
    block_input = b * T * cfg.model.n_embd * 4
    layout = Layout(dp=1, micro_batch_size=b, recompute="selective")
    want = layer_activation_bytes(from_config(cfg, 50), layout, PRECISIONS["fp32"], FRAMEWORKS["torchtitan"])
    assert block_input + sum(kept) == want  # bytes, exactly


MODELS = {"gpt": {}, "llama": {"model.type": "llama", "model.n_kv_head": "2", "model.multiple_of": "16"}}


CHUNKED_IN_MAKE_TEST = {("gpt", "none"), ("llama", "full")}
"""The chunked loss's (kind, mode) cases ``make test`` runs (the 0.25 MiB chunks take 2-3x the plain loss's time);
the other four are in ``make test-slow``. Every (kind, mode) runs with the plain loss."""


@pytest.mark.parametrize(("kind", "mode", "chunk_mb"), [
    pytest.param(kind, mode, chunk, marks=() if chunk == 0.0 or (kind, mode) in CHUNKED_IN_MAKE_TEST
                 else pytest.mark.slow, id=f"{chunk}-{kind}-{mode}")
    for chunk in (0.0, 0.25) for kind in MODELS for mode in ("none", "selective", "full")])
def test_step_peak_is_the_planned_activations(kind, mode, chunk_mb):
    """One forward + backward of the trainer's model (4 layers, fp32, vocabulary 2048 so that the loss is the
    larger term at the backward's start), its gradients allocated beforehand: the allocated peak is
    :func:`meshtrain.planner.memory.activation_bytes` plus what that leaves out, the activations outside the
    blocks (the embedding's output, the final norm's input, output and statistics, the head's input): at most
    4 vectors of width h per token. The Llama's blocks keep what eager PyTorch keeps on a CPU: K and V repeated to
    the query heads, SwiGLU's four f-wide tensors, each composite RMSNorm's normalised input (``composite_norms``).
    The loss as the trainer computes it (:func:`meshtrain.parallel.reduce.cross_entropy`): ``F.cross_entropy`` at once
    (``chunk_mb = 0``) or chunked (a quarter MiB: 32 tokens a chunk of the 1,024)."""
    from dataclasses import replace

    import meshtrain.parallel.recompute as rc
    from meshtrain.parallel.reduce import cross_entropy
    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.planner.model_specs import from_config

    vocab, b = 2048, 8
    cfg = load_config(CONFIG, {"model.n_layer": "4", "model.n_head": "4", "model.n_embd": "128", "model.block_size": "128",
                               "model.dropout": "0.0", **MODELS[kind]})
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab)
    rc.apply_recompute(model.blocks, mode)
    T = cfg.model.block_size
    x, y = torch.randint(0, vocab, (b, T)), torch.randint(0, vocab, (b, T))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the gradients exist before the step: only activations are allocated in it

    def step():
        logits = model(x)
        loss = cross_entropy(logits, y, chunk_mb=chunk_mb)
        del logits  # as the trainer's loss() does on return
        loss.backward()

    step()
    measured = allocated_peak(step)
    planned = activation_bytes(from_config(cfg, vocab), Layout(dp=1, micro_batch_size=b, recompute=mode),
                               PRECISIONS["fp32"], replace(MESHTRAIN, loss_chunk_bytes=chunk_mb * 2**20),
                               composite_norms=True)
    outside_blocks = 4 * cfg.model.n_embd * 4 * b * T
    assert planned <= measured <= planned + outside_blocks


def test_meshtrain_llama_eager_elementwise_bytes_are_counted():
    """``Framework.eager_elementwise`` of meshtrain is what ``bench/eager_elementwise.py`` counts on the trainer's
    Llama block at a width it was not derived from (grouped and per-head K/V), fp32 = twice the 16-bit bytes. The
    count also has per-token scalars that the formula leaves out: the two RMSNorms' fp32 rstd and the reductions of
    their backward, 120 bytes per token at every width (at most 32 fp32 values: 128 bytes)."""
    import importlib.util

    bench = Path(__file__).resolve().parents[1] / "bench"
    import sys

    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("eager_elementwise", bench / "eager_elementwise.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    a, b, c, d = MESHTRAIN.eager_elementwise
    for heads, kv_heads, multiple_of in ((14, 2, 64), (7, 7, 96)):
        counted, kv, f = module.meshtrain_block("llama", 448, heads, kv_heads, multiple_of)
        h = 448
        formula = 2 * ((a * h + b * kv + c * f) if kv < h else ((a + b - d) * h + c * f))
        assert 0 <= counted - formula <= 128, (heads, kv_heads, counted, formula)


WORKING_CASES = [(1, "ulysses", recompute, ffn) for recompute in ("none", "selective", "full") for ffn in (352, 32)]
"""One rank: every recompute mode, with the MLP's (SwiGLU 352 wide) or the attention's (MLP 32 wide) backward the
larger."""
WORKING_RANKS = [(2, "ulysses", "none", ffn) for ffn in (352, 32)] + [(2, "ring", mode, 32) for mode in ("none", "full")] \
    + [(4, "usp", "none", 32)]
"""Ulysses, ring and USP 2x2, with the attention's backward the larger."""
WORKING_ERROR = 0.10
"""The issue's goal for the planner's peak: within 10% of the measured one. The bytes are exact (tensor by tensor) and
deterministic, so the check is a fixed number, not a sample; at the time of writing they were within 8.3%."""


@pytest.mark.parametrize(("sp", "mode", "recompute", "ffn"), WORKING_CASES)
def test_a_layers_backward_working_set_is_planned(tmp_path, sp, mode, recompute, ffn):
    """The peak of a step of the trainer's Llama at 2,048 tokens (the layers' stored bytes, then the backward of the
    last one: :func:`meshtrain.planner.memory.backward_working_bytes`, and recomputation's) against
    :func:`meshtrain.planner.memory.activation_bytes` (``tests/memory_worker.py``)."""
    import memory_worker

    try:
        got = memory_worker.measure(2048, sp, mode, recompute, ffn, tmp_path / "run")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert abs(got["planned"] - got["measured"]) <= WORKING_ERROR * got["measured"], got


@pytest.mark.slow  # one torchrun launch per case: ~15 s each
@pytest.mark.parametrize(("sp", "mode", "recompute", "ffn"), WORKING_RANKS)
def test_attention_working_set_per_sp_mode_is_planned(tmp_path, sp, mode, recompute, ffn):
    """As :func:`test_a_layers_backward_working_set_is_planned` on ``sp`` gloo ranks (every rank's peak): Ulysses'
    all-to-all buffers, ring attention's fp32 accumulators and the K/V travelling around the ring."""
    import json
    import subprocess
    import sys

    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={sp}",
                           str(Path(__file__).parent / "memory_worker.py"), str(out), "4096", str(sp), mode, recompute,
                           str(ffn)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for got in json.loads(out.read_text()):
        assert abs(got["planned"] - got["measured"]) <= WORKING_ERROR * got["measured"], got
