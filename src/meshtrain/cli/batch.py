"""``meshtrain batch``: the batch arithmetic of a layout (:mod:`meshtrain.batch_math`) as a table or JSON."""

from __future__ import annotations

import argparse
import json

from meshtrain.argtypes import positive_float
from meshtrain.axes import REPLICA_AXES, SPECS, degree, product_text, replica_size
from meshtrain.config.sections import LR_SCALINGS


def add_parser(sub: argparse._SubParsersAction, line: str) -> None:
    p = sub.add_parser("batch", help=line,
                       description="Global batch = micro_batch_size * grad_accum * world_size / (pp*sp*tp). "
                                   "Only the dp factor multiplies the batch.")
    p.add_argument("--world-size", type=int, required=True, help="ranks = nnodes * nproc_per_node")
    p.add_argument("--micro-batch-size", type=int, required=True,
                   help="samples per dp replica per micro-step (Open-Sora-Plan's train_sp_batch_size when sp > 1)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (default 1)")
    for axis in REPLICA_AXES:
        p.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} degree (default 1): {SPECS[axis].doc}")
    p.add_argument("--seq-len", type=int, help="tokens per sample, for tokens_per_step")
    p.add_argument("--num-samples", type=int, help="samples in one epoch of the dataset")
    p.add_argument("--epochs", type=positive_float, help="epochs to train (needs --num-samples; default 1)")
    p.add_argument("--steps", type=int, help="optimizer steps to train, instead of --epochs")
    p.add_argument("--time-per-step", type=positive_float, help="seconds per optimizer step, for total_time_s")
    p.add_argument("--lr", type=positive_float, help="peak learning rate tuned at --reference-batch-size, to show it scaled")
    p.add_argument("--lr-scaling", default="none", choices=LR_SCALINGS,
                   help="how the learning rate follows the global batch (optim.lr_scaling; default none)")
    p.add_argument("--reference-batch-size", type=int,
                   help="global batch --lr was tuned at (optim.reference_batch_size)")
    p.add_argument("--loader-batch-size", type=int,
                   help="Open-Sora-Plan's per-rank train_batch_size (b): also show what its log would print")
    p.add_argument("--diloco-group", type=int, default=0,
                   help="ranks per DiLoCo worker (diloco.group): also show the workers and outer steps")
    p.add_argument("--diloco-inner-steps", type=int, default=8, help="DiLoCo's H (diloco.inner_steps; 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshtrain.batch_math import open_sora_log, plan_batch

    plan = plan_batch(args.world_size, args.micro_batch_size, args.grad_accum, **{str(a): getattr(args, a) for a in REPLICA_AXES},
                      seq_len=args.seq_len, num_samples=args.num_samples, epochs=args.epochs,
                      total_steps=args.steps, time_per_step_s=args.time_per_step, lr=args.lr,
                      lr_scaling=args.lr_scaling, reference_batch_size=args.reference_batch_size,
                      diloco_group=args.diloco_group, diloco_inner_steps=args.diloco_inner_steps)
    osl = None
    if args.loader_batch_size is not None:
        osl = open_sora_log(args.world_size, args.sp, args.micro_batch_size, args.grad_accum,
                            args.loader_batch_size, args.num_samples)
    if args.json:
        out = plan.to_dict()
        if osl is not None:
            out["open_sora_log"] = osl.to_dict()
        print(json.dumps(out))
        return 0
    _print_batch_table(plan, osl)
    return 0


def _print_batch_table(plan, osl) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="meshtrain batch", show_header=True)
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("how")
    rows = [
        ("world_size", plan.world_size, "ranks = nnodes * nproc_per_node"),
        (" * ".join(REPLICA_AXES), replica_size(plan),
         f"{' * '.join(str(degree(plan, a)) for a in REPLICA_AXES)}: ranks sharing each sample"),
        ("dp", plan.dp, f"world_size / ({product_text(REPLICA_AXES)}): the only factor that multiplies the batch"),
        ("micro_batch_size", plan.micro_batch_size, "per dp replica, per micro-step"),
        ("gradient_accumulation_steps", plan.gradient_accumulation_steps, "micro-steps per optimizer step"),
        ("global_batch_size", plan.global_batch_size, "micro_batch_size * GA * dp  [samples/step]"),
        ("tokens_per_step", plan.tokens_per_step, "global_batch_size * seq_len"),
        ("num_samples", plan.num_samples, "one epoch"),
        ("steps_per_epoch", plan.steps_per_epoch, "ceil(num_samples / global_batch_size)  [optimizer steps]"),
        ("micro_steps_per_epoch", plan.micro_steps_per_epoch, "steps_per_epoch * GA, per dp replica"),
        ("epochs", plan.epochs, ""),
        ("total_steps", plan.total_steps, "optimizer steps"),
        ("time_per_step_s", plan.time_per_step_s, "seconds"),
        ("total_time_s", plan.total_time_s, "total_steps * time_per_step_s"),
        ("lr", plan.lr, _lr_how(plan)),
        ("diloco_workers", plan.diloco_workers, "world_size / diloco_group: DiLoCo's workers"),
        ("worker_batch_size", plan.worker_batch_size, "global_batch_size / diloco_workers  [samples/inner step]"),
        ("diloco_inner_steps", plan.diloco_inner_steps, "H: inner steps between two exchanges"),
        ("outer_steps", plan.outer_steps, "ceil(total_steps / H): exchanges between workers"),
    ]
    for name, value, how in rows:
        if value is not None:
            t.add_row(name, f"{value:,.4g}" if isinstance(value, float) else f"{value:,}", how)
    console = Console()
    console.print(t)
    if osl is not None:
        console.print(osl.explain())


def _lr_how(plan) -> str:
    if plan.lr_scaling == "none":
        return "peak learning rate (no scaling)"
    power = "" if plan.lr_scaling == "linear" else " ** 0.5"
    return (f"{plan.base_lr:g} * ({plan.global_batch_size} / {plan.reference_batch_size}){power}: "
            f"{plan.lr_scaling} scaling from reference_batch_size {plan.reference_batch_size}")
