"""meshtrain's LoRA against ``peft`` + ``transformers`` in a plain PyTorch loop, and against meshtrain's own full
fine-tuning, side by side on this CPU.

One tiny Llama (``transformers.LlamaConfig`` with ``configs/llama_tiny.toml``'s shape, vocabulary 65, random weights
saved to a temporary folder, never downloaded) is the base of all three runs:

- ``meshtrain LoRA``: ``meshtrain train configs/hf_finetune.toml --model.init_from MODEL --adapter.lora_rank 8
  --adapter.lora_alpha 16 --adapter.lora_targets all-linear`` (the base frozen, adapters on q, k, v, o, gate, up,
  down of every block);
- ``peft LoRA``: ``LlamaForCausalLM.from_pretrained(MODEL)`` wrapped by ``get_peft_model(LoraConfig(r=8,
  lora_alpha=16, target_modules="all-linear"))``, trained by a plain loop (forward with labels, backward,
  ``clip_grad_norm_``, fused AdamW step) in its own process;
- ``meshtrain full``: the first command with ``--adapter.lora_rank 0`` (every parameter trains).

The same batches: the bundled Tiny Shakespeare by characters (meshtrain's char corpus, 65 ids, val fraction 0.1),
and the peft loop draws its windows from meshtrain's own sampler (``ShardedSampler`` at ``train.seed``), so step s
of both LoRA runs trains on the same (x, y). The same start: the peft adapters are set (``set_peft_model_state_dict``)
to the initial A (B = 0) meshtrain draws for its run (rebuilt from the run's checkpoint by
``described_model``, exported in peft's format by ``write_peft_folder``), so the two LoRA loss curves must agree up to
float rounding -- the "equal loss" check. Both: fp32 (``--dtype bfloat16``: bf16 autocast), one process, OMP_NUM_THREADS = every core, fused AdamW, the
same constant lr, betas, eps, no weight decay, grad clip 1.0, batch, block and steps.

tokens/s = batch x block over the median step time, and over the fastest step's (a step from the end of the previous
one: batch, forward, backward, clip, optimizer, the loss read back), steps after ``SKIP_STEPS``; start-up, the final
evaluation and the saves are not timed. Peak memory is the training process's RSS high-water mark (``ru_maxrss``) on
both sides: meshtrain's logged ``peak_memory_bytes`` (which is ``ru_maxrss`` on a CPU), the peft worker's own
``getrusage``. The rounds interleave the three runs; each run waits for idle cores and is retried when disturbed
(``plan_vs_actual.run_alone``), since other people's jobs share this machine's cores.

    python bench/bench_lora.py [--steps 60] [--rounds 3] [--batch 12] [--block 128] [--dtype float32|bfloat16]
    # 3-9 min on 2 idle cores

(longer while other people's jobs hold the cores: 48 minutes once on 2026-11-29, waiting for them).

Writes ``bench/results/lora.{md,json}`` (``--dtype bfloat16``: ``lora_bf16.{md,json}``, both sides' forward in bf16
autocast over fp32 weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_posttraining import cpu_line  # noqa: E402
from common import REPO, meshtrain_command, write_results  # noqa: E402
from plan_vs_actual import run_alone  # noqa: E402

CORPUS = REPO / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"
SKIP_STEPS = 5  # first steps of a run left out of tokens/s (allocator, thread pools, autograd warm-up)
VOCAB = 65  # Tiny Shakespeare's characters: meshtrain's char tokenizer ids 0..64
MODEL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=1024)
"""configs/llama_tiny.toml's shape (4 layers, 128 wide, 4 query and 2 kv heads, SwiGLU 352) as a LlamaConfig."""
RANK, ALPHA = 8, 16.0
LR, BETAS, EPS, CLIP, SEED, VAL_FRACTION = 1e-3, (0.9, 0.95), 1e-8, 1.0, 1337, 0.1
ENV = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "PYTHONUNBUFFERED": "1",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
MIB = 2**20


