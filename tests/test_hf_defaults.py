"""Every family's ``config.json`` defaults are ``transformers``' own, and a checkpoint's tensors and training keys are
read as ``transformers`` reads them (issue 58, items 1, 2 and the unexpected tensors).

Checked against the installed ``transformers`` (never against a copy of its numbers), for every family with a
Hugging Face format in the registry, so a new family or a ``transformers`` release that changes a default fails here:

- each default of the family's table (:attr:`meshtrain.models.family.HFFormat.defaults`) equals the attribute of its
  config class built with no arguments, a derived one the class's own derivation;
- the reader looks at no key outside that table (its spellings and the architecture's names aside), and the table
  knows the class's ``attribute_map`` spellings;
- an empty ``config.json`` reads as the class's defaults do, and a tiny config without any one key reads as the
  config ``transformers`` fills from it;
- a Mixtral ``config.json`` without ``rope_theta`` and ``rms_norm_eps`` gives ``transformers``' logits;
- ``router_aux_loss_coef`` and the dropouts come from the folder unless the run sets them, and the run says which;
- a folder holding a tensor its ``config.json`` has no place for (a fifth expert of four, q/k/v biases of a Llama) is
  refused in one line naming it, before anything is written.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import override_args
from meshtrain.models import hf_io as hf
from meshtrain.models.registry import FAMILIES

transformers = pytest.importorskip("transformers")

HF_FAMILIES = [name for name, f in FAMILIES.items() if f.hf is not None]
IDENTITY = ("architectures", "model_type")
"""Keys naming the family (the registry's choice), not the model."""
SPELLINGS = ("rope_scaling",)
"""``transformers`` 4's spelling of ``rope_parameters``, which 5 still reads (over ``rope_parameters``)."""
MISSING = object()

_LLAMA = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-5,
              tie_word_embeddings=True, rope_theta=5e5, attention_dropout=0.125)
_MOE = dict(num_experts_per_tok=1, router_aux_loss_coef=0.02)
_QWEN_MOE = dict(moe_intermediate_size=16, num_experts=4, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], **_MOE)
TINY = {
    "llama": {**_LLAMA, "attention_bias": False, "mlp_bias": False},
    "qwen2": {**_LLAMA, "use_sliding_window": False},
    "qwen3": {**_LLAMA, "attention_bias": False, "use_sliding_window": False},
    "mixtral": {**_LLAMA, "sliding_window": None, "num_local_experts": 4, "router_jitter_noise": 0.0, **_MOE},
    "qwen3_moe": {**_LLAMA, "attention_bias": False, "use_sliding_window": False, **_QWEN_MOE},
    "qwen2_moe": {**_LLAMA, "use_sliding_window": False, "shared_expert_intermediate_size": 24, "qkv_bias": True,
                  **_QWEN_MOE},
    "deepseek_v3": dict(vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                        n_routed_experts=8, routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=4, v_head_dim=12, qk_nope_head_dim=8, n_group=2, topk_group=1,
                        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=False, hidden_act="silu",
                        max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=5e5,
                        rope_interleave=False, attention_bias=False, attention_dropout=0.125),
    "deepseek_v2": dict(vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, n_shared_experts=1, n_routed_experts=8,
                        routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=12,
                        qk_nope_head_dim=8, n_group=2, topk_group=1, topk_method="group_limited_greedy",
                        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=False, hidden_act="silu",
                        max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=5e5,
                        attention_bias=False, attention_dropout=0.125),
    "glm4_moe": {**_LLAMA, "intermediate_size": 40, "moe_intermediate_size": 16, "n_shared_experts": 2,
                 "n_routed_experts": 8, "routed_scaling_factor": 1.5, "n_group": 2, "topk_group": 1,
                 "num_experts_per_tok": 2, "first_k_dense_replace": 0, "norm_topk_prob": False,
                 "partial_rotary_factor": 0.25, "attention_bias": True, "use_qk_norm": True},
    "gpt": dict(vocab_size=80, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=None,
                activation_function="gelu", resid_pdrop=0.05, embd_pdrop=0.05, attn_pdrop=0.05,
                layer_norm_epsilon=1e-6, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                add_cross_attention=False, tie_word_embeddings=True),
}
"""A tiny config of each family with every key of its defaults table set, where it can be, to another value than the
default (a Llama 3.1-free RoPE in transformers 4's top-level ``rope_theta``; an explicit ``head_dim`` of 16 where the
width derives 8)."""

