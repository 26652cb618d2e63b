"""Document packing (``data.packing = "document"``, :mod:`meshtrain.data.packing`): positions restart and
attention stays inside each document of a window, in one process and under tp, sp (Ulysses), pp and dp."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import packing_worker
from conftest import TINY, check_layout
from layout_worker import launch_layouts, layout_launcher, load_result, run_in_process
from meshtrain.config.checks import validate
from meshtrain.config.load import load_config
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.models.registry import ModelConfig
from meshtrain.data.packing import document_ids, document_positions, pack_documents
from meshtrain.models.build import build_model
from meshtrain.models.attention import document_causal_mask
from packing_worker import newline_documents


# --- documents, positions and the mask ------------------------------------------------------------

def test_documents_end_after_each_eos_and_positions_restart():
    x = torch.tensor([[5, 0, 3, 0, 0, 4, 4, 4],
                      [7, 7, 7, 7, 7, 7, 7, 0]])  # EOS = 0
    assert document_ids(x, 0).tolist() == [[0, 0, 1, 1, 2, 3, 3, 3], [0] * 8]
    assert document_positions(document_ids(x, 0)).tolist() == [[0, 1, 0, 1, 0, 0, 1, 2], list(range(8))]
    mask = document_causal_mask(document_ids(x, 0))  # (2, 1, 8, 8)
    assert mask.shape == (2, 1, 8, 8)
    assert torch.equal(mask[1, 0], torch.ones(8, 8, dtype=torch.bool).tril())  # one document: plain causal
    assert mask[0, 0, 2].tolist() == [False, False, True] + [False] * 5  # token 2 starts document 1
    assert mask[0, 0, 7].tolist() == [False] * 5 + [True] * 3  # document 3 is tokens 5..7


# --- 1. a packed window's loss is the mean of its documents' own losses ----------------------------

EOS = 0
V = 20
ROWS = [[3, 4, 20], [0, 31], [], [10, 11, 12, 25]]
"""EOS positions of each of the 4 windows of 32 tokens: a 1-token document (the EOS right after another), an
EOS at the first and at the last position, a window of one document, several short documents."""


def _windows(T: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, V, (len(ROWS), T), generator=g)  # (B, T), no EOS but where ROWS puts it
    y = torch.randint(0, V, (len(ROWS), T), generator=g)
    for b, eos in enumerate(ROWS):
        x[b, eos] = EOS
    return x, y


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_packed_loss_is_the_token_weighted_mean_of_each_documents_own_loss(model_type):
    cfg = ModelConfig(type=model_type, n_layer=2, n_head=4, n_kv_head=2 if model_type == "llama" else 0, n_embd=32,
                      block_size=32, multiple_of=16)
    torch.manual_seed(0)
    model = build_model(cfg, V)
    x, y = _windows()
    doc_ids, positions = pack_documents(x, EOS)  # (B, T) each
    with torch.no_grad():
        packed = float(F.cross_entropy(model(x, positions, doc_ids=doc_ids).flatten(0, 1), y.flatten()))
        total, n = 0.0, 0
        for b in range(x.size(0)):
            for d in doc_ids[b].unique():
                cols = (doc_ids[b] == d).nonzero().flatten()  # one document's tokens, contiguous
                s, e = int(cols[0]), int(cols[-1]) + 1
                logits = model(x[b:b + 1, s:e])[0]  # (e - s, V): the document alone, from position 0
                total += float(F.cross_entropy(logits.double(), y[b, s:e], reduction="sum"))
                n += e - s
    assert n == x.numel()
    # Both sides compute the same function: a masked key enters the packed softmax as exp(-inf) = 0 exactly.
    # They differ by fp32 rounding only where sums run in another order (matmuls over 128 vs e - s rows
    # may block differently, the attention over T = 32 masked vs e - s unmasked keys): a reordered sum of n
    # terms differs by ~log2(n) * u relative (u = 2**-24 = 6e-8; blocked summation, Higham 2002, Sec. 4.2).
    # Per token, each block has ~8 such sums (norm statistics over C = 32, q/k/v and proj over 32, scores
    # over hs = 8, softmax and attention x v over <= 32 keys, MLP over 32 and <= 4C = 128): 2 blocks plus
    # the head and the log-softmax over V = 20 are ~18 sums of <= 7u each, ~126u = 7.5e-6 relative on each
    # per-token loss if no error cancelled; the mean of 128 such positive terms errs by no more than its
    # worst term, plus log2(128) * u for the sum. Hence 1e-5. Measured: 3e-8 (gpt), 8e-8 (llama). A bug
    # is far outside: attention across documents moves the loss by 9e-4 (gpt) and 1.5e-4 (llama), positions
    # that do not restart by 6.5e-3 (gpt; RoPE under the mask is relative, so the llama cannot tell).
    assert packed == pytest.approx(total / n, rel=1e-5)


def test_a_window_of_one_document_is_the_causal_window():
    """No EOS in the window: the document mask is the causal mask and the positions 0..T-1, so the logits
    are those of "concat" up to the kernels' rounding (the masked kernel vs ``is_causal``: 1e-5 of the
    logits' scale ~1, the same reasoning as the loss test above)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=32), V)
    x = torch.randint(1, V, (2, 32), generator=torch.Generator().manual_seed(2))
    doc_ids, positions = pack_documents(x, EOS)
    with torch.no_grad():
        torch.testing.assert_close(model(x, positions, doc_ids=doc_ids), model(x), rtol=0, atol=1e-5)


