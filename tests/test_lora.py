"""LoRA adapters on a frozen base (meshtrain.adapters): every layout against one process, peft's numbers, the
checkpoints (the adapters only, refused on another base), and the ``[adapter]`` rules.

The layouts train a 4-layer Llama with rank-4 adapters on every linear map (``all-linear``) for 3 steps. At step 1
``B`` is zero, so only the ``B`` gradients are nonzero; from step 2 on ``A``'s are too, and the losses of steps 2 and
3 depend on both. Gradients are compared at step 1 (the adapters' only: the base has none) and parameters at the end.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, check_layout, cli_here
from layout_worker import layout_launcher, reference_run

MODEL = {**TINY, "model.type": "llama", "model.n_layer": "4", "model.n_head": "4", "model.n_kv_head": "2",
         "model.multiple_of": "16", "train.steps": "3", "batch.micro_batch_size": "8",
         "adapter.lora_rank": "4", "adapter.lora_alpha": "8", "adapter.lora_targets": "all-linear"}
PIPE = {"parallel.pp": "2", "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4"}
LAYOUTS = {
    "ddp-dp2": (2, {"batch.micro_batch_size": "4"}),
    "fsdp2-zero3": (2, {"parallel.zero_stage": "3", "batch.micro_batch_size": "4"}),
    "tp2-seqpar": (2, {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "sp2-ring-recompute": (2, {"parallel.sp": "2", "parallel.sp_mode": "ring", "train.recompute": "selective"}),
    "pp2-1f1b": (2, PIPE),
}
MOE = {"model.type": "mixtral", "model.num_experts": "4", "model.ffn_hidden": "24",
       "adapter.lora_targets": "q_proj,k_proj,v_proj,o_proj,experts.gate_up_proj,experts.down_proj"}
"""A Mixtral's attention and routed experts adapted (the experts' adapters split over the ranks with the experts at
ep = 2); its router and the experts' own weights stay frozen."""
LAYOUTS |= {"ep2-fsdp2-moe": (2, {**MOE, "parallel.ep": "2", "parallel.zero_stage": "3", "batch.micro_batch_size": "4"})}
SAVED = {"adapter.modules_to_save": "embed_tokens,lm_head", "adapter.lora_targets": "q_proj,v_proj"}
"""The embedding and the untied head trained in full beside q and v adapters (peft's ``modules_to_save``)."""
LAYOUTS |= {"tp2-seqpar-saved": (2, {**SAVED, "parallel.tp": "2", "parallel.tp_sequence_parallel": "true"})}
REFERENCES = {"plain": {}, "rslora": {"adapter.use_rslora": "true"}, "moe": MOE, "saved": SAVED,
              "moe-ga4": {**MOE, "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4"},
              "dora": {"adapter.use_dora": "true"}}
"""One process each; "moe-ga4" cuts the batch into the pipeline's micro-batches, since the load-balancing loss
counts each micro-batch's assignments (its gradient reaches the attention's adapters through the router's input)."""


def _reference_of(name: str) -> str:
    return next((ref for ref in ("rslora", "moe-ga4", "moe", "saved", "dora") if ref in name), "plain")


