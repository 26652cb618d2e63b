"""Recurrent language models: a stack of LSTM or GRU layers between a token embedding and a head.

The char-rnn layout of Karpathy 2015 and the "medium" LSTM language model of Zaremba et al. 2014
("Recurrent Neural Network Regularization", arXiv:1409.2329, Sec. 3-4): embedding, ``n_layer``
recurrent layers of width C, dropout on the non-recurrent connections (between layers, never on
the recurrence), a linear head. LSTM: Hochreiter & Schmidhuber 1997; GRU: Cho et al. 2014
(arXiv:1406.1078, Eq. 5-8); PyTorch's ``nn.LSTM`` / ``nn.GRU`` run the cells. The head shares the
embedding's weight (Press & Wolf 2017, arXiv:1608.05859, Sec. 5, and Inan et al. 2017,
arXiv:1611.01462, both on LSTM language models). Shape legend: B batch, T sequence length,
C = n_embd, V vocabulary size.

Parameters (PyTorch keeps two bias vectors per gate)::

    per layer  LSTM: 4 gates * (2*C*C + 2*C) = 8*C**2 + 8*C        GRU: 6*C**2 + 6*C
    total      V*C (tied embedding and head) + n_layer * per layer

Each layer is one block (``blocks["i"]``), so pipeline parallelism cuts the stack between
recurrent layers: stage s runs its layers over the whole sequence and hands the next stage the
(B, T, C) outputs. Tensor and sequence parallelism do not apply (a recurrence is sequential in T,
and its C x 4C matrices are small); data parallelism wraps the blocks like a GPT's.

Truncated backpropagation through time (Williams & Peng 1990; Sutskever 2013, PhD thesis Sec. 2.8.6):
with ``model.tbptt_steps = k`` each layer runs the sequence in segments of k steps and carries its
state into the next segment detached, so the forward pass is unchanged and a gradient flows back at
most k steps -- TBPTT(k, k) over the block_size-long samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from meshtrain.models.base import LayeredLM, sample_token
from meshtrain.models.registry import ModelConfig

CELLS: dict[str, type[nn.RNNBase]] = {"lstm": nn.LSTM, "gru": nn.GRU}
INIT_STD = 0.02
"""Standard deviation of the normal init of the (tied) embedding, as the GPT's."""
FORGET_BIAS = 1.0
"""Initial LSTM forget-gate bias (Jozefowicz et al. 2015, "An Empirical Exploration of Recurrent
Network Architectures", ICML, Sec. 2.2): the cell remembers by default at the start of training."""

State = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A layer's recurrent state: ``h`` (1, B, C) for a GRU, ``(h, c)`` for an LSTM."""


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. nn.LSTM/nn.GRU hand back their input's
    gradient as a (T, B, C) buffer viewed as (B, T, C); a pipeline stage sends that gradient to the
    previous stage, and gloo sends (and torch's pipelining allocates receive buffers for) contiguous
    tensors only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _detach(state: State) -> State:
    return tuple(s.detach() for s in state) if isinstance(state, tuple) else state.detach()


class RecurrentBlock(nn.Module):
    """One recurrent layer and the dropout after it: ``x`` (B, T, C) -> (B, T, C).

    ``tbptt_steps`` > 0 runs the sequence in segments of that many steps, each starting from the
    previous segment's final state detached (truncated BPTT); 0 backpropagates through all T steps.
    """

    def __init__(self, cell: str, n_embd: int, dropout: float, tbptt_steps: int = 0) -> None:
        super().__init__()
        self.rnn = CELLS[cell](n_embd, n_embd, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.tbptt_steps = tbptt_steps

    def forward(self, x: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
        """``x`` (B, T, C), initial ``state`` (zeros if None) -> outputs (B, T, C) and the final state."""
        T = x.size(1)
        k = self.tbptt_steps or T
        x = _ContiguousGrad.apply(x)
        outputs = []
        for start in range(0, T, k):
            y, state = self.rnn(x[:, start:start + k], state)  # (B, <=k, C)
            outputs.append(y)
            if start + k < T:
                state = _detach(state)
        # nn.LSTM/nn.GRU return a (T, B, C) buffer viewed as (B, T, C): contiguous for the pipeline's sends
        return self.drop(torch.cat(outputs, dim=1).contiguous()), state  # (B, T, C)


class RNNLM(LayeredLM):
    """LSTM or GRU language model returning logits; the loss is computed by the caller.

    Args:
        cfg: ``type`` ("lstm" or "gru"), ``n_layer``, ``n_embd``, ``block_size`` (training sequence
            length), ``dropout``, ``tbptt_steps``.
        vocab_size: V, number of token ids.

    As the GPT, weights come from a seed drawn from the global torch RNG at construction, filled by
    :meth:`init_weights` from a private CPU generator (device independent, meta-device friendly).
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        if cfg.type not in CELLS:
            raise ValueError(f"model.type = {cfg.type!r} is not a recurrent model: use one of {', '.join(CELLS)}")
        super().__init__(cfg, vocab_size,
                         lambda i: RecurrentBlock(cfg.type, cfg.n_embd, cfg.dropout, cfg.tbptt_steps))

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from ``self.init_seed``, in module order on the CPU.

        Embedding normal(0, 0.02); recurrent weights and biases uniform(-1/sqrt(C), 1/sqrt(C)) (PyTorch's
        ``nn.LSTM`` default, drawn here from the private generator); LSTM forget-gate biases
        :data:`FORGET_BIAS` (gate order i, f, g, o; the ``bias_ih`` half, ``bias_hh`` stays as drawn).
        """
        tied = self.tie_weights()
        if any(p.is_meta for p in self.parameters()):
            return
        gen = torch.Generator(device="cpu").manual_seed(self.init_seed)
        bound = 1.0 / math.sqrt(self.cfg.n_embd)
        for module in self.modules():
            if isinstance(module, nn.Embedding) or (isinstance(module, nn.Linear) and not (tied and module is self.lm_head)):
                w = module.weight
                w.copy_(torch.empty(w.shape, dtype=w.dtype).normal_(0.0, INIT_STD, generator=gen))
            elif isinstance(module, nn.RNNBase):
                for name, p in module.named_parameters():
                    p.copy_(torch.empty(p.shape, dtype=p.dtype).uniform_(-bound, bound, generator=gen))
                    if isinstance(module, nn.LSTM) and name.startswith("bias_ih"):
                        C = module.hidden_size
                        p[C:2 * C] = FORGET_BIAS  # (4C,) = [input, forget, cell, output] gates

    def tp_split_dropout_modules(self, sequence_parallel: bool) -> list[nn.Module]:
        return []

    def run(self, idx: torch.Tensor, states: list[State | None] | None = None
            ) -> tuple[torch.Tensor, list[State]]:
        """Token ids ``idx`` (B, T) (or hidden states (B, T, C) on a later pipeline stage) and each held
        layer's initial state (None: zeros) -> logits (B, T, V) (hidden states (B, T, C) without the head)
        and each held layer's final state."""
        x = self.drop(self.tok_emb(idx)) if self.tok_emb is not None else idx  # (B, T, C)
        states = states or [None] * len(self.blocks)
        finals = []
        for block, state in zip(self.blocks.values(), states):
            x, state = block(x, state)  # (B, T, C)
            finals.append(state)
        return (x if self.lm_head is None else self.lm_head(x)), finals

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``idx`` (B, T) int64 -> logits (B, T, V), every layer starting from a zero state.

        ``positions`` is accepted for the trainer's common call and ignored: a recurrence knows the
        order of its inputs. A pipeline stage without ``tok_emb`` takes hidden states (B, T, C); one
        without ``lm_head`` returns them.
        """
        return self.run(idx)[0]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 on_token: Callable[[torch.Tensor], bool | None] | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T0); return (B, T0 + N).

        The prompt is read once and then one token at a time, carrying every layer's state, so the
        context is not cropped to ``block_size`` (a recurrence has no window). Sampling:
        :func:`meshtrain.models.base.sample_token`; ``on_token`` gets each new token (B, 1) as it is drawn, and
        returning True stops the sampling there (that token included).
        """
        logits, states = self.run(idx)  # (B, T0, V)
        for _ in range(max_new_tokens):
            nxt = sample_token(logits[:, -1, :], temperature, top_k, generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
            if on_token is not None and on_token(nxt):
                break
            logits, states = self.run(nxt, states)  # (B, 1, V)
        return idx
