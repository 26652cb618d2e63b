"""Optimizers: a table of rows, one per ``optim.name``, and what builds them. Torch-free (the submodules that
need torch import it).

The contract of a row (:class:`meshtrain.optim.table.OptimizerSpec`), as ``models/family.py`` is for families:
its states per parameter (fp32 tensors of the parameter's shape), its elementwise update FLOPs, which parameters
it takes (``hidden_matrices``: the blocks' matrices by :func:`meshtrain.optim.table.takes_muon`, AdamW the rest)
and its source. The trainer builds it (:func:`meshtrain.optim.build.build_optimizer`), checkpoints record
``optim.name`` and refuse to resume another's states, the planner reads its states and FLOPs (and Muon's
Newton-Schulz FLOPs and exchange traffic).

A next optimizer touches: ``config/sections.py`` (its name in ``OPTIMIZERS`` and its keys in ``OptimConfig``),
``config/checks.py`` (its keys' checks), ``optim/table.py`` (its row), ``optim/build.py`` (its constructor in
``_kind``), its own module if torch has none (as ``optim/muon.py``), and ``docs/optimizers.md``."""