class _References(dict):
    """{reference name: :func:`layout_worker.reference_run`}, each run the first time a test asks for it."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> tuple:
        self[name] = reference_run(self.root / name, {**MODEL, **REFERENCES[name]})
        return self[name]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return _References(tmp_path_factory.mktemp("lora-ref"))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return layout_launcher(tmp_path_factory, MODEL, LAYOUTS, "lora")


SLOW_LAYOUTS = {  # `make test-slow`: ZeRO-1, Ulysses, rsLoRA, the other pipeline schedules, compile, 4-rank mixes
    "zero1-dp2": (2, {"batch.micro_batch_size": "4", "parallel.zero_stage": "1"}),
    "sp2-ulysses": (2, {"parallel.sp": "2"}),
    "dp2-ga2-rslora": (2, {"batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "2",
                           "adapter.use_rslora": "true"}),
    "pp2-zbv": (2, {**PIPE, "parallel.pp_schedule": "zbv", "parallel.virtual_stages": "2"}),
    "pp2-interleaved": (2, {**PIPE, "parallel.pp_schedule": "interleaved-1f1b", "parallel.virtual_stages": "2"}),
    "ddp-compiled": (2, {"batch.micro_batch_size": "4", "train.compile": "on"}),
    "tp2-compiled": (2, {"parallel.tp": "2", "train.compile": "on"}),
    "pp2-tp2": (4, {**PIPE, "parallel.tp": "2"}),
    "fsdp2-zero2-tp2": (4, {"parallel.tp": "2", "parallel.zero_stage": "2", "batch.micro_batch_size": "4"}),
    "ddp-dp2-saved": (2, {**SAVED, "batch.micro_batch_size": "4"}),
    "fsdp2-zero3-saved": (2, {**SAVED, "parallel.zero_stage": "3", "batch.micro_batch_size": "4"}),
    "pp2-1f1b-saved": (2, {**SAVED, **PIPE}),
    "sp2-ulysses-saved": (2, {**SAVED, "parallel.sp": "2"}),
    "ep2-ddp-moe": (2, {**MOE, "parallel.ep": "2", "batch.micro_batch_size": "4"}),
    "ep2-dp4-moe": (4, {**MOE, "parallel.ep": "2", "batch.micro_batch_size": "2"}),
    "ep2-fsdp2-dp4-moe": (4, {**MOE, "parallel.ep": "2", "parallel.zero_stage": "3", "batch.micro_batch_size": "2"}),
    "pp2-moe-ga4": (2, {**MOE, **PIPE}),
    "tp2-moe": (2, {**MOE, "parallel.tp": "2"}),
    "tp2-seqpar-dora": (2, {"adapter.use_dora": "true", "parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "fsdp2-zero3-dora": (2, {"adapter.use_dora": "true", "parallel.zero_stage": "3", "batch.micro_batch_size": "4"}),
    "pp2-1f1b-dora": (2, {"adapter.use_dora": "true", **PIPE}),
    "fsdp2-zero2-tp2-dora": (4, {"adapter.use_dora": "true", "parallel.tp": "2", "parallel.zero_stage": "2",
                                 "batch.micro_batch_size": "4"}),
}


@pytest.fixture(scope="module")
def launched_slow(tmp_path_factory):
    return layout_launcher(tmp_path_factory, MODEL, SLOW_LAYOUTS, "lora-slow")


def _check(got: tuple, want: tuple, overrides: dict[str, str]) -> None:
    """The contract (conftest.check_layout), after checking that only adapters got gradients, and the embedding where
    ``modules_to_save`` trains it (``layout_worker.full_gradients`` leaves an untied head's out, in every layout)."""
    full = {"tok_emb.weight"} if "adapter.modules_to_save" in overrides else set()
    assert got[1] and {n for n in got[1] if ".lora_" not in n} == full, sorted(got[1])[:3]
    check_layout(got, want, {**MODEL, **overrides})


@pytest.mark.parametrize("name", LAYOUTS)
def test_lora_layout_matches_one_process(references, launched, name):
    """Loss of every step, the adapters' step-1 gradients, and every parameter at the end (the frozen base
    included: it must come out as it went in)."""
    world, overrides = LAYOUTS[name]
    _check(launched(world)[name], references[_reference_of(name)], overrides)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_LAYOUTS)
def test_lora_slow_layout_matches_one_process(references, launched_slow, name):
    world, overrides = SLOW_LAYOUTS[name]
    _check(launched_slow(world)[name], references[_reference_of(name)], overrides)


