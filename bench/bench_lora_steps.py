"""meshtrain LoRA against ``peft`` + ``transformers``, step by step in one process: the two train on the same batches,
their steps interleaved, so that both see the same load of a shared machine.

``bench_lora.py`` runs each contender as its own process and waits for idle cores; on a machine whose two cores
other people's jobs keep busy its runs wait or are disturbed. This bench interleaves the steps instead: one
process builds meshtrain's trainer (``configs/hf_finetune.toml`` on ``bench_lora``'s tiny Llama, rank 8, alpha 16,
all-linear, no dropout, fused AdamW, the same lr, betas, clip) and peft's model (``get_peft_model`` on
``LlamaForCausalLM.from_pretrained``, its adapters set to meshtrain's initial A and B = 0), and each step s draws
meshtrain's batch s and trains both on it, alternating which goes first. meshtrain's steps alternate too: odd
steps take its fast LoRA path, even steps the plain one (the path before it), on the same model, so "before" and
"after" are measured side by side; the numbers are the same up to rounding, which the loss check below shows.

``--dtype float32`` (the default): both in fp32; meshtrain's fast path is the merged one
(``meshtrain.adapters.lora._MergedLoRA``; ``MERGED_FORWARD = False`` gives the unmerged one). ``--dtype bfloat16``:
both in bf16 autocast over fp32 weights, the same scheme on each side -- meshtrain's ``train.dtype = "bfloat16"``,
and peft's model kept in fp32 with its forward under ``torch.autocast("cpu", dtype=torch.bfloat16)`` and the backward
outside it, as ``transformers.Trainer`` runs ``bf16=True``; meshtrain's fast path is the fused one
(``meshtrain.adapters.lora._FusedLoRA``; ``FUSED_FORWARD = False`` gives the plain one).

Each step is timed by wall clock and by this process's CPU time (``time.process_time``: with one thread the work
the step did, which other processes' load inflates much less than the wall time). tokens/s = batch x block over
the median step time; the spread is the ratio's range over ``--chunks`` consecutive groups of steps. Equal loss:
the largest |meshtrain - peft| step loss over every step.

    OMP_NUM_THREADS=1 python bench/bench_lora_steps.py [--dtype float32] [--steps 120] [--threads 1] [--batch 12]

Writes ``bench/results/lora_steps.{md,json}`` (fp32) or ``bench/results/lora_steps_bf16.{md,json}`` (bf16).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora import ALPHA, BETAS, CLIP, EPS, LR, RANK, SEED, VAL_FRACTION, build_model  # noqa: E402
from bench_posttraining import cpu_line  # noqa: E402
from common import REPO, write_results  # noqa: E402

SKIP_STEPS = 6  # first steps left out (allocator, thread pools, autograd warm-up): 3 of each meshtrain path
PATHS = {"float32": ("MERGED_FORWARD", "merged", "unmerged"), "bfloat16": ("FUSED_FORWARD", "fused", "plain")}
"""Per ``--dtype``: the switch in :mod:`meshtrain.adapters.lora` that turns the fast path off, and the names of the
fast path and of the one it replaced."""
BOUND = "meshtrain, frozen base without adapters (the bound)"


def contenders(dtype: str) -> tuple[tuple[str, str, str], dict[str, str]]:
    """The rows (meshtrain's fast path, its plain path, peft) of ``dtype``, and for each meshtrain row the key of the
    peft steps that ran beside it (on the same batches): each meshtrain path is compared with those."""
    _, fast, plain = PATHS[dtype]
    names = (f"meshtrain LoRA, {fast} (after)", f"meshtrain LoRA, {plain} (before)", "peft LoRA")
    return names, {names[0]: f"peft beside {fast}", names[1]: f"peft beside {plain}", BOUND: "peft beside the bound"}


def trainer(model: Path, out: Path, batch: int, block: int, dtype: str):
    """meshtrain's trainer of ``bench_lora.meshtrain_argv``'s LoRA run, in this process, ``train.dtype = dtype``."""
    from meshtrain.config.load import load_config
    from meshtrain.train.loop import Trainer

    overrides = {"model.init_from": str(model), "model.block_size": block, "adapter.lora_rank": RANK,
                 "adapter.lora_alpha": ALPHA, "adapter.lora_targets": ["all-linear"],
                 "data.val_fraction": VAL_FRACTION, "batch.micro_batch_size": batch,
                 "batch.gradient_accumulation_steps": 1, "optim.lr": LR, "optim.min_lr": LR, "optim.warmup_steps": 0,
                 "optim.weight_decay": 0.0, "optim.grad_clip": CLIP, "optim.beta1": BETAS[0],
                 "optim.beta2": BETAS[1], "train.dtype": dtype, "train.seed": SEED, "train.out_dir": str(out)}
    return Trainer(load_config(REPO / "configs" / "hf_finetune.toml", overrides))


def peft_model(model: Path, ours, cfg):
    """peft's LoRA model on the same base, its adapters copied from meshtrain's model ``ours`` (A drawn from the
    seed, B = 0; ``cfg`` its ``[model]`` section), and its fused AdamW over them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from meshtrain.adapters.spec import peft_names, targeted_paths

    theirs = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    theirs = get_peft_model(theirs, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                               target_modules="all-linear"))
    mine = dict(ours.named_parameters())
    params = dict(theirs.named_parameters())
    names = peft_names(cfg, targeted_paths(cfg, ["all-linear"]))
    with torch.no_grad():
        for o, t in names.items():
            params[t.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")].copy_(mine[o])
    trained = [p for p in theirs.parameters() if p.requires_grad]
    assert len(trained) == len(names), (len(trained), len(names))
    theirs.train()
    return theirs, trained, torch.optim.AdamW(trained, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120, help="steps of each side (meshtrain's alternate paths)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=5, help="groups of steps the spread is taken over")
    parser.add_argument("--bound-steps", type=int, default=40, help="steps of the bound (adapters skipped), after")
    parser.add_argument("--dtype", choices=list(PATHS), default="float32",
                        help="float32, or bfloat16: bf16 autocast over fp32 weights on both sides")
    parser.add_argument("--name", help="results name; default lora_steps (fp32), lora_steps_bf16 (bf16)")
    args = parser.parse_args()
    args.name = args.name or ("lora_steps" if args.dtype == "float32" else "lora_steps_bf16")
    return args


def steppers(tr, theirs, trained, optimizer, dtype: str):
    """One training step of meshtrain's trainer ``tr`` (step number, batches -> loss) and one of peft's model
    ``theirs`` (batches -> loss): forward, backward, clipping, fused AdamW; peft's forward under bf16 autocast when
    ``dtype`` is bfloat16 (the backward outside it, as ``transformers.Trainer``'s ``bf16=True``)."""
    import torch

    from meshtrain.parallel.rng import seed_step

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()

    def ours_step(step: int, batches) -> float:
        seed_step(tr.model, tr.cfg.train.seed, step, 0, 1)
        loss = tr.forward_backward(batches)
        tr.clip_gradients()
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)
        tr.scheduler.step()
        return float(loss)

    def peft_step(batches) -> float:
        x, y = batches[0]
        with autocast:
            loss = theirs(input_ids=x, labels=x, shift_labels=y.contiguous()).loss  # targets y, as bench_lora's
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return ours_step, peft_step


def taken_paths(model):
    """Hooks that record, for every adapted layer of ``model``, the path its next forwards take (merged, fused or
    plain, :meth:`meshtrain.adapters.lora.LoRALinear._mergeable` / ``_fusable`` on the layer's input, inside the
    forward's autocast); returns the record (``collections.Counter`` of path names) and the hooks' handles."""
    import collections

    import meshtrain.adapters.lora as lora

    seen = collections.Counter()

    def hook(module, args):
        x = args[0]
        seen["merged" if module._mergeable(x) else "fused" if module._fusable(x) else "plain"] += 1

    return seen, [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, lora.LoRALinear)]


