"""Pipeline parallelism (``pp``): consecutive layers on consecutive ranks, micro-batches streamed through.

The model is cut into ``pp * virtual_stages`` chunks balanced by cost (:mod:`meshtrain.parallel.pipeline.balance`);
each rank keeps its chunks (the embedding on the first, the final norm, head and loss on the last)
and runs a schedule from ``torch.distributed.pipelining`` over them. Pipeline micro-batches are the
step's ``gradient_accumulation_steps`` micro-batches, so a step's gradient is the same mean as
without a pipeline (the schedules divide it by the number of micro-batches).

Embedding and head: when they sit in different chunks the head gets its own copy of the tied weight
(equal at the start), and after every backward the two gradients are summed across the ranks that
hold them -- Megatron-LM's embedding group -- so both copies stay equal to the single tied weight of
one process. The gradient norm counts that weight once. Multi-token prediction (DeepSeek-V3's) runs on the last
stage, which keeps a copy of the embedding for it, kept equal the same way (:mod:`meshtrain.models.deepseek_v3.mtp`).

Each schedule's rules (torch-free: what config validation and the planner check) are :mod:`meshtrain.rules.pipeline`.
Modules, each imported by name (this package imports nothing, so that ``balance.py`` is read before torch loads):
``balance.py`` (the cut into chunks balanced by cost, torch-free: the launcher prints it), ``split.py``
(:func:`~meshtrain.parallel.pipeline.split.split_model`: this rank's chunks;
:func:`~meshtrain.parallel.pipeline.split.embedding_group`), ``schedule.py``
(:data:`~meshtrain.parallel.pipeline.schedule.SCHEDULES`, with their bubbles, and
:class:`~meshtrain.parallel.pipeline.schedule.Pipeline`, which runs this rank's stages), ``naive.py`` (the naive
schedule), ``trace.py`` (what each rank did when: Chrome trace, timeline, measured bubble).
"""
