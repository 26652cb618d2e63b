"""Mixture of experts on this CPU, side by side in one run (docs/moe.md):

1. one MoE layer's forward + backward with the experts as one grouped GEMM (``torch._grouped_mm``) vs one GEMM per
   expert (the reference loop), interleaved rounds, median ms;
2. a tiny Mixtral against the dense Llama of the same active parameters (each token runs k = 2 experts of width
   F/2: the dense MLP's width F), trained by ``meshtrain train`` on the bundled text, one process, fp32: tokens/s
   and val loss after the same steps;
3. meshtrain's Mixtral step against ``transformers``' ``MixtralForCausalLM`` in a plain loop (same config, same
   initial weights, same batches, AdamW, fp32, one process): tokens/s.

Writes ``bench/results/moe.md`` and ``.json``, and copies the table into docs/benchmarks.md. ``--steps`` for part 2, ``--rounds`` for parts 1 and 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import REPO, meshtrain_command, update_benchmarks_doc, write_results

LLAMA = REPO / "configs" / "llama_tiny.toml"
DENSE_F, EXPERTS, TOP_K = 352, 8, 2


def cpu_flags() -> str:
    """The bf16/AMX/AVX-512 flags of this CPU (``/proc/cpuinfo``), which decide its fp32 and bf16 GEMM speed."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f" {f}" in flags) or "none of avx2/avx512/amx"


def layer_times(rounds: int) -> list[list]:
    """Median ms of forward + backward of one MoE layer (12 x 128 tokens, C = 128, E = 8, k = 2, F = 176 and 704)."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.moe.layer import MoE

    rows = []
    for ffn in (DENSE_F // 2, 4 * DENSE_F // 2):
        x = torch.randn(12, 128, 128)
        layers = {}
        for compute in ("grouped", "loop"):
            torch.manual_seed(0)
            cfg = ModelConfig(type="mixtral", n_embd=128, ffn_hidden=ffn, num_experts=EXPERTS, moe_compute=compute)
            layer = MoE(cfg)
            for w, _ in layer.experts.expert_weights():
                torch.nn.init.normal_(w, std=0.02)
            layers[compute] = layer
        times = {name: [] for name in layers}
        for _ in range(rounds):
            for name, layer in layers.items():  # interleaved
                t0 = time.perf_counter()
                for _ in range(5):
                    layer(x.requires_grad_()).square().mean().backward()
                times[name].append((time.perf_counter() - t0) / 5 * 1e3)
        g, lp = statistics.median(times["grouped"]), statistics.median(times["loop"])
        rows.append([f"MoE layer fwd+bwd, F = {ffn} (a: grouped GEMM, b: per-expert loop)", f"{g:.2f}", f"{lp:.2f}", f"{lp / g:.2f}x",
                     " / ".join(f"{a:.1f}:{b:.1f}" for a, b in zip(times["grouped"], times["loop"]))])
    return rows


def bucketed_times(rounds: int) -> list[list]:
    """Median ms of the experts alone (:class:`GroupedExperts`, C = 128, F = 176, E = 8) in bf16, forward + backward,
    with a new routing each call (12 x 128 x 2 rows split over the experts at random, as a router's draw changes from
    step to step): rows padded to buckets (``pad_rows``, the default on a CPU) vs exact rows."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.moe.layer import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(ModelConfig(type="mixtral", n_embd=128, ffn_hidden=DENSE_F // 2, num_experts=EXPERTS))
    for w, _ in experts.expert_weights():
        torch.nn.init.normal_(w, std=0.02)
    gen = torch.Generator().manual_seed(1)
    rows = 12 * 128 * TOP_K
    times = {True: [], False: []}
    for _ in range(rounds):
        for pad in times:  # interleaved
            experts.pad_rows = pad
            t0 = time.perf_counter()
            for _ in range(5):
                counts = torch.bincount(torch.randint(0, EXPERTS, (rows,), generator=gen), minlength=EXPERTS)
                x = torch.randn(rows, 128, generator=gen).requires_grad_()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = experts(x, counts)
                y.float().square().mean().backward()
            times[pad].append((time.perf_counter() - t0) / 5 * 1e3)
    padded, exact = statistics.median(times[True]), statistics.median(times[False])
    return [["experts fwd+bwd, bf16, new routing each call (a: rows padded to buckets, b: exact rows)", f"{padded:.2f}", f"{exact:.2f}",
             f"{exact / padded:.2f}x", " / ".join(f"{a:.1f}:{b:.1f}" for a, b in zip(times[True], times[False]))]]


def compute_dtype_is_bf16() -> bool:
    """Whether this CPU computes in bf16 by default (``dtype = "auto"``): the padded rows matter only there."""
    from meshtrain.runtime.device import compute_dtype

    return compute_dtype("auto", "cpu") == "bfloat16"