def timed(times: tuple[dict, dict], keys, run, record: bool):
    """``run()``'s value, its wall and CPU seconds appended to ``times`` (wall, cpu) under each of ``keys`` when
    ``record``."""
    w0, c0 = time.perf_counter(), time.process_time()
    value = run()
    w1, c1 = time.perf_counter(), time.process_time()
    if record:
        for key in keys:
            times[0][key].append(w1 - w0)
            times[1][key].append(c1 - c0)
    return value


def interleave(args, tr, ours_step, peft_step, times, loss: dict, paths: dict) -> None:
    """The LoRA steps: meshtrain's odd steps on its fast path, even ones on the plain path, each beside a peft step on
    the same batches, the order alternating every two steps; the paths steps 1 and 2 took go to ``paths``."""
    import meshtrain.adapters.lora as lora

    switch = PATHS[args.dtype][0]
    names, beside = contenders(args.dtype)
    try:
        for step in range(1, args.steps + 1):
            batches = tr.sampler.next_step()
            fast = step % 2 == 1
            setattr(lora, switch, fast)
            name = names[0] if fast else names[1]
            seen, hooks = taken_paths(tr.model) if step <= 2 else (None, [])
            order = [("mesh", name), ("peft", names[2])]
            for side, who in order if (step // 2) % 2 == 0 else order[::-1]:
                if side == "mesh":
                    loss["meshtrain"].append(timed(times, (who,), lambda: ours_step(step, batches), step > SKIP_STEPS))
                else:
                    loss["peft"].append(timed(times, (who, beside[name]), lambda: peft_step(batches),
                                              step > SKIP_STEPS))
            for hook in hooks:
                hook.remove()
            if seen is not None:
                paths[name] = dict(seen)
    finally:
        setattr(lora, switch, True)


def bound(args, tr, ours_step, peft_step, times) -> None:
    """The bound: the same model with every adapter skipped (``LoRALinear`` computes its base only) and the embedding
    trainable so that the backward still runs through every block (the frozen linear maps' input gradients, as in
    LoRA): what a LoRA step costs here if its adapters cost nothing; beside peft steps, as the others."""
    import meshtrain.adapters.lora as lora

    names, beside = contenders(args.dtype)
    forward, lora.LoRALinear.forward = lora.LoRALinear.forward, lora.LoRALinear.base_output
    tr.model.tok_emb.requires_grad_(True)
    try:
        for step in range(args.steps + 1, args.steps + 1 + args.bound_steps):
            batches = tr.sampler.next_step()
            record = step > args.steps + 2  # its first two steps (the embedding's first gradient) not timed
            order = [("mesh", BOUND), ("peft", names[2])]
            for side, _ in order if step % 2 == 0 else order[::-1]:
                if side == "mesh":
                    timed(times, (BOUND,), lambda: ours_step(step, batches), record)
                else:
                    timed(times, (beside[BOUND],), lambda: peft_step(batches), record)
    finally:
        lora.LoRALinear.forward = forward


def main() -> None:
    args = arguments()
    import torch

    torch.set_num_threads(args.threads)
    names, beside = contenders(args.dtype)
    wall = {name: [] for name in (*names, BOUND, *beside.values())}
    cpu = {name: [] for name in (*names, BOUND, *beside.values())}
    loss, paths = {"meshtrain": [], "peft": []}, {}
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-lora-steps-") as tmp:
        work = Path(tmp)
        build_model(work)
        tr = trainer(work / "model", work / "run", args.batch, args.block, args.dtype)
        theirs, trained, optimizer = peft_model(work / "model", tr.model, tr.cfg.model)
        ours_step, peft_step = steppers(tr, theirs, trained, optimizer, args.dtype)
        interleave(args, tr, ours_step, peft_step, (wall, cpu), loss, paths)
        bound(args, tr, ours_step, peft_step, (wall, cpu))
        torch.distributed.destroy_process_group()
    report(args, wall, cpu, loss, paths)


def _ratios(times: dict, a: str, b: str, chunks: int) -> tuple[float, list[float]]:
    """Median step time of ``b`` over ``a``'s (paired lists: the same batches), whole and per chunk of consecutive
    steps (the spread)."""
    n = min(len(times[a]), len(times[b]))
    size = max(1, n // chunks)
    per = [statistics.median(times[b][i:i + size]) / statistics.median(times[a][i:i + size])
           for i in range(0, n - size + 1, size)]
    return statistics.median(times[b][:n]) / statistics.median(times[a][:n]), per


def report(args, wall: dict, cpu: dict, loss: dict, paths: dict) -> None:
    import peft
    import torch
    import transformers

    tokens = args.batch * args.block
    columns = ["run", "tokens/s (CPU time)", "tokens/s (wall)", "x peft's tokens/s (CPU time), spread over chunks",
               "x peft's tokens/s (wall), spread over chunks", "steps timed"]
    names, beside = contenders(args.dtype)
    _, fast, plain = PATHS[args.dtype]
    rows = []
    for name in (*names, BOUND) if cpu[BOUND] else names:
        row = [name, f"{tokens / statistics.median(cpu[name]):,.0f}", f"{tokens / statistics.median(wall[name]):,.0f}"]
        for times in (cpu, wall):
            if name not in beside:
                row.append("")
            else:
                whole, per = _ratios(times, name, beside[name], args.chunks)
                row.append(f"{whole:.2f}x ({min(per):.2f}..{max(per):.2f})")
        rows.append(row + [len(cpu[name])])
    gap = max(abs(a - b) for a, b in zip(loss["meshtrain"], loss["peft"]))
    gains = {kind: _ratios(times, names[0], names[1], args.chunks) for kind, times in (("CPU time", cpu), ("wall", wall))}
    tail = max(1, args.steps // 4)
    notes = [f"CPU: {cpu_line()} (this machine's cores are shared with other people's jobs); torch {torch.__version__}"
             f", transformers {transformers.__version__}, peft {peft.__version__}; {args.threads} thread(s).",
             f"One process, {args.steps} steps of {args.batch} x {args.block} tokens on each side, meshtrain's odd "
             f"steps {fast} and even steps {plain}, the order of meshtrain and peft alternating every two steps; "
             f"the first {SKIP_STEPS} steps are not timed. A step: forward, backward, gradient clipping, fused AdamW "
             f"step, the loss read back.",
             "Precision: fp32 on both sides." if args.dtype == "float32" else "Precision: bf16 autocast over fp32 "
             "weights (master weights, gradients and AdamW in fp32) on both sides: meshtrain's train.dtype = "
             "bfloat16; peft's fp32 model with its forward under torch.autocast('cpu', torch.bfloat16), the backward "
             "outside it (transformers.Trainer's bf16=True).",
             f"meshtrain's {fast} path over its {plain} one (its odd steps against the even steps beside them, the "
             "same model): " + ", ".join(f"{whole:.3f}x ({min(per):.3f}..{max(per):.3f}) by {kind}"
                                          for kind, (whole, per) in gains.items()) + ".",
             f"Spread: the ratio of the median step times in each of {args.chunks} groups of consecutive steps "
             f"(min..max).",
             f"Equal loss: largest |meshtrain - peft| step loss over all {args.steps} steps {gap:.1e}; loss step 1 "
             f"{loss['meshtrain'][0]:.4f} / {loss['peft'][0]:.4f}, mean of the last {tail} steps "
             f"{statistics.mean(loss['meshtrain'][-tail:]):.4f} (meshtrain) / "
             f"{statistics.mean(loss['peft'][-tail:]):.4f} (peft).",
             f"The bound: {args.bound_steps} more steps, after the others, of meshtrain's model with every adapter "
             "skipped (its layers compute W x only) and the embedding trainable, so that the backward still runs "
             "through every frozen block: a LoRA step whose adapters would cost nothing; its loss is not LoRA's.",
             "Paths the adapted layers took (steps 1 and 2, recorded by forward hooks): "
             + "; ".join(f"{name}: " + ", ".join(f"{n} {path}" for path, n in seen.items())
                         for name, seen in paths.items()) + ".",
             "x peft's tokens/s: the median of peft's step times on the same batches (the steps beside this path's) "
             "over this path's; the issue's goal is >= 1.2x at equal loss."]
    data = {"args": vars(args), "cpu": cpu_line(), "wall_s": wall, "cpu_s": cpu, "loss": loss, "max_loss_gap": gap,
            "paths": paths, "fast_over_plain": gains}
    title = "meshtrain LoRA against peft + transformers, steps interleaved in one process"
    path = write_results(args.name, title + ("" if args.dtype == "float32" else ", bf16 autocast"),
                         columns, rows, notes, data)
    print(path.read_text())


if __name__ == "__main__":
    main()
