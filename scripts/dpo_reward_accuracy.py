"""Reward accuracy of a DPO-trained model on every pair of a prepared preference split, with its standard error.

    python scripts/dpo_reward_accuracy.py --policy runs/llama_dpo_hf --reference runs/llama_sft_hf --data data/pairs

``--policy`` and ``--reference`` are Hugging Face folders (``meshtrain export --format hf``), run by transformers'
``AutoModelForCausalLM`` (not by meshtrain's model code); ``--data`` is a ``meshtrain prepare --format preference``
folder. Every pair of ``--split`` (default val: all of them, not a sample drawn with replacement as the trainer's
``eval_steps`` draws) is read as the trainer reads it: each sequence's first ``--block-size + 1`` tokens, its
log-probability the sum of its completion tokens' (loss mask 1) log-probabilities. With ``pi`` the policy's and
``ref`` the reference's, a completion's implicit reward is ``beta * (pi - ref)`` (Rafailov et al. 2023,
arXiv:2305.18290, Sec. 5), a pair is right when its chosen reward is strictly the larger (TRL's
``rewards/accuracies``: a tie, e.g. a pair whose prompt fills the window, counts as wrong), and the standard error of
the accuracy ``p`` over ``n`` pairs is the binomial one, ``sqrt(p (1 - p) / n)``. Prints one JSON line: pairs,
accuracy, its standard error, mean margin ``beta (h)``, and how many pairs had no completion token in the window.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from meshtrain.data.shards import PreparedData


def sequences(folder: Path, split: str, block_size: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of ``split`` (the first ``limit`` when ``limit`` > 0) as padded rows, chosen then rejected.

    Returns:
        ids (2P, block_size + 1) int64, padding 0; mask (2P, block_size + 1) float, 1 on the completion's tokens.
    Raises:
        ValueError: ``folder`` is not preference data.
    """
    data = PreparedData.open(folder)
    if not data.is_preference:
        raise ValueError(f"{folder} is not preference data (meshtrain prepare --format preference)")
    tokens, masks = data.tokens(split), data.masks(split)
    starts = [int(s) for s in data.documents(split)] + [len(tokens)]
    docs = len(starts) - 1 if limit <= 0 else min(len(starts) - 1, 2 * limit)
    ids = np.zeros((docs, block_size + 1), np.int64)
    mask = np.zeros((docs, block_size + 1), np.float32)
    for d in range(docs):
        n = min(starts[d + 1] - starts[d], block_size + 1)  # the trainer keeps the first block_size + 1 tokens
        ids[d, :n] = tokens.window(starts[d], n)
        mask[d, :n] = masks.window(starts[d], n)
    return torch.from_numpy(ids), torch.from_numpy(mask)


@torch.no_grad()
def completion_logps(model_dir: str, ids: torch.Tensor, mask: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """(rows,) float64: each row's sum over its masked target tokens t of log p(ids[t] | ids[:t]), in nats."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for a in range(0, len(ids), batch):
        x, m = ids[a:a + batch], mask[a:a + batch]
        logits = model(input_ids=x[:, :-1]).logits.float()  # (b, T, V); padding comes after the tokens: causal is enough
        logp = torch.log_softmax(logits, dim=-1).gather(-1, x[:, 1:, None]).squeeze(-1)  # (b, T)
        out.append((logp * m[:, 1:]).double().sum(dim=1))
    return torch.cat(out)


def reward_accuracy(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> dict[str, float]:
    """Accuracy, its binomial standard error and the mean margin of the pairs whose rows (chosen, rejected
    interleaved) have log-probabilities ``policy`` and ``reference`` (each (2P,), nats), and the mean sigmoid DPO loss
    ``-log sigmoid(beta h)`` (Rafailov et al. 2023, Eq. 7), which the trainer's ``val_loss`` estimates."""
    reward = beta * (policy - reference)
    chosen, rejected = reward[0::2], reward[1::2]
    p = float((chosen > rejected).double().mean())
    n = len(chosen)
    return {"pairs": n, "accuracy": p, "se": math.sqrt(p * (1 - p) / n),
            "loss": float(-torch.nn.functional.logsigmoid(chosen - rejected).mean()),  # Eq. 7, the sigmoid loss
            "margin": float((chosen - rejected).mean()), "chosen_reward": float(chosen.mean()),
            "rejected_reward": float(rejected.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", required=True, help="HF folder of the DPO-trained model")
    parser.add_argument("--reference", required=True, help="HF folder of the reference (the model DPO started from)")
    parser.add_argument("--data", type=Path, required=True, help="meshtrain prepare --format preference folder")
    parser.add_argument("--split", default="val", choices=("train", "val"))
    parser.add_argument("--block-size", type=int, default=128, help="the training context (model.block_size)")
    parser.add_argument("--beta", type=float, default=0.1, help="train.dpo_beta of the run")
    parser.add_argument("--limit", type=int, default=0, help="the first N pairs only (0 = all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    ids, mask = sequences(args.data, args.split, args.block_size, args.limit)
    empty = int((mask[:, 1:].sum(dim=1) == 0).sum())
    result = reward_accuracy(completion_logps(args.policy, ids, mask), completion_logps(args.reference, ids, mask),
                             args.beta)
    print(json.dumps({"split": args.split, **result, "rows_without_completion": empty}))


if __name__ == "__main__":
    main()
