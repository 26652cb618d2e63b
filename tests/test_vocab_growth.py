"""Fine-tuning a model on conversations prepared with ChatML's added tokens grows its vocabulary (issue 51 §1,
:mod:`meshtrain.data.growth`, :mod:`meshtrain.models.resize`).

A tiny random ``LlamaForCausalLM`` (untied head) of 1,020 ids is saved with ``transformers`` (nothing downloaded); a
1,020-id byte-level BPE without a template prepares the plays' conversations, adding ``<|im_start|>`` and
``<|im_end|>`` as ids 1020 and 1021; ``model.init_from`` then starts a run whose model has 1,024 rows (1,022 padded to
a multiple of 128 * tp: 1,024 for tp 1 and for tp 2, so one model for every layout below). Checked: the first 1,020
rows are the checkpoint's, bit for bit; the new rows are ``transformers``' mean-resizing draw for the same seed; one
process, tp2, FSDP2 dp2 and pp2 start from the same rows and train to the same losses, gradients and parameters; the
export has the grown vocabulary and says so; data whose extra ids prepare did not add is still refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import TINY, check_layout, cli_here, launch_here
from layout_worker import launch_layouts, load_result
from test_hf import EPS32, FINETUNE, PIPE
from test_sft_layouts import CORPUS, _load_script
from test_qwen import saved
from vocab_growth_worker import ROWS_FILE, start_rows_here

transformers = pytest.importorskip("transformers")

OLD, ADDED, NEW = 1020, 2, 1024
"""The checkpoint's rows, the tokens prepare adds (ChatML's two), the grown model's rows (1022 padded to 128 * tp)."""
SEED = 1337
RUN = {**{k: v for k, v in TINY.items() if not k.startswith("model.")}, "train.steps": "2", "train.seed": str(SEED),
       "train.eval_steps": "1", "batch.micro_batch_size": "4", "data.packing": "document"}
"""Global batch 4 windows of 128 tokens (the model's positions), as every layout below."""
LAYOUTS = {"tp2": {"parallel.tp": "2"}, "fsdp2-dp2": {"parallel.zero_stage": "3", "batch.micro_batch_size": "2"},
           "pp2": PIPE}
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def prepared(root: Path, vocab: int) -> Path:
    """The plays' first 2,000 lines cut into conversations (scripts/shakespeare_chat.py), prepared as chat with a
    ``vocab``-id BPE trained on those lines (no template: prepare adds ChatML's tokens)."""
    from meshtrain.cli.tokenizer import train_bpe
    from meshtrain.data.preprocess import prepare

    text = "\n".join(CORPUS.read_text().splitlines()[:2000])
    (root / "plays.txt").write_text(text)
    tokenizer = train_bpe([root / "plays.txt"], vocab, root / "bpe.json")
    with open(root / "records.jsonl", "w") as f:
        for record in _load_script("shakespeare_chat").conversations(text):
            f.write(json.dumps(record) + "\n")
    prepare(str(tokenizer), [str(root / "records.jsonl")], root / "chat", data_format="chat", val_fraction=0.1)
    return root / "chat"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    """(the saved tiny Llama of OLD ids, the prepared conversations of OLD + ADDED ids)."""
    root = tmp_path_factory.mktemp("growth")
    folder = saved(root / "hf", "LlamaForCausalLM", vocab_size=OLD, head_dim=8, max_position_embeddings=128)
    return folder, prepared(root, OLD)


def overrides(setup, **more: str) -> dict[str, str]:
    folder, data = setup
    return {**RUN, "model.init_from": str(folder), "data.path": str(data), **more}


def checkpoint_rows(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in (EMBEDDING, HEAD)}


def transformers_rows(folder: Path) -> dict[str, torch.Tensor]:
    """The new rows ``transformers``' mean resizing gives with the global RNG seeded SEED: its
    ``_init_added_embeddings_weights_with_mean`` on the embedding, then ``_init_added_lm_head_weights_with_mean`` on
    the untied head, in the order ``resize_token_embeddings`` calls them."""
    from torch import nn

    model = transformers.LlamaForCausalLM.from_pretrained(folder)
    emb, head = nn.Embedding(NEW, model.config.hidden_size), nn.Linear(model.config.hidden_size, NEW, bias=False)
    torch.manual_seed(SEED)
    model._init_added_embeddings_weights_with_mean(model.model.embed_tokens, emb, OLD, NEW - OLD)
    model._init_added_lm_head_weights_with_mean(model.lm_head, head, model.config.hidden_size, OLD, NEW - OLD)
    return {EMBEDDING: emb.weight.detach()[OLD:], HEAD: head.weight.detach()[OLD:]}


