"""What the launcher tells the user before the ranks start: the memory check against the planner's
prediction, the slow-bf16 warning, and where the pipeline cuts the model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.resolved import ResolvedRun


def warn_slow_bf16(cfg: Config) -> None:
    """One warning line when ``train.dtype = bfloat16`` runs on a CPU without bf16 matmul instructions
    (no AVX512-BF16/AMX: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False). torch's bf16 GEMMs
    there are emulated and ran 30-180x slower than fp32 on this model's shapes (AVX2-only EPYC,
    docs/benchmarks.md). The user's choice stands: it is a warning, not an error. ``auto`` picks float32
    there by itself (:func:`meshtrain.runtime.device.compute_dtype`)."""
    if cfg.train.dtype != "bfloat16":
        return
    import torch

    if torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return
    print(f"meshtrain train: warning: train.dtype = bfloat16, but this CPU ({torch.backends.cpu.get_cpu_capability()}) "
          f"has no bf16 matmul, so bf16 runs far slower than float32 here (docs/benchmarks.md): "
          f"use --train.dtype float32", file=sys.stderr)


def available_memory() -> tuple[str, float]:
    """(what, bytes) one device of this node offers: the smallest CUDA device's memory, or the CPU's
    MemAvailable (``/proc/meminfo``; ``os.sysconf`` physical pages where there is none)."""
    import torch

    if torch.cuda.is_available():
        return "GPU", min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return "CPU (MemAvailable)", int(line.split()[1]) * 1024
    except OSError:
        pass
    return "CPU", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


CPU_MEMORY_ERROR = 0.183
"""Largest |error| of the planner's peak memory per rank against the measured peak on a CPU (ru_maxrss):
-18.3% for ``dp2 z2 C384 T128`` in ``bench/plan_vs_actual.py`` (docs/planner.md, "Plan vs actual on this
machine"; every other layout of that table is within 10%)."""


def published_memory_error(path: Path | None = None) -> float:
    """Largest |error| of the planner's peak memory per GPU against the published runs that report one
    (``peak_memory_gib`` in ``planner/data/published_runs.toml``, e.g. torchtitan's docs/performance.md
    tables); 0 when none does."""
    from meshtrain.config.load import read_toml
    from meshtrain.planner.validate import PUBLISHED_RUNS, predict_run

    errors = [0.0]
    for run in read_toml(path or PUBLISHED_RUNS, "validation file").get("run", []):
        if "peak_memory_gib" in run.get("measured", {}):
            measured = float(run["measured"]["peak_memory_gib"])
            errors.append(abs(predict_run(run)[1]["peak_memory_gib"] - measured) / measured)
    return max(errors)


def memory_margin(what: str) -> float:
    """How far over the available memory a prediction may be and the run still fit: the largest measured
    |error| of the planner's memory prediction (:data:`CPU_MEMORY_ERROR` on a CPU; on a GPU the larger of
    it and :func:`published_memory_error`). Both directions count: the CPU bench only under-predicted,
    the published GPU runs over-predicted, and the next layout's sign is not known."""
    return CPU_MEMORY_ERROR if what != "GPU" else max(CPU_MEMORY_ERROR, published_memory_error())


def memory_verdict(needed: float, available: float, margin: float) -> str:
    """"fits", "uncertain" (over the available memory by at most ``margin`` of it: within the planner's
    measured error, so the run may still fit) or "over" (more than that: it cannot fit unless the
    prediction is off by more than ever measured). A NaN prediction (unknown device) "fits"."""
    if not needed > available:
        return "fits"
    return "uncertain" if needed <= available * (1 + margin) else "over"


def check_memory(run: ResolvedRun, nproc: int) -> None:
    """Check the planner's predicted peak per rank (:func:`meshtrain.planner.actual.predict_for_run`), times
    the ranks sharing this node's CPU memory, against what is available. A layout that fits must never be
    refused, and the prediction has a measured error (:func:`memory_margin`): over by more than that
    margin, the run is refused (ConfigError with the numbers); over by less, one warning line says by how
    much and the run goes on. Models the planner does not cover (lstm, gru) are not checked."""
    cfg = run.config
    if cfg.model.family().planner is None:
        return
    from meshtrain.planner.actual import predict_for_run
    from meshtrain.planner.model_specs import corpus_vocab_size

    what, available = available_memory()
    cfg, world = run.config, run.world_size
    vocab = cfg.model.vocab_size or corpus_vocab_size(cfg)
    predicted = predict_for_run(cfg, world, vocab, "cuda" if what == "GPU" else "cpu", threads=1)
    peak = predicted["peak_memory_bytes"]
    needed = peak * (1 if what == "GPU" else nproc)
    margin = memory_margin(what)
    verdict = memory_verdict(needed, available, margin)
    if verdict == "fits":
        return
    per = "per GPU" if what == "GPU" else f"for {nproc} rank(s) of {peak / 2**30:,.2f} GiB"
    over = f"over by {(needed - available) / 2**30:,.2f} GiB ({needed / available - 1:.0%})"
    if verdict == "over":
        raise ConfigError(f"the run needs about {needed / 2**30:,.2f} GiB {per} (planner prediction), this node has "
                          f"{available / 2**30:,.2f} GiB {what}, {over}, more than the planner's largest measured "
                          f"memory error ({margin:.0%}): shrink the model or batch, add ranks to shard it "
                          f"(zero_stage 3, tp, pp), or skip this check with --train.check_memory false")
    print(f"meshtrain train: warning: the run needs about {needed / 2**30:,.2f} GiB {per} (planner prediction), this "
          f"node has {available / 2**30:,.2f} GiB {what}, {over}; that is within the planner's largest measured "
          f"memory error ({margin:.0%}), so it may still fit: running it (it may run out of memory)", file=sys.stderr)


def print_pipeline_split(cfg: Config) -> None:
    """Print where the pipeline cuts the model (the split the ranks will make, :mod:`meshtrain.parallel.pipeline.balance`)."""
    from meshtrain.parallel.pipeline.balance import chunk_ranks, describe_split, model_item_costs, split_layers
    from meshtrain.planner.model_specs import corpus_vocab_size
    from meshtrain.rules.pipeline import RULES

    m, p, b = cfg.model, cfg.parallel, cfg.batch
    vocab = m.vocab_size or corpus_vocab_size(cfg)
    n_chunks = p.pp * p.virtual_stages
    tokens = b.gradient_accumulation_steps * b.micro_batch_size * m.block_size
    chunks = split_layers(m.n_layer, n_chunks, model_item_costs(m, vocab, tokens))
    print(f"pipeline split ({p.pp_schedule}, pp={p.pp}, {p.virtual_stages} chunk(s) per rank, balanced by cost):\n"
          + describe_split(chunks, chunk_ranks(p.pp, n_chunks, RULES[p.pp_schedule].placement)), file=sys.stderr)
