"""``meshtrain.train`` on every rank with a probe: ``torchrun ... tests/sync_worker.py PROBE CONFIG [overrides]``.

Probes (each wraps one method of the trainer; torch.distributed itself is untouched):

- ``local-sgd``: after every optimizer step each rank records whether the replicas were just averaged
  and a digest of its parameters (their float64 sum), written to ``OUT/local_sgd_rank{R}.json``.
- ``slow-worker``: the first async worker sleeps 50 ms before each gradient, so the others run ahead.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def probe_local_sgd() -> None:
    from meshtrain.parallel.local_sgd import LocalSGD

    after_step = LocalSGD.after_step
    records: list[dict] = []

    def recorded(self, params):
        params = list(params)
        averaged = after_step(self, params)
        digest = float(sum(p.detach().double().sum() for p in params))
        records.append({"averaged": averaged, "digest": digest})
        out = Path(sys.argv[sys.argv.index("--train.out_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"local_sgd_rank{dist.get_rank()}.json").write_text(json.dumps(records))
        return averaged

    LocalSGD.after_step = recorded


def probe_slow_worker() -> None:
    from meshtrain.train.async_run import AsyncRun

    compute = AsyncRun._compute

    def slow(self):
        if self.rank == len(self.servers):
            time.sleep(0.05)
        return compute(self)

    AsyncRun._compute = slow


if __name__ == "__main__":
    probe = sys.argv.pop(1)
    {"local-sgd": probe_local_sgd, "slow-worker": probe_slow_worker}[probe]()
    from meshtrain.train.entry import main

    torch.set_num_threads(1)
    sys.exit(main())
