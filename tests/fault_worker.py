"""``meshtrain.train`` on every rank with an injected fault: ``torchrun ... tests/fault_worker.py FAULT CONFIG [overrides]``.

Faults (``NAME:ARG:...``; each wraps one function of the trainer or of DCP's writer in this process only;
torch.distributed itself is untouched):

- ``sleep:STEP:RANK:SECONDS``: rank RANK sleeps before step STEP's forward/backward (a stuck rank).
- ``raise:STEP:RANK``: rank RANK raises RuntimeError("injected failure") before step STEP's forward/backward.
- ``kill-in-save:RANK:POINT``: rank RANK SIGKILLs itself during the run's second checkpoint save, at POINT:
  ``before`` (entering the save), ``shard`` (after DCP wrote the first tensor of its shard file),
  ``shard-late`` (after the second tensor), ``shards`` (DCP's save returned: every shard on disk),
  ``meta`` (rank 0: meta.json written into the ``.tmp`` folder, not yet renamed), ``cleanup`` (rank 0:
  committed, deleting the older checkpoint). With ``checkpoint.async_save`` the shard points are in the
  background writer's thread (the whole process dies), and one more: ``training`` (the writer stalls
  before its first tensor; the rank dies in the next step's forward/backward, its write still in flight).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fault_at_step(kind: str, step: int, rank: int, seconds: float = 0.0) -> None:
    from meshtrain.train.loop import Trainer

    forward_backward = Trainer.forward_backward
    calls = {"n": 0}

    def faulty(self, micro_batches):
        calls["n"] += 1
        if self.start_step + calls["n"] == step and dist.get_rank() == rank:
            if kind == "sleep":  # stuck in Python: it notices torchrun's SIGTERM (a rank stuck in C is SIGKILLed)
                from meshtrain.runtime.faults import STOP

                end = time.monotonic() + seconds
                while time.monotonic() < end and not STOP.signum:
                    time.sleep(0.05)
            else:
                raise RuntimeError("injected failure")
        return forward_backward(self, micro_batches)

    Trainer.forward_backward = faulty


def kill_in_save(rank: int, point: str) -> None:
    import shutil

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs

    from meshtrain.checkpoint import store as ckpt  # the module whose globals the writer and save call

    import torch.distributed.checkpoint.state_dict_saver as saver

    from meshtrain.train.loop import Trainer

    saves = {"n": 0, "items": 0}
    def armed() -> bool:
        return saves["n"] == 2 and dist.get_rank() == rank

    begin_save = ckpt.begin_save

    def counted_save(*args, **kwargs):
        saves["n"] += 1
        if point == "before" and armed():
            _die()
        return begin_save(*args, **kwargs)

    ckpt.begin_save = counted_save  # every save, blocking or in the background, begins with it

    forward_backward = Trainer.forward_backward

    def step_while_writing(self, micro_batches):
        if point == "training" and armed():  # the second save began in the previous step; its writer stalls
            _die()
        return forward_backward(self, micro_batches)

    Trainer.forward_backward = step_while_writing

    write_item = fs._write_item

    def item(*args, **kwargs):
        if point == "training" and armed():
            time.sleep(120)  # a write that outlasts the next step (the rank dies there)
        result = write_item(*args, **kwargs)
        saves["items"] += 1 if armed() else 0
        if armed() and ((point == "shard" and saves["items"] == 1) or (point == "shard-late" and saves["items"] == 2)):
            _die()
        return result

    fs._write_item = item

    dcp_save = dcp.save

    def after_shards(*args, **kwargs):
        result = dcp_save(*args, **kwargs)
        if point == "shards" and armed():
            _die()
        return result

    dcp.save = after_shards  # a blocking save calls dcp.save, the background writer state_dict_saver.save
    saver.save = after_shards

    write_json = ckpt.write_json_atomic

    def meta_written(*args, **kwargs):
        write_json(*args, **kwargs)
        if point == "meta" and armed():
            _die()

    ckpt.write_json_atomic = meta_written

    rmtree = shutil.rmtree

    def cleanup(path, *args, **kwargs):
        if point == "cleanup" and armed() and not str(path).endswith(".tmp"):
            entries = sorted(os.listdir(path))
            os.remove(os.path.join(path, entries[0]))  # half-deleted, then killed
            _die()
        return rmtree(path, *args, **kwargs)

    shutil.rmtree = cleanup


if __name__ == "__main__":
    name, *fields = sys.argv.pop(1).split(":")
    if name in ("sleep", "raise"):
        fault_at_step(name, int(fields[0]), int(fields[1]), float(fields[2]) if name == "sleep" else 0.0)
    elif name == "kill-in-save":
        kill_in_save(int(fields[0]), fields[1])
    else:
        raise SystemExit(f"unknown fault {name!r}")
    from meshtrain.train.entry import main

    torch.set_num_threads(1)
    sys.exit(main())
