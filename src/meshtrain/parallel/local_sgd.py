"""Local SGD (``parallel.sync_mode = "local-sgd"``): each dp replica steps on its own gradients, and the
replicas average their parameters every ``local_sgd_steps`` (H) optimizer steps.

Lin et al. 2020 ("Don't Use Large Mini-Batches, Use Local SGD", ICLR, arXiv:1808.07217, Alg. 1 and
Sec. 3, post-local SGD): the first ``local_sgd_warmup`` steps are ordinary synchronous data parallelism
(gradients all-reduced), then every replica runs H local steps between two averages of the weights.
One average moves as many bytes as one gradient all-reduce, so communication falls by H; the price is
that replicas drift apart between averages (Stich 2019, "Local SGD Converges Fast and Communicates
Little", arXiv:1805.09767, Thm. 2.2, bounds the cost for H up to ~sqrt(T / (batch * replicas))).

Both halves are PyTorch's own: the DDP communication hook ``post_localSGD_hook`` all-reduces gradients
during the warm-up and nothing afterwards (``post_local_gradient_allreduce=False``), and
``PeriodicModelAverager`` all-reduces the parameters over the dp group every H steps after it.
Optimizer states (AdamW's moments) stay local to each replica, as in Lin et al.'s experiments.
Gradient clipping uses each replica's own gradient norm.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel as DDP


class LocalSGD:
    """Turns a DDP model into a local-SGD one; call :meth:`after_step` after every ``optimizer.step()``.

    Args:
        model: the ``DistributedDataParallel`` module over ``dp_group``.
        dp_group: the replicas that average (the dp axis).
        period: H, optimizer steps between two averages (>= 1).
        warmup: synchronous steps before local SGD starts (>= 0).
    """

    def __init__(self, model: DDP, dp_group: dist.ProcessGroup, period: int, warmup: int) -> None:
        state = PostLocalSGDState(process_group=dp_group, subgroup=None, start_localSGD_iter=warmup,
                                  post_local_gradient_allreduce=False)
        model.register_comm_hook(state, post_localSGD_hook)
        self.averager = PeriodicModelAverager(period=period, warmup_steps=warmup, process_group=dp_group)
        self.dp_group = dp_group

    def after_step(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Count one optimizer step; average ``params`` over dp when H local steps are done. Returns
        whether the replicas now hold the same parameters (an average just ran, or still in warm-up)."""
        step = self.averager.step  # steps counted before this one
        self.averager.average_parameters(params)
        return step < self.averager.warmup_steps or (step - self.averager.warmup_steps) % self.averager.period == 0

    @torch.no_grad()
    def average_now(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average ``params`` over dp outside the period (before a checkpoint, so that it holds the
        replicas' mean model rather than replica 0's)."""
        for p in params:
            p.div_(dist.get_world_size(self.dp_group))
            dist.all_reduce(p, group=self.dp_group)
