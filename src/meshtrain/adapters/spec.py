"""Which modules a family's low-rank adapters (LoRA) may target, by the names ``peft`` uses, and the ``[adapter]``
checks. Torch-free: config validation and the planner read it before any process starts.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685, Eq. 3) replaces a
frozen linear map ``h = W x`` by ``h = W x + (alpha / r) B A x`` with ``A`` (r, in) and ``B`` (out, r) trained;
rank-stabilised LoRA (Kalajdzievski 2023, arXiv:2312.03732, Theorem 3.2) scales by ``alpha / sqrt(r)`` instead.

A target is named as in ``peft``'s ``target_modules``: the last component of the module's name in the family's
Hugging Face checkpoint (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``),
read from the family's :class:`meshtrain.models.family.Source` table, so a new family needs no list here. A module
qualifies when it is a linear map (a 2-D weight inside a block) that one Hugging Face tensor holds whole (not
GPT-2's fused, transposed ``c_attn``; not a stack of experts), and is not a mixture of experts' router.
"""

from __future__ import annotations

from typing import Any

from meshtrain.adapters.saved import saved_modules
from meshtrain.errors import ConfigError, require

ALL_LINEAR = "all-linear"
"""``lora_targets`` value that targets every module that qualifies (peft's ``"all-linear"``; the output head is
never one)."""
GATE_UP, DOWN = "gate_up", "down"
"""The keys of a mixture of experts' adapter stacks (:mod:`meshtrain.adapters.experts`): on the gate and up
projections (fused, as ``transformers``' ``gate_up_proj``), and on the down projection."""
EXPERT_TARGETS = {"experts.gate_up_proj": GATE_UP, "experts.down_proj": DOWN}
"""``lora_targets`` names of the routed experts' stacks, peft's ``target_parameters`` names of ``transformers`` 5's
3-D expert tensors, in the order peft nests their wrappers (:func:`expert_peft_names`); never in ``all-linear``."""
MAGNITUDE = "lora_magnitude_vector"
"""DoRA's magnitude parameter of an adapted module (:mod:`meshtrain.adapters.dora`; peft's name)."""
EXPERTS_PATH = "mlp.experts"
"""The experts' module inside a block (:class:`meshtrain.models.moe.layer.MoE`'s ``experts``)."""
QUANTIZATIONS = ("none", "nf4")
"""``adapter.quantize_base`` values."""
NF4_BLOCK = 64
"""Weights per NF4 block (QLoRA, Sec. 3); :data:`meshtrain.adapters.nf4.BLOCK`."""
ROUTER = "router"
"""The mixture of experts' router (:class:`meshtrain.models.moe.layer.MoE`): frozen, never adapted."""


def lora_modules(m: Any) -> dict[str, tuple[str, ...]]:
    """The family of ``m`` (a ``ModelConfig``)'s adaptable modules: ``{peft name: (module path inside a block,
    ...)}``, e.g. Llama's ``{"q_proj": ("attn.q",), ..., "down_proj": ("mlp.down",)}``; empty for a family without
    a Hugging Face format (lstm, gru) or without a module that qualifies (gpt: its q, k and v are rows of one
    transposed ``c_attn``)."""
    from meshtrain.models.registry import family

    fmt = family(m.type).hf
    if fmt is None:
        return {}
    sources = fmt.sources(m, ())
    shapes = fmt.shapes(m, 1, ())
    readers: dict[str, list[str]] = {}  # Hugging Face tensor -> the parameters read from it
    for ours, source in sources.items():
        readers.setdefault(source.name, []).append(ours)
    out: dict[str, list[str]] = {}
    for ours, source in sources.items():
        parts = ours.split(".")
        if parts[0] != "blocks" or parts[1] != "0" or parts[-1] != "weight" or parts[-2] == ROUTER:
            continue
        whole = len(readers[source.name]) == 1 and not source.transpose and not source.row0 and not source.experts
        if whole and len(shapes.get(source.name, ())) == 2:
            peft_name = source.name.split(".")[-2]
            out.setdefault(peft_name, []).append(".".join(parts[2:-1]))
    return {name: tuple(paths) for name, paths in out.items()}


def has_experts(m: Any) -> bool:
    """Whether the family of ``m`` (a ``ModelConfig``) has routed experts LoRA can target (:data:`EXPERT_TARGETS`)."""
    from meshtrain.models.registry import family

    fmt = family(m.type).hf
    return fmt is not None and f"blocks.0.{EXPERTS_PATH}.w_gate" in fmt.sources(m, ())