def run_quietly(argv_of: Callable[[int], list]) -> tuple[int, dict]:
    """Run the command ``argv_of(try)`` alone (``plan_vs_actual.run_alone``: once the cores are idle, again up to 3
    times while other processes take over 10% of them); return the try kept and how disturbed it was."""
    i, busy, others = run_alone(lambda i: [str(a) for a in argv_of(i)], ENV)
    return i, {"tries": i + 1, "busy_at_start": busy, "others_share": others}


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def meshtrain_argv(model: Path, out: Path, rank: int, steps: int, batch: int, block: int,
                   dtype: str = "float32") -> list:
    adapter = ["--adapter.lora_rank", rank]
    if rank:
        adapter += ["--adapter.lora_alpha", ALPHA, "--adapter.lora_targets", "all-linear"]
    return [*meshtrain_command(), "train", REPO / "configs" / "hf_finetune.toml", "--nproc", "1",
            "--model.init_from", model, "--model.block_size", block, *adapter, "--data.val_fraction", VAL_FRACTION,
            "--batch.micro_batch_size", batch, "--batch.gradient_accumulation_steps", "1", "--optim.lr", LR,
            "--optim.min_lr", LR, "--optim.warmup_steps", "0", "--optim.weight_decay", "0", "--optim.grad_clip",
            CLIP, "--optim.beta1", BETAS[0], "--optim.beta2", BETAS[1], "--train.dtype", dtype,
            "--train.seed", SEED, "--steps", steps, "--train.log_interval", "1", "--train.eval_interval", "0",
            "--train.eval_steps", "1", "--checkpoint.interval", "0", "--checkpoint.keep", "1", "--out", out]


def run_meshtrain(rank: int, work: Path, out: Path, steps: int, batch: int, block: int, dtype: str) -> dict:
    i, quiet = run_quietly(lambda i: meshtrain_argv(work / "model", out / f"try{i}", rank, steps, batch, block, dtype))
    out = out / f"try{i}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step_time_s" in r]
    from meshtrain.checkpoint.store import list_checkpoints

    ckpt = list_checkpoints(out)[-1]
    return {"loss": [r["loss"] for r in records], "step_time_s": [r["step_time_s"] for r in records],
            "peak_memory_bytes": records[-1]["peak_memory_bytes"], "checkpoint_bytes": folder_bytes(ckpt),
            "checkpoint": str(ckpt), **quiet}


def initial_adapters(ckpt: Path, out: Path) -> Path:
    """The adapters a meshtrain LoRA run started from (A from its seed, B = 0), rebuilt from its checkpoint's
    config and written as peft's ``adapter_model.safetensors`` to ``out``; returns ``out``."""
    from meshtrain.adapters.export import write_peft_folder
    from meshtrain.checkpoint.store import described_model, read_meta
    from meshtrain.config.load import saved_adapter
    from meshtrain.models.registry import ModelConfig

    meta = read_meta(ckpt)
    model = described_model(meta, base=True)  # the base, then add_adapters from train.seed: step 0's adapters
    write_peft_folder(out, model.state_dict(), saved_adapter(meta["config"]), ModelConfig(**meta["config"]["model"]))
    return out


def run_peft(init: Path, work: Path, out: Path, steps: int, batch: int, block: int, dtype: str) -> dict:
    i, quiet = run_quietly(lambda i: [sys.executable, __file__, "--peft-worker", "--work", work, "--init", init,
                                      "--out", out / f"try{i}.json", "--steps", steps, "--batch", batch,
                                      "--block", block, "--dtype", dtype])
    return {**json.loads((out / f"try{i}.json").read_text()), **quiet}


