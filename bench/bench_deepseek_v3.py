"""DeepSeek-V3 on this CPU, side by side in one run (docs/models.md, docs/moe.md):

1. meshtrain's DeepSeek-V3 training step (forward, cross-entropy, backward, AdamW) against ``transformers``'
   ``DeepseekV3ForCausalLM`` in the same plain loop: same tiny config, same initial weights (meshtrain's export
   loaded by ``transformers``), same Tiny Shakespeare batches; tokens/s and the loss each reaches, in fp32 and under
   bf16 autocast where this CPU has bf16 matmul;
2. multi-head latent attention against grouped-query attention of about the same parameters (one attention layer,
   forward + backward): tokens/s and peak activation bytes (torch's ``MemTracker``, tensor by tensor);
3. multi-token prediction on (D = 1, lambda = 0.3) vs off: ``meshtrain train`` on the bundled Tiny Shakespeare, the
   main head's val loss after the same steps, 3 seeds.

Writes ``bench/results/deepseek_v3.md`` and ``.json``. ``--rounds`` for parts 1-2, ``--blocks`` (sequence lengths)
for part 1, ``--steps`` and ``--seeds`` for part 3; ``--parts 1,2,3`` picks parts, and a part not run keeps its last
results (dated in the notes). Contenders alternate round by round (interleaved), so a load from elsewhere on
the machine falls on both alike; the spread of the rounds is reported beside each median.
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
import torch.nn.functional as F

from bench_moe import cpu_flags
from common import REPO, RESULTS_DIR, meshtrain_command, write_results

CONFIG = REPO / "configs" / "shakespeare_char.toml"
MODEL = dict(type="deepseek_v3", n_layer=4, n_head=4, n_embd=128, block_size=128, ffn_hidden=128, num_experts=8,
             num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
             q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             router_aux_loss_coef=0.0)
"""Tiny but every part present: MLA with q's low-rank path, 8 routed experts in 2 groups (1 allowed per token), one
shared expert, one dense first layer; no load-balancing loss (``transformers`` has none for this family)."""
BATCH, STEPS_PER_ROUND = 8, 4


def spread(values: list[float]) -> str:
    """``min..max`` of the rounds."""
    return f"{min(values):,.0f}..{max(values):,.0f}"


def shakespeare() -> torch.Tensor:
    """The bundled Tiny Shakespeare's train split as character ids (meshtrain's char tokenizer)."""
    from meshtrain.config.load import load_config
    from meshtrain.data.corpus import load_corpus

    cfg = load_config(CONFIG, {})
    return load_corpus(cfg.data.resolved_path(), cfg.data.val_fraction, MODEL["block_size"]).train


CONTENDERS = (("meshtrain", "meshtrain DeepseekV3"), ("unpadded", "meshtrain DeepseekV3, v unpadded"),
              ("compiled", "meshtrain DeepseekV3, train.compile = on"))
"""meshtrain's rows of part 1 (key, label), each timed against ``transformers``."""


def contenders(cfg, V: int, dtype: str, warmup: list[torch.Tensor]) -> dict:
    """{name: model} of part 1 from the same weights: meshtrain's model; the same with v unpadded
    (``MLAttention.pad_v = False``: the math path of ``scaled_dot_product_attention``, as before v was padded); the same
    with its blocks compiled as ``train.compile = "on"`` compiles them (:func:`meshtrain.parallel.recompute.
    compile_blocks`), compiled here by forward + backward passes on the ``warmup`` batches, under ``dtype``'s autocast,
    without an optimizer step (the weights stay the others'); and ``transformers``' model of meshtrain's export."""
    import transformers

    from meshtrain.models.build import build_model
    from meshtrain.models.deepseek_v3.model import MLAttention
    from meshtrain.models.hf import write_hf_folder
    from meshtrain.parallel.recompute import compile_blocks

    torch.manual_seed(0)
    models = {name: build_model(cfg, V) for name, _ in CONTENDERS}
    for name in ("unpadded", "compiled"):
        models[name].load_state_dict(models["meshtrain"].state_dict())
    for module in models["unpadded"].modules():
        if isinstance(module, MLAttention):
            module.pad_v = False
    compile_blocks(models["compiled"].blocks)
    for b in warmup:  # each new shape of the experts' rows compiles once; none is timed
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = models["compiled"](b[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten()).backward()
        models["compiled"].zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_hf_folder(Path(tmp) / "m", models["meshtrain"].state_dict(), cfg, V, None, max_shard_bytes=2**30)
        models["transformers"] = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "m",
                                                                                   dtype=torch.float32)
    return {name: m.train() for name, m in models.items()}


