"""Naive model parallelism as a ``torch.distributed.pipelining`` schedule.

The seeds' plain model parallelism: layers split across devices, and one micro-batch at a time goes
forward through every stage and back before the next one enters, so at any moment one stage works
and the others wait -- each rank idles ``(p-1)/p`` of the step. It is GPipe with its micro-batches
run one after another instead of overlapped, written on the same stage API as torch's schedules so
that it composes with dp/tp/sp, tracing and checkpoints exactly like them.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _Action, _ComputationType


class ScheduleNaive(PipelineScheduleSingle):
    """Forward then backward of micro-batch 0 through all stages, then of micro-batch 1, ...

    Gradients are accumulated over the micro-batches and reduced across data-parallel replicas after
    the last backward (as the other schedules do), then divided by the number of micro-batches.
    """

    def _step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                           target_mbs: list | None = None, losses: list | None = None,
                           return_outputs: bool = True, loss_kwargs: dict[str, Any] | None = None) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs else None, loss_kwargs)
        stage, n = self._stage, self._n_microbatches
        for i in range(n):
            _run_p2p(stage.get_fwd_recv_ops(i), "fwd_recv")
            output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
            _run_p2p(stage.get_fwd_send_ops(i), "fwd_send")
            self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
            if self._has_backward:
                _run_p2p(stage.get_bwd_recv_ops(i), "bwd_recv")
                stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == n - 1)
                _run_p2p(stage.get_bwd_send_ops(i), "bwd_send")
        self._update_losses(stage, losses)
        if self._has_backward:
            stage.perform_reduce_grad(n if self.scale_grads else 1)

    def _get_pipeline_order(self) -> dict[int, list[_Action | None]]:
        """Rank r: wait r slots, forward, wait while later stages work, backward; per micro-batch."""
        p, order = self._num_stages, {}
        for rank in range(p):
            actions: list[_Action | None] = []
            for i in range(self._n_microbatches):
                actions += [None] * rank + [_Action(rank, _ComputationType.FORWARD, i)]
                actions += [None] * (2 * (p - 1 - rank)) + [_Action(rank, _ComputationType.FULL_BACKWARD, i)]
                actions += [None] * rank
            order[rank] = actions
        return order


def _run_p2p(ops: list, desc: str) -> None:
    """Issue ``ops`` (sends or receives with the neighbouring stage) and wait for them (looked up on
    torch's module at call time, so that :class:`meshtrain.parallel.pipeline.trace.PipelineTracer` sees them)."""
    for work in torch_schedules._sorted_batch_p2p(ops, desc=desc).values():
        torch_schedules._wait_batch_p2p(work)
