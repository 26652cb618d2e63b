"""QK-clip (``optim.qk_clip``; MuonClip, Kimi K2 technical report, Sec. 2.1, Eq. 1-3): after each optimizer step,
every attention head whose largest attention logit in the step exceeded a threshold tau has its query and key
projections scaled down so that logit would have been tau.

For head h, ``S_max^h = max over the step's sequences and positions i >= j of q_i^h . k_j^h / sqrt(hs)`` (the
logits the softmax sees, RoPE applied). With ``gamma_h = tau / S_max^h < 1``:

- multi-head attention (a key head per query head): ``W_q^h <- sqrt(gamma_h) W_q^h`` and ``W_k^h <- sqrt(gamma_h)
  W_k^h`` (the report's split), so the head's logits are scaled by ``gamma_h``;
- grouped-query attention (a key head shared by several query heads): ``W_q^h <- gamma_h W_q^h`` and the shared key
  head is left alone, so each query head is clipped by its own factor;

biases scale with their weights (q = gamma W x + gamma b). The maxima are observed by a forward pre-hook on each
block's ``inner_attention`` (its q and k, in training only: evaluation is not part of the step), one head at a time
(a (B, T, T) logit matrix per head, fp32), reduced with MAX over the data-parallel ranks and over tp's head shards.
This costs one extra q k^T per head and step (the attention's score FLOPs again), only when enabled.

Families whose attention normalises q and k per head (Qwen3's q/k RMSNorm) have bounded logits and are refused, as
is sequence parallelism, whose ranks see pieces of the sequence (``config.checks``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from meshtrain.models.attention import DocumentMask
from meshtrain.optim.muon import shard_indices


def max_logits(q: Tensor, k: Tensor, mask: Tensor | DocumentMask | None = None) -> Tensor:
    """Per query head, the largest causal attention logit: ``q`` (B, nh, T, hs), ``k`` (B, nkv, T, hs) with nkv
    dividing nh (each kv head serving nh / nkv consecutive query heads) -> (nh,) fp32. ``mask``: None (causal), the
    (B, 1, T, T) bool document mask, True where query i may attend to key j, or its :class:`DocumentMask`."""
    B, nh, T, hs = q.shape
    group = nh // k.size(1)
    if isinstance(mask, DocumentMask):
        mask = mask.dense
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() if mask is None else mask[:, 0]
    out = torch.empty(nh, dtype=torch.float32, device=q.device)
    for h in range(nh):  # one (B, T, T) matrix at a time
        logits = q[:, h].float() @ k[:, h // group].float().mT / math.sqrt(hs)
        out[h] = logits.masked_fill(~allowed, -math.inf).amax()
    return out


def _scale_rows(p: Tensor, factor: Tensor, rows_per_head: int) -> None:
    """Multiply the rows of head ``r // rows_per_head`` of parameter ``p`` (its local shard, whatever the
    placements) by ``factor[head]``."""
    local = p.to_local() if isinstance(p, DTensor) else p
    rows = shard_indices(p, p.device_mesh.get_coordinate())[0] if isinstance(p, DTensor) else torch.arange(p.shape[0])
    scale = factor[rows // rows_per_head].to(local.dtype)
    local.mul_(scale.view(-1, *([1] * (local.dim() - 1))))


class QKClip:
    """QK-clip over the attention blocks of ``model`` (this rank's stages and shards, any wrappers) at threshold
    ``tau`` (module docstring). ``tp_rank``: this rank's place among tp's head shards (its query heads are the
    ``tp_rank``-th slice of the heads); ``groups``: the process groups whose ranks observe other sequences or other
    heads of the same blocks (dp x sp, and tp), over which the maxima are reduced."""

    def __init__(self, model: nn.Module, tau: float, tp_rank: int = 0, groups: tuple[ProcessGroup, ...] = ()) -> None:
        self.tau, self.tp_rank, self.groups = tau, tp_rank, groups
        self.blocks: list[tuple[nn.Module, nn.Module]] = []
        for name, module in model.named_modules():
            if name.endswith("inner_attention"):
                attn = model.get_submodule(name.rpartition(".")[0])
                self.blocks.append((attn, module))
                module.register_forward_pre_hook(self._observe, with_kwargs=True)
        self.seen: dict[int, Tensor] = {}
        self.last_max = 0.0
        self.last_clipped = 0

    def _observe(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        q, k = args[0], args[1]
        with torch.no_grad():
            m = max_logits(q.detach(), k.detach(), kwargs.get("mask", args[3] if len(args) > 3 else None))
        key = id(module)
        self.seen[key] = m if key not in self.seen else torch.maximum(self.seen[key], m)

    @torch.no_grad()
    def after_step(self) -> None:
        """Reduce the step's maxima, scale the heads over ``tau`` (module docstring), and forget the step's maxima;
        ``last_max`` (the largest logit of the step over every head of this rank's blocks) and ``last_clipped`` (the
        heads scaled) say what happened. Collective over ``groups``."""
        heads = [self._global_heads(attn) for attn, _ in self.blocks]
        table = torch.full((len(self.blocks), max(heads, default=1)), -math.inf)
        for i, (_, inner) in enumerate(self.blocks):
            local = self.seen.get(id(inner))
            if local is not None:
                start = self.tp_rank * local.numel()
                table[i, start:start + local.numel()] = local
        for group in self.groups:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        self.seen.clear()
        self.last_max = float(table.max()) if table.numel() else 0.0
        gamma = (self.tau / table).clamp(max=1.0)  # -inf (an unobserved head) -> -0.0 -> no scaling below
        gamma = torch.where(table > self.tau, gamma, torch.ones_like(gamma))
        self.last_clipped = int((gamma < 1).sum())
        for i, (attn, _) in enumerate(self.blocks):
            if bool((gamma[i] < 1).any()):
                self._clip(attn, gamma[i, :heads[i]])

    @staticmethod
    def _global_heads(attn: nn.Module) -> int:
        """Query heads of the whole (unsharded) attention block."""
        return attn.q.weight.shape[0] // attn.head_size

    def _clip(self, attn: nn.Module, gamma: Tensor) -> None:
        hs = attn.head_size
        multi_head = attn.k.weight.shape[0] == attn.q.weight.shape[0]
        q_factor = gamma.sqrt() if multi_head else gamma
        for p in (attn.q.weight, attn.q.bias):
            if p is not None:
                _scale_rows(p, q_factor, hs)
        if multi_head:
            for p in (attn.k.weight, attn.k.bias):
                if p is not None:
                    _scale_rows(p, q_factor, hs)