# --- 2. every layout computes what one process computes --------------------------------------------

PACKED = {**TINY, "data.packing": "document", "model.n_head": "4", "train.steps": "3", "batch.micro_batch_size": "8"}
"""The trainer on the bundled text, each line a document (:mod:`packing_worker`), global batch 8 of 32 tokens,
3 steps: step 1's loss and gradients, then steps 2-3 on parameters moved by AdamW."""
GPT = PACKED
LLAMA = {**PACKED, "model.type": "llama", "model.n_kv_head": "2", "model.multiple_of": "16"}
LOSS_CHUNK = str(2 * 4 * 65 / 2**20)
"""``train.loss_chunk_mb`` of two tokens per chunk at the bundled text's 65 characters (fp32 logits)."""
PIPE = {"parallel.pp": "2", "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4"}
LAYOUTS = {  # name: (model, overrides); 2 ranks each, global batch 8
    "gpt-dp2": (GPT, {"batch.micro_batch_size": "4"}),
    "gpt-tp2-seqpar": (GPT, {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "llama-sp2-ulysses": (LLAMA, {"parallel.sp": "2"}),
    "llama-pp2": (LLAMA, PIPE),
    # ring attention slices each block's part of the document mask: documents cross its chunks, start exactly at
    # one (a chunk is 8 tokens at sp2, 4 at sp4) or fill a whole 32-token window (a line longer than it)
    "llama-sp2-ring": (LLAMA, {"parallel.sp": "2", "parallel.sp_mode": "ring"}),
    # the chunked cross-entropy (train.loss_chunk_mb) two tokens at a time, on a sequence shard and on a pipeline's last
    # stage, against the reference's F.cross_entropy over the whole micro-batch
    "gpt-sp2-ring-loss-chunks": (GPT, {"parallel.sp": "2", "parallel.sp_mode": "ring", "train.loss_chunk_mb": LOSS_CHUNK}),
    "gpt-pp2-loss-chunks": (GPT, {**PIPE, "train.loss_chunk_mb": LOSS_CHUNK}),
}
SLOW2 = {  # name: (model, overrides); 2 ranks each, in `make test-slow`: the other model on the mechanisms above
    "gpt-sp2-ulysses": (GPT, {"parallel.sp": "2"}),
    "gpt-pp2": (GPT, PIPE),
    "llama-tp2": (LLAMA, {"parallel.tp": "2"}),
    "gpt-sp2-ring": (GPT, {"parallel.sp": "2", "parallel.sp_mode": "ring"}),
}
RING4 = {  # name: (model, overrides); 4 ranks each, global batch 8, in `make test-slow`
    "gpt-sp4-ring": (GPT, {"parallel.sp": "4", "parallel.sp_mode": "ring"}),
    "llama-sp2-ring-tp2": (LLAMA, {"parallel.sp": "2", "parallel.sp_mode": "ring", "parallel.tp": "2"}),
    "gpt-sp2-ring-pp2": (GPT, {**PIPE, "parallel.sp": "2", "parallel.sp_mode": "ring"}),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process, micro batch 8, for each model; its loss ``F.cross_entropy`` over the whole micro-batch
    (``train.loss_chunk_mb = 0``), so every layout (chunked loss, the default) is checked against the plain loss."""
    root = tmp_path_factory.mktemp("packing-ref")
    spec = [{"out": str(root / name), "overrides": {**model, "train.loss_chunk_mb": "0"}}
            for name, model in (("gpt", GPT), ("llama", LLAMA))]
    with newline_documents():
        run_in_process(spec)
    return {name: load_result(root / name) for name in ("gpt", "llama")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every layout in one 2-rank torchrun launch."""
    layouts = {name: (2, {**model, **overrides}) for name, (model, overrides) in LAYOUTS.items()}
    layouts |= {name: (4, {**model, **overrides}) for name, (model, overrides) in RING4.items()}
    return layout_launcher(tmp_path_factory, {}, layouts, "packing", worker=packing_worker.__file__)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_document_packing_layout_matches_single_process(references, launched, name):
    """Losses of every step (1e-5 relative), step-1 gradients (1e-5 of the norm), final parameters (AdamW's
    drift bound): the tolerances of conftest.py, whose derivations hold here too (the same sums, fewer terms
    unmasked)."""
    model = {k: v for k, v in LAYOUTS[name][0].items() if k != "data.packing"}  # the drift bound's config: valid
    check_layout(launched(2)[name], references[name.split("-")[0]], model)


@pytest.fixture(scope="module")
def launched_slow(tmp_path_factory):
    """The :data:`SLOW2` layouts in one 2-rank launch."""
    return launch_layouts(2, tmp_path_factory.mktemp("packing-slow"),
                          {name: {**model, **overrides} for name, (model, overrides) in SLOW2.items()},
                          worker=Path(packing_worker.__file__))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW2))
def test_document_packing_slow_layout_matches_single_process(references, launched_slow, name):
    """The same as :func:`test_document_packing_layout_matches_single_process`, GPT under Ulysses, pp2 and ring,
    the Llama under tp2."""
    model = {k: v for k, v in SLOW2[name][0].items() if k != "data.packing"}
    check_layout(launched_slow[name], references[name.split("-")[0]], model)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RING4))
