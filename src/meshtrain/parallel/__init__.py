"""The parallel strategies, one module or folder each (``tensor``, ``sequence/``, ``pipeline/``, ``expert``,
``data_parallel``, ``hierarchical``, ``local_sgd``, ``async_ps``, ``diloco/``, ``recompute``), what they share
(``reduce``, ``rng``, ``model``), and how they compose: :func:`meshtrain.parallel.compose.parallelize`, the one
function the trainer calls.

Importing this package imports nothing, so that the torch-free parts of a strategy (the pipeline's cost-balanced
split, :mod:`meshtrain.parallel.pipeline.balance`) can be read by the launcher and the planner before torch; every
name is imported from the module that defines it (``from meshtrain.parallel.compose import parallelize``).
"""
