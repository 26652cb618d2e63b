"""``meshtrain plan --plot PNG``: stacked bars of the memory and step-time breakdowns of the top layouts."""

from __future__ import annotations

import os
from pathlib import Path

from meshtrain.planner.estimate import Estimate
from meshtrain.planner.hardware import GiB


def plot_breakdowns(estimates: list[Estimate], path: Path, capacity_bytes: float | None = None) -> Path:
    """Write a PNG with two panels (GiB per device by part; seconds per step by part) for ``estimates``;
    a dashed line marks the device memory ``capacity_bytes`` when given.

    Raises:
        ValueError: no estimates to plot.
    """
    if not estimates:
        raise ValueError("no layouts to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"#{i}\n{_tick_label(e)}" for i, e in enumerate(estimates, 1)]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(estimates) * 2), 6))
    for ax, parts, unit in ((ax_mem, [e.memory.to_dict() for e in estimates], GiB),
                            (ax_time, [e.time.to_dict() for e in estimates], 1.0)):
        bottom = [0.0] * len(estimates)
        for key in (k for k in parts[0] if k != "total"):
            values = [p[key] / unit for p in parts]
            if any(values):
                ax.bar(range(len(estimates)), values, bottom=bottom, label=key)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(estimates)), labels, fontsize=7)
        ax.legend(fontsize=8)
    if capacity_bytes:
        ax_mem.axhline(capacity_bytes / GiB, color="black", linestyle="--", linewidth=1, label="device memory")
        ax_mem.legend(fontsize=8)
    ax_mem.set_ylabel("GiB per device (busiest stage)")
    ax_mem.set_title("memory")
    ax_time.set_ylabel("seconds per optimizer step")
    ax_time.set_title("step time")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)  # a reader never sees a half-written picture
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _tick_label(estimate: Estimate) -> str:
    """A layout on short lines: degrees and zero stage; batch split; recompute; pipeline schedule."""
    words = estimate.layout.label().split()
    return "\n".join([" ".join(words[:5]), " ".join(words[5:7]), *words[7:]])
