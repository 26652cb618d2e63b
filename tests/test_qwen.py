"""Qwen2 / Qwen2.5 and Qwen3 (dense), and the Llama with a decoupled ``head_dim``, checked against ``transformers``.

Each family is one folder (``models/qwen2``, ``models/qwen3``) and one registry line. ``transformers`` builds tiny
random ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` models offline (their biases and q/k norm
weights made non-trivial: the init sets them to 0 and 1, which would hide one loaded into the wrong place):

- imported logits equal ``transformers``' (tolerance :func:`test_hf.logits_tolerance`);
- import -> export is bit-identical and loads in ``transformers`` with no missing key; a meshtrain-built model's
  export computes ``transformers``' logits;
- ``model.init_from`` into tp (with Megatron-SP), Ulysses, ring, FSDP2 and tp x pp: every step's loss and the step-1
  gradients equal one process's, and the first loss equals ``transformers``' on the same batch;
- greedy ``generate --temperature 0`` of a run trained at tp=2 x pp=2 equals ``transformers``' greedy decoding of
  its export;
- the planner's parameter count equals the built model's ``numel()`` for every family the planner models.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import assert_close_grads, assert_close_losses
from layout_worker import launch_layouts, reference_run
from meshtrain.models import hf_io as hf
from meshtrain.cli.export import load_hf_model
from meshtrain.models.hf import write_hf_folder
from test_hf import FINETUNE, PIPE, V, assert_logits_equal, first_batch_loss, model_overrides, reference

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, bos_token_id=None,
             eos_token_id=None)
ROPE = {"rope_type": "default", "rope_theta": 1000000.0}


def saved(folder: Path, architecture: str, **overrides) -> Path:
    """A random tiny ``architecture`` (Qwen2ForCausalLM, ...) saved into ``folder``, its 1-D parameters (biases,
    norm weights) perturbed."""
    config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(
        **{**SHAPE, "rope_parameters": ROPE, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


CASES = {
    "qwen2-tied": lambda d: saved(d, "Qwen2ForCausalLM", tie_word_embeddings=True),
    "qwen2-untied": lambda d: saved(d, "Qwen2ForCausalLM", tie_word_embeddings=False),
    "qwen3-head-dim-16": lambda d: saved(d, "Qwen3ForCausalLM", head_dim=16),
    "qwen3-head-dim-8": lambda d: saved(d, "Qwen3ForCausalLM", head_dim=8, tie_word_embeddings=True),
    "llama-head-dim-16": lambda d: saved(d, "LlamaForCausalLM", head_dim=16),
}


@pytest.mark.parametrize("case", CASES)
def test_imported_logits_equal_transformers(case, tmp_path):
    folder = CASES[case](tmp_path / "hf")
    ours, cfg = load_hf_model(folder)
    assert cfg.type == case.split("-")[0]
    assert_logits_equal(ours, reference(folder), cfg.n_layer, cfg.ffn_hidden_size(), T=cfg.block_size)


@pytest.mark.parametrize("case", CASES)
def test_import_export_round_trip_is_bit_identical(case, tmp_path):
    """Import -> export writes every tensor back bit for bit under the same names, and ``transformers`` loads it
    with no missing, unexpected or mismatched key."""
    folder = CASES[case](tmp_path / "hf")
    ours, cfg = load_hf_model(folder)
    out = tmp_path / "out"
    write_hf_folder(out, ours.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    with safe_open(str(folder / hf.SINGLE_FILE), framework="pt") as f:
        original = {name: f.get_tensor(name) for name in f.keys()}
    with safe_open(str(out / hf.SINGLE_FILE), framework="pt") as f:
        exported = {name: f.get_tensor(name) for name in f.keys()}
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t.float()), name
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.parametrize("model", [{"type": "qwen2", "n_kv_head": 2}, {"type": "qwen2", "tie_embeddings": True},
                                   {"type": "qwen3", "head_dim": 16}, {"type": "llama", "head_dim": 4}])
def test_a_built_model_exports_as_transformers_computes_it(model, tmp_path):
    """A meshtrain model (its biases and norms at their init) exported loads in ``transformers`` with no missing
    key and the same logits."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, multiple_of=16, **model)
    torch.manual_seed(0)
    ours = build_model(cfg, V)
    out = tmp_path / "out"
    write_hf_folder(out, ours.state_dict(), cfg, V, None, max_shard_bytes=2**30)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(theirs).__name__ == cfg.family().hf.architectures[0]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_logits_equal(ours, theirs.eval(), cfg.n_layer, cfg.ffn_hidden_size(), T=cfg.block_size)


