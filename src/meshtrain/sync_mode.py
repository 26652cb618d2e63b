"""The hooks a sync mode hangs around the training loop's steps (:class:`SyncMode`). Torch-free, and importing nothing
of meshtrain: :mod:`meshtrain.parallel.model` and the sync modes of ``parallel/`` (DiLoCo) both build on it."""

from __future__ import annotations

from typing import Any


class SyncMode:
    """What a sync mode does around the training loop's steps: the hooks the loop calls, whatever the mode, each a
    no-op here.

    ``parallel.sync_mode`` picks how the replicas combine their work. "sync" (gradients all-reduced every step) and
    "local-sgd" (parameters averaged every ``local_sgd.steps``, inside the optimizer step,
    :mod:`meshtrain.parallel.local_sgd`) need nothing around the step: they are this class. DiLoCo
    (:class:`meshtrain.parallel.diloco.DiLoCo`) and its elastic workers
    (:class:`meshtrain.parallel.diloco.elastic.ElasticDiLoCo`) subclass it. The parameter server ("async") runs a
    loop of its own (:mod:`meshtrain.train.async_run`). :func:`meshtrain.parallel.compose.parallelize` builds the
    run's, so the loop (:class:`meshtrain.train.loop.Trainer`) has no branch on the mode, and a new mode is its
    module, its config section (:data:`meshtrain.axes.SYNC_MODE_SECTIONS`) and the line of ``parallelize`` that
    builds it. It lives outside ``parallel/``, so that a strategy (DiLoCo) can subclass it without importing another
parallel module (docs/architecture.md, "Layers")."""

    phase: str = ""
    """What :meth:`after_step` does, for the loop's phase record (``meshtrain.runtime.faults.enter_phase``); "" when
    it does nothing collective."""

    def data_share(self, dims: Any, rank: int) -> tuple[int, int]:
        """``(shares, share)``: into how many shares beyond this job's dp ranks the data is split, and which of them
        ``rank``'s worker reads (:meth:`meshtrain.mesh.ParallelDims.worker_of`: DiLoCo's workers inside a job)."""
        return 1, dims.worker_of(rank)

    def start(self, step: int, optimizer: Any, sampler: Any, scheduler: Any) -> int:
        """Begin after step ``step`` (0, or the step a checkpoint resumed) with the trainer's optimizer, sampler and
        LR schedule; return the step to continue after (elastic workers may take over a living worker's)."""
        return step

    def after_step(self, step: int, diverged: bool = False) -> str | None:
        """After optimizer step ``step`` (1-based) on every rank, updated or skipped. ``diverged``: this rank has seen
        ``train.max_nonfinite_steps`` non-finite steps in a row (now or before: its vote to stop). Returns None to go
        on, else who diverged, agreed by every rank, for the run's one line: "" here, where every rank sees the same
        all-reduced loss and gradient norm and so counts the same steps (DiLoCo's workers count their own, and agree
        at an exchange)."""
        return "" if diverged else None

    def consolidate(self, step: int) -> None:
        """Before a checkpoint of ``step``: make the replicas hold the saved model."""

    def can_save(self, step: int) -> bool:
        """Whether a checkpoint of ``step`` may be written now."""
        return True

    def checkpointed(self) -> Any:
        """What the checkpoint saves beside the model and optimizer (an object with ``state_dict`` and
        ``load_state_dict``, :data:`meshtrain.checkpoint.store.EXTRA`), or None."""
        return None

    def report(self) -> dict[str, Any]:
        """Entries of the run's summary."""
        return {}

    def close(self) -> None:
        """At the end of the run (elastic workers leave the quorum)."""


SYNCHRONOUS = SyncMode()
"""The hooks of "sync" and "local-sgd" (stateless, shared)."""