def versus_transformers(rounds: int, T: int) -> list[list]:
    """Tokens/s of meshtrain's and ``transformers``' training step, same weights and batches (module docstring),
    meshtrain's three ways (:func:`contenders`)."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.runtime.device import compute_dtype

    cfg, V = ModelConfig(**{**MODEL, "block_size": T}), 65
    data = shakespeare()
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(len(data) - T - 1, ((rounds + 1) * STEPS_PER_ROUND, BATCH), generator=gen)
    batches = [torch.stack([data[i:i + T + 1] for i in row.tolist()]) for row in starts]  # each (B, T+1)
    warmup, batches = batches[-STEPS_PER_ROUND:], batches[:-STEPS_PER_ROUND]

    def step_ours(model, b):
        logits = model(b[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten())

    def step_theirs(model, b):
        return model(b, labels=b).loss  # transformers shifts the labels itself: the same B x T predictions

    rows = []
    for dtype in sorted({"float32", compute_dtype("auto", "cpu")}, reverse=True):  # fp32, then the default
        models = contenders(cfg, V, dtype, warmup)
        opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
        times, losses = {name: [] for name in models}, {name: [] for name in models}
        for r in range(rounds):
            for name, model in models.items():  # interleaved: a round each, the same batches
                step = step_theirs if name == "transformers" else step_ours
                t0 = time.perf_counter()
                for b in batches[r * STEPS_PER_ROUND:(r + 1) * STEPS_PER_ROUND]:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                        loss = step(model, b)
                    loss.backward()
                    opts[name].step()
                    opts[name].zero_grad()
                    losses[name].append(float(loss.detach()))
                times[name].append(STEPS_PER_ROUND * BATCH * T / (time.perf_counter() - t0))
        rows += step_rows(times, losses, f"{dtype}, T = {T}",
                          models["transformers"].config._experts_implementation)
    return rows


def part_one(rounds: int, blocks: list[int], previous: dict) -> tuple[list[list], dict, str | None]:
    """Part 1's rows at each T of ``blocks``, then those of the last run (``previous``, the results' json) at any other
    T, kept with their date -> (rows, facts for the json, the note saying what was kept, or None)."""
    rows = [row for T in blocks for row in versus_transformers(rounds, T)]
    old = [row for row in previous.get("versus_transformers", []) if int(row[0].rsplit("= ", 1)[1]) not in blocks]
    if not old:
        return rows, {}, None
    date = previous.get("versus_transformers_kept_from", previous["machine"]["date"])
    shown = ", ".join(sorted({row[0].rsplit("= ", 1)[1] for row in old}))
    note = f"one training step at T = {shown}: from the run of {date}"
    return rows + old, {"versus_transformers_kept_from": date}, note


def step_rows(times: dict[str, list[float]], losses: dict[str, list[float]], what: str, experts: str) -> list[list]:
    """Part 1's rows of one dtype and T: each contender's median tokens/s, spread, ratio to ``transformers`` (of the
    medians, and per round) and its losses."""
    b, rows = statistics.median(times["transformers"]), []
    for name, label in CONTENDERS:
        a, ratios = statistics.median(times[name]), [x / y for x, y in zip(times[name], times["transformers"])]
        rows.append([f"{label}, {what}", f"{a:,.0f}", spread(times[name]),
                     f"{a / b:.2f}x ({min(ratios):.2f}..{max(ratios):.2f})",
                     f"{losses[name][0]:.4f} -> {losses[name][-1]:.4f}"])
    return rows + [[f"transformers DeepseekV3ForCausalLM ({experts} experts), {what}", f"{b:,.0f}",
                    spread(times["transformers"]), "1.00x",
                    f"{losses['transformers'][0]:.4f} -> {losses['transformers'][-1]:.4f}"]]


ATTN = dict(n_embd=256, n_head=8, block_size=256)
"""The attention layer of part 2: C = 256, 8 query heads, 256 tokens."""


def attention_pair() -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """(MLA, GQA, facts): MLA as V2-Lite (q from C directly, dn = 16, dr = 16, dv = 32) with the latent rank that
    brings its parameters nearest those of GQA with 2 kv heads of 32 features (8 query heads of 32)."""
    from meshtrain.models.deepseek_v3.model import MLAttention
    from meshtrain.models.llama.model import LlamaAttention
    from meshtrain.models.registry import ModelConfig

    gqa_cfg = ModelConfig(type="llama", n_kv_head=2, **ATTN)
    torch.manual_seed(0)
    gqa = LlamaAttention(gqa_cfg)
    target = sum(p.numel() for p in gqa.parameters())

    def mla_for(rank: int) -> torch.nn.Module:
        return MLAttention(ModelConfig(**{**MODEL, **ATTN, "q_lora_rank": 0, "kv_lora_rank": rank,
                                          "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 32}))

    rank = min(range(8, 257, 8), key=lambda r: abs(sum(p.numel() for p in mla_for(r).parameters()) - target))
    torch.manual_seed(0)
    mla = mla_for(rank)
    return mla, gqa, {"kv_lora_rank": rank, "mla_params": sum(p.numel() for p in mla.parameters()),
                      "gqa_params": target}


def rope_tables(dim: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``cos, sin`` (T, dim) at theta 10000, each angle twice (the Llama's :meth:`rope`)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))  # (dim/2,)
    angles = torch.arange(T).float()[:, None] * inv  # (T, dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, dim)
    return angles.cos(), angles.sin()


def attention_memory(module: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Peak bytes of the tensors one forward + backward of ``module`` allocates, its parameters and gradients not
    counted (``MemTracker``, as tests/memory_worker.py measures a step)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        module(x.requires_grad_(), cos, sin).square().mean().backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    module.zero_grad(set_to_none=True)
    return sum(v for k, v in peak.items() if k != "Total" and "PARAM" not in str(k) and "GRAD" not in str(k))


def mla_vs_gqa(rounds: int) -> tuple[list[list], dict]:
    """Tokens/s (median of rounds, interleaved) and peak activation bytes of MLA and GQA, fp32, B = 4."""
    mla, gqa, facts = attention_pair()
    B, T, C = 4, ATTN["block_size"], ATTN["n_embd"]
    x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(2))
    tables = {"mla": rope_tables(16, T), "gqa": rope_tables(32, T)}  # each (cos, sin) (T, hd)
    runners = {"mla": mla, "gqa": gqa}
    memory = {name: attention_memory(m, x.clone(), *tables[name]) for name, m in runners.items()}
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, module in runners.items():  # interleaved
            t0 = time.perf_counter()
            for _ in range(5):
                module(x.clone().requires_grad_(), *tables[name]).square().mean().backward()
            times[name].append(5 * B * T / (time.perf_counter() - t0))
    a, b = statistics.median(times["mla"]), statistics.median(times["gqa"])
    rows = [[f"MLA (rkv = {facts['kv_lora_rank']}, dn = dr = 16, dv = 32), {facts['mla_params']:,} params",
             f"{a:,.0f}", spread(times["mla"]), f"{a / b:.2f}x", f"{memory['mla'] / 2**20:.2f}"],
            [f"GQA (8 q heads, 2 kv heads of 32), {facts['gqa_params']:,} params", f"{b:,.0f}", spread(times["gqa"]),
             "1.00x", f"{memory['gqa'] / 2**20:.2f}"]]
    return rows, {**facts, "memory_bytes": memory, "tokens_per_s": times}


def train_mtp(out: Path, steps: int, seed: int, depth: int) -> float:
    """``meshtrain train`` of the bench model on the bundled text, one process, fp32; the main head's val loss."""
    args = [x for k, v in MODEL.items() if k != "block_size" for x in (f"--model.{k}", str(v).lower())]
    cmd = [*meshtrain_command(), "train", str(CONFIG), "--nproc", "1", "--steps", str(steps), "--out", str(out),
           "--seed", str(seed), *args, "--model.num_nextn_predict_layers", str(depth),
           "--train.dtype", "float32", "--train.eval_interval", "0", "--train.log_interval", "50"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((out / "summary.json").read_text())["val_loss"]


def mtp_rows(steps: int, seeds: int, work: Path) -> tuple[list[list], dict]:
    """Val loss of the main head with MTP off and on, per seed (the two runs of a seed alternate)."""
    loss = {0: [], 1: []}
    for seed in range(seeds):
        for depth in loss:
            loss[depth].append(train_mtp(work / f"s{seed}d{depth}", steps, seed, depth))
    return mtp_table(loss), {"val_loss": loss, "on_minus_off": [b - a for a, b in zip(loss[0], loss[1])]}


def mtp_table(loss: dict[int, list[float]]) -> list[list]:
    """The rows of part 3 from the val losses per depth (0: off, 1: on), one per seed."""
    diffs = [b - a for a, b in zip(loss[0], loss[1])]
    return [[f"MTP {'on (D = 1, lambda = 0.3)' if d else 'off'}", " / ".join(f"{v:.4f}" for v in loss[d]),
             f"{statistics.mean(loss[d]):.4f}", "" if not d else " / ".join(f"{v:+.4f}" for v in diffs)]
            for d in loss]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parts", default="1,2,3")
    parser.add_argument("--blocks", default="128,512", help="part 1's sequence lengths T, comma-separated")
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    rows, data = [], {"rounds": args.rounds, "steps": args.steps, "seeds": args.seeds, "cpu_flags": cpu_flags()}
    old = RESULTS_DIR / "deepseek_v3.json"  # parts not run now keep their last results, with their date
    previous = json.loads(old.read_text()) if old.exists() else {}
    kept = []
    if 1 in parts:
        vs, facts, note = part_one(args.rounds, [int(T) for T in args.blocks.split(",")], previous)
        data.update(facts)
        kept += [note] if note else []
        rows += [["**one training step**", "tokens/s (median)", "rounds min..max", "vs transformers (per round)",
                  f"loss, first -> last of {args.rounds * STEPS_PER_ROUND} steps"]] + vs
        data["versus_transformers"] = vs
    if 2 in parts:
        attn, data["attention"] = mla_vs_gqa(args.rounds)
        data["attention"]["rows"] = attn
    elif "rows" in previous.get("attention", {}):
        attn, data["attention"] = previous["attention"]["rows"], previous["attention"]
        data["attention"].setdefault("date", previous["machine"]["date"])
        kept.append(f"attention layer: from the run of {data['attention']['date']}")
    if 2 in parts or "attention" in data:
        rows += [["**attention layer**", "tokens/s (median)", "rounds min..max", "vs GQA", "peak activations MiB"]] + attn
    steps, seeds = args.steps, args.seeds
    if 3 in parts:
        with tempfile.TemporaryDirectory() as work:
            mtp, data["mtp"] = mtp_rows(args.steps, args.seeds, Path(work))
    elif "mtp" in previous:
        data["mtp"] = previous["mtp"]
        data["mtp"].setdefault("date", previous["machine"]["date"])
        data["mtp"].setdefault("steps", previous["steps"])
        mtp = mtp_table({int(d): v for d, v in data["mtp"]["val_loss"].items()})
        steps, seeds = data["mtp"]["steps"], len(mtp[0][1].split(" / "))
        kept.append(f"multi-token prediction: from the run of {data['mtp']['date']}")
    if "mtp" in data:
        rows += [["**multi-token prediction**", f"val loss after {steps} steps, seeds 0..{seeds - 1}", "mean",
                  "on - off per seed", ""]] + [r + [""] for r in mtp]
    model = ", ".join(f"{k} = {v}" for k, v in MODEL.items() if k != "type")
    notes = [f"CPU: Intel Xeon, flags {cpu_flags()} (AVX-512-BF16/AMX: bf16 matmul in hardware); torch threads: "
             f"{torch.get_num_threads()}; the machine was shared with other jobs, hence the spreads.",
             f"Model of parts 1 and 3: deepseek_v3 with {model}; vocabulary 65 (Tiny Shakespeare's characters); part "
             "1 sets block_size to each T.",
             f"One training step: batch {BATCH} x T tokens of the bundled Tiny Shakespeare (the "
             f"same batches for both), forward, cross-entropy, backward, AdamW (lr 1e-3); {STEPS_PER_ROUND} steps a "
             "round, rounds interleaved; both start from the same weights (meshtrain's Hugging Face export loaded by "
             "`from_pretrained`), so equal losses show the same computation. bf16 rows: autocast on both sides.",
             "meshtrain zero-pads MLA's v (dv = 32) to q's and k's width (dn + dr = 48), so that "
             "scaled_dot_product_attention runs torch's CPU flash kernel; with unequal widths it runs its math path "
             "(bmm + softmax + mask, the T x T weights kept for backward), as transformers' sdpa attention does and "
             "the 'v unpadded' rows (the same meshtrain model with `MLAttention.pad_v = False`). The gain grows with "
             "T, the attention's share of the step. At short T the attention is a small share and the rest of the "
             "step runs the same kernels on both sides (transformers 5 runs its experts as grouped_mm too, its "
             "default), so there the step stays near transformers'. 'train.compile = on' rows: the same model with "
             "each block compiled as that option compiles it (torch.compile, inductor's C++ kernels on the CPU: "
             "norms, RoPE, SwiGLU and the routing's small ops fused), compiled before the timing by forward + "
             "backward passes on other batches without an optimizer step; the CPU default ('auto') leaves it off.",
             f"Attention layer: C = {ATTN['n_embd']}, 8 query heads, batch 4 x {ATTN['block_size']} tokens, fp32, "
             "forward + backward of mean(y^2), 5 a round; peak activations: every tensor allocated during one forward "
             "+ backward (torch's MemTracker), the weights and their gradients not counted. MLA trains with k and v "
             "expanded per head (the latent cache is an inference saving), so its activations are not smaller.",
             f"Multi-token prediction: `meshtrain train configs/shakespeare_char.toml` with the model above at block "
             f"64, one process, fp32, {steps} steps, --seed 0..{seeds - 1}; val loss of the main head (MTP "
             "modules run only in training), on the config's val split at the last step.",
             *[f"Kept, not rerun: {k}." for k in kept]]
    md = write_results("deepseek_v3", "DeepSeek-V3: meshtrain vs transformers, MLA vs GQA, MTP on vs off",
                       ["", "", "", "", ""], rows, notes, data)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