def rss_now() -> int:
    """This process's resident set size in bytes (VmRSS of /proc/self/status)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def peft_worker(work: Path, init: Path, out: Path, steps: int, batch: int, block: int, dtype: str) -> None:
    """One peft run in its own process: per-step loss and time, its RSS high-water mark and adapter size to ``out``.
    ``dtype = "bfloat16"``: the forward under ``torch.autocast`` over the fp32 weights, backward outside it (what
    ``transformers.Trainer`` does with ``bf16 = True``; meshtrain's ``train.dtype = "bfloat16"`` is the same)."""
    import contextlib

    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.sampler import ShardedSampler

    out.parent.mkdir(parents=True, exist_ok=True)
    model = LlamaForCausalLM.from_pretrained(work / "model", dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear"))
    loaded = set_peft_model_state_dict(model, load_file(init / "adapter_model.safetensors"))
    assert not loaded.unexpected_keys, loaded.unexpected_keys  # every meshtrain adapter has its peft twin
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)
    sampler = ShardedSampler(load_corpus(CORPUS, VAL_FRACTION, block).train, block, batch, 1, 1, 0, SEED)
    rss_start = rss_now()
    losses, times = [], []
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16"
                else contextlib.nullcontext())
    mark = time.perf_counter()
    for _ in range(steps):
        x, y = sampler.next_step()[0]  # (batch, block) each: meshtrain's windows of this step
        with autocast:
            loss = model(input_ids=x, labels=x, shift_labels=y.contiguous()).loss  # targets y: x shifted drops one
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now = time.perf_counter()
        times.append(now - mark)
        mark = now
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model.save_pretrained(out.with_suffix(""))  # adapters only, peft's format
    out.write_text(json.dumps({"loss": losses, "step_time_s": times, "peak_memory_bytes": peak,
                               "rss_before_step_1_bytes": rss_start, "trainable_params": sum(p.numel() for p in params),
                               "checkpoint_bytes": folder_bytes(out.with_suffix(""))}))


RUNS = ["meshtrain LoRA", "peft LoRA", "meshtrain full"]
PRECISION = {"float32": "fp32",
             "bfloat16": "bf16 autocast over fp32 weights (meshtrain's train.dtype = \"bfloat16\"; the peft loop's "
                         "forward under torch.autocast, as transformers.Trainer with bf16 = True)"}
RESULTS = {"float32": "lora", "bfloat16": "lora_bf16"}  # bench/results/<name>.{md,json}
PEFT = ("meshtrain LoRA", "peft LoRA")
PEAK_IS = {"meshtrain LoRA": "meshtrain's peak_memory_bytes (ru_maxrss)", "peft LoRA": "worker's ru_maxrss",
           "meshtrain full": "meshtrain's peak_memory_bytes (ru_maxrss)"}
SAVED = {"meshtrain LoRA": "step folder: adapters + AdamW state + meta", "peft LoRA": "save_pretrained: adapters only",
         "meshtrain full": "step folder: weights + AdamW state + meta"}


def tokens_per_s(r: dict, tokens: int, best: bool = False) -> float:
    """``tokens`` per step over the median step time after ``SKIP_STEPS`` (``best``: the fastest step's)."""
    times = r["step_time_s"][SKIP_STEPS:]
    return tokens / (min(times) if best else statistics.median(times))


def ratio_cell(per_round: dict, a: str, b: str) -> str:
    ratios = [x / y for x, y in zip(per_round[a], per_round[b])]
    return f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})"


