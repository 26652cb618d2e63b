"""Supervised fine-tuning on prepared conversations: every layout computes one process's loss and gradients.

The loss is the cross-entropy summed over the supervised (assistant) tokens of the whole global batch and divided by
their count (meshtrain.parallel.reduce.loss_scale). The data is chosen so that a wrong normalisation shows: the
conversations cut from the plays differ in length and in the share of their tokens that the assistant speaks, and
some windows hold no supervised token at all (a conversation whose user turn alone fills the window: its answer is
cut with its tail). Layouts, 2 gloo ranks: DDP dp2, FSDP2 dp2, tp2 with sequence parallelism, pp2 (1F1B), Ulysses
sp2, ring sp2 (packed conversations, and one conversation per sample), ep2 on a mixture of experts, and gradient
accumulation over 4 micro-batches, each against one process on the whole batch at once (one launch in ``make test``,
:data:`SLOW` in a second one in ``make test-slow``). A sabotage layout averages the loss per micro-batch instead, and must fail the same comparison.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import TINY, assert_close_losses, check_layout
from layout_worker import launch_layouts, reference_run

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"
STEPS = 3
MODEL = {**TINY, "model.type": "llama", "model.n_head": "2", "model.n_kv_head": "2", "model.block_size": "128",
         "model.vocab_size": "1280",  # 0 would pad the tokenizer's 1,026 ids to a multiple of 128 * tp: another model
         "train.steps": str(STEPS), "train.eval_steps": "2", "data.packing": "document",
         "batch.micro_batch_size": "8", "batch.gradient_accumulation_steps": "1"}
"""Global batch 8 windows of 128 tokens, as every layout below."""
MOE = {"model.type": "mixtral", "model.num_experts": "4", "model.ffn_hidden": "24", "model.router_aux_loss_coef": "0"}
"""Mixtral without the load-balancing loss: what is compared is the supervised cross-entropy."""
PAD = {"data.packing": "pad"}
LAYOUTS = {  # name: (reference, overrides); the references: "packed", "padded", "moe"
    "dp2": ("packed", {"batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "2"}),
    "fsdp2-dp2": ("packed", {"batch.micro_batch_size": "4", "parallel.zero_stage": "3"}),
    "tp2-seqpar": ("packed", {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "pp2-1f1b": ("packed", {"parallel.pp": "2", "parallel.pp_schedule": "1f1b", "batch.micro_batch_size": "2",
                            "batch.gradient_accumulation_steps": "4"}),
    "ulysses-sp2": ("packed", {"parallel.sp": "2", "parallel.sp_mode": "ulysses"}),
    "ring-sp2": ("padded", {**PAD, "parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "ring-sp2-packed": ("packed", {"parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "ep2": ("moe", {**MOE, "parallel.ep": "2", "batch.micro_batch_size": "4"}),
    "dp2-ga4": ("packed", {"batch.micro_batch_size": "1", "batch.gradient_accumulation_steps": "4"}),
}
REFERENCES = {"packed": {}, "padded": PAD, "moe": MOE}
SLOW = {"fsdp2-dp2", "ulysses-sp2", "ring-sp2", "dp2-ga4"}
"""In ``make test-slow`` (one more launch; ``make test`` stays under 15 minutes): the supervised-token normalisation
they check is crossed in ``make test`` by dp2 with accumulation (ranks and micro-batches), tp2, pp2 and ring sp2
packed (the count over sequence shards) and ep2; FSDP2 reduces the gradients as DDP does, Ulysses shards the
sequence as ring does, padding and accumulation 4 are the same sums."""


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prepared_plays(root: Path, data_format: str) -> Path:
    """The plays' first 2,000 lines cut by scripts/shakespeare_chat.py into conversations (``data_format`` "chat") or
    preference pairs ("preference"), prepared with a 1,024-id BPE trained on those lines (ChatML added)."""
    from meshtrain.cli.tokenizer import train_bpe
    from meshtrain.data.preprocess import prepare

    text = "\n".join(CORPUS.read_text().splitlines()[:2000])
    (root / "plays.txt").write_text(text)
    tokenizer = train_bpe([root / "plays.txt"], 1024, root / "bpe.json")
    script = _load_script("shakespeare_chat")
    records = script.conversations(text) if data_format == "chat" else script.preference_pairs(text)
    with open(root / "records.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    prepare(str(tokenizer), [str(root / "records.jsonl")], root / data_format, data_format=data_format,
            val_fraction=0.1)
    return root / data_format


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    return prepared_plays(tmp_path_factory.mktemp("sft_data"), "chat")


def _model(reference: str, data: Path) -> dict[str, str]:
    return {**MODEL, **REFERENCES[reference], "data.path": str(data)}


class _References(dict):
    """The one-process runs by reference name, each trained when a test first asks for it (the padded one only by the
    slow layouts)."""

    def __init__(self, root: Path, data: Path) -> None:
        super().__init__()
        self.root, self.data = root, data

    def __missing__(self, name: str):
        self[name] = reference_run(self.root / name, _model(name, self.data))
        return self[name]


@pytest.fixture(scope="module")
def references(chat_data, tmp_path_factory):
    return _References(tmp_path_factory.mktemp("sft_reference"), chat_data)


def _launch(chat_data: Path, root: Path, names: list[str], sabotage: bool = False) -> dict:
    layouts = {name: {**_model(LAYOUTS[name][0], chat_data), **LAYOUTS[name][1]} for name in names}
    if sabotage:
        layouts["sabotage-dp2-ga2"] = {**layouts["dp2"], "sabotage": "per-micro-batch-mean"}
    return launch_layouts(2, root, layouts)


@pytest.fixture(scope="module")
def launched(chat_data, tmp_path_factory):
    return _launch(chat_data, tmp_path_factory.mktemp("sft_layouts"), [n for n in LAYOUTS if n not in SLOW], True)


@pytest.fixture(scope="module")
def launched_slow(chat_data, tmp_path_factory):
    return _launch(chat_data, tmp_path_factory.mktemp("sft_layouts_slow"), sorted(SLOW))


def _check(references, results: dict, name: str) -> None:
    reference, overrides = LAYOUTS[name]
    check_layout(results[name], references[reference], _model(reference, Path()) | overrides)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in SLOW])
def test_sft_layout_matches_one_process(references, launched, name):
    _check(references, launched, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_sft_layout_matches_one_process_slow(references, launched_slow, name):
    _check(references, launched_slow, name)


def test_per_micro_batch_mean_fails_the_comparison(references, launched):
    """The sabotage: each micro-batch's mean, averaged. Its first loss already differs from one process's."""
    with pytest.raises(AssertionError):
        assert_close_losses(launched["sabotage-dp2-ga2"][0], references["packed"][0])


def test_windows_hold_unequal_supervised_counts(chat_data):
    """What makes the comparisons able to fail: the windows of one step hold very different numbers of supervised
    tokens, some none."""
    from meshtrain.data.corpus import load_prepared

    train = load_prepared(chat_data, 128, packing="document").train
    counts = [(y != -100).sum().item() for y in train.samples(torch.arange(min(len(train), 64)))[1]]
    assert min(counts) == 0 and max(counts) > 2 * sum(counts) / len(counts)


def test_loss_equals_transformers_with_num_items_in_batch(chat_data, tmp_path):
    """An imported tiny Qwen3: the trainer's loss of a step of 4 micro-batches equals the sum of transformers'
    ``model(input_ids, labels=..., num_items_in_batch=N).loss`` over them, N the step's supervised tokens."""
    import torch.distributed as dist

    from meshtrain.config.load import load_config
    from meshtrain.train.loop import Trainer
    from test_hf import EPS32, logits_tolerance
    from test_qwen import saved

    transformers = pytest.importorskip("transformers")
    folder = saved(tmp_path / "hf", "Qwen3ForCausalLM", vocab_size=1280, head_dim=16, max_position_embeddings=128)
    overrides = {**MODEL, **PAD, "data.path": str(chat_data), "model.init_from": str(folder),
                 "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4", "train.out_dir": str(tmp_path / "run")}
    for key in ("model.type", "model.n_head", "model.n_kv_head", "model.n_layer", "model.n_embd"):
        overrides.pop(key)
    cfg = load_config(None, overrides)
    try:
        trainer = Trainer(cfg)
        micro_batches = trainer.sampler.next_step()
        ours = float(trainer.forward_backward(micro_batches))
        N = trainer.parallel.supervised_tokens
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    theirs, peak = 0.0, 0.0
    with torch.no_grad():
        for x, y in micro_batches:  # transformers shifts labels itself: feed one more token, labels one later
            ids = torch.cat([x, y[:, -1:].clamp(min=0)], 1)  # (B, T + 1)
            labels = torch.cat([torch.full_like(y[:, :1], -100), y], 1)  # (B, T + 1)
            out = hf(input_ids=ids, labels=labels, num_items_in_batch=N)
            theirs += float(out.loss)
            peak = max(peak, float(out.logits.abs().max()))
    assert N == sum(int((y != -100).sum()) for _, y in micro_batches) > 0
    # per token |d CE| <= 2 max|d logit| (test_hf.first_batch_loss), and summing N terms adds ~N eps of the loss
    cfg = trainer.cfg.model
    tol = 2 * logits_tolerance(cfg.n_layer, max(cfg.ffn_hidden_size(), cfg.block_size), peak) + N * EPS32 * theirs
    assert abs(ours - theirs) <= tol, (ours, theirs, tol)