def test_the_base_stays_frozen_and_only_b_moves_at_step_one(references, tmp_path_factory):
    """The reference's base at the end equals the seed's initial weights; at step 1 A's gradients are 0 (B = 0)."""
    from meshtrain.checkpoint import store as ckpt

    _, grads, params = references["plain"]
    root = tmp_path_factory.getbasetemp()
    meta = ckpt.read_meta(ckpt.resolve_checkpoint(next(root.glob("lora-ref*")) / "plain"))
    fresh = ckpt.described_model(meta).state_dict()  # built from the seed, adapters added, nothing loaded
    base = [name for name in fresh if ".lora_" not in name]
    assert len(base) > 30
    for name in base:
        assert torch.equal(params[name], fresh[name]), name
    assert all(float(g.abs().max()) == 0.0 for n, g in grads.items() if "lora_A" in n)
    assert all(float(g.abs().max()) > 0.0 for n, g in grads.items() if "lora_B" in n)


def test_expert_adapters_get_gradients(references):
    """The Mixtral reference adapts every layer's routed experts: at step 1 each B stack has a gradient (A's are 0,
    as B = 0), so the layouts' gradient equality checks them."""
    grads = references["moe"][1]
    for i in range(int(MODEL["model.n_layer"])):
        for kind in ("gate_up", "down"):
            assert float(grads[f"blocks.{i}.mlp.experts.lora_B.{kind}"].abs().max()) > 0, (i, kind)
            assert float(grads[f"blocks.{i}.mlp.experts.lora_A.{kind}"].abs().max()) == 0, (i, kind)


def test_modules_to_save_train_and_are_checkpointed(references):
    """With ``modules_to_save``, the checkpoint holds the adapters and the embedding and head (and nothing else of the
    base), and those two moved from their initial weights (so the layouts' equal final parameters check them)."""
    from meshtrain.checkpoint import store as ckpt

    params = references["saved"][2]
    found = ckpt.resolve_checkpoint(references.root / "saved")
    stored = {k[len("model."):] for k in ckpt.read_metadata(found).state_dict_metadata if k.startswith("model.")}
    assert {k for k in stored if ".lora_" not in k} == {"tok_emb.weight", "lm_head.weight"}
    fresh = ckpt.described_model(ckpt.read_meta(found)).state_dict()
    for name in ("tok_emb.weight", "lm_head.weight"):
        assert float((params[name] - fresh[name]).abs().max()) > 1e-4, name  # AdamW moves each entry by ~lr = 3e-3
    assert torch.equal(params["norm.weight"], fresh["norm.weight"])


def test_modules_to_save_resume_as_the_uninterrupted_run(tmp_path):
    """4 steps with the embedding and head trained beside the adapters, against 2 steps then a resume to 4: the resumed
    steps' losses equal the uninterrupted run's (conftest.assert_resumed_losses), so the checkpoint carried the trained
    embedding and head and their AdamW states (a base embedding, or fresh states, moves step 3's loss by > 1e-4)."""
    from conftest import assert_resumed_losses, losses, train_here

    run = {**MODEL, **SAVED, "train.steps": "4", "checkpoint.interval": "2"}
    want = losses(train_here(tmp_path / "whole", **run))
    train_here(tmp_path / "half", **{**run, "train.steps": "2"})
    got = losses(train_here(tmp_path / "resumed", **run, **{"checkpoint.resume": str(tmp_path / "half")}))
    assert_resumed_losses({k: v for k, v in got.items() if k > 2}, {k: v for k, v in want.items() if k > 2})


