"""A LoRA run's adapters as ``peft`` saves them (``PeftModel.save_pretrained``): ``adapter_config.json`` and
``adapter_model.safetensors``, which ``PeftModel.from_pretrained(base, folder)`` loads onto the Hugging Face base the
run started from (``model.init_from``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from meshtrain.adapters.experts import to_peft
from meshtrain.adapters.saved import saved_peft_names, tied_embeddings
from meshtrain.adapters.spec import EXPERT_TARGETS, expert_peft_names, peft_names, targeted_experts, targeted_paths
from meshtrain.errors import ConfigError
from meshtrain.fileio import fresh_temp_dir, unwritten
from meshtrain.models.base import is_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(adapter: Any, model_cfg: Any) -> dict[str, Any]:
    """``adapter_config.json`` of the ``[adapter]`` section ``adapter``: peft's ``LoraConfig`` fields that fix the
    adapters' maths (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules`` by the Hugging Face module names of
    :func:`meshtrain.adapters.spec.peft_names`), the routed experts' stacks as ``target_parameters``
    (:func:`meshtrain.adapters.spec.expert_peft_names`), no bias, ``modules_to_save`` (for a tied embedding with
    ``ensure_weight_tying``, so that peft keeps the one trained matrix), and the base's folder as
    ``base_model_name_or_path``."""
    names = peft_names(model_cfg, targeted_paths(model_cfg, list(adapter.lora_targets)))
    targets = sorted({theirs.split(".lora_")[0].rsplit(".", 1)[1] for theirs in names.values()})
    saved = list(adapter.modules_to_save)
    experts = [f"mlp.{name}" for name in EXPERT_TARGETS if name in adapter.lora_targets]  # in peft's nesting order
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.lora_rank, "lora_alpha": adapter.lora_alpha,
            "lora_dropout": adapter.lora_dropout, "use_rslora": adapter.use_rslora, "use_dora": adapter.use_dora,
            "target_modules": targets or None,
            "target_parameters": experts or None,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": saved or None, "ensure_weight_tying": bool(saved) and tied_embeddings(model_cfg),
            "base_model_name_or_path": model_cfg.init_from or None}


def write_peft_folder(out: Path, state: dict[str, torch.Tensor], adapter: Any, model_cfg: Any) -> list[Path]:
    """Write the peft adapter folder ``out`` (which must not exist) from a whole model's ``state`` (its adapters are
    read, by :func:`meshtrain.adapters.spec.peft_names`, and the modules trained beside them, by
    :func:`meshtrain.adapters.spec.saved_peft_names`), built beside it and renamed into place. Returns the files.

    Raises:
        ConfigError: ``out`` exists, ``state`` holds no adapter, or the folder cannot be written.
    """
    from safetensors.torch import save_file

    if out.exists():
        raise ConfigError(f"'{out}' already exists: exports never overwrite; choose another --out")
    names = peft_names(model_cfg, targeted_paths(model_cfg, list(adapter.lora_targets)), adapter.use_dora)
    if not any(map(is_adapter, state)):
        raise ConfigError("the checkpoint holds no LoRA adapters (adapter.lora_rank = 0): export it with --format hf")
    names |= saved_peft_names(model_cfg, list(adapter.modules_to_save))  # the modules trained beside them
    # copies: safetensors refuses tensors that share memory (a tied embedding written under both names)
    tensors = {theirs: state[ours].detach().float().clone() for ours, theirs in names.items()}
    experts = expert_peft_names(model_cfg, targeted_experts(model_cfg, list(adapter.lora_targets)))
    tensors |= {theirs: to_peft(ours.split(".")[-2], state[ours].detach().float()).contiguous()
                for ours, theirs in experts.items()}  # ours: blocks.{i}.mlp.experts.lora_A.gate_up
    tmp = fresh_temp_dir(out)
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_config(adapter, model_cfg), indent=2) + "\n")
        os.replace(tmp, out)
    except OSError as e:
        raise ConfigError(unwritten(out, e)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(out.iterdir())
