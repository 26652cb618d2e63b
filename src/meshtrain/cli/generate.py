"""``meshtrain generate --checkpoint DIR --prompt TEXT --max-new-tokens N``: sample text from a checkpoint.

Runs in one process without a process group: DCP reads the (possibly dp-sharded) checkpoint into a
plain model, whatever layout saved it; or the model comes from a ``meshtrain export`` safetensors file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshtrain.argtypes import positive_float


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint",
                       description="Sample from a trained model. DIR is a run folder (its latest checkpoint) "
                                   "or a checkpoints/step_* folder.")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="run folder, step folder, or a .safetensors file written by meshtrain export")
    p.add_argument("--prompt", default="\n", help="text to continue (characters must be in the corpus vocabulary)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens (characters) to generate")
    p.add_argument("--temperature", type=positive_float, default=0.8, help="softmax temperature > 0")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed")
    p.set_defaults(func=run)


def sample(checkpoint: str | Path, prompt: str, max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = None, seed: int = 1337) -> str:
    """Continue ``prompt`` by ``max_new_tokens`` characters with the model saved in ``checkpoint``.

    Raises:
        ConfigError: no checkpoint there, bad sampling arguments, or a prompt character outside the vocabulary.
    """
    import torch

    from meshtrain.config import ConfigError
    from meshtrain.data.corpus import CharTokenizer

    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens = {max_new_tokens} must be >= 1")
    if temperature <= 0:
        raise ConfigError(f"--temperature = {temperature} must be > 0")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k = {top_k} must be >= 1")
    model, info = _load(checkpoint)
    tokenizer = CharTokenizer.from_dict(info["tokenizer"])
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        raise ConfigError(f"--prompt: {e}") from None
    model.eval()
    idx = torch.tensor([ids], dtype=torch.long)  # (1, T0)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k,
                         generator=torch.Generator().manual_seed(seed))  # (1, T0 + N)
    return tokenizer.decode(out[0].tolist())


def _load(checkpoint: str | Path):
    """(model, info with "tokenizer") from a DCP checkpoint folder or a ``meshtrain export`` file."""
    from meshtrain.cli.export import SUFFIX, load_checkpoint_model, load_export

    if Path(checkpoint).suffix == SUFFIX and Path(checkpoint).is_file():
        return load_export(Path(checkpoint))
    return load_checkpoint_model(checkpoint)[:2]


def run(args: argparse.Namespace) -> int:
    text = sample(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed)
    sys.stdout.write(text + "\n")
    return 0
