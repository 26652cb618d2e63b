"""What a step minimises besides the language-modelling cross-entropy: direct preference optimization.

``train.objective = "dpo"`` trains on preference pairs (a prompt, a chosen and a rejected completion; ``meshtrain
prepare --format preference``). A sequence's log-probability is the sum of its completion tokens' log-probabilities
(the supervised tokens of the pair's masks). With the policy's ``pi_c, pi_r`` and the frozen reference's
``ref_c, ref_r`` (the model as training started), the implicit rewards are ``r_c = beta (pi_c - ref_c)`` and
``r_r = beta (pi_r - ref_r)`` and, with ``h = (pi_c - pi_r) - (ref_c - ref_r)``:

- ``"sigmoid"``: ``-log sigmoid(beta h)``, the DPO loss of Rafailov et al. 2023 ("Direct Preference Optimization",
  arXiv:2305.18290, Eq. 7), TRL's ``"sigmoid"``;
- ``"robust"``: ``(-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)`` with
  ``eps = label_smoothing``, the probability that a pair's preference is flipped: robust DPO, Chowdhury et al. 2024
  ("Provably Robust DPO", arXiv:2403.00409, its de-biased loss), TRL's ``"robust"``; ``eps = 0`` is DPO;
- ``"ipo"``: ``(h' - 1 / (2 beta))^2``, IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning
  from Human Preferences", arXiv:2310.12036, Eq. 17, beta its tau), with h' the difference of the two log-ratios each
  divided by its completion's token count (TRL's ``"ipo"``, which the paper's authors confirmed to TRL is the form
  of their results).

A step's loss is the mean over the pairs of the whole global batch (:func:`meshtrain.parallel.reduce.pair_scale`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.config.sections import DPO_LOSSES
PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin")
"""What a DPO step logs per pair, averaged over the global batch's pairs (TRL's ``rewards/chosen``,
``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``)."""


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and their metrics.

    Args:
        policy: (2P,) the policy's sequence log-probabilities (nats), rows chosen, rejected, chosen, ...
        reference: (2P,) the reference's, in the same order (no gradient).
        beta: the KL coefficient (``train.dpo_beta``), > 0.
        loss_type: one of :data:`DPO_LOSSES` (module docstring).
        label_smoothing: eps in [0, 0.5) of the "robust" loss.
        counts: (2P,) each row's completion tokens, needed by "ipo" (floored at 1, as TRL does).

    Returns:
        ``(losses, metrics)``: (P,) losses, and (P, 4) detached :data:`PAIR_METRICS` (rewards in nats x beta,
        the accuracy 1.0 where ``r_c > r_r``).
    """
    logratio = (policy - reference).view(-1, 2)  # (P, 2): log pi - log ref of chosen, rejected
    h = logratio[:, 0] - logratio[:, 1]  # (P,)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "robust":
        eps = label_smoothing
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "ipo":
        if counts is None:
            raise ValueError("loss_type = 'ipo' needs each row's completion token count (counts)")
        per_token = logratio / counts.to(logratio).view(-1, 2).clamp(min=1.0)  # (P, 2)
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"loss_type = {loss_type!r}: use one of {', '.join(DPO_LOSSES)}")
    rewards = beta * logratio.detach()  # (P, 2)
    metrics = torch.stack([rewards[:, 0], rewards[:, 1], (rewards[:, 0] > rewards[:, 1]).to(rewards.dtype),
                           rewards[:, 0] - rewards[:, 1]], dim=1)  # (P, 4)
    return losses, metrics
