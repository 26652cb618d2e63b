"""DPO's reference model (``train.objective = "dpo"``), one of two ways (``train.dpo_reference``).

DPO compares the policy's log-probability of each sequence with a frozen reference's: the model as training starts
(Rafailov et al. 2023, Sec. 4).

- ``"precomputed"`` (the default): the trainer computes the reference's log-probability of every train sequence once,
  before the first step, with the starting weights and the run's own layout (a forward pass over the pairs, shared
  out over the dp ranks; TRL's ``precompute_ref_log_probs``): training then holds one model, and each step costs what
  the frozen copy's forward would have cost once per epoch. The table is written to ``OUT/reference_logps.json`` so
  that a resumed run, whose weights have moved, reads the starting model's values back instead of computing others.
- ``"copy"``: a second model, the starting weights (built from ``train.seed`` and read from ``model.init_from``
  exactly as the policy was, the grown vocabulary's rows drawn alike), parallelized with the policy's layout but
  frozen (:func:`reference_copy`; tp and FSDP2 shard it as they shard the policy, a pipeline cuts it alike), runs
  forward on every micro-batch of every step before the policy (TRL's default, ``ref_model``). It needs no pass
  before step 1 and no file, and a resume rebuilds it from the same sources; it costs a second model's parameters
  (no gradients, no optimizer states) and a forward per step. The two give the same reference values: the same
  weights, the same layout, the same rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.config.sections import Config
from meshtrain.data.conversations import Pairs
from meshtrain.errors import ConfigError
from meshtrain.fileio import write_json_atomic
from meshtrain.mesh import Axis, ParallelDims
from meshtrain.models.build import build_model
from meshtrain.models.hf import load_hf_weights
from meshtrain.parallel.compose import parallelize
from meshtrain.parallel.model import Batch, ParallelModel

REFERENCE_FILE = "reference_logps.json"
FORMAT = "meshtrain-dpo-reference"


def train_reference(model: ParallelModel, pairs: Pairs, dims: ParallelDims, micro_batch_size: int) -> torch.Tensor:
    """The reference's log-probability of every train sequence, (2P,) float64 on every rank (rows chosen, rejected
    of pair 0, 1, ...). dp rank r computes pairs ``[r * S, (r + 1) * S)``, S = ceil(P / dp), in micro-batches of
    ``micro_batch_size`` pairs (every dp rank runs as many forwards: the last one repeats pair 0 to fill its share,
    and drops them), then one all-reduce over dp gives every rank the whole table."""
    dp, rank = dims.batch_degree // dims.sp, dims.rank_of(Axis.DP)
    share = math.ceil(len(pairs) / dp)
    index = torch.arange(rank * share, (rank + 1) * share) % len(pairs)  # (S,): past the end, wrap around
    rows = model.reference_logps([pairs.samples(chunk) for chunk in index.split(micro_batch_size)])  # (2S,)
    mine = min(share, max(0, len(pairs) - rank * share))  # pairs of this rank that are its own
    table = torch.zeros(2 * len(pairs), dtype=torch.float64)
    table[2 * rank * share:2 * (rank * share + mine)] = rows[:2 * mine]
    if dp > 1:
        dist.all_reduce(table, group=dims.get_mesh(Axis.DP).get_group())
    return table


def reference_copy(cfg: Config, dims: ParallelDims, vocab_size: int, device: torch.device, autocast,
                   grown=None) -> ParallelModel:
    """``train.dpo_reference = "copy"``: the starting weights as a frozen model on ``dims``' mesh, parallelized as the
    policy (:func:`meshtrain.parallel.compose.parallelize` with ``frozen``): built from ``train.seed`` with
    ``vocab_size`` rows as :func:`meshtrain.train.setup.set_up` builds the policy, then ``model.init_from``'s weights
    read into this rank's slices as the policy's are (``grown``: the same
    :class:`meshtrain.models.resize.GrownRows` draws). Its :meth:`~meshtrain.parallel.model.ParallelModel.reference_logps`
    gives the rows' reference log-probabilities (:func:`with_reference`)."""
    torch.manual_seed(cfg.train.seed)
    copy = parallelize(build_model(cfg.model, vocab_size).to(device), dims, cfg, autocast, conversations=True,
                       frozen=True)
    if cfg.model.init_from:
        load_hf_weights(copy.model, cfg.model.init_from, cfg.model, grown)
    copy.model.eval()  # no dropout; tp's dropout stream only needs a start (the default stream is left alone)
    if (tp_rng := getattr(copy.model, "tp_rng", None)) is not None:
        tp_rng.seed(cfg.train.seed)
    return copy


def with_reference(model: ParallelModel, batches: Batch) -> Batch:
    """``batches`` (micro-batches of pairs: this rank's validation ones, or with a frozen copy a step's) with each
    row's reference log-probability under ``model`` (the policy before step 1, or the frozen copy)."""
    rows = model.reference_logps(batches).split([len(mb[0]) for mb in batches])
    model.after_forward_only()
    return [(x, y, docs, reference) for (x, y, docs, _), reference in zip(batches, rows)]


def save(table: torch.Tensor, out_dir: Path, corpus_sha256: str) -> None:
    """Write ``table`` (2P,) to ``out_dir/REFERENCE_FILE`` (atomic; floats as Python writes them, exactly)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)  # before the first step: metrics.jsonl not yet written
    write_json_atomic(Path(out_dir) / REFERENCE_FILE, {"format": FORMAT, "corpus_sha256": corpus_sha256,
                                                       "train": table.tolist()})


def load(checkpoint: Path, corpus_sha256: str, sequences: int) -> torch.Tensor:
    """The table a DPO run wrote before its first step, found in the run folder of the step folder ``checkpoint``.

    Raises:
        ConfigError: no such file, or one of other data (another corpus or pair count).
    """
    path = Path(checkpoint).parent / REFERENCE_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"resuming a DPO run needs the reference log-probabilities its first step used: '{path}' "
                          f"is missing or unreadable; start the DPO run again") from None
    if saved.get("format") != FORMAT or saved.get("corpus_sha256") != corpus_sha256 or len(saved["train"]) != sequences:
        raise ConfigError(f"'{path}' holds reference log-probabilities of other data than data.path's: resume with "
                          f"the data the run started with")
    return torch.tensor(saved["train"], dtype=torch.float64)