def test_document_packing_under_ring_on_four_ranks_matches_single_process(references, launched, name):
    """Ring attention at sp4 (chunks of 4 tokens: most documents span several), and at sp2 with tp2 and with pp2."""
    model = {k: v for k, v in RING4[name][0].items() if k != "data.packing"}
    check_layout(launched(4)[name], references[name.split("-")[0]], model)


def test_document_packing_changes_what_is_trained(references, tmp_path):
    """The hook is live: the same run with "concat" has another step-1 loss, by 10x the 1e-5 the layouts are
    held to (measured: 5.5e-4 relative; at init the model attends nearly uniformly, so masking moves little)."""
    with newline_documents():
        run_in_process([{"out": str(tmp_path), "overrides": {**GPT, "data.packing": "concat"}}])
    concat, packed = load_result(tmp_path)[0][1], references["gpt"][0][1]
    assert abs(concat - packed) / packed > 1e-4, (concat, packed)


# --- 3. what cannot run is refused before launch, in one line ---------------------------------------

def _error(**overrides) -> str:
    cfg = Config()
    cfg.data.tokenizer = "tokenizer.json"  # a file tokenizer, checked below only by name
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("overrides, message", [
    ({"data__packing": "docs"}, "data.packing = 'docs' is not valid: use one of concat, document"),
    ({"data__packing": "document", "data__tokenizer": "char"},
     "data.packing = 'document' needs an end-of-document (EOS) token and data.tokenizer = 'char' has none"),
    ({"data__packing": "document", "model__type": "lstm"},
     "data.packing = 'document' masks attention, which model.type = 'lstm' has none"),
    ({"data__packing": "document", "parallel__sync_mode": "async"},
     "data.packing = 'document' is not supported with parallel.sync_mode = 'async'"),
])
def test_what_document_packing_cannot_run_is_refused(overrides, message, monkeypatch):
    monkeypatch.setattr("meshtrain.config.checks.tokenizer_kind", lambda spec: "hf")  # no tokenizer file needed
    assert message in _error(**overrides)