def _hf_folder(folder, case: str):
    """A tiny random ``transformers`` model of ``case`` saved into ``folder`` (built offline)."""
    if case in ("mixtral", "qwen3_moe", "qwen2_moe"):
        from test_moe import saved as moe_saved

        return moe_saved(folder, case)
    from test_qwen import saved

    if case == "qwen3-tied":
        return saved(folder, "Qwen3ForCausalLM", head_dim=16, tie_word_embeddings=True)
    return saved(folder, {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[case],
                 head_dim=16)


PEFT_CASES = {  # name: (family folder, targets, rank, alpha, rsLoRA, modules_to_save[, DoRA])
    "llama-all-linear": ("llama", ["all-linear"], 4, 8.0, False, []),
    "llama-all-linear-dora": ("llama", ["all-linear"], 4, 8.0, False, [], True),
    "qwen2-qkv-bias-dora-rslora": ("qwen2", ["q_proj", "k_proj", "v_proj"], 8, 16.0, True, [], True),
    "qwen3-qv-rslora": ("qwen3", ["q_proj", "v_proj"], 8, 16.0, True, []),
    "mixtral-attention": ("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"], 2, 4.0, False, []),
    "llama-qv-embedding-head": ("llama", ["q_proj", "v_proj"], 4, 8.0, False, ["embed_tokens", "lm_head"]),
    "qwen3-tied-embedding": ("qwen3-tied", ["q_proj", "v_proj"], 4, 8.0, False, ["embed_tokens", "lm_head"]),
    "mixtral-experts": ("mixtral", ["q_proj", "experts.gate_up_proj", "experts.down_proj"], 2, 4.0, False, []),
    "qwen3_moe-experts-down-rslora": ("qwen3_moe", ["experts.down_proj"], 4, 8.0, True, []),
    "qwen2_moe-experts-and-shared": ("qwen2_moe", ["gate_proj", "experts.gate_up_proj"], 2, 4.0, False, []),
}


def _peft_trainable(name: str) -> str:
    """peft's parameter name of a saved adapter key: adapters under ``default``, a ``ModulesToSaveWrapper``'s copy
    under ``modules_to_save.default``."""
    if name.endswith(".lora_magnitude_vector"):  # DoRA's, saved without peft's ``.weight``
        return f"{name}.default.weight"
    if ".lora_" in name:
        return name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
    return name.replace(".weight", ".modules_to_save.default.weight")


def _as_peft(name: str, t: torch.Tensor) -> torch.Tensor:
    """Our tensor ``name`` as peft holds it: an expert stack reshaped (:func:`meshtrain.adapters.experts.to_peft`)."""
    from meshtrain.adapters.experts import to_peft

    return to_peft(name.split(".")[-2], t) if ".experts.lora_" in name else t


