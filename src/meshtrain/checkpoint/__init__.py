"""Checkpoints, one folder: the sharded store (:mod:`.store`: save, commit, verify, load and reshard with
``torch.distributed.checkpoint``), the trainer's writer (:mod:`.writer`: blocking or in the background) and the
schema of ``meta.json`` (:mod:`.schema`, torch-free).

Importing this package imports no torch: the store's names (``ckpt.save``, ``ckpt.read_meta``,
``resume_hint``, ...) are loaded from :mod:`.store` when first used, so the launcher's checks and a rank's
entry can name the package before torch is loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

SUBMODULES = ("store", "writer", "schema")


def __getattr__(name: str) -> Any:
    """A name of :mod:`meshtrain.checkpoint.store` (PEP 562), imported on first use."""
    if name.startswith("__") or name in SUBMODULES:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"{__name__}.store"), name)