def test_concat_is_the_default_and_document_is_accepted_where_it_runs(monkeypatch):
    assert load_config(None).data.packing == "concat"
    monkeypatch.setattr("meshtrain.config.checks.tokenizer_kind", lambda spec: "hf")
    cfg = Config()
    cfg.data.tokenizer, cfg.data.packing, cfg.parallel.sp = "tokenizer.json", "document", 2
    validate(cfg)  # Ulysses


def test_a_tokenizer_file_without_eos_is_refused_when_the_trainer_reads_it():
    """A file's special tokens are known once it is loaded: :func:`meshtrain.parallel.compose.parallelize` refuses
    "document" without an ``eos_id``, in one line."""
    from meshtrain.parallel.compose import _packing_eos

    cfg = Config()
    cfg.data.tokenizer, cfg.data.packing = "tokenizer.json", "document"
    with pytest.raises(ConfigError, match="data.packing = 'document' needs an end-of-document token, and "
                                          "data.tokenizer = 'tokenizer.json' has none"):
        _packing_eos(cfg, None)
    assert _packing_eos(cfg, 7) == 7
    cfg.data.packing = "concat"
    assert _packing_eos(cfg, 7) is None


@pytest.mark.parametrize("ids", [False, True])
@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("case", ["crossing", "at-boundaries", "one-document", "one-token-documents"])
def test_ring_blocks_of_documents_equal_masked_attention(sp, case, ids):
    """Ring attention's forward, every rank's blocks merged as the ring would (one process: each rank's query
    chunks against every rank's K/V chunks), equals SDPA with the whole sequence's document mask; blocks whose keys
    are all in earlier documents are skipped. Windows of 16 tokens (chunks of 8 / sp): documents crossing chunks,
    starting exactly at each chunk, one filling the window, and many of one token. Tolerance: fp32 scores of 8-term
    dot products and a softmax merged over at most 2 * sp blocks (log-sum-exp merges exact to ~2**-24 each): 1e-6
    absolute on outputs of magnitude <= 1 (a convex mix of v's rows of N(0, 1) entries, clipped by the test to
    |v| <= 1). The mask as the models hand it (``ids``: :class:`DocumentMask`, each block computed from the ids) and as
    the whole (B, 1, T, T) tensor."""
    from meshtrain.models.attention import DocumentMask, document_causal_mask
    from meshtrain.parallel.sequence.ring import _block_forward, _block_pairs, _merge
    from meshtrain.parallel.sequence.shard import shard_sequence

    T, c = 16, 16 // (2 * sp)
    starts = {"crossing": [0, 3, 11], "at-boundaries": list(range(0, T, c)), "one-document": [0],
              "one-token-documents": list(range(T))}[case]
    doc = torch.zeros(T, dtype=torch.long)
    for s in starts[1:]:
        doc[s:] += 1
    doc_ids = torch.stack([doc, doc.flip(0).max() - doc.flip(0)])  # (2, T): a second row, documents reversed
    mask = document_causal_mask(doc_ids)  # (2, 1, T, T)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, T, 8, generator=g) for _ in range(3))
    v = v.clamp(-1, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (2, 2, T, 8)
    scale = 1 / 8 ** 0.5
    skipped = 0
    for rank in range(sp):
        q_r = shard_sequence(q, 2, rank, sp, "ring")
        outs, lses = [None, None], [None, None]
        for src in range(sp):
            kv = torch.stack([shard_sequence(k, 2, src, sp, "ring"), shard_sequence(v, 2, src, sp, "ring")])
            pairs = list(_block_pairs(q_r, kv, rank, src, sp, DocumentMask(doc_ids) if ids else mask))
            skipped += 4 - len(pairs)
            for n, j, block_mask, q_c, kv_c in pairs:
                blk, blk_lse = _block_forward(q_c, kv_c[0], kv_c[1], block_mask, scale)
                outs[n], lses[n] = _merge(outs[n], lses[n], blk, blk_lse)
        torch.testing.assert_close(torch.cat(outs, dim=2), shard_sequence(want, 2, rank, sp, "ring"),
                                   rtol=0, atol=1e-6)
    causal_skips = sp * sp * 4 - sp * (2 * sp + 1)  # the blocks above the diagonal of 2sp x 2sp chunks
    assert skipped > causal_skips if case in ("at-boundaries", "one-token-documents") else skipped >= causal_skips