def report(rounds: dict, args, params: dict) -> Path:
    import peft
    import transformers

    tokens = args.batch * args.block
    stats, median_tps, best_tps = {}, {}, {}
    for name, rs in rounds.items():
        median_tps[name] = [tokens_per_s(r, tokens) for r in rs]
        best_tps[name] = [tokens_per_s(r, tokens, best=True) for r in rs]
        stats[name] = {"tokens_per_s": statistics.median(median_tps[name]), "tokens_per_s_rounds": median_tps[name],
                       "best_step_tokens_per_s": statistics.median(best_tps[name]),
                       "best_step_tokens_per_s_rounds": best_tps[name],
                       "peak_memory_mib": statistics.median(r["peak_memory_bytes"] for r in rs) / MIB,
                       "checkpoint_mib": rs[0]["checkpoint_bytes"] / MIB, "loss": rs[0]["loss"],
                       "others_share": [r["others_share"] for r in rs], "tries": [r["tries"] for r in rs]}
    gap = max(abs(a - b) for r1, r2 in zip(rounds["meshtrain LoRA"], rounds["peft LoRA"])
              for a, b in zip(r1["loss"], r2["loss"]))
    tail = max(1, args.steps // 4)
    columns = ["run", "tokens/s, median step (median of rounds)", "per round", "meshtrain LoRA / this, same round",
               "tokens/s, fastest step", "meshtrain LoRA / this, fastest steps", "others' share of the cores per round",
               "peak memory MiB", "peak memory is", "trainable params", "saved on disk MiB", "what is saved",
               f"loss step 1 / {args.steps}", f"mean loss, last {tail} steps"]
    rows = []
    for name in RUNS:
        s, mine = stats[name], name == "meshtrain LoRA"
        rows.append([name, f"{s['tokens_per_s']:,.0f}", " / ".join(f"{t:,.0f}" for t in median_tps[name]),
                     "" if mine else ratio_cell(median_tps, "meshtrain LoRA", name),
                     f"{s['best_step_tokens_per_s']:,.0f}",
                     "" if mine else ratio_cell(best_tps, "meshtrain LoRA", name),
                     " / ".join(f"{x:.0%}" for x in s["others_share"]), f"{s['peak_memory_mib']:.0f}", PEAK_IS[name],
                     f"{params[name]:,}", f"{s['checkpoint_mib']:.2f}", SAVED[name],
                     f"{s['loss'][0]:.4f} / {s['loss'][-1]:.4f}", f"{statistics.mean(s['loss'][-tail:]):.4f}"])
    peft_start = statistics.median(r["rss_before_step_1_bytes"] for r in rounds["peft LoRA"]) / MIB
    notes = [
        f"CPU: {cpu_line()}; transformers {transformers.__version__}, peft {peft.__version__}. The machine's "
        f"{os.cpu_count()} cores are shared with other engineers' jobs (test suites, benchmarks): each run starts "
        "once the cores are idle and is repeated (up to 3 tries, the least disturbed kept) when other processes "
        "took over 10% of the cores during it ('others' share'; tries per round: "
        + ", ".join(f"{n} {stats[n]['tries']}" for n in RUNS) + "). A disturbed step on 2 busy cores takes 5-40x "
        "its time (OpenMP threads wait for a descheduled partner), so the median step is quoted as the other "
        "benchmarks do and the fastest step as the contention-free speed; read the same-round ratios.",
        f"Model: LlamaForCausalLM {MODEL['num_hidden_layers']} layers x {MODEL['hidden_size']}, "
        f"{MODEL['num_attention_heads']} query / {MODEL['num_key_value_heads']} kv heads, SwiGLU "
        f"{MODEL['intermediate_size']}, untied head, vocab {VOCAB}, random weights (seed {SEED}), "
        f"{params['base']:,} parameters; meshtrain loads it through model.init_from, peft through from_pretrained.",
        f"LoRA: rank {RANK}, alpha {ALPHA:g} (scaling {ALPHA / RANK:g}), no dropout, all-linear = q, k, v, o, gate, "
        "up, down of every block (the head is not adapted on either side); both LoRA runs start from the same A "
        "(meshtrain's, set into peft) and B = 0.",
        f"Settings, all runs: {PRECISION[args.dtype]}, 1 process, {os.cpu_count()} threads, {args.steps} steps of {args.batch} x "
        f"{args.block} tokens (Tiny Shakespeare by characters, meshtrain's sampler at seed {SEED}: the same windows "
        f"on every side), fused AdamW lr {LR:g} constant, betas {BETAS}, eps {EPS:g}, weight decay 0, grad clip "
        f"{CLIP:g}. {args.rounds} rounds, the three runs interleaved in each.",
        f"tokens/s = {tokens} tokens per step over the median (or the fastest) step time of steps "
        f"{SKIP_STEPS + 1}..{args.steps}, a step timed from the end of the previous one (the batch and the loss "
        "read-back included; start-up, meshtrain's final evaluation and the saves not).",
        f"Equal loss: the largest |meshtrain LoRA - peft LoRA| train loss over all steps and rounds is {gap:.1e} "
        "(same start, same batches; the two differ only in float rounding of two model implementations).",
        f"The issue's goal, meshtrain LoRA >= 1.2x peft's tokens/s at equal loss: {ratio_cell(median_tps, *PEFT)} "
        f"(median steps), {ratio_cell(best_tps, *PEFT)} (fastest steps): "
        f"{'met' if statistics.median(x / y for x, y in zip(*(median_tps[n] for n in PEFT))) >= 1.2 else 'not met'}.",
        f"Peak memory is the RSS high-water mark of the training process on both sides, libraries included: the "
        f"peft worker imports transformers and peft (and peft imports torchao); its RSS just before step 1 was "
        f"{peft_start:.0f} MiB. At this size the weights (fp32, {params['base'] * 4 / MIB:.1f} MiB) and AdamW states "
        "are small beside the libraries and the activations, so LoRA saves little memory here; the saving grows "
        "with the model (full fine-tuning keeps a gradient and two AdamW moments per parameter, 12 bytes, LoRA "
        "only for the adapters). A LoRA peak at or above full fine-tuning's is glibc's heap keeping freed "
        "activations resident (plan_vs_actual.py's RECOMPUTE_ENV), not tensors the LoRA step holds.",
        "Saved on disk: meshtrain's final checkpoint step folder (LoRA: the adapters and their AdamW moments, the "
        "base is rebuilt from model.init_from; full: every weight and its AdamW moments), the peft run's "
        "save_pretrained folder (adapters only, no optimizer state: not a resumable checkpoint).",
    ]
    data = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "cpu": cpu_line(),
            "params": params, "stats": stats, "rounds": rounds, "max_lora_loss_gap": gap}
    return write_results(RESULTS[args.dtype], "meshtrain LoRA against peft + transformers and against full fine-tuning", columns,
                         rows, notes, data)