def targeted_experts(m: Any, targets: list[str]) -> tuple[str, ...]:
    """The expert stacks (:data:`GATE_UP`, :data:`DOWN`) that ``targets`` name, in :data:`EXPERT_TARGETS`' order
    (checked by :func:`targeted_paths`)."""
    return tuple(kind for name, kind in EXPERT_TARGETS.items() if name in targets)


def targeted_paths(m: Any, targets: list[str]) -> tuple[str, ...]:
    """The module paths inside each block that ``targets`` (``adapter.lora_targets``) name, in the block's order (the
    experts' stacks, which are not modules, by :func:`targeted_experts`).

    Raises:
        ConfigError: no module of the family qualifies, or a target that names none of them.
    """
    experts = [name for name in targets if name in EXPERT_TARGETS]
    require(not experts or has_experts(m), f"adapter.lora_targets names {experts[0] if experts else ''!r}, and "
                                           f"model.type = {m.type!r} has no routed experts: use its module names")
    targets = [name for name in targets if name not in EXPERT_TARGETS]
    if experts and not targets:
        return ()
    modules = lora_modules(m)
    require(bool(modules), f"model.type = {m.type!r} has no module LoRA can target (it needs linear maps that a "
                           f"Hugging Face tensor holds whole: llama, qwen2, qwen3 and the mixtures of experts' "
                           f"attention have them): use adapter.lora_rank = 0")
    if ALL_LINEAR in targets:
        require(targets == [ALL_LINEAR], f"adapter.lora_targets = {targets}: '{ALL_LINEAR}' stands alone; use "
                                         f"['{ALL_LINEAR}'] or a list of module names")
        return tuple(path for paths in modules.values() for path in paths)
    for name in targets:
        valid = ", ".join([*modules, *(EXPERT_TARGETS if has_experts(m) else ())])
        require(name in modules, f"adapter.lora_targets names {name!r}, which model.type = {m.type!r} has no "
                                 f"adaptable module of; valid: {valid} or '{ALL_LINEAR}'")
    return tuple(path for name, paths in modules.items() if name in targets for path in paths)


def _check_nf4(cfg: Any) -> None:
    """What QLoRA's NF4 base needs (:mod:`meshtrain.adapters.nf4`): bitsandbytes, and input widths that are multiples
    of its 64-weight blocks (no tensor parallelism: a layout rule, :mod:`meshtrain.rules.layout`). Raises ConfigError."""
    import importlib.util

    m = cfg.model
    require(importlib.util.find_spec("bitsandbytes") is not None,
            "adapter.quantize_base = 'nf4' needs bitsandbytes, which is not installed: pip install 'meshtrain[qlora]'")
    from meshtrain.models.registry import family

    fmt = family(m.type).hf
    sources, shapes = fmt.sources(m, ()), fmt.shapes(m, 1, ())
    for path in targeted_paths(m, [ALL_LINEAR]):
        width = shapes[sources[f"blocks.0.{path}.weight"].name][1]
        require(width % NF4_BLOCK == 0, f"adapter.quantize_base = 'nf4': blocks.*.{path} takes {width} inputs, not a "
                                        f"multiple of NF4's {NF4_BLOCK}-weight blocks; use quantize_base = 'none'")


def _check_dora(cfg: Any) -> None:
    """What DoRA (:mod:`meshtrain.adapters.dora`) runs with: linear modules on a plain base. Raises ConfigError."""
    a = cfg.adapter
    require(not targeted_experts(cfg.model, list(a.lora_targets)),
            f"adapter.use_dora = true with adapters on the routed experts (adapter.lora_targets = {list(a.lora_targets)}):"
            f" DoRA is built for linear modules only (peft refuses it on expert parameters too); drop the experts' "
            f"targets or use_dora")
    require(a.quantize_base == "none", f"adapter.use_dora = true with adapter.quantize_base = {a.quantize_base!r}: "
                                       f"DoRA on an NF4 base is not built here; use quantize_base = 'none' or "
                                       f"use_dora = false")


def lora_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """The factor of the adapter's output: ``alpha / r`` (Hu et al. 2021, Sec. 4.1), or ``alpha / sqrt(r)`` with
    rank-stabilised LoRA (Kalajdzievski 2023, Theorem 3.2), as peft's ``LoraLayer.update_layer`` computes it."""
    return alpha / (rank ** 0.5 if rslora else rank)


