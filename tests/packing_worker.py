"""Layouts trained with ``data.packing = "document"`` on the bundled text, each line a document:
``torchrun --nproc-per-node N tests/packing_worker.py SPEC.json`` (``tests/layout_worker.py``'s spec and runs).

A user cannot ask for this: config validation refuses document packing with the char tokenizer, which has no
end-of-document token. Two test hooks (:func:`newline_documents`) make the character corpus a stream of
documents without loosening that rule for anyone else:

- a ``data.packing`` override is set on the config after validation (``layout_worker.load_config``);
- the trainer's char tokenizer reports the id of ``"\\n"`` as its ``eos_id`` (``meshtrain.train.loop.set_up``),
  so every line ends a document: with blocks of 32 characters, most windows hold 1-3 documents, and blank
  lines give one-token documents.

Everything else is the real trainer: sampler, :func:`meshtrain.parallel.compose.parallelize` and the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import layout_worker
from meshtrain.train import loop

EOS_TEXT = "\n"


@contextlib.contextmanager
def newline_documents() -> Iterator[None]:
    """Within: ``layout_worker`` applies a ``data.packing`` override after validation, and the trainer's char
    tokenizer has ``eos_id`` = the id of "\\n". Restores both on exit."""
    load_config, set_up = layout_worker.load_config, loop.set_up

    def load_packed(path, overrides):
        overrides = dict(overrides)
        packing = overrides.pop("data.packing", "concat")
        cfg = load_config(path, overrides)  # validated as "concat": "document" + "char" is refused
        cfg.data.packing = packing
        return cfg

    def set_up_newline_eos(cfg, device):
        run = set_up(cfg, device)
        tok = run.corpus.tokenizer
        tok.eos_id = tok.encode(EOS_TEXT)[0]  # an instance attribute over the class's None
        return run

    layout_worker.load_config, loop.set_up = load_packed, set_up_newline_eos
    try:
        yield
    finally:
        layout_worker.load_config, loop.set_up = load_config, set_up


if __name__ == "__main__":
    with newline_documents():
        layout_worker.main()
