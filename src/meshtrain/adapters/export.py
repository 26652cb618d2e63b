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

from meshtrain.adapters.spec import peft_names, targeted_paths
from meshtrain.errors import ConfigError
from meshtrain.fileio import fresh_temp_dir, unwritten
from meshtrain.models.base import is_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(adapter: Any, model_cfg: Any) -> dict[str, Any]:
    """``adapter_config.json`` of the ``[adapter]`` section ``adapter``: peft's ``LoraConfig`` fields that fix the
    adapters' maths (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules`` by the Hugging Face module names of
    :func:`meshtrain.adapters.spec.peft_names`), no bias, and the base's folder as ``base_model_name_or_path``."""
    names = peft_names(model_cfg, targeted_paths(model_cfg, list(adapter.lora_targets)))
    targets = sorted({theirs.split(".lora_")[0].rsplit(".", 1)[1] for theirs in names.values()})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.lora_rank, "lora_alpha": adapter.lora_alpha,
            "lora_dropout": adapter.lora_dropout, "use_rslora": adapter.use_rslora, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None, "base_model_name_or_path": model_cfg.init_from or None}


def write_peft_folder(out: Path, state: dict[str, torch.Tensor], adapter: Any, model_cfg: Any) -> list[Path]:
    """Write the peft adapter folder ``out`` (which must not exist) from a whole model's ``state`` (its adapters are
    read, by :func:`meshtrain.adapters.spec.peft_names`), built beside it and renamed into place. Returns the files.

    Raises:
        ConfigError: ``out`` exists, ``state`` holds no adapter, or the folder cannot be written.
    """
    from safetensors.torch import save_file

    if out.exists():
        raise ConfigError(f"'{out}' already exists: exports never overwrite; choose another --out")
    names = peft_names(model_cfg, targeted_paths(model_cfg, list(adapter.lora_targets)))
    if not any(map(is_adapter, state)):
        raise ConfigError("the checkpoint holds no LoRA adapters (adapter.lora_rank = 0): export it with --format hf")
    tensors = {theirs: state[ours].detach().float().contiguous() for ours, theirs in names.items()}
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
