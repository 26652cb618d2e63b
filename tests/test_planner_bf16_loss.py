"""The stack option ``bf16-ce`` (:data:`meshtrain.planner.stack.STACK_OPTIONS`): a cross-entropy on the 16-bit logits
without an fp32 copy (NeMo AutoModel's ``MaskedCrossEntropy`` with ``fp32_upcast = false``, Megatron-Core's loss)
holds the bytes per logit the option states, measured as the fp32 loss's are in
``tests/test_planner_memory_mechanisms.py``."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from meshtrain.planner.layout import FRAMEWORKS
from meshtrain.planner.stack import STACK_OPTIONS
from test_planner_memory_mechanisms import PER_TOKEN_EXTRA, TOKENS, VOCAB, allocated_peak


def test_a_bf16_loss_holds_what_bf16_ce_states():
    """Its backward holds the log-softmax (2 bytes a logit), the loss's gradient through it (2) and the logits'
    gradient (2) besides the logits: ``loss_backward_bytes`` of a framework with the option."""
    torch.manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, dtype=torch.bfloat16)
    targets = torch.randint(0, VOCAB, (TOKENS,))

    def step():
        leaf = logits.clone().requires_grad_()  # the logits, allocated here: 2 bytes a logit
        F.cross_entropy(leaf, targets).backward()

    per_logit = allocated_peak(step) / (TOKENS * VOCAB) - logits.element_size()
    want = replace(FRAMEWORKS["torchtitan"], **STACK_OPTIONS["bf16-ce"]).loss_backward_bytes
    assert want <= per_logit <= want + PER_TOKEN_EXTRA / VOCAB  # the same per-token allowance as the fp32 loss's
    assert want < FRAMEWORKS["torchtitan"].loss_backward_bytes  # the option changes what the stack holds