def check_adapter(cfg: Any) -> None:
    """The ``[adapter]`` rules of a whole config ``cfg``: ranges, targets the family has, and the layouts adapters
    run on today.

    Raises:
        ConfigError: the first rule broken, naming the key, its value and what would be valid.
    """
    a, p = cfg.adapter, cfg.parallel
    require(a.lora_rank >= 0, f"adapter.lora_rank = {a.lora_rank} must be >= 0 (0 = no adapters)")
    require(a.quantize_base in QUANTIZATIONS, f"adapter.quantize_base = {a.quantize_base!r} is not one of "
                                              f"{', '.join(map(repr, QUANTIZATIONS))}")
    require(a.lora_rank > 0 or a.quantize_base == "none",
            f"adapter.quantize_base = {a.quantize_base!r} quantizes the frozen base of LoRA adapters, and "
            f"adapter.lora_rank = 0 trains every parameter: set lora_rank > 0, or quantize_base = 'none'")
    require(a.lora_rank > 0 or not a.modules_to_save,
            f"adapter.modules_to_save = {list(a.modules_to_save)} trains modules beside LoRA adapters, and "
            f"adapter.lora_rank = 0 trains every parameter: set lora_rank > 0, or modules_to_save = []")
    if a.lora_rank == 0:
        return
    require(a.lora_alpha > 0, f"adapter.lora_alpha = {a.lora_alpha} must be > 0 (peft's default is 8)")
    require(0 <= a.lora_dropout < 1, f"adapter.lora_dropout = {a.lora_dropout} must be in [0, 1)")
    require(bool(a.lora_targets), "adapter.lora_targets is empty: name modules (e.g. ['q_proj', 'v_proj']) or "
                                  f"use ['{ALL_LINEAR}']")
    targeted_paths(cfg.model, list(a.lora_targets))
    require(not (targeted_experts(cfg.model, list(a.lora_targets)) and a.lora_dropout),
            f"adapter.lora_dropout = {a.lora_dropout} with adapters on the routed experts (adapter.lora_targets = "
            f"{list(a.lora_targets)}): their update is added to the experts' weights, which leaves no input to drop "
            f"(peft refuses it too); use lora_dropout = 0")
    saved_modules(cfg.model, list(a.modules_to_save))  # valid names
    if a.use_dora:
        _check_dora(cfg)
    if a.quantize_base == "nf4":
        _check_nf4(cfg)
    require(p.sync_mode == "sync",
            f"adapter.lora_rank = {a.lora_rank} with parallel.sync_mode = {p.sync_mode!r}: adapters train with the "
            f"synchronous sync_mode only; use sync_mode = 'sync'")


BASE_KEY = "adapter_base"
"""``meta.json``'s record of the frozen base a checkpoint's adapters were trained on (:func:`base_record`)."""


