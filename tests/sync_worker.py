"""``meshtrain.train`` on every rank with a probe: ``torchrun ... tests/sync_worker.py PROBE CONFIG [overrides]``.

``torchrun ... tests/sync_worker.py SPEC.json`` (:func:`layout_worker.launch_layouts` with this worker): that spec's
layouts, the ``local-sgd`` probe on. Probes (each wraps one method of the trainer; torch.distributed itself is
untouched):

- ``local-sgd``: after every optimizer step each rank records whether the replicas were just averaged
  and a digest of its parameters (their float64 sum), written to ``OUT/local_sgd_rank{R}.json``.
- ``slow-worker``: the first async worker sleeps 50 ms before each gradient, so the others run ahead.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def _out_dir_argument() -> Path:
    return Path(sys.argv[sys.argv.index("--train.out_dir") + 1])


def probe_local_sgd(out_dir: Callable[[], Path] = _out_dir_argument) -> None:
    """Install the ``local-sgd`` probe; ``out_dir()``: the running run's folder (default: this command line's
    ``--train.out_dir``), whose records are kept apart from other runs' of the same process."""
    from meshtrain.parallel.local_sgd import LocalSGD

    after_step = LocalSGD.after_step
    records: dict[Path, list[dict]] = {}

    def recorded(self, params):
        params = list(params)
        averaged = after_step(self, params)
        digest = float(sum(p.detach().double().sum() for p in params))
        out = out_dir()
        records.setdefault(out, []).append({"averaged": averaged, "digest": digest})
        out.mkdir(parents=True, exist_ok=True)
        (out / f"local_sgd_rank{dist.get_rank()}.json").write_text(json.dumps(records[out]))
        return averaged

    LocalSGD.after_step = recorded


def local_sgd_layouts() -> None:
    """``torchrun ... tests/sync_worker.py SPEC.json``: :mod:`layout_worker`'s layouts, each with the ``local-sgd``
    probe writing into that layout's folder."""
    import layout_worker

    current: dict[str, Path] = {}
    run_layout = layout_worker.run_layout

    def tracked(overrides: dict[str, str], out: Path, config: Path = layout_worker.CONFIG) -> None:
        current["out"] = Path(out)
        run_layout(overrides, out, config)

    layout_worker.run_layout = tracked
    probe_local_sgd(lambda: current["out"])
    layout_worker.main()


def probe_slow_worker() -> None:
    from meshtrain.train.async_run import AsyncRun

    compute = AsyncRun._compute

    def slow(self):
        if self.rank == len(self.servers):
            time.sleep(0.05)
        return compute(self)

    AsyncRun._compute = slow


if __name__ == "__main__":
    if sys.argv[1].endswith(".json"):  # layout_worker's SPEC.json (layout_worker.launch_layouts(worker=this file))
        torch.set_num_threads(1)
        local_sgd_layouts()
        sys.exit(0)
    probe = sys.argv.pop(1)
    {"local-sgd": probe_local_sgd, "slow-worker": probe_slow_worker}[probe]()
    from meshtrain.train.entry import main

    torch.set_num_threads(1)
    sys.exit(main())
