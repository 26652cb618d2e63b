"""What a model family provides: the contract between one folder ``models/<family>/`` and the rest of meshtrain.

A family is a folder with a torch-free ``spec.py`` that fills in a :class:`Family`, and a ``model.py`` that
builds the torch module; :mod:`meshtrain.models.registry` lists the families, one line each, and is the only
place that reads ``model.type``. Config checks, the planner, the pre-launch checks, the pipeline split, the
tensor-parallel plan and Hugging Face import/export ask the registry for the family and call what it provides
here, so adding a family touches its folder and the registry line only (learned from torchtitan's
``TrainSpec``/model registry; meshtrain keeps one generic ``parallelize`` that reads the family's plan).

What ``model.py``'s class must provide is :class:`meshtrain.models.base.LayeredLM`'s contract: ``blocks`` in an
``nn.ModuleDict`` keyed by layer index, the embedding and head module names, ``tp_plan`` and
``tp_split_dropout_modules``, ``forward(idx, positions=None, doc_ids=None)`` -> logits (B, T, V), ``generate``.

Auxiliary loss: a family with ``aux_loss = True`` (a mixture of experts' router, :mod:`meshtrain.models.moe`)
has a model whose forward adds its blocks' auxiliary loss to the cross-entropy through the gradient: it hands the
loss's gradient to the blocks that made it in backward (:func:`meshtrain.models.moe.layer.attach_aux_loss`), so
every layout -- a pipeline stage that never sees the cross-entropy included -- trains on ``cross-entropy + aux``;
``aux_loss()`` returns the last forward's value for the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


OPTIMIZER_FLOPS_PER_PARAM = 16
"""FLOPs per parameter per step outside the matmuls, for a family's ``layer_costs``: AdamW's update (~12
elementwise operations on m, v and the weight, PyTorch's ``_single_tensor_adamw``) plus accumulating and zeroing
the gradient."""
BLOCK_KINDS = ("attention", "recurrent")
"""What a family's blocks are: "attention" blocks can be tensor- and sequence-parallel, compiled, recomputed
and document-masked; "recurrent" ones run their sequence in order on one rank (dp and pp only)."""


@dataclass(frozen=True)
class Source:
    """Where a meshtrain parameter lives in a Hugging Face checkpoint: rows ``row0 .. row0 + rows`` (dim 0) of
    tensor ``name``, transposed first when ``transpose`` (GPT-2's ``Conv1D`` stores (in, out)).

    A 3-D parameter (E, rows, cols) holds one matrix per expert (:mod:`meshtrain.models.moe`): with ``experts`` = E
    it is the stack of E tensors ``name.format(e=e)`` (the per-expert tensors of published checkpoints); with
    ``experts`` = 0 it is the 3-D tensor ``name`` whose rows ``row0 ..`` (dim 1) it holds (``transformers``' fused
    experts)."""

    name: str
    transpose: bool = False
    row0: int = 0
    experts: int = 0
    """See above; a Source whose ``name`` is "" marks a model tensor no Hugging Face checkpoint holds (a routing bias
    of :mod:`meshtrain.models.moe`): an import leaves it at its initial value, an export writes nothing for it."""


@dataclass(frozen=True)
class HFFormat:
    """A family's Hugging Face ``transformers`` format: its ``config.json`` and its tensors' names and shapes.

    ``present`` is the set of tensor names a checkpoint folder holds (empty when writing one): a family whose
    names vary between files (GPT-2's optional ``transformer.`` prefix) reads it."""

    architectures: tuple[str, ...]
    """``config.json``'s ``architectures`` this family builds; the first is the one an export writes."""
    model_type: str
    """``config.json``'s ``model_type``, which names the family when ``architectures`` is absent."""
    read: Callable[[dict[str, Any], Path], dict[str, Any]]
    """``(config.json, its path)`` -> the ``[model]`` keys it sets. Raises ``HFFormatError`` (an option the model
    does not build, a missing or ill-typed key)."""
    write: Callable[[Any, int], dict[str, Any]]
    """``(ModelConfig, vocab_size)`` -> ``config.json`` for ``transformers`` (fp32 weights)."""
    sources: Callable[[Any, Collection[str]], dict[str, Source]]
    """``(ModelConfig, present)`` -> {meshtrain parameter name: :class:`Source`}; a tied head reads the embedding."""
    shapes: Callable[[Any, int, Collection[str]], dict[str, tuple[int, ...]]]
    """``(ModelConfig, vocab_size, present)`` -> {tensor name: shape} every weight has in a checkpoint (a tied
    head not listed: ``transformers`` saves it once, as the embedding)."""
    zeros: Callable[[Any], dict[str, tuple[int, ...]]] = lambda m: {}
    """``ModelConfig`` -> {tensor name: shape} of tensors ``transformers`` expects that this model lacks: an export
    writes them as zeros (a GPT without biases is GPT-2 with zero biases)."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Every ``config.json`` key ``read`` reads -> the default of the family's ``transformers`` config class
    (``LlamaConfig``, ...), which a file without the key means: a value, or a :class:`meshtrain.models.hf_io.Derived`
    rule from other keys. ``tests/test_hf_defaults.py`` compares it with the installed ``transformers``."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Other spellings of a key in ``defaults`` that ``transformers`` reads as it (its config class's
    ``attribute_map``, e.g. Mixtral's ``num_experts`` for ``num_local_experts``)."""
    training: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """``[model]`` keys that ``config.json`` holds but training may choose (dropout, the load-balancing loss's weight)
    -> the ``config.json`` keys that hold them: the folder's value unless the run sets the key."""
    copies: Callable[[Any], dict[str, str]] = lambda m: {}
    """``ModelConfig`` -> {tensor name: the tensor name it repeats} of tensors a checkpoint holds twice (DeepSeek-V3's
    multi-token prediction layer's embedding and head): :attr:`shapes` lists them, an import reads the original and
    an export writes the copy again."""
    ignored: tuple[str, ...] = ()
    """Regular expressions (searched, as ``transformers``' ``_keys_to_ignore_on_load_unexpected``) of checkpoint
    tensors the model has no place for and ``transformers`` drops silently (GPT-2's causal-mask buffers); any other
    tensor the model lacks is refused (:func:`meshtrain.models.hf_io.check_weights`)."""


@dataclass(frozen=True)
class TPNames:
    """A decoder's tensor-parallel plan by module name inside ``blocks.{i}`` (Megatron-LM's layout, Shoeybi et
    al. 2019, arXiv:1909.08053, Sec. 3): column-parallel projections, row-parallel ones, and head-sharded
    norms (a norm over each head's features, whose weight every tp rank holds whole)."""

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    head_norms: tuple[str, ...] = ()
    extra_inputs: int = 0
    """Plain tensors a block and its attention take after the residual stream (RoPE's ``cos, sin``: 2)."""
    plain_inputs: bool = False
    """Whether a block's ``attn`` and ``mlp`` take the replicated residual stream as a plain tensor, each
    column-parallel module then all-reducing its own input's gradient (Megatron's ``f`` per module), instead of one
    ``DTensor`` shared by all of them: for modules that also run replicated layers on that input (MLA's
    down-projections and latent norms, DeepSeekMoE's router and routed experts beside its split shared experts)."""
    experts_sequence_parallel: bool = False
    """Whether ``tp_sequence_parallel`` works with the family's experts: its model's ``tp_plan`` all-gathers the
    sequence before each mixture of experts (replicated over tp) and cuts its output back to this rank's tokens
    (DeepSeek-V3); otherwise :mod:`meshtrain.rules.layout` refuses the two together."""


@dataclass(frozen=True)
class Family:
    """One model family (one ``model.type``): its keys, checks, shapes, costs and formats, without torch."""

    name: str
    """``model.type``."""
    summary: str
    """One line for docs and errors, e.g. "Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention)"."""
    model: str
    """``"module:Class"`` of the torch module, by name (:data:`meshtrain.models.build.MODELS` imports the class and
    builds it; a test checks the two agree)."""
    keys: type | None
    """Dataclass of this family's own ``[model]`` keys (defaults and a docstring under each); families that share
    keys share the class. :data:`meshtrain.models.registry.ModelConfig` holds every family's keys."""
    blocks: str
    """One of :data:`BLOCK_KINDS`."""
    check: Callable[[Any], None]
    """``ModelConfig`` -> None: the family's own rules (ranges, shapes). Raises ``ConfigError``."""
    layer_costs: Callable[[Any, int, int], tuple[float, float, float]]
    """``(ModelConfig, vocab_size, tokens)`` -> (embedding, one block, head) FLOPs per step for ``tokens`` tokens
    per pipeline rank (:mod:`meshtrain.parallel.pipeline.split`, which cuts the stages)."""
    resume_keys: tuple[str, ...]
    """``[model]`` keys a checkpoint must share with the config to resume (the shapes it loads into)."""
    kv_heads: Callable[[Any], int] = lambda m: m.n_head
    """Key/value heads of the attention (grouped-query attention: fewer than ``n_head``)."""
    head_dim: Callable[[Any], int] = lambda m: m.n_embd // m.n_head
    """Features per attention head."""
    ffn_hidden: Callable[[Any], int] = lambda m: 4 * m.n_embd
    """Width of the MLP's hidden layer."""
    planner: Callable[[Any, int], dict[str, Any]] | None = None
    """``(ModelConfig, vocab_size)`` -> the keyword arguments of the planner's ``ModelSpec`` (layers, hidden,
    heads, ffn width, kv heads, activation, tying, positions, biases); None: the planner does not model it."""
    hf: HFFormat | None = None
    """Hugging Face import and export; None: the family has no ``transformers`` architecture."""
    tp: TPNames | None = None
    """Tensor-parallel plan names; None: no tensor parallelism."""
    derived: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    """Keys whose 0 means "derive it" -> how (from the other keys): a Hugging Face folder's explicit value is then
    accepted when it equals the derived one (``model.init_from`` with the config an export was trained with)."""
    experts: bool = False
    """Whether its MLPs are mixtures of experts (:mod:`meshtrain.models.moe`), which expert parallelism
    (``parallel.ep``) splits."""
    tp_widths: Callable[[Any], dict[str, int]] = lambda m: {}
    """``ModelConfig`` -> {what (the keys it comes from): width} of the widths tensor parallelism splits beyond the
    heads and the dense MLP's ``ffn_hidden`` (:mod:`meshtrain.rules.layout`): DeepSeek-V3's dense layers and shared
    experts. Config validation refuses a tp that does not divide one, in one line."""
    qk_clip: bool = True
    """Whether QK-clip (``optim.qk_clip``, :mod:`meshtrain.optim.qk_clip`) can bound its attention logits by scaling
    each head's ``attn.q`` and ``attn.k`` rows: not where q and k are normalised per head (Qwen3's RMSNorm, whose
    logits are bounded already), nor in latent attention (DeepSeek-V3, whose clip scales other matrices)."""
    aux_loss: bool = False
    """Whether the model has an auxiliary loss that its forward adds to the cross-entropy's gradient, and whose last
    value ``aux_loss()`` returns (see the module docstring)."""

    @property
    def attention(self) -> bool:
        """Whether its blocks are attention blocks (tp, sp, compile, recompute and document masks apply)."""
        return self.blocks == "attention"