def base_record(init_from: str, seed: int) -> dict[str, Any]:
    """What identifies a LoRA run's frozen base: ``{"init_from": folder, "sha256": ...}``, the SHA-256 of the Hugging
    Face folder's weight files (their names and bytes, in name order; ~1 s per GB read), or, with no
    ``model.init_from``, ``{"init_from": "", "seed": seed}``: the base is ``train.seed``'s initial weights.

    Raises:
        ConfigError: the folder's weights cannot be listed or read.
    """
    import hashlib
    from pathlib import Path

    from meshtrain.models import hf_io

    if not init_from:
        return {"init_from": "", "seed": seed}
    folder = Path(init_from).expanduser()
    digest = hashlib.sha256()
    try:
        for name in sorted(set(hf_io.weight_map(folder).values())):
            digest.update(name.encode() + b"\0")
            with open(folder / name, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    except (OSError, hf_io.HFFormatError) as e:
        raise ConfigError(f"model.init_from = '{init_from}': its weights cannot be read ({e})") from None
    return {"init_from": init_from, "sha256": digest.hexdigest()}


def check_same_base(saved: dict[str, Any] | None, now: dict[str, Any], found: Any) -> None:
    """A checkpoint's adapters continue (or export, or generate) only on the base they were trained on: its
    :data:`BASE_KEY` record ``saved`` must equal ``now`` (:func:`base_record` of the base at hand).

    Raises:
        ConfigError: another base, naming both."""
    if saved is None or saved == now:
        return
    if saved.get("init_from") and saved.get("sha256") != now.get("sha256"):
        raise ConfigError(f"checkpoint {found} holds LoRA adapters trained on the base in '{saved['init_from']}' "
                          f"(weights SHA-256 {saved.get('sha256', '?')[:12]}...), and '{now.get('init_from')}' now "
                          f"holds other weights (SHA-256 {now.get('sha256', '?')[:12]}...): give the base it was "
                          f"trained on (--model.init_from)")
    raise ConfigError(f"checkpoint {found} holds LoRA adapters trained on the base {saved}, not on {now}: give the "
                      f"base it was trained on")


def peft_names(m: Any, paths: tuple[str, ...], dora: bool = False) -> dict[str, str]:
    """``{meshtrain adapter parameter: peft's name in a saved adapter}`` of every block of ``m`` (a ``ModelConfig``)
    for the adapted module ``paths`` (:func:`targeted_paths`): ``blocks.0.attn.q.lora_A.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, the module's name in the family's Hugging
    Face checkpoint (:class:`meshtrain.models.family.Source`) under peft's ``base_model.model.`` prefix, as
    ``peft.get_peft_model_state_dict`` writes ``adapter_model.safetensors``; with ``dora`` DoRA's magnitudes too
    (``...q.lora_magnitude_vector`` -> ``...q_proj.lora_magnitude_vector``, no ``.weight``, as peft saves them)."""
    from meshtrain.models.registry import family

    sources = family(m.type).hf.sources(m, ())
    out = {}
    for i in range(m.n_layer):
        for path in paths:
            module = sources[f"blocks.{i}.{path}.weight"].name.removesuffix(".weight")
            for part in ("lora_A", "lora_B"):
                out[f"blocks.{i}.{path}.{part}.weight"] = f"base_model.model.{module}.{part}.weight"
            if dora:
                out[f"blocks.{i}.{path}.{MAGNITUDE}"] = f"base_model.model.{module}.{MAGNITUDE}"
    return out


def expert_peft_names(m: Any, kinds: tuple[str, ...]) -> dict[str, str]:
    """``{meshtrain expert adapter stack: peft's name in a saved adapter}`` of every block of ``m`` for the expert
    stacks ``kinds`` (:func:`targeted_experts`): ``blocks.0.mlp.experts.lora_A.gate_up`` ->
    ``base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight``. peft wraps ``transformers`` 5's experts
    module once per targeted parameter, in ``target_parameters``' order, the first innermost: each later one adds a
    ``base_layer.`` to the earlier ones' names. The tensors are reshaped by :func:`meshtrain.adapters.experts.to_peft`."""
    from meshtrain.models.registry import family

    if not kinds:
        return {}
    fused = {f"model.layers.0.{EXPERTS_PATH}.gate_up_proj"}  # transformers 5's in-memory names (peft adapts those)
    sources = family(m.type).hf.sources(m, fused)
    out = {}
    for i in range(m.n_layer):
        module = sources[f"blocks.{i}.{EXPERTS_PATH}.w_gate"].name.rsplit(".", 1)[0]  # model.layers.{i}.mlp.experts
        for k, kind in enumerate(kinds):
            inner = "base_layer." * (len(kinds) - 1 - k)
            for part in ("lora_A", "lora_B"):
                out[f"blocks.{i}.{EXPERTS_PATH}.{part}.{kind}"] = f"base_model.model.{module}.{inner}{part}.weight"
    return out


def adapter_parameters(m: Any, targets: list[str], rank: int, dora: bool = False) -> int:
    """How many parameters the adapters of ``m`` (a ``ModelConfig``) hold: ``r * (in + out)`` for each adapted module
    of each block (A is r x in, B out x r; Hu et al. 2021, Sec. 4.1), ``out`` more with ``dora`` (the magnitude),
    ``r * (in + out)`` per expert for the routed experts' stacks; 0 at rank 0."""
    if rank == 0:
        return 0
    from meshtrain.models.registry import family

    fmt = family(m.type).hf
    sources, shapes = fmt.sources(m, ()), fmt.shapes(m, 1, ())
    per_block = sum(sum(shapes[sources[f"blocks.0.{path}.weight"].name]) for path in targeted_paths(m, targets))
    magnitudes = sum(shapes[sources[f"blocks.0.{path}.weight"].name][0] for path in targeted_paths(m, targets))
    kinds = targeted_experts(m, targets)  # per expert: gate_up r * (C + 2F), down r * (F + C)
    if kinds:
        C, F = m.n_embd, m.ffn_hidden_size()
        per_block += m.num_experts * ((C + 2 * F) * (GATE_UP in kinds) + (F + C) * (DOWN in kinds))
    return (rank * per_block + (magnitudes if dora else 0)) * m.n_layer