def count_params(init: Path, model: Path) -> dict:
    """Parameters of the base and of the adapters in ``init`` (meshtrain's and peft's: the same tensors)."""
    from safetensors import safe_open

    with safe_open(str(init / "adapter_model.safetensors"), "pt") as f:
        lora = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        base = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return {"base": base, "meshtrain LoRA": lora, "peft LoRA": lora, "meshtrain full": base}


def build_model(work: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **MODEL)).save_pretrained(work / "model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=12, help="windows per step (llama_tiny's micro_batch_size)")
    parser.add_argument("--block", type=int, default=128, help="tokens per window (llama_tiny's block_size)")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--dtype", choices=sorted(PRECISION), default="float32",
                        help="both sides' compute dtype (bfloat16: autocast; writes bench/results/lora_bf16.*)")
    parser.add_argument("--peft-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--init", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peft_worker:
        return peft_worker(args.work, args.init, args.out, args.steps, args.batch, args.block, args.dtype)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-lora-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        build_model(work)
        rounds: dict[str, list[dict]] = {name: [] for name in RUNS}
        init = None
        for r in range(args.rounds):
            for name in RUNS:
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                out = work / f"{r}-{name.replace(' ', '_')}"
                if name == "peft LoRA":
                    result = run_peft(init, work, out, args.steps, args.batch, args.block, args.dtype)
                else:
                    result = run_meshtrain(RANK if "LoRA" in name else 0, work, out, args.steps, args.batch,
                                           args.block, args.dtype)
                if init is None and name == "meshtrain LoRA":
                    init = initial_adapters(Path(result["checkpoint"]), work / "initial_adapters")
                rounds[name].append(result)
        params = count_params(init, work / "model")
    path = report(rounds, args, params)
    print(path.read_text())
    print(f"whole bench: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