def rows_tolerance(rows: torch.Tensor) -> float:
    """How far our new rows may sit from ``transformers``': the statistics differ by float32 rounding only. Ours are
    summed in float64 and rounded once; theirs in float32 by torch's cascaded reduction, whose error in a column's sum
    of V terms is at most ~log2(V) * eps * the sum of their magnitudes (Higham 2002, Sec. 4.2), so the mean's is
    log2(V) * eps * mean|x| of that column. A row is mean + L eps with |L eps| ~ sqrt(1e-9) * std ~ 6e-7 here, whose
    own rounding is far smaller. Hence 2 * log2(V) * eps * max over columns of mean|x| (~4e-8 here): the draw is
    ~40x larger, so rows that were the mean alone, or another draw, fail it (checked)."""
    return 2 * math.log2(OLD) * EPS32 * float(rows.abs().mean(0).max())


def test_prepare_records_the_added_tokens(setup):
    meta = json.loads((setup[1] / "meta.json").read_text())
    assert meta["vocab_size"] == OLD + ADDED
    assert meta["added_tokens"] == [{"id": OLD, "content": "<|im_start|>"}, {"id": OLD + 1, "content": "<|im_end|>"}]


def test_new_rows_are_transformers_mean_resizing(setup):
    """Loaded in one process: the first OLD rows are the file's exactly, the new ones transformers' draw."""
    from meshtrain.config.load import load_config
    from meshtrain.data.corpus import corpus_of
    from meshtrain.data.growth import vocab_growth
    from meshtrain.models.build import build_model
    from meshtrain.models.hf import load_hf_weights
    from meshtrain.models.resize import GrownRows

    cfg = load_config(FINETUNE, overrides(setup))
    corpus = corpus_of(cfg)
    growth = vocab_growth(cfg, corpus.tokenizer.vocab_size, corpus.added_tokens)
    assert (growth.old, growth.new, growth.added) == (OLD, NEW, {OLD: "<|im_start|>", OLD + 1: "<|im_end|>"})
    model = build_model(cfg.model, growth.new)
    grown = GrownRows(growth.old, growth.new, SEED)
    load_hf_weights(model, setup[0], cfg.model, grown)
    assert grown.sampled
    ours = {EMBEDDING: model.tok_emb.weight.detach(), HEAD: model.lm_head.weight.detach()}
    file, theirs = checkpoint_rows(setup[0]), transformers_rows(setup[0])
    for name in (EMBEDDING, HEAD):
        assert torch.equal(ours[name][:OLD], file[name])
        tol = rows_tolerance(file[name])
        assert (ours[name][OLD:] - theirs[name]).abs().max() <= tol
        mean = file[name].mean(0).expand(NEW - OLD, -1)  # sabotage: the mean alone is not transformers' draw
        assert (mean - theirs[name]).abs().max() > 10 * tol
    assert (ours[EMBEDDING][OLD:] - ours[HEAD][OLD:]).abs().max() > 1e-4  # the head's rows are its own


def test_resize_token_embeddings_draws_from_the_same_distribution(setup):
    """``transformers``' ``resize_token_embeddings`` itself: the same mean, and deviations of the scale of
    N(0, 1e-9 cov) (its fresh modules' default init draws from the global RNG first, so its draw is another one)."""
    from meshtrain.models.resize import row_statistics

    model = transformers.LlamaForCausalLM.from_pretrained(setup[0])
    torch.manual_seed(SEED)
    model.resize_token_embeddings(NEW)
    file = checkpoint_rows(setup[0])
    for name, weight in ((EMBEDDING, model.model.embed_tokens.weight), (HEAD, model.lm_head.weight)):
        mean, cov = row_statistics(lambda r0, r1: file[name][r0:r1], OLD)
        deviation = weight.detach()[OLD:] - mean
        sigma = math.sqrt(1e-9 * float(cov.diagonal().max()))
        assert 1e-2 * sigma < deviation.abs().max() < 8 * sigma  # 8 sigma: p < 1e-14 per value


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    """{name: (losses, step-1 gradients, final parameters, starting rows)}: one process, then tp2, FSDP2 dp2 and pp2
    on 2 gloo ranks in one launch."""
    root = tmp_path_factory.mktemp("growth_runs")
    start_rows_here([{"out": str(root / "one"), "overrides": overrides(setup), "config": str(FINETUNE)}])
    results = {"one": load_result(root / "one")}
    results |= launch_layouts(2, root, {name: overrides(setup, **o) for name, o in LAYOUTS.items()}, config=FINETUNE,
                              worker=Path(__file__).with_name("vocab_growth_worker.py"))
    return {name: (*result, torch.load(root / name / ROWS_FILE)) for name, result in results.items()}