@pytest.mark.parametrize("model", [{"type": "gpt"}, {"type": "gpt", "bias": True}, {"type": "llama", "n_kv_head": 2},
                                   {"type": "llama", "head_dim": 16, "tie_embeddings": True},
                                   {"type": "qwen2", "n_kv_head": 1}, {"type": "qwen3", "head_dim": 16, "n_kv_head": 2},
                                   {"type": "mixtral", "n_kv_head": 2, "ffn_hidden": 24, "num_experts": 4},
                                   {"type": "qwen3_moe", "head_dim": 16, "ffn_hidden": 24, "num_experts": 8,
                                    "num_experts_per_tok": 3}])
def test_planner_parameter_count_equals_the_built_model(model):
    """The planner's N (:class:`meshtrain.planner.model_specs.ModelSpec`, from the family's planner numbers) is the
    built model's parameter count, a tied head counted once."""
    from meshtrain.config.sections import Config
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model
    from meshtrain.planner.model_specs import from_config

    cfg = Config(model=ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, multiple_of=16, **model))
    torch.manual_seed(0)
    assert from_config(cfg, vocab_size=V).num_params() == build_model(cfg.model, V).num_params()


# --- training from imported weights, every layout ------------------------------------------------------------

LAYOUTS = {
    "qwen2-tp2": (2, "qwen2", {"parallel.tp": "2"}),
    "qwen2-ring-sp2": (2, "qwen2", {"parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "qwen3-tp2-seqpar": (2, "qwen3", {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "qwen3-ulysses-sp2": (2, "qwen3", {"parallel.sp": "2"}),
    "qwen3-fsdp2-dp2": (2, "qwen3", {"parallel.zero_stage": "3", "batch.micro_batch_size": "2"}),
    "qwen2-pp2": (2, "qwen2", PIPE),
    "qwen3-tp2-pp2": (4, "qwen3", {"parallel.tp": "2", **PIPE, "checkpoint.interval": "0"}),
    "qwen2-dp2-tp2": (4, "qwen2", {"parallel.tp": "2", "batch.micro_batch_size": "2"}),
}
"""Each layout's global batch is the one-process reference's 4 samples; the model keys come from the folder."""
SLOW = {"qwen2-tp2", "qwen3-ulysses-sp2", "qwen3-fsdp2-dp2", "qwen2-pp2", "qwen2-dp2-tp2", "qwen3-tp2-pp2"}
"""In `make test-slow` (`make test` stays under 15 minutes on 2 cores): `make test` keeps Qwen3's q/k norms under tp
with Megatron-SP and Qwen2's biases under ring sp, in one 2-rank launch; the Llama's tests run every layout too."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(folders by family, {layout: (losses, step-1 grads, final params)}, {family: one-process result}, root)."""
    root = tmp_path_factory.mktemp("qwen_layouts")
    folders = {"qwen2": CASES["qwen2-tied"](root / "qwen2"), "qwen3": CASES["qwen3-head-dim-16"](root / "qwen3")}
    one = {name: reference_run(root / f"one-{name}", model_overrides(folder), config=FINETUNE)
           for name, folder in folders.items()}
    return folders, launch(root, {n: v for n, v in LAYOUTS.items() if n not in SLOW}, folders), one, root


def launch(root: Path, layouts: dict, folders: dict) -> dict:
    """One torchrun launch per world size of ``layouts`` (name -> (world, family, overrides)) under ``root``."""
    results = {}
    for world in sorted({w for w, _, _ in layouts.values()}):
        (root / f"w{world}").mkdir(parents=True, exist_ok=True)
        named = {n: {**model_overrides(folders[f]), **o} for n, (w, f, o) in layouts.items() if w == world}
        results |= launch_layouts(world, root / f"w{world}", named, config=FINETUNE)
    return results


@pytest.fixture(scope="module")
def trained_slow(trained):
    folders, _, one, root = trained
    return launch(root / "slow", {n: v for n, v in LAYOUTS.items() if n in SLOW}, folders), one


def check(results: dict, one: dict, name: str) -> None:
    """Every layout loaded the slices it holds (q/k/v biases column-parallel, q/k norms whole on every tp rank with
    their gradients summed over the heads): every step's loss and the step-1 gradients equal one process's."""
    family = LAYOUTS[name][1]
    assert_close_losses(results[name][0], one[family][0])
    assert_close_grads(results[name][1], one[family][1])


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in SLOW])
def test_training_from_imported_weights_equals_one_process(trained, name):
    _, results, one, _ = trained
    check(results, one, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_training_from_imported_weights_equals_one_process_slow(trained_slow, name):
    check(*trained_slow, name)


def test_first_step_loss_equals_transformers(trained):
    folders, _, one, _ = trained
    for name, folder in folders.items():
        want, tol = first_batch_loss(folder)
        assert abs(one[name][0][1] - want) <= tol, f"{name}: {one[name][0][1]} vs transformers' {want} (tol {tol:.2e})"


def test_tp2_run_exported_generates_as_transformers(trained, tmp_path):
    """A Qwen3 trained at tp=2 with Megatron-SP and exported: ``transformers``' greedy continuation of a prompt is
    meshtrain's ``generate --temperature 0`` on the run, token for token (the run at tp=2 x pp=2: `make test-slow`,
    :func:`test_tp2_pp2_run_exported_generates_as_transformers`)."""
    generates_as_transformers(trained[3] / "w2" / "qwen3-tp2-seqpar", tmp_path)


@pytest.mark.slow
def test_tp2_pp2_run_exported_generates_as_transformers(trained_slow, trained, tmp_path):
    """The same for the Qwen3 trained at tp=2 x pp=2."""
    generates_as_transformers(trained[3] / "slow" / "w4" / "qwen3-tp2-pp2", tmp_path)


def generates_as_transformers(run: Path, tmp_path: Path, architecture: str = "Qwen3ForCausalLM") -> None:
    """Export ``run`` to Hugging Face (as ``architecture``); ``transformers``' greedy continuation of a prompt is
    meshtrain's ``generate --temperature 0`` on the run and on the export, token for token."""
    from meshtrain.checkpoint import store as ckpt
    from meshtrain.cli.export import export_hf
    from meshtrain.cli.generate import sample
    from meshtrain.data.corpus import CharTokenizer

    export_hf(run, tmp_path / "export")
    prompt, n = "ROMEO:\n", 12
    ours = sample(run, prompt, n, temperature=0.0)
    tokenizer = CharTokenizer.from_dict(ckpt.read_meta(ckpt.resolve_checkpoint(run))["tokenizer"])
    theirs = reference(tmp_path / "export")
    assert type(theirs).__name__ == architecture
    ids = torch.tensor([tokenizer.encode(prompt)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # an explicit mask: without one transformers masks every prompt token equal to pad_token_id (id 0 is "\n")
        out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)
    assert tokenizer.decode(out[0].tolist()) == ours
    assert sample(tmp_path / "export", prompt, n, temperature=0.0) == ours  # generate reads the export as well