@pytest.mark.parametrize("case", PEFT_CASES)
def test_logits_and_adapter_gradients_equal_peft(case, tmp_path):
    """The same base and the same adapter weights (random A and B, copied into peft's ``LoraModel`` by name through
    :func:`meshtrain.adapters.spec.peft_names`; the embedding and head of ``modules_to_save`` perturbed and copied
    into peft's ``ModulesToSaveWrapper``, a tied pair with ``ensure_weight_tying``): equal logits, and equal
    gradients of every trained tensor for the same loss (a fixed random weighting of the logits, so every logit's
    gradient is nonzero); then the same weights exported as peft's folder load with no missing key and compute the
    same logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from meshtrain.adapters.apply import adapt
    from meshtrain.adapters.saved import saved_peft_names, tied_embeddings
    from meshtrain.adapters.spec import EXPERT_TARGETS, expert_peft_names, peft_names, targeted_experts, targeted_paths
    from meshtrain.config.sections import AdapterConfig
    from meshtrain.cli.export import load_hf_model
    from test_hf import V, logits_tolerance

    kind, targets, rank, alpha, rslora, saved, *dora = PEFT_CASES[case]
    dora = bool(dora and dora[0])
    folder = _hf_folder(tmp_path / "hf", kind)
    ours, cfg = load_hf_model(folder)
    adapter = AdapterConfig(lora_rank=rank, lora_alpha=alpha, lora_targets=targets, use_rslora=rslora,
                            modules_to_save=saved, use_dora=dora)
    adapt(ours, adapter, cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".lora_magnitude_vector"):  # DoRA's m: moved off the row norms it starts at
                p.mul_(1 + torch.randn(p.shape, generator=generator) * 0.1)
            elif ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            elif p.requires_grad:  # trained in full: moved off the base, so that peft's copy must be the one used
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    assert {n for n, p in ours.named_parameters() if p.requires_grad and ".lora_" not in n} == \
        (set() if not saved else {"tok_emb.weight"} if tied_embeddings(cfg) else {"tok_emb.weight", "lm_head.weight"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder)
    names = peft_names(cfg, targeted_paths(cfg, targets), dora)
    peft_targets = sorted({n.split(".lora_")[0].rsplit(".", 1)[1] for n in names.values()}) or None
    experts = [f"mlp.{t}" for t in EXPERT_TARGETS if t in targets] or None  # transformers 5's 3-D expert tensors
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=peft_targets,
                                                         target_parameters=experts, use_rslora=rslora, use_dora=dora,
                                                         lora_dropout=0.0, modules_to_save=saved,
                                                         ensure_weight_tying=tied_embeddings(cfg) and bool(saved)))
    ours_state = dict(ours.named_parameters())
    theirs_params = dict(theirs.named_parameters())
    names |= saved_peft_names(cfg, saved) | expert_peft_names(cfg, targeted_experts(cfg, targets))
    theirs_of = {o: _peft_trainable(t) for o, t in names.items() if o in ours_state}  # a tied pair: listed once
    assert {n for n, p in theirs_params.items() if p.requires_grad} == set(theirs_of.values())  # the same tensors train
    with torch.no_grad():
        for o, t in theirs_of.items():
            theirs_params[t].copy_(_as_peft(o, ours_state[o]))
    x = torch.randint(0, V, (2, cfg.block_size), generator=generator)
    weights = torch.randn(2, cfg.block_size, V, generator=generator)
    got = ours.train()(x)
    want = theirs.train()(input_ids=x).logits
    scale = float(want.detach().abs().max())
    # logits: test_hf.logits_tolerance (fp32 sums of max(C, F, T) products per block, in another order)
    width = max(cfg.n_embd, cfg.ffn_hidden_size(), cfg.block_size)
    tol = logits_tolerance(cfg.n_layer, width, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    # each gradient element sums B*T*V weighted products of values that agree to `tol` relative to the logits:
    # bound it by that relative error of the gradient's global norm, as conftest.assert_close_grads does -- the
    # adapters' norm and the full modules' apart, so that the embedding's larger gradients loosen no adapter's bound
    for group in filter(None, ({o for o in theirs_of if ".lora_" in o}, {o for o in theirs_of if ".lora_" not in o})):
        norm = float(torch.sqrt(sum(ours_state[o].grad.double().pow(2).sum() for o in group)))
        for o in group:
            torch.testing.assert_close(_as_peft(o, ours_state[o].grad), theirs_params[theirs_of[o]].grad, rtol=0,
                                       atol=max(tol / scale, 1e-5) * norm, msg=lambda m, n=o: f"{n}: {m}")
    # meshtrain's peft export of these weights (meshtrain.adapters.export), loaded by peft onto a fresh base; and
    # the adapters merged into our base (an export's --merge) compute the same logits
    from meshtrain.adapters.apply import merge
    from meshtrain.adapters.export import write_peft_folder

    write_peft_folder(tmp_path / "peft", ours.state_dict(), adapter, cfg)
    with _no_missing_keys():
        loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                                tmp_path / "peft")
    with torch.no_grad():
        want = ours.eval()(x)
        torch.testing.assert_close(loaded.eval()(input_ids=x).logits, want, rtol=0, atol=tol)
        assert merge(ours) == len(targeted_paths(cfg, targets)) * cfg.n_layer + (cfg.n_layer if experts else 0)
        assert not any(".lora_" in n for n in ours.state_dict())
        torch.testing.assert_close(ours(x), want, rtol=0, atol=tol)


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory):
    """4 steps of rank-4 adapters on every linear map of a random tiny transformers Llama (``model.init_from``),
    one process; (its Hugging Face folder, the run folder)."""
    from test_hf import FINETUNE, llama, model_overrides

    root = tmp_path_factory.mktemp("lora-imported")
    folder = llama(root / "hf")
    overrides = {**model_overrides(folder), "train.steps": "4", "optim.lr": "1e-2", "optim.warmup_steps": "0",
                 "checkpoint.interval": "2", "adapter.lora_rank": "4", "adapter.lora_targets": "all-linear"}
    reference_run(root / "run", overrides, config=FINETUNE)
    return folder, root / "run"


def _checkpoint_model(run):
    from meshtrain.cli.export import load_checkpoint_model

    return load_checkpoint_model(run)[0].eval()


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_states_only(imported_run):
    from meshtrain.checkpoint import store as ckpt

    _, run = imported_run
    found = ckpt.resolve_checkpoint(run)
    stored = [k for k in ckpt.read_metadata(found).state_dict_metadata if k.startswith("model.")]
    assert stored and all(".lora_" in k for k in stored), stored[:3]
    assert ckpt.read_meta(found)["adapter_base"]["sha256"]
    trained = [p for n, p in _checkpoint_model(run).named_parameters() if ".lora_B" in n]
    assert all(float(p.detach().abs().max()) > 0 for p in trained)  # B moved away from its zero init


def test_peft_loads_the_adapter_export_and_computes_the_same_logits(imported_run, tmp_path):
    """``meshtrain export --format peft``; ``PeftModel.from_pretrained(base, folder)`` on it: every adapter key found,
    equal logits (which the adapters moved well away from the base's)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from test_hf import V, logits_tolerance

    folder, run = imported_run
    proc = cli_here("export", "--checkpoint", str(run), "--format", "peft", "--out", str(tmp_path / "peft"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(folder)
    ours = _checkpoint_model(run)
    with _no_missing_keys():
        theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                                tmp_path / "peft").eval()
    x = torch.randint(0, V, (2, ours.cfg.block_size), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = ours(x), theirs(input_ids=x).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=x).logits
    tol = logits_tolerance(ours.cfg.n_layer, max(ours.cfg.n_embd, ours.cfg.ffn_hidden_size(), ours.cfg.block_size),
                           float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    assert float((base - want).abs().max()) > 100 * tol  # the adapters change the logits


def test_merged_exports_compute_the_adapted_logits(imported_run, tmp_path, capsys):
    """``export --format hf --merge`` loads in transformers, ``--format safetensors --merge`` in meshtrain, both with
    the run's logits; without ``--merge`` both refuse in one line."""
    transformers = pytest.importorskip("transformers")
    from meshtrain.cli.export import load_export
    from test_hf import V, logits_tolerance

    from meshtrain.cli.main import main as cli_main

    folder, run = imported_run
    for fmt, out in (("hf", tmp_path / "merged"), ("safetensors", tmp_path / "merged.safetensors")):
        export = ["export", "--checkpoint", str(run), "--format", fmt, "--out", str(out)]
        assert cli_main(export) == 2 and not out.exists()  # in this process: the CLI's own lines are tested above
        assert "--format peft" in capsys.readouterr().err
        assert cli_main([*export, "--merge"]) == 0
    ours = _checkpoint_model(run)
    x = torch.randint(0, V, (2, ours.cfg.block_size), generator=torch.Generator().manual_seed(3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    mine = load_export(tmp_path / "merged.safetensors")[0].eval()
    with torch.no_grad():
        want, got_hf, got_mine = ours(x), hf(input_ids=x).logits, mine(x)
    tol = logits_tolerance(ours.cfg.n_layer, max(ours.cfg.n_embd, ours.cfg.ffn_hidden_size(), ours.cfg.block_size),
                           float(want.abs().max()))
    torch.testing.assert_close(got_hf, want, rtol=0, atol=tol)
    torch.testing.assert_close(got_mine, want, rtol=0, atol=tol)


def _no_missing_keys():
    """Fails when peft warns that the adapter file lacks keys its model expects."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def check():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        missing = [str(w.message) for w in caught if "missing" in str(w.message).lower()]
        assert not missing, missing
    return check()


def test_another_base_is_refused_by_resume_export_and_generate(imported_run, tmp_path):
    """The run's adapters were trained on its base folder; once that folder holds other weights (one number changed),
    resuming, exporting and sampling each refuse in one line naming the folder, exit 2, nothing written."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, run = imported_run
    moved = tmp_path / "run"
    shutil.copytree(run, moved)
    changed = tmp_path / "hf"
    shutil.copytree(folder, changed)
    tensors = load_file(changed / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0, 0] += 1.0
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    for meta in moved.glob("checkpoints/step_*/meta.json"):  # the run's base is now the changed copy
        data = json.loads(meta.read_text())
        data["config"]["model"]["init_from"] = str(changed)
        meta.write_text(json.dumps(data))
    from test_hf import FINETUNE

    commands = {
        "train": ["train", str(FINETUNE), "--resume", str(moved), "--out", str(moved), "--steps", "6",
                  "--model.init_from", str(changed), "--adapter.lora_rank", "4", "--adapter.lora_targets", "all-linear",
                  "--batch.micro_batch_size", "4", "--train.dtype", "float32"],
        "export": ["export", "--checkpoint", str(moved), "--out", str(tmp_path / "out.safetensors")],
        "generate": ["generate", "--checkpoint", str(moved), "--prompt", "a", "--max-new-tokens", "2"],
    }
    for command, args in commands.items():
        proc = cli_here(*args, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (command, proc.stderr[-2000:])
        assert "holds LoRA adapters trained on the base" in lines[0] and str(changed) in lines[0], lines[0]
    assert not (tmp_path / "out.safetensors").exists()


def test_generate_samples_from_a_run_with_adapters(imported_run):
    from meshtrain.cli.generate import sample

    _, run = imported_run
    text = sample(run, "ROMEO:", 8, temperature=0.0)
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")


BAD = {  # overrides on MODEL: (what the one line must name)
    "negative-rank": ({"adapter.lora_rank": "-1"}, "adapter.lora_rank = -1"),
    "zero-alpha": ({"adapter.lora_alpha": "0"}, "adapter.lora_alpha = 0"),
    "dropout-one": ({"adapter.lora_dropout": "1.0"}, "adapter.lora_dropout = 1.0"),
    "no-targets": ({"adapter.lora_targets": ""}, "adapter.lora_targets is empty"),
    "unknown-target": ({"adapter.lora_targets": "q_proj,qkv_proj"}, "'qkv_proj'"),
    "all-linear-and-more": ({"adapter.lora_targets": "all-linear,q_proj"}, "'all-linear' stands alone"),
    "gpt": ({"model.type": "gpt", "model.n_kv_head": "0", "model.multiple_of": "256"}, "model.type = 'gpt'"),
    "local-sgd": ({"parallel.sync_mode": "local-sgd"}, "parallel.sync_mode = 'local-sgd'"),
    "unknown-saved-module": ({"adapter.modules_to_save": "norm"}, "adapter.modules_to_save names 'norm'"),
    "saved-without-adapters": ({"adapter.lora_rank": "0", "adapter.modules_to_save": "lm_head"},
                               "adapter.modules_to_save = ['lm_head']"),
    "experts-of-a-dense-model": ({"adapter.lora_targets": "q_proj,experts.down_proj"},
                                 "model.type = 'llama' has no routed experts"),
    "experts-with-dropout": ({**MOE, "adapter.lora_dropout": "0.1"},
                             "adapter.lora_dropout = 0.1 with adapters on the routed experts"),
    "dora-on-experts": ({**MOE, "adapter.use_dora": "true"}, "adapter.use_dora = true with adapters on the routed"),
    "dora-on-nf4": ({"adapter.use_dora": "true", "adapter.quantize_base": "nf4"},
                    "adapter.use_dora = true with adapter.quantize_base = 'nf4'"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_adapter_settings_are_one_line_before_launch(case, tmp_path):
    assert_refused_before_launch({**MODEL, **BAD[case][0]}, BAD[case][1], tmp_path)


def assert_refused_before_launch(overrides: dict[str, str], named: str, tmp_path) -> None:
    """``meshtrain train`` at 2 ranks, in this process (``conftest.cli_here``: torchrun's engine a trap, so a command
    that got past the checks fails): exit 2, one line that holds ``named``, no run folder."""
    from conftest import CONFIG, override_args

    out = tmp_path / "run"
    proc = cli_here("train", str(CONFIG), "--nproc", "2", "--out", str(out), *override_args(overrides))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and named in lines[0], proc.stderr[-1500:]
    assert not out.exists()