REQUIRED = {"deepseek_v2": {"num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}}
"""Keys whose ``transformers`` default (None) builds no model, which a reader refuses in one line: the least
``config.json`` gives them (``DeepseekV2Config``: no top-k; no groups for its "group_limited_greedy" routing)."""


def fmt(name: str):
    return FAMILIES[name].hf


def config_class(name: str) -> type:
    return getattr(transformers, fmt(name).architectures[0]).config_class


def named(name: str, config: dict) -> dict:
    """``config`` as a ``config.json`` of ``name``'s architecture."""
    return {"architectures": [fmt(name).architectures[0]], "model_type": fmt(name).model_type, **config}


def read(name: str, config: dict) -> dict:
    return fmt(name).read(named(name, config), Path("config.json"))


def filled(name: str, config: dict) -> dict:
    """The ``config.json`` ``transformers`` writes for ``config``: every key it lacks at the class's default."""
    return named(name, config_class(name)(**copy.deepcopy(config)).to_dict())


def test_every_family_with_a_hugging_face_format_is_checked():
    assert set(TINY) == set(HF_FAMILIES), "a new family needs its tiny config here"
    for name in HF_FAMILIES:
        assert fmt(name).defaults, f"{name} states no transformers defaults"


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_each_default_is_the_transformers_config_class_default(name):
    """Key by key against ``XConfig()``: RoPE's base is ``rope_parameters["rope_theta"]`` (the class's
    ``default_theta``); a :class:`meshtrain.models.hf_io.Derived` default is the class's own derivation where it has
    the key (``LlamaConfig.head_dim``), absent or None where its attention derives it."""
    theirs, table = config_class(name)(), fmt(name).defaults
    for key, default in table.items():
        got = theirs.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(theirs, key, MISSING)
        if key == "rope_parameters" and default is None:  # None: RoPE's default type at the class's base
            default = {"rope_type": "default", "rope_theta": table["rope_theta"]}
        if isinstance(default, hf.Derived):
            assert got in (MISSING, None) or got == default.rule(theirs.to_dict()), (key, got, default.text)
        else:
            assert got is not MISSING and got == default, \
                f"{name}: {key} defaults to {got!r} in transformers {transformers.__version__}, {default!r} in meshtrain"


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_the_reader_reads_no_key_without_a_stated_default(name):
    """A ``config.json`` that records every key its reader looks at: all are in the table, its aliases, RoPE's
    other spelling or the architecture's names -- a key read with a default of meshtrain's own would be a new silent
    difference. And the table knows every ``attribute_map`` spelling of its keys."""

    class Recording(dict):
        seen: set

        def __getitem__(self, key):
            self.seen.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            self.seen.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            self.seen.add(key)
            return super().__contains__(key)

    known = {*fmt(name).defaults, *fmt(name).aliases, *IDENTITY, *SPELLINGS}
    for config in (named(name, REQUIRED.get(name, {})), filled(name, TINY[name])):
        recording = Recording(config)
        recording.seen = set()
        fmt(name).read(recording, Path("config.json"))
        assert recording.seen <= known, f"{name} reads {sorted(recording.seen - known)} without a stated default"
    for alias, key in config_class(name).attribute_map.items():
        if alias in known or key in known:
            assert fmt(name).aliases.get(alias) == key or fmt(name).aliases.get(key) == alias, (alias, key)


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_an_empty_config_reads_as_the_class_defaults(name):
    least = REQUIRED.get(name, {})
    assert read(name, least) == read(name, filled(name, least))


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_a_config_without_any_one_key_reads_as_transformers_fills_it(name):
    """For each key of the table the tiny config sets: without it, meshtrain's model keys equal those of the config
    ``transformers`` fills in (a derived default from this config's other keys, e.g. ``head_dim`` from a width of
    32 and 4 heads)."""
    for key in [k for k in fmt(name).defaults if k in TINY[name] and k not in REQUIRED.get(name, {})]:
        trimmed = {k: v for k, v in TINY[name].items() if k != key}
        assert read(name, trimmed) == read(name, filled(name, trimmed)), f"{name} without {key}"


def test_llama31_rope_without_its_factors_is_refused_in_one_line(tmp_path, capsys):
    """``rope_type = "llama3"`` without ``factor``: transformers has no default for it; meshtrain says so in one line
    before anything runs (its ``original_max_position_embeddings`` defaults to ``max_position_embeddings``)."""
    from test_hf import FINETUNE

    from meshtrain.cli.main import main as cli_main

    assert read("llama", {**TINY["llama"], "rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
                )["rope_original_max_positions"] == 64
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / hf.CONFIG_FILE).write_text(json.dumps(named("llama", {**TINY["llama"], "rope_parameters": {
        "rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}})))
    code = cli_main(["plan", str(FINETUNE), "--model.init_from", str(folder), "--num-gpus", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "has no factor, which transformers has no default for" in err, err


# --- a Mixtral config.json without rope_theta and rms_norm_eps -------------------------------------------------

def test_mixtral_without_rope_theta_and_eps_computes_transformers_logits(tmp_path):
    """Before: meshtrain's shared Llama reader took 1e4 and 1e-6 for every family, logits 2.63 off. Now the folder
    means ``MixtralConfig``'s 1e6 and 1e-5, and the logits are ``transformers``' within the summation bound of
    ``test_hf.logits_tolerance``."""
    from test_hf import assert_logits_equal, reference

    from meshtrain.cli.export import load_hf_model

    args = {k: v for k, v in TINY["mixtral"].items() if k not in ("rope_theta", "rms_norm_eps", "head_dim")}
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**args)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    for key in ("rope_parameters", "rope_theta", "rms_norm_eps"):
        config.pop(key, None)
    (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(config))
    ours, cfg = load_hf_model(tmp_path)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.n_kv_head) == (1e6, 1e-5, 2)
    assert_logits_equal(ours, reference(tmp_path), cfg.n_layer, cfg.ffn_hidden_size(), T=cfg.block_size)


# --- training keys from the folder ---------------------------------------------------------------------------

def saved(name: str, folder: Path, drop: tuple[str, ...] = (), **overrides) -> Path:
    """A random tiny model of family ``name`` saved by ``transformers`` into ``folder``, its config.json without
    ``drop``."""
    torch.manual_seed(0)
    config = config_class(name)(**{**TINY[name], **overrides})
    getattr(transformers, fmt(name).architectures[0])(config).save_pretrained(folder)
    data = json.loads((folder / hf.CONFIG_FILE).read_text())
    (folder / hf.CONFIG_FILE).write_text(json.dumps({k: v for k, v in data.items() if k not in drop}))
    return folder


def loaded(folder: Path, **overrides: str):
    from meshtrain.config.load import load_config

    return load_config(None, {"model.init_from": str(folder), **overrides}).model


def test_router_aux_loss_coef_is_the_folders_unless_the_run_sets_it(tmp_path):
    """Before: 0.02 in config.json, 0.001 in the run. Now the folder's, or the run's where it sets one; its absence
    means MixtralConfig's 0.001; the run says which and where from."""
    from meshtrain.config.load import init_from_origins

    folder = saved("mixtral", tmp_path / "mixtral")
    m = loaded(folder)
    assert m.router_aux_loss_coef == 0.02 and m.dropout == 0.125
    assert f"model.router_aux_loss_coef = 0.02, from router_aux_loss_coef in '{folder / hf.CONFIG_FILE}'" in \
        init_from_origins(m)
    m = loaded(folder, **{"model.router_aux_loss_coef": "0.001"})
    assert m.router_aux_loss_coef == 0.001
    assert (f"model.router_aux_loss_coef = 0.001, the run's config ('{folder / hf.CONFIG_FILE}' gives "
            f"router_aux_loss_coef = 0.02)") in init_from_origins(m)
    bare = saved("mixtral", tmp_path / "bare", drop=("router_aux_loss_coef",))
    m = loaded(bare)
    assert m.router_aux_loss_coef == 0.001
    assert any("transformers' default for MixtralForCausalLM" in line and "router_aux_loss_coef" in line
               for line in init_from_origins(m))


def test_gpt2_dropout_is_the_folders_and_unequal_dropouts_need_the_run(tmp_path):
    """GPT-2's three dropouts are meshtrain's one ``model.dropout``: equal, they are its value; unequal, the run must
    set it (one line), and then its value is used."""
    from meshtrain.errors import ConfigError

    assert loaded(saved("gpt", tmp_path / "gpt")).dropout == 0.05
    unequal = saved("gpt", tmp_path / "unequal", embd_pdrop=0.0)
    with pytest.raises(ConfigError, match=r"resid_pdrop = 0.05, embd_pdrop = 0, attn_pdrop = 0.05, .*: set "
                                          r"model.dropout$"):
        loaded(unequal)
    assert loaded(unequal, **{"model.dropout": "0.1"}).dropout == 0.1


def test_train_says_where_router_aux_loss_coef_comes_from(tmp_path):
    """``meshtrain train`` prints the line before its ranks start: in this process, up to the launch (torchrun's
    engine a trap: :func:`artefacts.run_cli_here`; the ranks of such a run are tests/test_hf.py's)."""
    from artefacts import run_cli_here
    from test_hf import FINETUNE, STEPS

    folder = saved("mixtral", tmp_path / "mixtral")
    args = {k: v for k, v in STEPS.items() if not k.startswith("model.")}
    code, stderr, _ = run_cli_here(["train", str(FINETUNE), "--nproc", "1", *override_args({
        **args, "model.init_from": str(folder), "model.block_size": "16", "train.steps": "1",
        "train.out_dir": str(tmp_path / "run")})])
    assert code == "launched", stderr[-3000:]  # every check passed
    assert f"meshtrain train: model.router_aux_loss_coef = 0.02, from router_aux_loss_coef in '{folder}" in stderr
    assert "meshtrain train: model.dropout = 0.0, the run's config" in stderr  # hf_finetune.toml sets it


# --- tensors config.json has no place for ---------------------------------------------------------------------

def with_tensors(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    """Add ``extra`` to the folder's ``model.safetensors``."""
    from safetensors.torch import load_file, save_file

    path = folder / hf.SINGLE_FILE
    save_file({**load_file(path), **extra}, str(path), metadata={"format": "pt"})


def fifth_expert(tmp_path: Path) -> Path:
    folder = saved("mixtral", tmp_path / "hf")
    C, F = TINY["mixtral"]["hidden_size"], TINY["mixtral"]["intermediate_size"]
    with_tensors(folder, {f"model.layers.0.block_sparse_moe.experts.4.{w}.weight": torch.zeros(shape) for w, shape in
                          (("w1", (F, C)), ("w2", (C, F)), ("w3", (F, C)))})
    return folder


def llama_biases(tmp_path: Path) -> Path:
    """A Llama with q/k/v biases whose config.json no longer says ``attention_bias``: LlamaConfig's False."""
    return saved("llama", tmp_path / "hf", drop=("attention_bias",), attention_bias=True)


@pytest.mark.parametrize("case, tensor", [(fifth_expert, "model.layers.0.block_sparse_moe.experts.4.w1.weight"),
                                          (llama_biases, "model.layers.0.self_attn.k_proj.bias")])
@pytest.mark.parametrize("command", ["train", "generate"])
def test_a_tensor_config_json_has_no_place_for_is_refused_in_one_line(case, tensor, command, tmp_path, capsys):
    """Before: trained and generated with the tensors dropped. Now one line naming the (first, sorted) tensor, exit
    code 2, nothing written."""
    from test_hf import FINETUNE, one_line_error

    folder = case(tmp_path)
    out = tmp_path / "run"
    argv = (["train", str(FINETUNE), "--model.init_from", str(folder), "--model.block_size", "16", "--out", str(out),
             "--nproc", "1"] if command == "train" else ["generate", "--checkpoint", str(folder), "--prompt", "a"])
    one_line_error(capsys, argv, f"tensor {tensor}")
    assert not out.exists()


def test_what_transformers_drops_itself_is_accepted(tmp_path):
    """GPT-2's causal-mask buffers (``h.{i}.attn.bias``, older files) and a tied head saved anyway are no weights
    of the model: accepted, as ``transformers`` accepts them."""
    from meshtrain.cli.export import load_hf_model

    folder = saved("gpt", tmp_path / "gpt")
    with_tensors(folder, {"h.0.attn.bias": torch.ones(1, 1, 32, 32), "h.1.attn.masked_bias": torch.tensor(-1e4),
                          "lm_head.weight": torch.zeros(80, 32)})
    load_hf_model(folder)
