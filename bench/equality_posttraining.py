"""Post-training's equality with one process, measured: for every layout of ``tests/test_sft_layouts.py`` (supervised
fine-tuning on conversations, the loss over the global batch's assistant tokens) and ``tests/test_dpo.py`` (DPO on
preference pairs), the worst relative loss error over the steps and the worst step-1 gradient error over the gradient
norm, against one process on the whole batch; and the per-micro-batch-mean sabotage the SFT test must catch.

The tests assert these (the contract's 1e-5; DPO's loss against its derived tolerance, ``test_dpo.dpo_loss_tolerance``);
this table shows how far inside the bounds each layout is. About two minutes on a 2-core CPU.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import REPO, write_results
from equality import errors

sys.path.insert(0, str(REPO / "tests"))
import test_dpo as dpo  # noqa: E402
import test_sft_layouts as sft  # noqa: E402
from layout_worker import launch_layouts, reference_run  # noqa: E402


def measure(module, data_format: str, root: Path, sabotage: str | None = None) -> dict[str, tuple]:
    """{layout: (reference name, loss error, gradient error)} of one test module's layouts (and the sabotage)."""
    root.mkdir(parents=True)
    data = sft.prepared_plays(root, data_format)
    refs = {name: reference_run(root / f"ref-{name}", module._model(name, data)) for name in module.REFERENCES}
    layouts = {name: {**module._model(ref, data), **overrides} for name, (ref, overrides) in module.LAYOUTS.items()}
    if sabotage:
        layouts[f"sabotage-{sabotage}"] = {**layouts["dp2"], "sabotage": sabotage}
    got = launch_layouts(2, root, layouts)
    reference_of = {name: ref for name, (ref, _) in module.LAYOUTS.items()}
    return {name: (reference_of.get(name, "packed"), *errors(got[name], refs[reference_of.get(name, "packed")]))
            for name in layouts}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {"SFT": measure(sft, "chat", Path(tmp) / "sft", sabotage="per-micro-batch-mean"),
                   "DPO": measure(dpo, "preference", Path(tmp) / "dpo")}
    rows = [[objective, name, ref, f"{loss:.1e}", f"{grad:.1e}"]
            for objective, layouts in results.items() for name, (ref, loss, grad) in layouts.items()]
    write_results("equality_posttraining", "Supervised fine-tuning and DPO: every layout against one process (fp32, "
                  "gloo, CPU)", ["objective", "layout (2 ranks)", "reference", "worst relative loss error",
                                 "worst step-1 gradient error / gradient norm"], rows,
                  [f"Model: Llama, 2 layers, 32 wide, block 128, vocab 1,280; {sft.STEPS} steps; SFT: 8 windows of "
                   f"whole conversations a step; DPO: 4 pairs a step, beta 0.5. Data: the plays' first 2,000 lines "
                   f"(scripts/shakespeare_chat.py), a 1,024-id BPE with ChatML added.",
                   "The sabotage averages the loss per micro-batch (transformers' gradient accumulation bug): the "
                   "SFT test must fail it, and does (tests/test_sft_layouts.py).",
                   "DPO's loss is a function of differences of sequence log-probabilities of hundreds of nats: its "
                   "rounding is bounded by test_dpo.dpo_loss_tolerance, not the contract's 1e-5 relative."],
                  {"layouts": {o: {n: {"reference": r, "max_rel_loss_error": le, "max_grad_error_over_norm": ge}
                                   for n, (r, le, ge) in layouts.items()} for o, layouts in results.items()}})


if __name__ == "__main__":
    main()
