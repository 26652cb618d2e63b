"""Hugging Face checkpoints in and out, checked against ``transformers`` itself (never against ourselves).

``transformers`` (the test extra) builds tiny random ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` models and
``save_pretrained``-s them into temporary folders; nothing is downloaded. Checked:

- an imported model's logits equal ``transformers``' for the same ids (one process; bf16 weights into fp32;
  sharded safetensors with an index; GPT-2's Conv1D transposes and fused ``c_attn``);
- import -> export is bit-identical, and ``transformers`` loads the export with no missing or unexpected keys;
- the first training step's loss from imported weights equals ``transformers``' loss on the same batch, at one
  process and under tp=2, pp=2, Ulysses and ring sp=2, FSDP2 dp=2 (every later step equal to one process), and
  at tp=2 x pp=2 (``make test-slow``, a 4-rank launch);
- a model trained at tp=2 x pp=2 and exported continues a prompt greedily in ``transformers`` exactly as
  ``meshtrain generate --temperature 0`` does on the run (``make test-slow``);
- bad inputs: one line, exit code 2, before any rank starts, nothing written.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from conftest import (ROOT, TINY, assert_close_grads, assert_close_losses, assert_resumed_losses, damaged_json_copy,
                      launch_here, train_config_here)
from layout_worker import launch_layouts, reference_run
from meshtrain.models import hf_io as hf
from meshtrain.cli.export import export_hf
from meshtrain.cli.main import main as cli_main
from meshtrain.cli.export import load_hf_model
from meshtrain.models.hf import write_hf_folder

transformers = pytest.importorskip("transformers")

EPS32 = torch.finfo(torch.float32).eps
FINETUNE = ROOT / "configs" / "hf_finetune.toml"
V = 80  # > the 65 characters of Tiny Shakespeare, as a real model's vocabulary is larger than the corpus's


def llama(folder: Path, dtype=torch.float32, shard: str | None = None, **overrides) -> Path:
    """A random tiny ``LlamaForCausalLM`` saved into ``folder`` (GQA, untied, Llama 3.1 RoPE scaling by default)."""
    args = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=None, rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                                   "rope_theta": 500000.0})
    args.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**args)).to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def gpt2(folder: Path, **overrides) -> Path:
    """A random tiny ``GPT2LMHeadModel`` saved into ``folder``; its biases and norms made non-trivial (GPT-2's
    init sets them to 0 and 1, which would hide a bias or norm loaded into the wrong place)."""
    args = dict(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None)
    args.update(overrides)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def reference(folder: Path):
    """``transformers``' own model of ``folder``, in fp32 (bf16 weights cast exactly as meshtrain casts them)."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits_tolerance(n_layer: int, widths: int, scale: float) -> float:
    """How far two fp32 implementations of the same model may put a logit apart.

    Each logit is a chain of ``n_layer`` blocks whose matmuls sum at most ``widths`` = max(C, F, T) products;
    fp32 rounding bounds a sum's error by ~widths * eps of its magnitude (Higham 2002, Sec. 4.2), and the two
    implementations may order sums differently in every block: ``2 * n_layer * widths * eps * max|logit|``.
    A weight loaded into the wrong place (a transposed Conv1D, q and k swapped, a missing bias) is O(1) off."""
    return 2 * n_layer * widths * EPS32 * scale


def assert_logits_equal(ours, theirs, n_layer: int, width: int, T: int) -> None:
    x = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours.eval()(x), theirs(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=logits_tolerance(n_layer, max(width, T), float(want.abs().max())))


