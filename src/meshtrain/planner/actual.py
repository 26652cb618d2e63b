"""Plan vs actual: the planner's prediction for the layout a ``meshtrain train`` run uses, and the
comparison with what the run measured (``OUT/plan_vs_actual.json``).

The trainer does not import the planner (docs/architecture.md, "Layers"): rank 0 writes ``OUT/summary.json``
(median seconds per optimizer step, peak memory of the busiest rank: peak RSS on CPU, the CUDA
allocator's peak on GPU, world size, vocabulary, device). The launcher (``meshtrain train``,
:func:`meshtrain.cli.train.run`) then calls :func:`report_run`, which predicts the same layout with
:func:`predict_for_run` (the config's layout, :meth:`meshtrain.planner.layout.Layout.from_config`: dp, tp,
sp with its ``sp_mode``, ``tp_sequence_parallel``, ZeRO stage, batch split), writes the comparison with :func:`write_plan_vs_actual` and prints one line. On CPU the
prediction uses the profile of ``meshtrain plan --calibrate`` (default
``~/.cache/meshtrain/hardware_profile.toml``), whose measured runtime overhead (Python, torch, the
trainer's imports, gloo) is part of the RSS a rank reaches.
"""

from __future__ import annotations

import math
import sys
import tomllib
from pathlib import Path
from typing import Any

from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.fileio import write_json_atomic
from meshtrain.planner.cost import step_time
from meshtrain.planner.hardware import DEFAULT_PROFILE, Hardware, get_hardware
from meshtrain.planner.layout import Layout, meshtrain_framework
from meshtrain.planner.memory import PRECISIONS, memory_breakdown, memory_range
from meshtrain.planner.model_specs import from_config
from meshtrain.planner.stack import nulls, speed_for

CORPUS_BYTES_PER_CHAR = 18.0
"""RSS the trainer's corpus loading adds per character when no profile measured it: the text (1 byte),
the list of ids (8-byte pointers) and the int64 tensor (8 bytes)."""
GPU_NAMES = (("H200", "H200-SXM-141GB"), ("H100 PCIe", "H100-PCIe-80GB"), ("H100", "H100-SXM-80GB"),
             ("B200", "B200-SXM-180GB"), ("MI300X", "MI300X-192GB"), ("A100-SXM4-40GB", "A100-SXM-40GB"),
             ("A100", "A100-SXM-80GB"))


def _torch_threads() -> int:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 1


def _cuda_name() -> str:
    torch = sys.modules.get("torch")
    return torch.cuda.get_device_name() if torch is not None and torch.cuda.is_available() else ""


def hardware_for_run(device: str, profile: Path, threads: int) -> tuple[Hardware, str]:
    """(hardware, description) for the trainer's device: the calibrated ``cpu`` (one thread per rank)
    or ``cpu-<n>threads`` profile, else the uncalibrated reference profile's (``cpu`` for thread counts it lacks);
    on CUDA the catalog entry of the GPU."""
    if device == "cuda":
        name = _cuda_name()
        entry = next((c for key, c in GPU_NAMES if key.lower() in name.lower()), None)
        if entry is None:
            raise ConfigError(f"GPU '{name}' is not in the planner's catalog: add it with --hardware")
        return get_hardware(entry), f"catalog {entry}"
    calibrated = profile.expanduser().is_file()
    name = f"cpu-{threads}threads" if threads > 1 else "cpu"
    try:
        hw = get_hardware(name, profile=profile)
    except ConfigError:
        hw, name = get_hardware("cpu", profile=profile), "cpu"
    return hw, (f"{profile} [{name}]" if calibrated
                else "uncalibrated: the reference machine's cpu profile (run meshtrain plan --calibrate)")


def corpus_rss_bytes(cfg: Config, profile: Path) -> float:
    """Bytes of RSS a CPU rank adds by loading ``cfg``'s corpus: its size times the profile's measured
    ``corpus_bytes_per_char`` (or :data:`CORPUS_BYTES_PER_CHAR` without one)."""
    from meshtrain.fileio import read_text_checked
    from meshtrain.planner.hardware import PROFILE, PROFILE_FIX

    per_char = CORPUS_BYTES_PER_CHAR
    text = read_text_checked(profile.expanduser(), PROFILE, PROFILE_FIX, missing_ok=True)
    if text is not None:
        try:
            per_char = float(tomllib.loads(text).get("trainer", {}).get("corpus_bytes_per_char", per_char))
        except (tomllib.TOMLDecodeError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{PROFILE} '{profile}': no corpus_bytes_per_char in [trainer] ({e}): "
                              f"{PROFILE_FIX}") from None
    return per_char * cfg.data.resolved_path().stat().st_size


