"""A mixture-of-experts MLP: a top-k router over ``num_experts`` SwiGLU experts, dropless, and its load-balancing loss.

Shape legend: B batch, T tokens, N = B*T, C = n_embd, E = num_experts, k = num_experts_per_tok, F = ffn_hidden.

Routing (Shazeer et al. 2017, arXiv:1701.06538, Eq. 3-4; Mixtral, Jiang et al. 2024, arXiv:2401.04088, Eq. 1-2),
in fp32 whatever the compute dtype: ``p = softmax(x W_r^T)`` (N, E); each token's k largest ``p`` pick its experts,
their values (divided by their sum with ``norm_topk_prob``) weigh the experts' outputs:
``y = sum_j w_j * SwiGLU_{e_j}(x)``. Dropless by default: every token reaches all k experts; with
``moe_capacity_factor`` each expert keeps its first ``ceil(factor * N*k / E)`` assignments of the micro-batch in token
order and drops the rest (:meth:`MoE.within_capacity`; GShard, Lepikhin et al. 2020, arXiv:2006.16668, Sec. 2.2).

Expert compute: the N*k (token, expert) pairs are sorted by expert (stable, so ties keep token order), each
expert's rows multiplied by its weights, and the results summed back per token. "grouped" runs each of SwiGLU's
three GEMMs as one ``torch._grouped_mm`` over all experts (``offs``: each expert's last row); "loop" runs one GEMM
per expert (the reference). Weights are stacks ``w_gate, w_up`` (E, F, C) and ``w_down`` (E, C, F), one
``nn.Linear`` weight per expert, so a (E, ...) shard is a set of whole experts.

With ``router_bias_update_rate`` > 0 each expert also has a routing bias that picks the top-k (``probs + bias``) but
does not weigh them, moved after every step towards balance (DeepSeek-V3's auxiliary-loss-free balancing,
:meth:`MoE.update_bias`).

Load balancing (Fedus et al. 2021, "Switch Transformers", arXiv:2101.03961, Eq. 4-6, with top-k counts as
``transformers``' ``load_balancing_loss_func`` and Mixtral): per MoE layer
``aux = E * sum_i f_i * P_i``, ``f_i`` the fraction of the N*k assignments that went to expert i times k (so
``sum_i f_i = k``), ``P_i`` the mean router probability of expert i over the tokens; ``f`` carries no gradient.
With ``router_aux_loss_scope = "global_batch"`` the counts behind ``f`` are summed over the ranks of the batch mesh
(dp x sp) first, so every rank uses the global batch's ``f`` (Qiu et al. 2025, arXiv:2501.11873, Sec. 3); the
loss is linear in ``P``, so each rank's ``E * sum_i f_i * P_i(local)`` averaged over the ranks (as the gradients
and the logged loss are) is the global batch's loss. The model's auxiliary loss is ``router_aux_loss_coef`` times
the mean over its MoE layers. ``transformers`` pools every layer's counts and probabilities into one ``f`` and
``P`` instead: the same value for one layer, a different one for several (a per-layer loss is what Switch
Transformers, GShard and Megatron-Core's ``switch_load_balancing_loss_func`` add; docs/moe.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.models.registry import ModelConfig


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``torch._grouped_mm``'s backward fails on
    stride-0 gradients (those of a ``sum()`` or ``expand``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` (M, in) rows sorted by expert, ``w`` (E, out, in) one weight per expert, ``offs`` (E,) int32 the end
    row of each expert's rows -> (M, out): each expert's rows times its ``w[e]^T``."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


def grouped_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   offs: torch.Tensor) -> torch.Tensor:
    """Each expert's SwiGLU over its rows: ``x`` (M, C) sorted by expert, stacks (E, F, C), (E, F, C), (E, C, F),
    ``offs`` (E,) -> (M, C), three grouped GEMMs."""
    with torch.autocast(x.device.type, enabled=False):
        hidden = F.silu(grouped_mm(x, w_gate, offs)) * grouped_mm(x, w_up, offs)  # (M, F)
        return grouped_mm(hidden, w_down, offs)  # (M, C)


def bucket_rows(counts: torch.Tensor, min_step: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's row count ``counts`` (E,) rounded up to a bucket -> (padded counts (E,), ``pos`` (M,) the row in
    the padded layout of each of the M = sum(counts) rows, experts still in order).

    A count m is rounded up to a multiple of ``max(min_step, 2**floor(log2 m) / 8)``: at most 12.5% more rows (or
    ``min_step``), and about 8 sizes per doubling of m, so a run's expert GEMMs take a few dozen shapes instead of a
    new one at almost every step. On a CPU in bf16, oneDNN builds a kernel for each new GEMM shape and keeps the last
    1024: a (m, 128) x (128, 176) GEMM took 0.69 ms with a new m and 0.06 ms with a cached one on the 2-core EPYC of
    bench/results/moe.md (fp32, served by another path, gains nothing: 0.11 ms either way), so the padding pays
    for itself many times over there. Zero rows change no real row's output and add nothing to a weight's gradient.
    """
    sizes = counts.tolist()
    steps = [max(min_step, (1 << max(m.bit_length() - 1, 0)) // 8) for m in sizes]
    padded = [-(-m // step) * step for m, step in zip(sizes, steps)]
    extra = torch.tensor([p - m for p, m in zip(padded, sizes)], device=counts.device)  # (E,) padding rows of each
    shift = extra.cumsum(0) - extra  # (E,) padding rows before each expert's rows
    pos = torch.arange(sum(sizes), device=counts.device) + torch.repeat_interleave(shift, counts)
    return torch.tensor(padded, dtype=counts.dtype, device=counts.device), pos


_grouped_swiglu_eager = torch.compiler.disable(grouped_swiglu)
""":func:`grouped_swiglu` run eagerly inside a compiled block: torch 2.13's fake-tensor kernel of ``_grouped_mm``
(which ``torch.compile`` traces with) takes bf16 only, the eager CPU kernel fp32 too."""


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how many of ``experts`` (any shape, ids in [0, E)) chose each expert; ``torch.bincount`` with
    ``minlength = E`` computed as a scatter-add into E zeros, whose shape does not depend on the data (bincount's
    does, which breaks a compiled graph there)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def aux_loss_terms(probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """The load-balancing loss of one MoE layer, ``E * sum_i f_i * P_i`` (module docstring): ``probs`` (N, E) fp32
    router probabilities, ``experts`` (N, k) the chosen experts; ``group``: the ranks whose counts ``f`` sums
    (global-batch scope) or None (this micro-batch). Returns a scalar with the gradient of ``P``."""
    counts = expert_counts(experts, num_experts).to(probs.dtype)  # (E,) assignments
    tokens = torch.tensor([float(probs.shape[0])], dtype=probs.dtype, device=probs.device)
    if group is not None:
        both = torch.cat([counts, tokens])
        dist.all_reduce(both, group=group)
        counts, tokens = both[:-1], both[-1:]
    f = counts / tokens  # (E,), sums to k; no gradient
    P = probs.mean(dim=0)  # (E,)
    return num_experts * (f * P).sum()


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as three stacks, ``w_gate, w_up`` (E, F, C) and ``w_down`` (E, C, F);
    ``forward(x, counts)``: each expert over its rows of ``x`` (module docstring, "Expert compute").

    Under expert parallelism (:mod:`meshtrain.parallel.expert`) each stack is a ``DTensor`` sharded on dim 0 over the
    ``ep`` ranks: a rank holds E/ep whole experts and computes only those."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, C, hidden = cfg.num_experts, cfg.n_embd, cfg.ffn_hidden_size()
        self.grouped = cfg.moe_compute == "grouped"
        self.w_gate = nn.Parameter(torch.empty(E, hidden, C))
        self.w_up = nn.Parameter(torch.empty(E, hidden, C))
        self.w_down = nn.Parameter(torch.empty(E, C, hidden))
        self.grad_scale = 1.0
        """Factor on the stacks' gradients (expert parallelism sets 1/ep: :mod:`meshtrain.parallel.expert`)."""
        self.pad_rows = True
        """On a CPU in bf16, run the grouped GEMM on rows padded to buckets (:func:`bucket_rows`); False: exact rows."""

    def expert_weights(self) -> list[tuple[nn.Parameter, bool]]:
        """The stacks and whether each projects into the residual stream (the down projections):
        :func:`meshtrain.models.attention.init_decoder_weights` fills them as the dense MLP's Linears."""
        return [(self.w_gate, False), (self.w_up, False), (self.w_down, True)]

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights this rank computes with: its experts of ``w_gate, w_up`` (E_local, F, C) and ``w_down``
        (E_local, C, F) (LoRA adds its low-rank updates here, :class:`meshtrain.adapters.experts.LoRAExperts`)."""
        return _local(self.w_gate), _local(self.w_up), _local(self.w_down)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each expert this rank holds over its rows of ``x`` (M, C) (sorted by expert, ``counts`` (E_local,)
        rows each) -> (M, C)."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x.to(dtype)
        scale = self.grad_scale  # 1 without expert parallelism: no extra pass over the stacks' gradients
        w_gate, w_up, w_down = ((w if scale == 1.0 else _ScaleGrad.apply(w, scale)).to(dtype) for w in self.stacks())
        if self.grouped:
            run = grouped_swiglu if dtype == torch.bfloat16 else _grouped_swiglu_eager
            if self.pad_rows and x.device.type == "cpu" and dtype != torch.float32:  # oneDNN: a kernel per shape
                padded, pos = bucket_rows(counts)
                offs = torch.cumsum(padded, dim=0).to(torch.int32)
                x_pad = x.new_zeros(int(padded.sum()), x.shape[1]).index_copy(0, pos, x)
                return run(x_pad, w_gate, w_up, w_down, offs)[pos]  # a zero row adds nothing to any gradient
            offs = torch.cumsum(counts, dim=0).to(torch.int32)  # (E_local,) end row of each expert
            return run(x, w_gate, w_up, w_down, offs)
        outs = [F.linear(F.silu(F.linear(rows, w_gate[e])) * F.linear(rows, w_up[e]), w_down[e])
                for e, rows in enumerate(x.split(counts.tolist()))]  # each (rows_e, C)
        return torch.cat(outs) if outs else x[:0]


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: D102
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad * ctx.scale if ctx.scale != 1.0 else grad, None


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stack: a ``DTensor``'s local shard (expert parallelism), else the stack."""
    return w.to_local() if isinstance(w, DTensor) else w


Dispatch = Callable[[GroupedExperts, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(experts, x (M, C) sorted by expert, counts (E,)) -> (M, C)``: how the rows reach their experts and come back
(expert parallelism's all-to-all, :class:`meshtrain.parallel.expert.ExpertDispatch`)."""


class SharedExpert(nn.Module):
    """A SwiGLU every token runs, ``down(silu(gate(x)) * up(x))`` of width ``hidden`` (Qwen2-MoE's ``shared_expert``)."""

    def __init__(self, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(n_embd, hidden, bias=False)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (N, C) -> (N, C)."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(nn.Module):
    """Router ``router`` (E, C, no bias) and ``num_experts`` SwiGLU experts (``experts``, :class:`GroupedExperts`), and
    with ``shared_expert_ffn`` a shared expert (``shared``, :class:`SharedExpert`) gated by ``sigmoid(x w_g)``
    (``shared_gate``, (1, C)); ``forward(x)`` (B, T, C) -> (B, T, C) and sets :attr:`aux_loss`.

    ``balance_group``: the process group the global-batch counts are summed over (set by
    :func:`meshtrain.parallel.compose.parallelize` under dp or sp; None: this rank's tokens are the batch).
    ``dispatch``: set by expert parallelism; None runs every expert here."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, C = cfg.num_experts, cfg.n_embd
        self.num_experts, self.top_k, self.normalize = E, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.global_scope = cfg.router_aux_loss_scope == "global_batch"
        self.experts = GroupedExperts(cfg)  # before the router: the initial draws come in module order
        self.router = nn.Linear(C, E, bias=False)
        self.shared = SharedExpert(C, cfg.shared_expert_ffn) if cfg.shared_expert_ffn else None
        self.shared_gate = nn.Linear(C, 1, bias=False) if cfg.shared_expert_ffn else None
        self.capacity_factor = cfg.moe_capacity_factor
        self.bias_rate = cfg.router_bias_update_rate
        if self.bias_rate:  # DeepSeek-V3's auxiliary-loss-free balancing: a routing bias per expert, checkpointed
            self.register_buffer("expert_bias", torch.zeros(E))
            self.step_counts = torch.zeros(E)
            """Assignments to each expert in this step's training forwards so far (this rank's), for :meth:`update_bias`."""
        self.balance_group: dist.ProcessGroup | None = None
        self.dispatch: Dispatch | None = None
        self.aux_loss: torch.Tensor | None = None
        """This layer's load-balancing loss of the last forward (a scalar with gradient), before the coefficient."""
        self.last_experts: torch.Tensor | None = None
        """The experts each token of the last forward went to, (N, k) int64 (tests compare routings)."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (N, C) -> (probs (N, E) fp32, weights (N, k) fp32, experts (N, k) int64), in fp32 under autocast."""
        with torch.autocast(x.device.type, enabled=False):
            probs = F.softmax(F.linear(x.float(), self.router.weight.float()), dim=-1)  # (N, E)
        if self.bias_rate:  # the biases pick the experts; the probabilities weigh them (DeepSeek-V3, Eq. 16)
            experts = torch.topk(probs + self.expert_bias.to(probs.device), self.top_k, dim=-1).indices  # (N, k)
            weights = probs.gather(-1, experts)
        else:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k) each
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, C) -> (B, T, C): each token's k experts' outputs, weighted."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        probs, weights, experts = self.route(flat)
        self.last_experts = experts.detach()
        self.aux_loss = aux_loss_terms(probs, experts, self.num_experts,
                                       self.balance_group if self.global_scope else None)
        assignment = experts.reshape(-1)  # (N*k,)
        order = torch.argsort(assignment, stable=True)  # (N*k,) pairs sorted by expert, each in token order
        counts = expert_counts(assignment, self.num_experts)  # (E,)
        if self.bias_rate and self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.step_counts = self.step_counts.to(counts.device) + counts  # a training forward (not a recompute)
        if self.capacity_factor:  # the router's load above counts every assignment; the experts take their capacity
            order, counts = self.within_capacity(order, counts, assignment.numel())
        token = order // self.top_k  # (M,) the token of each sorted pair
        # (M, C); M = N*k without a capacity. index_select, not flat[token]: its backward is one index_add_, where
        # advanced indexing's is an accumulating index_put_ (0.43 against 0.81 ms fwd+bwd fp32, 0.28 against 0.90 bf16,
        # N = 1024, k = 2, C = 128, one thread; the same values, each token's k row gradients summed in another order)
        rows = flat.index_select(0, token)
        out = self.experts(rows, counts) if self.dispatch is None else self.dispatch(self.experts, rows, counts)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)  # a dropped pair adds nothing
        y = torch.zeros_like(flat, dtype=out.dtype).index_add_(0, token, out)  # (N, C)
        if self.shared is not None:  # Qwen2-MoE: + sigmoid(x w_g) * SwiGLU_shared(x), every token
            y = y + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return y.reshape(B, T, C).to(x.dtype)

    def capacity(self, assignments: int) -> int:
        """Assignments an expert keeps of a micro-batch's ``assignments`` = N*k: ``ceil(factor * N*k / E)``."""
        return math.ceil(self.capacity_factor * assignments / self.num_experts)

    def within_capacity(self, order: torch.Tensor, counts: torch.Tensor,
                        assignments: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sorted pairs ``order`` (N*k,) and ``counts`` (E,) with each expert's rows past its :meth:`capacity`
        dropped: its first ones in token order stay (``moe_capacity_factor``'s rule) -> (M,) and (E,), M <= N*k.
        Under a layout the micro-batch is this rank's tokens (its dp and sp share), so drops follow the layout."""
        cap = self.capacity(assignments)
        start = torch.cumsum(counts, dim=0) - counts  # (E,) first sorted row of each expert
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)  # (N*k,)
        keep = torch.arange(order.numel(), device=order.device) - start[expert] < cap
        return order[keep], counts.clamp(max=cap)

    @torch.no_grad()
    def update_bias(self) -> None:
        """After an optimizer step: each expert's routing bias moves by ``router_bias_update_rate`` towards balance,
        ``b_i += rate * sign(mean_j c_j - c_i)`` with ``c`` the step's assignments summed over ``balance_group``
        (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 2.1.2); the counts restart. Nothing without biases."""
        if not self.bias_rate:
            return
        counts = self.step_counts.float()
        if self.balance_group is not None:
            dist.all_reduce(counts, group=self.balance_group)
        self.expert_bias += self.bias_rate * torch.sign(counts.mean() - counts).to(self.expert_bias.device)
        self.step_counts = torch.zeros_like(self.step_counts)


class _AttachAuxLoss(torch.autograd.Function):
    """``x`` unchanged forward; backward also gives ``loss`` the gradient ``scale``: as if ``scale * loss`` were
    added to the objective whose gradient reaches ``x`` (DeepSeek-V2's ``AddAuxiliaryLoss``, arXiv:2405.04434)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: D102
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype)
        return x.clone()  # not a view: the zero-bubble schedules detach_() a stage's output in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: D102
        shape, dtype = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None


def aux_loss(layers: list[MoE], coef: float, num_layers: int) -> torch.Tensor | None:
    """``coef`` x the sum of ``layers``' auxiliary losses of the last forward / ``num_layers`` (the model's MoE layers,
    all stages together: a pipeline stage holds some of them and adds its share); None before any forward."""
    losses = [m.aux_loss for m in layers if m.aux_loss is not None]
    return coef * torch.stack(losses).sum() / num_layers if losses else None


def attach_aux_loss(x: torch.Tensor, loss: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``x`` (the hidden states after the layers that made ``loss`` ran) carrying ``loss`` into backward with weight
    ``scale``: the weight the caller's objective gives this forward's cross-entropy (``1 / micro-batches`` where the
    trainer divides each micro-batch's loss; 1 where a pipeline schedule divides the gradients afterwards)."""
    if loss is None or not torch.is_grad_enabled() or not loss.requires_grad:
        return x
    return _AttachAuxLoss.apply(x, loss, scale)