def test_training_starts_with_the_grown_vocabulary(setup, runs):
    file, theirs = checkpoint_rows(setup[0]), transformers_rows(setup[0])
    rows = runs["one"][3]
    for ours, name in ((rows["tok_emb.weight"], EMBEDDING), (rows["lm_head.weight"], HEAD)):
        assert ours.shape == (NEW, file[name].shape[1])
        assert torch.equal(ours[:OLD], file[name])
        assert (ours[OLD:] - theirs[name]).abs().max() <= rows_tolerance(file[name])


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_starts_from_the_same_rows_and_trains_alike(runs, name, setup):
    """The same rows on every rank of every layout (bit for bit: the statistics are summed in one order from the same
    file on every rank), then the correctness contract against one process."""
    for key, want in runs["one"][3].items():
        assert torch.equal(runs[name][3][key], want), key
    schedule = {k: v for k, v in {**RUN, **LAYOUTS[name]}.items() if k.split(".")[0] in ("optim", "train")}
    check_layout(runs[name][:3], runs["one"][:3], schedule)  # the drift bound reads the LR schedule only


def test_start_line_and_export(setup, tmp_path, capfd):
    """``meshtrain train`` says at start what grew and how; the export holds the grown vocabulary and its config.json
    says vocab_size changed; transformers loads it; the run resumes. The runs are real launches from this process
    (``conftest.launch_here``; ``capfd`` reads the launcher's and the rank's lines)."""
    args = [f"--{k}={v}" for k, v in overrides(setup, **{"train.steps": "1", "train.out_dir": str(tmp_path / "run")}).items()]
    capfd.readouterr()
    code = launch_here("train", str(FINETUNE), *args)
    stderr = capfd.readouterr().err
    assert code == 0, stderr[-3000:]
    line = next(line for line in stderr.splitlines() if line.startswith("vocabulary grown"))
    assert (f"from {OLD} to {NEW} rows for the 2 token(s) prepare added (<|im_start|> = {OLD}, <|im_end|> = {OLD + 1})"
            f" and 2 padding row(s)") in line and "N(mean, 1e-9 * covariance)" in line and f"seed {SEED}" in line
    proc = cli_here("export", "--checkpoint", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"config.json: vocab_size = {NEW} (the source model's was {OLD}; the run changed it)" in proc.stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == NEW
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.get_input_embeddings().weight.shape[0] == NEW
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [OLD, OLD + 1]
    args = [f"--{k}={v}" for k, v in overrides(setup, **{"train.steps": "2", "train.out_dir": str(tmp_path / "run"),
                                                          "checkpoint.resume": str(tmp_path / "run")}).items()]
    capfd.readouterr()
    code = launch_here("train", str(FINETUNE), *args)  # the grown checkpoint resumes, model.init_from given again
    stderr = capfd.readouterr().err
    assert code == 0 and "resumed from step 1" in stderr, stderr[-3000:]


def test_other_extra_ids_are_still_refused(setup, tmp_path):
    """A model of fewer ids than the tokenizer had before prepare: its extra ids are not all prepare's, so the run is
    refused before launch, one line, exit 2, nothing written."""
    folder = saved(tmp_path / "small", "LlamaForCausalLM", vocab_size=OLD - 20, head_dim=8, max_position_embeddings=128)
    out = tmp_path / "run"
    args = [f"--{k}={v}" for k, v in overrides((folder, setup[1]), **{"train.out_dir": str(out)}).items()]
    proc = cli_here("train", str(FINETUNE), *args)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err and "Traceback" not in err, err
    assert f"has a vocabulary of {OLD - 20} tokens, fewer than the {OLD + ADDED}" in err
    assert "only tokens prepare added to the model's tokenizer can grow it (it added 2: ids 1020-1021)" in err
    assert not out.exists()


LORA = {"adapter.lora_rank": "4", "adapter.lora_targets": "q_proj,v_proj"}
SAVED = {**LORA, "adapter.modules_to_save": "embed_tokens,lm_head"}


@pytest.mark.parametrize("saved", ["", "embed_tokens"])
def test_adapters_without_a_trained_embedding_and_head_are_refused(setup, saved):
    """LoRA leaves the new rows frozen unless ``adapter.modules_to_save`` trains the embedding and the (untied) head."""
    from meshtrain.config.load import load_config
    from meshtrain.errors import ConfigError
    from meshtrain.data.growth import vocab_growth

    cfg = load_config(FINETUNE, overrides(setup, **LORA, **{"adapter.modules_to_save": saved}))
    with pytest.raises(ConfigError, match=r"LoRA would leave frozen .* \(adapter.modules_to_save = \['embed_tokens', "
                                          r"'lm_head'\]\)"):
        vocab_growth(cfg, OLD + ADDED, {OLD: "<|im_start|>", OLD + 1: "<|im_end|>"})
    cfg = load_config(FINETUNE, overrides(setup, **SAVED))
    assert vocab_growth(cfg, OLD + ADDED, {OLD: "<|im_start|>", OLD + 1: "<|im_end|>"}).new == NEW


@pytest.fixture(scope="module")
def lora_run(setup, tmp_path_factory) -> Path:
    """Two steps of q/v adapters with the embedding and head trained in full (``modules_to_save``) on the grown
    vocabulary, one process."""
    run = tmp_path_factory.mktemp("growth_lora") / "run"
    start_rows_here([{"out": str(run), "overrides": overrides(setup, **SAVED, **{"optim.lr": "1e-2"}),
                      "config": str(FINETUNE)}])
    return run


def test_lora_grows_the_vocabulary_and_exports_as_peft_and_merged(setup, lora_run, tmp_path):
    """The run's checkpoint holds the adapters and the grown embedding and head, whose new rows trained away from
    their start; ``export --format peft`` loads with ``PeftModel.from_pretrained`` onto the base resized to the run's
    rows (``resize_token_embeddings``, as peft's users grow a vocabulary) with no missing key, ``--format hf --merge``
    with ``from_pretrained``; both compute the run's logits."""
    peft = pytest.importorskip("peft")
    from meshtrain.checkpoint import store as ckpt
    from meshtrain.cli.export import load_checkpoint_model
    from test_hf import logits_tolerance
    from test_lora import _no_missing_keys

    found = ckpt.resolve_checkpoint(lora_run)
    stored = {k for k in ckpt.read_metadata(found).state_dict_metadata if k.startswith("model.")}
    assert {k for k in stored if ".lora_" not in k} == {"model.tok_emb.weight", "model.lm_head.weight"}
    ours = load_checkpoint_model(lora_run)[0].eval()
    start = torch.load(lora_run / ROWS_FILE)
    for name in ("tok_emb.weight", "lm_head.weight"):
        trained = ours.get_parameter(name).detach()
        assert trained.shape[0] == NEW and not torch.equal(trained[OLD:OLD + ADDED], start[name][OLD:OLD + ADDED])
    for fmt, extra in (("peft", []), ("hf", ["--merge"])):
        proc = cli_here("export", "--checkpoint", str(lora_run), "--format", fmt, "--out", str(tmp_path / fmt), *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
    base = transformers.AutoModelForCausalLM.from_pretrained(setup[0])
    base.resize_token_embeddings(NEW)
    with _no_missing_keys():
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, OLD + ADDED, (2, 64), generator=torch.Generator().manual_seed(0))
    x[:, ::7] = OLD  # the new tokens, whose rows the run trained
    with torch.no_grad():
        want = ours(x)
        got_peft, got_merged = theirs(input_ids=x).logits, merged(input_ids=x).logits
    c = ours.cfg
    tol = logits_tolerance(c.n_layer, max(c.n_embd, c.ffn_hidden_size(), 64), float(want.abs().max()))
    torch.testing.assert_close(got_peft, want, rtol=0, atol=tol)
    torch.testing.assert_close(got_merged, want, rtol=0, atol=tol)


def test_the_planner_plans_the_grown_vocabulary(setup):
    """The planner's model of a run that grows the checkpoint's rows has the trainer's V (``NEW``, the prepared
    tokenizer's ids padded for tp), not the checkpoint's ``OLD``: its embedding and head parameters follow."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.model_specs import from_config

    cfg = load_config(None, overrides(setup))
    assert cfg.model.vocab_size == OLD
    spec = from_config(cfg)
    assert spec.vocab == NEW
    assert spec.embedding_params() - from_config(cfg, OLD).embedding_params() == (NEW - OLD) * spec.hidden
