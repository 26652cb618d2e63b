"""One run of the main job calibrates the planner for the other layouts of a CPU: how far off the planner is, before
and after ``--calibrate-from`` the main job's run, when it starts from its uncalibrated CPU (no profile of the machine).

    python bench/cpu_one_run.py          # seconds; reads measured results, runs nothing

Measured step times come from ``bench/plan_vs_actual.py``'s results: this machine's
(``bench/results/plan_vs_actual.json``) and an AVX2-only host's of 2026-11-23 00:26
(``bench/results/plan_vs_actual_avx2_2026-11-23.json``, 25 layouts, kept from git 7eabfcb), which the reference
profile never saw. Each row's layout is predicted from the hardware the planner starts from without a profile:

- ``reference``: today's, ``src/meshtrain/planner/data/cpu_reference.toml`` (one machine's measured profile);
- ``former guesses``: what it was before (:data:`FORMER_GUESSES`: 50 GFLOP/s fp32 per rank, 50 us gloo latency, no
  per-operator host time for tp or sp).

Calibrated: the speed factor ``s`` is fitted to the main job's row (``dp2 z0 mbs12``, ``make demo``'s layout) as
``meshtrain plan --calibrate-from`` fits it (:func:`meshtrain.planner.stack.breakdown_speed`: compute, bubble and
optimizer time divided by ``s``, communication kept), and every other row is predicted at that ``s``. Writes
``bench/results/cpu_one_run.{md,json}``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS_DIR, write_results  # noqa: E402
from plan_vs_actual import RUN_ARGS  # noqa: E402

RESULTS = {"this machine": RESULTS_DIR / "plan_vs_actual.json",
           "AVX2 host (2026-11-23)": RESULTS_DIR / "plan_vs_actual_avx2_2026-11-23.json"}
MAIN_JOB = "dp2 z0 mbs12"


def former_guesses():
    """The uncalibrated CPU the planner had before the reference profile (hardware.py until 2026-11-27)."""
    from meshtrain.planner.hardware import GiB, Device, Hardware, Network

    return Hardware(
        Device("cpu", {"float32": 50e9, "bfloat16": 25e9}, memory_bytes=16 * GiB, memory_bandwidth=10e9,
               matmul_efficiency=1.0, memory_efficiency=1.0, framework_overhead_bytes=350 * 2**20, layer_host_s=1e-3,
               microstep_host_s=2e-3, tensor_update_host_s=50e-6, sharded_tensor_update_host_s=1e-3, comm_overlap=False,
               peak_source="assumed"),
        Network(devices_per_node=2, intra_node_bandwidth=2e9, inter_node_bandwidth=1e9, intra_node_latency_s=50e-6,
                inter_node_latency_s=100e-6, intra_node_efficiency=1.0, inter_node_efficiency=1.0))


def hardware(source: str, threads: int):
    """The hardware an uncalibrated run with ``threads`` threads per rank is predicted on."""
    from meshtrain.planner.hardware import cpu_reference

    if source == "former guesses":
        return former_guesses()
    devices = cpu_reference()
    return devices.get(f"cpu-{threads}threads" if threads > 1 else "cpu", devices["cpu"])


def predict(record: dict[str, Any], hw) -> Any:
    """The planner's step time (:class:`meshtrain.planner.cost.StepTime`) of a results row's layout on ``hw``, built
    as ``bench/plan_vs_actual.py`` ran it (its fixed arguments, then the row's overrides)."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.cost import step_time
    from meshtrain.planner.layout import Layout, meshtrain_framework
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import from_config

    args = {**RUN_ARGS, **record["overrides"]}
    cfg = load_config(REPO / record.get("config", "configs/shakespeare_char.toml"),
                      {k: str(v) for k, v in args.items()})
    vocab = cfg.model.vocab_size or 65  # Tiny Shakespeare's characters
    precision = PRECISIONS["bf16-autocast" if cfg.train.dtype == "bfloat16" else "fp32"]
    return step_time(from_config(cfg, vocab), Layout.from_config(cfg, record["nproc"]), hw, precision,
                     meshtrain_framework(cfg, "cpu"))


def evaluate(path: Path, source: str) -> dict[str, Any]:
    """Uncalibrated and calibrated-on-the-main-job errors of every row of ``path`` from ``source``."""
    from meshtrain.planner.stack import breakdown_speed, scaled

    rows = []
    for record in json.loads(path.read_text())["layouts"]:
        threads = record["runs"][0]["predicted"].get("threads_per_rank", 2 if record["nproc"] == 1 else 1)
        measured = statistics.median(r["measured"]["step_time_s"] for r in record["runs"])
        rows.append((record, threads, measured, predict(record, hardware(source, threads))))
    main = next(r for r in rows if r[0]["name"] == MAIN_JOB)
    factor = breakdown_speed(main[3].to_dict(), main[2])
    errors = {}
    for record, threads, measured, time in rows:
        calibrated = predict(record, scaled(hardware(source, threads), factor)).total
        errors[record["name"]] = {"measured_s": measured, "uncalibrated": time.total / measured - 1,
                                  "calibrated": calibrated / measured - 1}
    others = [e for name, e in errors.items() if name != MAIN_JOB]
    return {"factor": factor, "rows": errors,
            **{f"{kind}_{stat}": f([abs(e[kind]) for e in (others if kind == "calibrated" else errors.values())])
               for kind in ("uncalibrated", "calibrated") for stat, f in (("median", statistics.median),
                                                                         ("max", max))}}


def main() -> None:
    results, rows = {}, []
    for host, path in RESULTS.items():
        for source in ("former guesses", "reference"):
            r = evaluate(path, source)
            results[f"{host} / {source}"] = r
            rows.append([host, source, len(r["rows"]), f"{r['uncalibrated_median']:.0%}", f"{r['uncalibrated_max']:.0%}",
                         f"{r['factor']:.2f}", f"{r['calibrated_median']:.0%}", f"{r['calibrated_max']:.0%}"])
    worst = {key: max(((n, e["calibrated"]) for n, e in r["rows"].items() if n != MAIN_JOB), key=lambda x: abs(x[1]))
             for key, r in results.items()}
    notes = [f"measured: {', '.join(f'{h}: {p.relative_to(REPO)}' for h, p in RESULTS.items())}; calibrated on the "
             f"main job's row ({MAIN_JOB}) by the factor --calibrate-from fits, errors of the other rows",
             "worst calibrated row: " + "; ".join(f"{k}: {n} {e:+.0%}" for k, (n, e) in worst.items())]
    write_results("cpu_one_run", "One run of the main job calibrates the planner on a CPU",
                  ["measured on", "planner starts from", "rows", "uncalibrated: median |error|", "max",
                   "factor from the main job", "calibrated: median |error|", "max"], rows, notes, {"results": results})
    print("\n".join(" | ".join(map(str, r)) for r in rows))


if __name__ == "__main__":
    main()