CASES = {
    "llama-gqa-rope-scaling": lambda d: llama(d),
    "llama-mha-tied-bf16": lambda d: llama(d, torch.bfloat16, num_key_value_heads=4, tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama-sharded": lambda d: llama(d, shard="20KB"),
    "gpt2": lambda d: gpt2(d),
    "gpt2-exact-gelu": lambda d: gpt2(d, activation_function="gelu", layer_norm_epsilon=1e-6),
}


@pytest.mark.parametrize("case", CASES)
def test_imported_logits_equal_transformers(case, tmp_path):
    folder = CASES[case](tmp_path / "hf")
    if case == "llama-sharded":
        assert (folder / hf.INDEX_FILE).exists() and len(list(folder.glob("*.safetensors"))) > 1
    ours, cfg = load_hf_model(folder)
    width = 4 * cfg.n_embd if cfg.type == "gpt" else cfg.ffn_hidden_size()
    assert_logits_equal(ours, reference(folder), cfg.n_layer, width, T=cfg.block_size // 2)


@pytest.mark.parametrize("case", ["llama-gqa-rope-scaling", "llama-mha-tied-bf16", "gpt2"])
def test_import_export_round_trip_is_bit_identical(case, tmp_path):
    """Import -> export writes every tensor of the original back, bit for bit (bf16 ones as their exact fp32
    values), under the same names; ``transformers`` loads it with no missing, unexpected or mismatched key."""
    folder = CASES[case](tmp_path / "hf")
    ours, cfg = load_hf_model(folder)
    out = tmp_path / "out"
    write_hf_folder(out, ours.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    original = {}
    for name, file in hf.weight_map(folder).items():
        with safe_open(str(folder / file), framework="pt") as f:
            original[name] = f.get_tensor(name)
    with safe_open(str(out / hf.SINGLE_FILE), framework="pt") as f:
        exported = {name: f.get_tensor(name) for name in f.keys()}
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], t.float()), name
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.parametrize("model", [{"type": "gpt", "bias": False}, {"type": "gpt", "bias": True, "activation": "gelu_tanh"},
                                   {"type": "llama", "n_kv_head": 2}, {"type": "llama", "tie_embeddings": True}])
def test_transformers_loads_every_export_as_the_same_model(model, tmp_path):
    """A meshtrain model (a GPT without biases too: GPT-2 with zero biases) exported in shards with an index
    loads in ``transformers`` with no missing or unexpected keys and computes the same logits; a character
    tokenizer comes out as a ``tokenizer.json`` that encodes and decodes as meshtrain's does."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.data.corpus import CharTokenizer
    from meshtrain.models.build import build_model

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, multiple_of=16, **model)
    torch.manual_seed(0)
    ours = build_model(cfg, V)
    text = (ROOT / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt").read_text()[:5000]
    tokenizer = CharTokenizer.from_text(text)
    out = tmp_path / "out"
    write_hf_folder(out, ours.state_dict(), cfg, V, tokenizer.to_dict(), max_shard_bytes=16 * 1024)
    assert (out / hf.INDEX_FILE).exists()
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_logits_equal(ours, theirs.eval(), cfg.n_layer, 4 * cfg.n_embd if cfg.type == "gpt" else cfg.ffn_hidden_size(),
                        T=cfg.block_size)
    theirs_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs_tok.encode(text[:400]) == tokenizer.encode(text[:400])
    assert theirs_tok.decode(tokenizer.encode(text[:400])) == text[:400]


# --- training from imported weights, every layout ------------------------------------------------------------

STEPS = {**TINY, "train.steps": "3", "batch.micro_batch_size": "4", "train.eval_steps": "1"}
PIPE = {"parallel.pp": "2", "batch.micro_batch_size": "1", "batch.gradient_accumulation_steps": "4"}
LAYOUTS = {
    "tp2": (2, {"parallel.tp": "2"}),
    "pp2": (2, PIPE),
    "ulysses-sp2": (2, {"parallel.sp": "2"}),
    "ring-sp2": (2, {"parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "fsdp2-dp2": (2, {"parallel.zero_stage": "3", "batch.micro_batch_size": "2"}),
    "tp2-pp2": (4, {"parallel.tp": "2", **PIPE, "checkpoint.interval": "0"}),
}
"""Each layout's global batch is the reference's 4 samples; the model keys come from the folder alone."""
FOUR_RANKS = [n for n, (world, _) in LAYOUTS.items() if world == 4]
"""The 4-rank layouts, launched in ``make test-slow`` (:func:`trained_four`); the 2-rank ones in ``make test``."""


def model_overrides(folder: Path) -> dict[str, str]:
    return {k: v for k, v in STEPS.items() if not k.startswith("model.")} | {"model.init_from": str(folder)}


GPT2_LAYOUT = {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}
"""GPT-2 imported under tp with Megatron-SP: its biases column- and row-parallel, its LayerNorm shifts replicated."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(folders {"llama", "gpt2"}, {layout: (losses, step-1 grads, final params)}, one-process result, root).

    One process first (checkpoints at steps 2 and 3), then one 2-rank launch, which also resumes the one-process
    step-2 checkpoint at tp = 2 and trains an imported GPT-2 at tp = 2 with Megatron-SP (the 4-rank layouts:
    :func:`trained_four`)."""
    from meshtrain.checkpoint import store as ckpt

    root = tmp_path_factory.mktemp("hf_layouts")
    folders = {"llama": llama(root / "llama", max_position_embeddings=32), "gpt2": gpt2(root / "gpt2")}
    base = model_overrides(folders["llama"])
    one = reference_run(root / "one", {**base, "checkpoint.interval": "2"}, config=FINETUNE)
    extra = {"resume-tp2": (2, {"parallel.tp": "2", "checkpoint.resume": str(ckpt.step_dir(root / "one", 2))}),
             "gpt2-tp2-seqpar": (2, {**model_overrides(folders["gpt2"]), **GPT2_LAYOUT})}
    (root / "w2").mkdir()
    results = launch_layouts(2, root / "w2", {n: {**base, **o} for n, (w, o) in {**LAYOUTS, **extra}.items() if w == 2},
                             config=FINETUNE)
    return folders, results, one, root


@pytest.fixture(scope="module")
def trained_four(trained):
    """``trained``'s tuple with the 4-rank layouts' results too (one 4-rank launch, ~20 s: ``make test-slow``)."""
    folders, results, one, root = trained
    (root / "w4").mkdir(exist_ok=True)
    four = launch_layouts(4, root / "w4", {n: {**model_overrides(folders["llama"]), **LAYOUTS[n][1]} for n in FOUR_RANKS},
                          config=FINETUNE)
    return folders, {**results, **four}, one, root


def first_batch_loss(folder: Path) -> tuple[float, float]:
    """(``transformers``' mean loss on the first step's batch, its tolerance): the batch the trainer's sampler
    draws for step 1 at one process (the same global batch every layout splits)."""
    from meshtrain.config.load import load_config
    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.sampler import ShardedSampler

    cfg = load_config(FINETUNE, model_overrides(folder))
    corpus = load_corpus(cfg.data.resolved_path(), cfg.data.val_fraction, cfg.model.block_size)
    sampler = ShardedSampler(corpus.train, cfg.model.block_size, cfg.batch.micro_batch_size,
                             cfg.batch.gradient_accumulation_steps, 1, 0, cfg.train.seed)
    x, y = (torch.cat(t) for t in zip(*sampler.next_step()))  # (B, T) each
    with torch.no_grad():
        logits = reference(folder)(x).logits  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    # |d CE| <= 2 max|d logit| (log-softmax is 1-Lipschitz in the max norm, plus the target's own logit),
    # and the mean of B*T terms adds ~B*T*eps of the loss.
    m = cfg.model
    width = 4 * m.n_embd if m.type == "gpt" else m.ffn_hidden_size()
    tol = 2 * logits_tolerance(m.n_layer, max(width, m.block_size), float(logits.abs().max()))
    return float(loss), tol + x.numel() * EPS32 * float(loss)


def test_first_step_loss_equals_transformers_under_every_layout(trained):
    folders, results, one, _ = trained
    want, tol = first_batch_loss(folders["llama"])
    for name, (losses, _, _) in {"one process": one, **{n: results[n] for n in LAYOUTS if n not in FOUR_RANKS}}.items():
        assert abs(losses[1] - want) <= tol, f"{name}: step-1 loss {losses[1]} vs transformers' {want} (tol {tol:.2e})"
    want, tol = first_batch_loss(folders["gpt2"])
    got = results["gpt2-tp2-seqpar"][0][1]
    assert abs(got - want) <= tol, f"GPT-2 at tp=2: step-1 loss {got} vs transformers' {want} (tol {tol:.2e})"


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in FOUR_RANKS])
def test_training_from_imported_weights_equals_one_process(trained, name):
    """Every layout loaded the slices it holds: the step-1 gradients (all weights) and every step's loss equal
    one process's (conftest's tolerances)."""
    _, results, one, _ = trained
    assert_close_losses(results[name][0], one[0])
    assert_close_grads(results[name][1], one[1])


@pytest.mark.slow  # a 4-rank launch
@pytest.mark.parametrize("name", FOUR_RANKS)
def test_four_rank_training_from_imported_weights_equals_one_process_and_transformers(trained_four, name):
    """The 4-rank layouts as the 2-rank ones: step-1 loss equal to ``transformers``', every loss and the step-1
    gradients equal to one process's."""
    folders, results, one, _ = trained_four
    want, tol = first_batch_loss(folders["llama"])
    assert abs(results[name][0][1] - want) <= tol, f"{name}: step-1 loss {results[name][0][1]} vs {want}"
    assert_close_losses(results[name][0], one[0])
    assert_close_grads(results[name][1], one[1])