def predict_for_run(cfg: Config, world_size: int, vocab_size: int, device: str,
                    profile: Path = DEFAULT_PROFILE, threads: int | None = None) -> dict[str, Any]:
    """Predicted ``step_time_s`` (seconds per optimizer step), ``peak_memory_bytes`` (per rank), the ``device``
    ("cpu" or "cuda": ``plan --calibrate-from`` calibrates plans of that kind only) and the ``profile`` used, for the
    trainer's GPT and layout of ``cfg`` on ``world_size`` ranks.

    ``threads`` defaults to torch's thread count in this process (torchrun gives each rank 1 thread
    when it starts more than one). On CPU the peak adds the corpus the rank holds; with an unknown
    GPU both predictions are NaN (the run's end must not fail on the planner).
    """
    threads = threads or _torch_threads()
    try:
        hw, description = hardware_for_run(device, profile, threads)
    except ConfigError as e:
        return {"step_time_s": math.nan, "peak_memory_bytes": math.nan, "profile": str(e)}
    model = from_config(cfg, vocab_size)
    layout = Layout.from_config(cfg, world_size)
    from meshtrain.runtime.device import compute_dtype

    precision = PRECISIONS["bf16-autocast" if compute_dtype(cfg.train.dtype, device) == "bfloat16" else "fp32"]
    framework = meshtrain_framework(cfg, "cpu" if device == "cpu" else "cuda")
    memory = memory_breakdown(model, layout, hw, precision, framework)
    time = step_time(model, layout, hw, precision, framework)
    peak = memory.total + (corpus_rss_bytes(cfg, profile) if device == "cpu" else 0.0)
    speed = speed_for(framework.name, hw.device.name, peak_source=hw.device.peak_source)
    ranges = {"step_time_s": nulls(speed.step_time_range(time.total)), "peak_memory_bytes": list(memory_range(peak, hw.device))}
    return {"step_time_s": time.total, "peak_memory_bytes": int(peak), "device": device, "profile": description,
            "ranges": ranges, "range_basis": speed.basis,
            "threads_per_rank": threads, "layout": layout.label(),
            "memory_breakdown_bytes": {k: int(v) for k, v in memory.to_dict().items()},
            "time_breakdown_s": time.to_dict()}


def write_plan_vs_actual(predicted: dict[str, Any], measured: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Write ``out_dir/plan_vs_actual.json`` atomically (:func:`meshtrain.fileio.write_json_atomic`) and return it.

    ``relative_error[k] = (predicted[k] - measured[k]) / measured[k]`` for every numeric key both have
    (a signed fraction: +0.1 means the plan predicted 10% more than measured), and ``inside_range[k]``: whether the
    measurement lies in the prediction's range (``predicted["ranges"][k]``, :mod:`meshtrain.planner.stack`; null
    where the prediction has none, as on an uncalibrated CPU).
    """
    errors = {}
    for key, value in measured.items():
        p = predicted.get(key)
        if isinstance(p, (int, float)) and isinstance(value, (int, float)) and value and not math.isnan(p):
            errors[key] = (p - value) / value
    ranges = predicted.get("ranges", {})
    inside = {k: (None if None in ranges.get(k, [None]) else ranges[k][0] <= v <= ranges[k][1])
              for k, v in measured.items() if isinstance(v, (int, float))}
    result = {"predicted": predicted, "measured": measured, "relative_error": errors, "inside_range": inside}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "plan_vs_actual.json", result)
    return result


def _inside(result: dict[str, Any]) -> str:
    """``"; step time inside its predicted range"`` (or outside), nothing without a range."""
    inside = result.get("inside_range", {}).get("step_time_s")
    return "" if inside is None else f"; step time {'inside' if inside else 'outside'} its predicted range"


def report_run(cfg: Config, summary: dict[str, Any], threads: int,
               profile: Path = DEFAULT_PROFILE) -> dict[str, Any] | None:
    """Compare a finished run's ``summary`` (``OUT/summary.json``) with the prediction for ``cfg``; write
    ``OUT/plan_vs_actual.json`` and print one line to stderr. ``threads``: torch threads of each rank.
    Returns the comparison, or None when the run measured no step time (nothing to compare)."""
    if summary.get("step_time_s") is None:
        return None
    predicted = predict_for_run(cfg, int(summary["world_size"]), int(summary["vocab_size"]),
                                str(summary.get("device", "cpu")), profile, threads)
    measured = {"step_time_s": summary["step_time_s"], "peak_memory_bytes": summary["peak_memory_bytes"]}
    result = write_plan_vs_actual(predicted, measured, Path(cfg.train.out_dir))
    err = result["relative_error"]
    print(f"plan vs actual: step time predicted {predicted['step_time_s']:.4f} s, measured "
          f"{measured['step_time_s']:.4f} s ({err.get('step_time_s', math.nan):+.1%}); peak memory/rank "
          f"predicted {predicted['peak_memory_bytes'] / 2**20:.0f} MiB, measured "
          f"{measured['peak_memory_bytes'] / 2**20:.0f} MiB ({err.get('peak_memory_bytes', math.nan):+.1%}); "
          f"hardware: {predicted['profile']}{_inside(result)}; to plan other layouts from this run: meshtrain plan "
          f"CONFIG --calibrate-from {cfg.train.out_dir}", file=sys.stderr)
    return result
