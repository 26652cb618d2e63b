"""Checkpoints, one folder: the sharded store (:mod:`.store`: save, commit, verify, load and reshard with
``torch.distributed.checkpoint``), the trainer's writer (:mod:`.writer`: blocking or in the background) and the
schema of ``meta.json`` (:mod:`.schema`, torch-free).

Importing this package imports nothing: callers import the module they use
(``from meshtrain.checkpoint import store as ckpt``, ``from meshtrain.checkpoint.store import resume_hint``), so the
launcher's checks and a rank's entry can read the torch-free schema before torch is loaded.
"""
