"""An export of a run that started from a Hugging Face folder keeps the folder's ``config.json`` (issue 58, item 3).

Every key the source had is written back as it was -- its spelling (``transformers`` 5's ``rope_parameters`` and
``dtype``, 4's top-level ``rope_theta``), a Qwen-MoE's dense ``intermediate_size``, GPT-2's three dropouts, the
options meshtrain has no use for -- unless the run changed what it means: then the new value, in the source's
spelling, listed in the export's report. Each family's config is round-tripped with every key of its defaults table
set (the tiny configs of ``test_hf_defaults``), and ``transformers`` loads each export with every weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import train_config_here
from meshtrain.models import hf_io as hf
from meshtrain.cli.export import load_hf_model
from meshtrain.models.hf import hf_config, write_hf_folder
from test_hf_defaults import HF_FAMILIES, TINY, fmt, loaded, named, saved

transformers = pytest.importorskip("transformers")


def source_of(folder: Path) -> dict:
    return json.loads((folder / hf.CONFIG_FILE).read_text())


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_an_export_writes_the_source_config_back_key_for_key(name, tmp_path):
    """Before: ``rope_parameters`` rewritten as ``rope_theta``, a Qwen-MoE's ``intermediate_size`` as the expert
    width, GPT-2's dropouts as the run's. Now a run that changed nothing exports the source's config.json as it was,
    and ``transformers`` loads it with no missing or unexpected weight."""
    folder = saved(name, tmp_path / "src")
    source = source_of(folder)
    model, _ = load_hf_model(folder)
    m = loaded(folder)  # the run's [model]: the folder's keys, its training keys too
    config, changes = hf_config(m, m.vocab_size, source)
    assert config == source and not changes, {k: (source.get(k), config.get(k)) for k in {*config, *source}
                                              if source.get(k) != config.get(k)}
    write_hf_folder(tmp_path / "out", model.state_dict(), m, m.vocab_size, None, 2**30, source)
    assert source_of(tmp_path / "out") == source
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


TRAINED = {"dropout": 0.0, "router_aux_loss_coef": 0.05}
"""Training keys a run set to other values than the tiny configs' (0.125 / 0.05 dropout, 0.02). GLM-4.5's
``num_nextn_predict_layers`` is a training key too (a run may drop the MTP layer), but its export keeps the source's
count with the layer absent, as a ``transformers`` save does (``tests/test_glm4_moe.py``): left out here."""


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_a_training_key_the_run_set_is_exported_and_reported(name, tmp_path):
    """The run set ``model.dropout`` (and an MoE's ``router_aux_loss_coef``): the export writes the run's values
    under the source's names -- all three of GPT-2's dropouts -- lists them as changed, and keeps every other key."""
    folder = saved(name, tmp_path / "src")
    source = source_of(folder)
    training = {k: v for k, v in fmt(name).training.items() if k != "num_nextn_predict_layers"}
    m = loaded(folder, **{f"model.{key}": str(TRAINED[key]) for key in training})
    config, changes = hf_config(m, m.vocab_size, source)
    names = {spelled: TRAINED[key] for key, spellings in training.items() for spelled in spellings}
    assert changes == {spelled: (source[spelled], value) for spelled, value in names.items()}
    assert config == {**source, **names}


def test_transformers_4_spelling_stays_and_a_changed_rope_keeps_the_sources_spelling(tmp_path):
    """A source in ``transformers`` 4's spelling (top-level ``rope_theta``, ``torch_dtype``) keeps it, but for the
    dtype, float32 as the weights are (reported); a RoPE base the run changed (a resume without ``init_from``) is
    written into a transformers 5 source's ``rope_parameters``, no top-level ``rope_theta`` added."""
    v4 = named("llama", {**TINY["llama"], "torch_dtype": "bfloat16", "bos_token_id": 1})
    m = loaded(saved("llama", tmp_path / "src"))
    config, changes = hf_config(m, m.vocab_size, v4)
    assert config == {**v4, "torch_dtype": "float32"} and changes == {"torch_dtype": ("bfloat16", "float32")}
    v5 = source_of(tmp_path / "src")
    m.rope_theta = 2e5
    config, changes = hf_config(m, m.vocab_size, v5)
    assert "rope_theta" not in config and config["rope_parameters"] == {"rope_type": "default", "rope_theta": 2e5}
    assert config == {**v5, "rope_parameters": config["rope_parameters"]}
    assert changes == {"rope_parameters": (v5["rope_parameters"], config["rope_parameters"])}


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_a_qwen_moe_export_from_scratch_writes_no_dense_width(name):
    """A model with experts in every layer has no dense MLP: its own export leaves ``intermediate_size`` (the
    width of ``mlp_only_layers``' MLPs) to transformers' default instead of writing the expert width there."""
    from meshtrain.models.registry import ModelConfig

    m = ModelConfig(type=name, n_layer=1, n_embd=32, n_head=4, ffn_hidden=16, num_experts=4, num_experts_per_tok=2,
                    shared_expert_ffn=24 if name == "qwen2_moe" else 0)
    config, _ = hf_config(m, 80, None)
    assert "intermediate_size" not in config and config["moe_intermediate_size"] == 16


def test_export_reports_the_training_key_the_run_changed(tmp_path, capsys):
    """``meshtrain export --format hf`` of a Mixtral run that set ``router_aux_loss_coef``: the export has the run's
    0.05 where the source had 0.02, the command says so, and the rest is the source's."""
    from test_hf import FINETUNE, STEPS

    from meshtrain.cli.main import main as cli_main

    folder = saved("mixtral", tmp_path / "src")
    args = {k: v for k, v in STEPS.items() if not k.startswith("model.")}
    train_config_here(FINETUNE, **{  # the run is this test's starting point: trained in this process
        **args, "model.init_from": str(folder), "model.router_aux_loss_coef": "0.05", "model.dropout": "0.125",
        "train.steps": "1", "train.out_dir": str(tmp_path / "run")})
    capsys.readouterr()
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "x")]) == 0
    out = capsys.readouterr().out
    assert "config.json: router_aux_loss_coef = 0.05 (the source model's was 0.02; the run changed it)" in out, out
    assert source_of(tmp_path / "x") == {**source_of(folder), "router_aux_loss_coef": 0.05}