def test_imported_llama_resumes_at_another_layout(trained):
    """The one-process run's step-2 checkpoint, resumed at tp = 2 (DCP reshards every weight and AdamW
    state), continues as the uninterrupted run: conftest's resumed-loss contract."""
    _, results, one, _ = trained
    assert_resumed_losses(results["resume-tp2"][0], {3: one[0][3]})


@pytest.mark.slow  # the 4-rank launch
def test_tp2_pp2_run_exported_generates_as_transformers(trained_four, tmp_path):
    """Train at tp=2 x pp=2 from the import, export to Hugging Face: ``transformers``' greedy continuation of a
    prompt is meshtrain's ``generate --temperature 0`` on the run, token for token."""
    from meshtrain.checkpoint import store as ckpt
    from meshtrain.cli.generate import sample
    from meshtrain.data.corpus import CharTokenizer

    _, _, _, root = trained_four
    run = root / "w4" / "tp2-pp2"
    files = export_hf(run, tmp_path / "export")
    assert {f.name for f in files} >= {hf.CONFIG_FILE, hf.SINGLE_FILE, hf.TOKENIZER_FILE}
    prompt, n = "ROMEO:\n", 12
    ours = sample(run, prompt, n, temperature=0.0)
    tokenizer = CharTokenizer.from_dict(ckpt.read_meta(ckpt.resolve_checkpoint(run))["tokenizer"])
    theirs = reference(tmp_path / "export")
    ids = torch.tensor([tokenizer.encode(prompt)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # an explicit mask: without one transformers masks every prompt token equal to pad_token_id (id 0 is "\n")
        out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)
    assert out.shape == (1, ids.size(1) + n)
    assert tokenizer.decode(out[0].tolist()) == ours
    assert sample(tmp_path / "export", prompt, n, temperature=0.0) == ours  # generate reads the export as well


# --- bad inputs ----------------------------------------------------------------------------------------------

def damage(kind: str, folder: Path) -> None:
    """Break a saved Hugging Face folder the way a user's copy can be broken."""
    if kind == "no-config":
        (folder / hf.CONFIG_FILE).unlink()
    elif kind == "architecture":
        data = json.loads((folder / hf.CONFIG_FILE).read_text())
        data["architectures"], data["model_type"] = ["MistralForCausalLM"], "mistral"
        (folder / hf.CONFIG_FILE).write_text(json.dumps(data))
    elif kind == "missing-shard":
        next(iter(sorted(folder.glob("model-*.safetensors")))).unlink()
    elif kind == "truncated-shard":
        shard = sorted(folder.glob("model-*.safetensors"))[-1]
        shard.write_bytes(shard.read_bytes()[:-100])
    elif kind == "padded-shard":  # a traceback in generate before: the binary property test found it
        shard = sorted(folder.glob("model-*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes() + b"\0")
    elif kind == "wrong-shape":
        data = json.loads((folder / hf.CONFIG_FILE).read_text())
        data["intermediate_size"] = 64
        (folder / hf.CONFIG_FILE).write_text(json.dumps(data))
    elif kind == "no-weights":
        for f in list(folder.glob("*.safetensors")) + list(folder.glob("*.index.json")):
            f.unlink()
    elif kind == "rope-not-object":  # a TypeError before: the property test below found it
        data = json.loads((folder / hf.CONFIG_FILE).read_text())
        data["rope_parameters"] = "llama3"
        (folder / hf.CONFIG_FILE).write_text(json.dumps(data))


DAMAGES = {"no-config": "config.json' does not exist", "architecture": "which meshtrain does not build: supported are GPT2LMHeadModel, LlamaForCausalLM",
           "missing-shard": "does not exist: copy every shard", "truncated-shard": "is truncated",
           "wrong-shape": "needs (64, 32)", "no-weights": "has neither model.safetensors nor",
           "rope-not-object": "rope_parameters = 'llama3' must be an object",
           "padded-shard": "has 1 byte after its last tensor"}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A sharded tiny Llama with a character ``tokenizer.json`` (generate reads it)."""
    from meshtrain.models.hf import char_tokenizer_json

    folder = llama(tmp_path_factory.mktemp("hf_bad") / "hf", shard="20KB")
    (folder / hf.TOKENIZER_FILE).write_text(char_tokenizer_json("abcdefghijklmnopqrstuvwxyz\n :"))
    return folder


def one_line_error(capsys, argv: list[str], expected: str) -> None:
    capsys.readouterr()  # what came before
    code = cli_main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    assert expected in err, err


@pytest.mark.parametrize("kind", DAMAGES)
@pytest.mark.parametrize("command", ["train", "plan", "generate"])
def test_damaged_folder_is_one_line_before_launch(kind, command, sharded, tmp_path, capsys):
    """(damage x subcommand): a one-line error, exit code 2, no rank started and nothing written. ``plan``
    reads only config.json, so weight damage is not its concern."""
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(sharded, folder)
    damage(kind, folder)
    out = tmp_path / "run"
    if command == "plan" and kind not in ("no-config", "architecture", "rope-not-object"):  # config.json's own damage
        assert cli_main(["plan", str(FINETUNE), "--model.init_from", str(folder), "--num-gpus", "2"]) == 0
        capsys.readouterr()
        return
    if command == "train":
        argv = ["train", str(FINETUNE), "--model.init_from", str(folder), "--out", str(out), "--nproc", "1"]
    elif command == "plan":
        argv = ["plan", str(FINETUNE), "--model.init_from", str(folder), "--num-gpus", "2"]
    else:
        argv = ["generate", "--checkpoint", str(folder), "--max-new-tokens", "2"]
    one_line_error(capsys, argv, DAMAGES[kind])
    assert not out.exists()


@pytest.mark.parametrize("args, expected", [
    (["--model.n_layer", "3"], "model.n_layer = 3 contradicts"),
    (["--model.type", "gpt"], "model.type = 'gpt' contradicts"),
    (["--model.block_size", "128"], "model.block_size = 128 exceeds the 64 positions"),
    (["--tp", "4", "--nproc", "4"], "model.n_kv_head = 2 is not divisible by parallel.tp = 4"),
    (["--data.path", "{text}"], "fewer than the"),
])
def test_bad_init_from_is_one_line_before_launch(args, expected, sharded, tmp_path, capsys):
    text = tmp_path / "wide.txt"
    text.write_text("".join(chr(0x4E00 + i) for i in range(V + 5)) * 50)
    out = tmp_path / "run"
    argv = ["train", str(FINETUNE), "--model.init_from", str(sharded), "--out", str(out),
            *[a.replace("{text}", str(text)) for a in args]]
    if "--nproc" not in args:
        argv += ["--nproc", "1"]
    one_line_error(capsys, argv, expected)
    assert not out.exists()


def test_init_from_resumes_only_the_run_it_started(sharded, tmp_path, capsys):
    """``init_from`` with ``--resume`` of a checkpoint that did not start from that folder is refused (two
    sources of weights); the run that did start from it resumes (the weights come from its checkpoint)."""
    from conftest import train_here

    other = tmp_path / "gpt"
    train_here(other, **{"train.steps": "1"})
    one_line_error(capsys, ["train", str(FINETUNE), "--model.init_from", str(sharded), "--resume", str(other),
                            "--steps", "2", "--out", str(tmp_path / "run"), "--nproc", "1"],
                   "both give the starting weights, and that checkpoint did not start from it")
    assert not (tmp_path / "run").exists()
    own = tmp_path / "own"
    args = ["train", str(FINETUNE), "--model.init_from", str(sharded), "--out", str(own), "--nproc", "1",
            *[t for k, v in model_overrides(sharded).items() if k != "model.init_from" for t in (f"--{k}", v)]]
    train_config_here(FINETUNE, **{**model_overrides(sharded), "train.steps": "1", "train.out_dir": str(own)})
    assert launch_here(*args, "--steps", "2", "--resume") == 0  # the run this process started: a real launch
    capsys.readouterr()


def test_export_hf_refuses_what_it_cannot_write(tmp_path, capsys):
    """A recurrent model has no Hugging Face architecture, and an existing --out is never overwritten."""
    from conftest import train_here

    run = tmp_path / "lstm"
    train_here(run, **{"model.type": "lstm", "train.steps": "1"})
    one_line_error(capsys, ["export", "--checkpoint", str(run), "--format", "hf", "--out", str(tmp_path / "x")],
                   "has no Hugging Face architecture")
    assert not (tmp_path / "x").exists()
    (tmp_path / "taken").mkdir()
    one_line_error(capsys, ["export", "--checkpoint", str(run), "--format", "hf", "--out", str(tmp_path / "taken")],
                   "already exists")


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_an_export_never_touches_a_users_tmp(fmt, tmp_path):
    """``export --out X`` writes under a fresh temporary name beside X: a user's own ``X.tmp`` (a folder with a
    file, or a file) is left as it was, and no temporary is left behind (it deleted them before)."""
    from conftest import train_here

    run = tmp_path / "run"
    train_here(run, **{"model.type": "llama", "train.steps": "1"})
    out = tmp_path / ("x" if fmt == "hf" else "m.safetensors")
    mine = out.with_name(out.name + ".tmp")
    if fmt == "hf":
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
    else:
        mine.write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli_main(["export", "--checkpoint", str(run), "--format", fmt, "--out", str(out)]) == 0
    assert (mine / "notes.txt" if fmt == "hf" else mine).read_text() == "mine"
    made = {out.name} | ({out.with_suffix(".json").name} if fmt == "safetensors" else set())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(before) | made)


def test_export_copies_a_hugging_face_tokenizer(tmp_path):
    """A run on a ``tokenizer.json`` (``data.tokenizer``) exports it with the model, byte for byte, and
    ``generate`` on the export reads the prompt with it."""
    from meshtrain.cli.generate import sample
    from meshtrain.models.registry import ModelConfig
    from meshtrain.data.tokenizers import load_tokenizer
    from meshtrain.models.build import build_model
    from meshtrain.models.hf import char_tokenizer_json

    source = tmp_path / "tok" / hf.TOKENIZER_FILE
    source.parent.mkdir()
    source.write_text(char_tokenizer_json("abcdefghijklmnopqrstuvwxyz \n"))
    tokenizer = load_tokenizer(str(source))
    cfg = ModelConfig(type="llama", n_layer=1, n_head=2, n_embd=16, block_size=16, multiple_of=16)
    torch.manual_seed(0)
    out = tmp_path / "out"
    write_hf_folder(out, build_model(cfg, V).state_dict(), cfg, V, tokenizer.to_dict(), max_shard_bytes=2**30)
    assert (out / hf.TOKENIZER_FILE).read_bytes() == source.read_bytes()
    assert transformers.AutoTokenizer.from_pretrained(out).encode("hello") == tokenizer.encode("hello")
    assert sample(out, "hello", 3, temperature=0.0).startswith("hello")


def test_an_export_reimports_with_the_config_it_was_trained_with(tmp_path):
    """configs/llama_tiny.toml says ``ffn_hidden = 0`` and ``vocab_size = 0`` ("derive"): an export of its model
    writes the derived values (352 by Llama's rule, the corpus's 65 characters), which the same config accepts with
    ``model.init_from``; a derive key whose rule gives another value than the folder's is still a contradiction."""
    from meshtrain.config.load import load_config
    from meshtrain.errors import ConfigError
    from meshtrain.models.build import build_model

    tiny = ROOT / "configs" / "llama_tiny.toml"
    cfg = load_config(tiny)
    torch.manual_seed(0)
    write_hf_folder(tmp_path / "hf", build_model(cfg.model, 65).state_dict(), cfg.model, 65, None, 2**30)
    again = load_config(tiny, {"model.init_from": str(tmp_path / "hf")})
    assert again.model.ffn_hidden_size() == cfg.model.ffn_hidden_size() == 352 and again.model.vocab_size == 65
    with pytest.raises(ConfigError, match="model.ffn_hidden = 0 contradicts .* which gives 352"):
        load_config(tiny, {"model.init_from": str(tmp_path / "hf"), "model.multiple_of": "256"})  # the rule: 512


def test_an_export_carries_the_source_config_keys_training_does_not_change(tmp_path):
    """A Llama with a 64-token context, BOS/EOS/PAD ids and its own options, fine-tuned at block_size 16: its
    export's config.json is the source's, key for key and in its spelling (the 64 positions -- RoPE has no table
    to cut --, the ids, the options, transformers 5's ``rope_parameters``), and transformers loads it with them and
    every weight."""
    source = llama(tmp_path / "src", bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05)
    out = tmp_path / "run"
    args = {**model_overrides(source), "model.block_size": "16", "train.steps": "2", "train.out_dir": str(out)}
    train_config_here(FINETUNE, **args)  # the fine-tuning is the export's source here: trained in this process
    files = export_hf(out, tmp_path / "export")
    config = json.loads((tmp_path / "export" / hf.CONFIG_FILE).read_text())
    want = json.loads((source / hf.CONFIG_FILE).read_text())
    assert config["max_position_embeddings"] == 64 and want["max_position_embeddings"] == 64
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert config["initializer_range"] == 0.05 and "rope_theta" not in config and config == want
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert (model.config.max_position_embeddings, model.config.eos_token_id) == (64, 2)
    assert any(f.suffix == ".safetensors" for f in files)


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    """A tiny saved model of two families: a Llama (GQA, Llama 3.1 RoPE scaling) and a GPT-2."""
    root = tmp_path_factory.mktemp("families")
    return {"llama": llama(root / "llama"), "gpt2": gpt2(root / "gpt2")}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_in_any_config_json_field_is_one_config_error(families, tmp_path, data):
    """``model.init_from`` at a folder whose config.json has any JSON value at any key path (or the key removed):
    the config and the launcher's check of the weights raise ConfigError with one line, or accept a model they can
    build; never another exception."""
    from meshtrain.config.load import load_config
    from meshtrain.errors import ConfigError
    from meshtrain.preflight import check_init_from

    source = families[data.draw(st.sampled_from(sorted(families)))]
    folder = damaged_json_copy(data, source, hf.CONFIG_FILE, tmp_path)
    try:
        cfg = load_config(None, {"model.init_from": str(folder), "model.block_size": "16"})
        check_init_from(cfg, 65)
    except ConfigError as e:
        assert "\n" not in str(e)