def train(out: Path, steps: int, extra: list[str]) -> dict:
    """``meshtrain train configs/llama_tiny.toml`` for ``steps`` on one process in fp32; (median tokens/s, val loss)."""
    cmd = [*meshtrain_command(), "train", str(LLAMA), "--nproc", "1", "--steps", str(steps), "--out", str(out),
           "--train.dtype", "float32", "--train.eval_interval", "0", "--train.log_interval", "10", *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tps = statistics.median(r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 10)
    summary = json.loads((out / "summary.json").read_text())
    return {"tokens_per_s": tps, "val_loss": summary["val_loss"]}


def model_rows(steps: int, work: Path) -> list[list]:
    dense = train(work / "dense", steps, ["--model.ffn_hidden", str(DENSE_F)])
    moe = train(work / "moe", steps, ["--model.type", "mixtral", "--model.ffn_hidden", str(DENSE_F // 2),
                                      "--model.num_experts", str(EXPERTS), "--model.num_experts_per_tok", str(TOP_K)])
    return [[f"Llama, dense MLP F = {DENSE_F}", f"{dense['tokens_per_s']:,.0f}", f"{dense['val_loss']:.4f}", "1.00x"],
            [f"Mixtral, {EXPERTS} experts of F = {DENSE_F // 2}, top-{TOP_K} (same active parameters)",
             f"{moe['tokens_per_s']:,.0f}", f"{moe['val_loss']:.4f}", f"{moe['tokens_per_s'] / dense['tokens_per_s']:.2f}x"]]


def versus_transformers(rounds: int) -> list[list]:
    """tokens/s of one training step (forward, backward, AdamW) of the same tiny Mixtral: meshtrain's model vs
    ``transformers``', same initial weights (meshtrain's export loaded by ``transformers``) and batches; in fp32, and
    under bf16 autocast where this CPU has bf16 matmul (meshtrain's ``dtype = "auto"`` there). Each pair of models
    starts from the same weights and sees the same batches: the last loss of each is reported beside its speed."""
    import transformers

    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model
    from meshtrain.models.hf import write_hf_folder
    from meshtrain.runtime.device import compute_dtype

    cfg = ModelConfig(type="mixtral", n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn_hidden=DENSE_F // 2,
                      block_size=128, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    batches = [torch.randint(0, 65, (12, 129), generator=torch.Generator().manual_seed(i)) for i in range(5)]

    def step_ours(model, b):
        logits = model(b[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten())

    def step_theirs(model, b):
        return model(b, labels=b).loss  # transformers shifts the labels itself: the same 12 x 128 predictions

    rows = []
    for dtype in sorted({"float32", compute_dtype("auto", "cpu")}, reverse=True):  # fp32, then the default
        torch.manual_seed(0)
        ours = build_model(cfg, 65)
        with tempfile.TemporaryDirectory() as tmp:
            write_hf_folder(Path(tmp) / "m", ours.state_dict(), cfg, 65, None, max_shard_bytes=2**30)
            theirs = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "m", dtype=torch.float32)
        theirs.train()
        runners = {"meshtrain": (ours, step_ours), "transformers": (theirs, step_theirs)}
        opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, (m, _) in runners.items()}
        times, last = {name: [] for name in runners}, {}
        for _ in range(rounds):
            for name, (model, step) in runners.items():
                t0 = time.perf_counter()
                for b in batches:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                        loss = step(model, b)
                    loss.backward()
                    opts[name].step()
                    opts[name].zero_grad()
                    last[name] = float(loss)
                times[name].append(len(batches) * 12 * 128 / (time.perf_counter() - t0))
        a, b = statistics.median(times["meshtrain"]), statistics.median(times["transformers"])
        rows += [[f"meshtrain Mixtral (grouped GEMM), {dtype}", f"{a:,.0f}", f"{a / b:.2f}x", f"{last['meshtrain']:.4f}"],
                 [f"transformers MixtralForCausalLM, {dtype}", f"{b:,.0f}", "1.00x", f"{last['transformers']:.4f}"]]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    layers = layer_times(args.rounds)
    if compute_dtype_is_bf16():
        layers += bucketed_times(args.rounds)
    with tempfile.TemporaryDirectory() as work:
        models = model_rows(args.steps, Path(work))
    vs = versus_transformers(args.rounds)
    rows = ([["**expert compute**", "a ms", "b ms", "b / a", "per round (a:b)"]] + layers
            + [["**model**", "tokens/s", f"val loss after {args.steps} steps", "tokens/s vs dense", ""]]
            + [r + [""] for r in models]
            + [["**one training step**", "tokens/s", "vs transformers", f"loss after {5 * args.rounds} steps", ""]]
            + [r + [""] for r in vs])
    notes = [f"CPU flags: {cpu_flags()}; torch threads: {torch.get_num_threads()}; fp32 but for the bf16 training-step rows.",
             "Expert compute: one MoE layer alone, 12 x 128 tokens, C = 128, E = 8, k = 2; forward + backward of "
             "mean(y^2), 5 per round, rounds interleaved; the ratio is of the medians. The padded row (where the CPU "
             "has bf16 matmul): the experts alone, grouped GEMM both, with a new random routing each call (oneDNN "
             "builds a bf16 kernel per GEMM shape; buckets keep the shapes few).",
             f"Models: configs/llama_tiny.toml (4 layers, C = 128, block 128, batch 12), {args.steps} steps, one "
             "process, `meshtrain train`; tokens/s the median over logged steps past the 10th; val loss on the "
             "val split at the last step.",
             "One training step: the same 4-layer Mixtral (meshtrain's export loaded by transformers), 5 batches of "
             "12 x 129 random ids per round (128 predictions per row on both sides), AdamW; rounds interleaved, median "
             "tokens/s; in fp32, and under bf16 autocast on both sides where the CPU has bf16 matmul (meshtrain's "
             "default there); meshtrain also computes its load-balancing loss (coefficient 0.001), transformers does "
             "not (output_router_logits off, its default)."]
    md = write_results("moe", "Mixture of experts: expert compute, MoE vs dense, meshtrain vs transformers",
                       ["", "", "", "", ""], rows, notes,
                       {"layers": layers, "models": models, "versus_transformers": vs, "steps": args.steps,
                        "rounds": args.rounds, "cpu_flags": cpu_flags()})
    update_benchmarks_doc("moe")
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
