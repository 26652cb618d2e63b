"""The catalogue of bad inputs: every subcommand, as a user types them (docs/bad_inputs.md lists the same).

Each case runs the CLI (in this process; one per subcommand also the installed one in a fresh process, which must
say the same) and must end with exit code 2 and exactly one line on stderr, ``meshtrain CMD: error: ...``. The line
names the value and what would be valid (the expected fragment), and there is no traceback. No file of the user's
is created or changed: the user's folder (with a run, a checkpoint, a plain file, a folder of checkpoints, configs)
is the same, name for name, size for size and mtime for mtime, after the command.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest

from bad_inputs_doc import DOC, check, doc_writer, parse  # noqa: F401 (doc_writer: a fixture)
from conftest import CONFIG, ROOT, TINY, run_cli, train_here
from meshtrain.models.registry import FAMILIES

C = str(CONFIG)
TRAIN = ["train", C, "--nproc", "1"]
PLAN = ["plan", "--model", "gpt2-small", "--gpu", "A100", "--num-gpus", "8", "--global-batch-size", "8"]
BATCH = ["batch", "--world-size", "8", "--micro-batch-size", "1"]
RUN_MODEL = [tok for key, value in TINY.items() if key.startswith("model.") for tok in (f"--{key}", value)]
"""The model options of the user's trained run (conftest's tiny model)."""

# (id, arguments with {user} = the user's folder and {run} = a trained run in it, fragment of the error line)
CATALOGUE: list[tuple[str, list[str], str]] = [
    # train: config values
    ("zero-layers", [*TRAIN, "--model.n_layer", "0"], "model.n_layer = 0 must be >= 1"),
    ("heads-not-dividing", [*TRAIN, "--model.n_embd", "130"], "model.n_embd = 130 must be divisible by model.n_head = 4"),
    ("unknown-model-type", [*TRAIN, "--model.type", "rnn"], "model.type = 'rnn' is not supported: use one of " + ", ".join(FAMILIES)),
    ("dropout-one", [*TRAIN, "--model.dropout", "1.0"], "model.dropout = 1.0 must be in [0, 1)"),
    ("dropout-nan", [*TRAIN, "--model.dropout", "nan"], "model.dropout = nan must be a finite number"),
    ("key-typo", [*TRAIN, "--model.n_layers", "4"], "unknown config key 'model.n_layers': did you mean 'n_layer'?"),
    ("section-typo", [*TRAIN, "--modle.n_layer", "4"], "unknown config section 'modle': did you mean 'model'?"),
    ("mlp-width-tp", ["train", C, "--nproc", "2", "--model.type", "llama", "--model.ffn_hidden", "35", "--tp", "2"],
     "the MLP's hidden width 35 (model.ffn_hidden, or its default from model.n_embd) is not divisible by parallel.tp = 2"),
    ("zero-stage-1", ["train", C, "--nproc", "2", "--parallel.tp", "2", "--parallel.zero_stage", "1"],
     "parallel.zero_stage = 1 needs tp = 1 and pp = 1 (got tp = 2, pp = 1"),
    ("fsdp-unit-negative", [*TRAIN, "--parallel.fsdp_unit_mb", "-1"], "parallel.fsdp_unit_mb = -1.0 must be >= 0 (0 = one FSDP2 unit per block)"),
    ("tp-not-dividing-heads", ["train", C, "--nproc", "3", "--parallel.tp", "3"], "model.n_head = 4 is not divisible by parallel.tp = 3"),
    ("pp-without-microbatches", ["train", C, "--nproc", "2", "--parallel.pp", "2"], "batch.gradient_accumulation_steps = 1 is below pp = 2"),
    ("unknown-schedule", [*TRAIN, "--parallel.pp_schedule", "pipedream"], "parallel.pp_schedule = 'pipedream' is not valid"),
    ("ulysses-heads", ["train", C, "--nproc", "3", "--parallel.sp", "3"], "model.n_head = 4 is not divisible by tp*sp = 3"),
    ("unknown-sp-mode", [*TRAIN, "--parallel.sp_mode", "zigzag"], "parallel.sp_mode = 'zigzag' is not valid: use one of ulysses, ring"),
    ("seqpar-without-tp", [*TRAIN, "--parallel.tp_sequence_parallel", "true"], "parallel.tp_sequence_parallel = true needs parallel.tp > 1"),
    ("ep-without-experts", ["train", C, "--nproc", "2", "--ep", "2"], "parallel.ep = 2 splits a mixture of experts' experts, and model.type = 'gpt' has none"),
    ("ep-not-dividing-dp", ["train", C, "--nproc", "2", "--ep", "4", "--model.type", "mixtral", "--model.num_experts", "4"],
     "parallel.ep = 4 does not divide dp*sp = 2*1 = 2"),
    ("ep-not-dividing-experts", ["train", C, "--nproc", "3", "--ep", "3", "--model.type", "mixtral", "--model.num_experts", "4"],
     "model.num_experts = 4 is not divisible by parallel.ep = 3"),
    ("ep-with-zero1", ["train", C, "--nproc", "2", "--ep", "2", "--model.type", "mixtral", "--parallel.zero_stage", "1"],
     "parallel.zero_stage = 1 is not supported with parallel.ep = 2"),
    ("bool-typo", [*TRAIN, "--parallel.tp_sequence_parallel", "maybe"], "parallel.tp_sequence_parallel = 'maybe' is not a valid bool"),
    ("dp-vs-nproc", ["train", C, "--nproc", "2", "--dp", "3"], "parallel.dp = 3 does not match --nproc = 2"),
    ("nproc-not-divisible", ["train", C, "--nproc", "3", "--tp", "2"], "--nproc = 3 is not divisible by pp*sp*tp = 2"),
    ("micro-batch-zero", [*TRAIN, "--batch.micro_batch_size", "0"], "batch.micro_batch_size = 0 must be >= 1"),
    ("micro-batch-word", [*TRAIN, "--batch.micro_batch_size", "twelve"], "batch.micro_batch_size = 'twelve' is not a valid int"),
    ("lr-nan", [*TRAIN, "--optim.lr", "nan"], "optim.lr = nan must be a finite number"),
    ("lr-inf", [*TRAIN, "--optim.lr", "inf"], "optim.lr = inf must be a finite number"),
    ("lr-zero", [*TRAIN, "--optim.lr", "0"], "optim.lr = 0.0 must be > 0"),
    ("min-lr-above-lr", [*TRAIN, "--optim.min_lr", "0.01"], "optim.min_lr = 0.01 must be in [0, optim.lr = 0.001]"),
    ("beta2-one", [*TRAIN, "--optim.beta2", "1.0"], "optim.beta2 = 1.0 must be in [0, 1)"),
    ("lr-scaling-unknown", [*TRAIN, "--optim.lr_scaling", "cubic"], "optim.lr_scaling = 'cubic' is not valid"),
    ("lr-scaling-without-reference", [*TRAIN, "--optim.lr_scaling", "linear"], "needs optim.reference_batch_size >= 1"),
    ("steps-zero", [*TRAIN, "--steps", "0"], "train.steps = 0 must be >= 1"),
    ("steps-nan", [*TRAIN, "--steps", "nan"], "train.steps = 'nan' is not a valid int"),
    ("dtype-float16", [*TRAIN, "--train.dtype", "float16"], "train.dtype = 'float16' is not valid: use one of auto, float32, bfloat16"),
    ("compile-unknown", [*TRAIN, "--train.compile", "yes"], "train.compile = 'yes' is not valid: use one of auto, on, off"),
    ("compile-on-with-async", ["train", C, "--nproc", "2", "--parallel.sync_mode", "async", "--train.compile", "on"],
     'train.compile = "on" cannot run here: sync_mode = \'async\' workers run their own loop, uncompiled'),
    ("recompute-unknown", [*TRAIN, "--train.recompute", "attention"],
     "train.recompute = 'attention' is not valid: use one of none, selective, full"),
    ("recompute-selective-zbv", ["train", C, "--nproc", "2", "--parallel.pp", "2", "--parallel.pp_schedule", "zbv",
                                 "--parallel.virtual_stages", "2", "--batch.gradient_accumulation_steps", "2",
                                 "--train.recompute", "selective"],
     "train.recompute = 'selective' cannot run with pp_schedule = 'zbv'"),
    ("zero3-zbv", ["train", C, "--nproc", "2", "--parallel.pp", "2", "--parallel.pp_schedule", "zbv",
                   "--parallel.virtual_stages", "2", "--batch.gradient_accumulation_steps", "2",
                   "--parallel.zero_stage", "3"],
     "pp_schedule = 'zbv' cannot run with zero_stage = 3"),
    ("interleaved-at-pp1", [*TRAIN, "--parallel.pp_schedule", "interleaved-1f1b"],
     "parallel.pp_schedule = 'interleaved-1f1b' needs parallel.pp > 1 (it is 1)"),
    ("virtual-stages-at-pp1", [*TRAIN, "--parallel.virtual_stages", "2"],
     "parallel.virtual_stages = 2 needs parallel.pp > 1 (it is 1)"),
    ("log-interval-zero", [*TRAIN, "--train.log_interval", "0"], "train.log_interval = 0 must be >= 1"),
    ("val-fraction", [*TRAIN, "--data.val_fraction", "1.5"], "data.val_fraction = 1.5 must be in (0, 1)"),
    ("missing-corpus", [*TRAIN, "--data.path", "/nonexistent/corpus.txt"], "data.path = '/nonexistent/corpus.txt' does not exist"),
    ("keep-zero", [*TRAIN, "--checkpoint.keep", "0"], "checkpoint.keep = 0 must be >= 1"),
    ("model-too-wide", [*TRAIN, "--model.n_embd", "100000"], "GiB CPU (MemAvailable), over by"),
    ("model-too-deep", [*TRAIN, "--model.n_layer", "100000"], "or skip this check with --train.check_memory false"),
    ("async-one-rank", [*TRAIN, "--parallel.sync_mode", "async"], "needs at least one worker besides parameter_server.servers = 1"),
    ("local-sgd-one-rank", [*TRAIN, "--parallel.sync_mode", "local-sgd"], "needs dp >= 2 replicas to average"),
    ("negative-staleness", ["train", C, "--nproc", "2", "--parallel.sync_mode", "async", "--parameter_server.max_staleness", "-1"],
     "parameter_server.max_staleness = -1 must be >= 0"),
    ("diloco-one-node", ["train", C, "--nproc", "2", "--parallel.sync_mode", "diloco"],
     "parallel.sync_mode = 'diloco' needs >= 2 workers, got 2 ranks in groups of 2: set diloco.group to one of 1"),
    ("diloco-group-not-divisor", ["train", C, "--nproc", "4", "--parallel.sync_mode", "diloco", "--diloco.group", "3"],
     "diloco.group = 3 ranks per worker does not divide the 4 ranks"),
    ("diloco-group-splits-a-replica", ["train", C, "--nproc", "4", "--tp", "2", "--parallel.sync_mode", "diloco",
                                       "--diloco.group", "1"], "diloco.group = 1 is not a multiple of"),
    ("diloco-fragments-not-divisor", [*TRAIN, "--parallel.sync_mode", "diloco", "--diloco.fragments", "3"],
     "diloco.inner_steps = 8 is not divisible by diloco.fragments = 3"),
    ("diloco-delay-too-long", [*TRAIN, "--parallel.sync_mode", "diloco", "--diloco.delay", "8"],
     "diloco.delay = 8 must be in [0, H/F = 8)"),
    ("diloco-precision-unknown", [*TRAIN, "--parallel.sync_mode", "diloco", "--diloco.precision", "fp8"],
     "diloco.precision = 'fp8' is not valid: use one of fp32, bf16, int8"),
    ("optimizer-unknown", [*TRAIN, "--optim.name", "lion"], "optim.name = 'lion' is not valid: use one of adamw, sgd"),
    ("lstm-with-tp", ["train", C, "--nproc", "2", "--model.type", "lstm", "--tp", "2"], "parallel.tp = 2 is not supported for model.type = 'lstm'"),
    ("tbptt-on-gpt", [*TRAIN, "--model.tbptt_steps", "8"], "model.tbptt_steps = 8 applies to model.type = 'lstm' or 'gru' only"),
    ("hierarchical-with-fsdp", [*TRAIN, "--parallel.hierarchical_allreduce", "true", "--parallel.zero_stage", "3"],
     "parallel.hierarchical_allreduce = true replaces DDP's gradient all-reduce"),
    ("unknown-option", [*TRAIN, "--foo", "1"], "unknown option --foo"),
    ("option-without-value", [*TRAIN, "--optim.lr"], "--optim.lr needs a value"),
    # train: files and folders
    ("missing-config", ["train", "/nonexistent/run.toml"], "config file '/nonexistent/run.toml' does not exist"),
    ("config-not-toml", ["train", "{user}/broken.toml"], "is not valid TOML"),
    ("toml-string-for-int", ["train", "{user}/quoted.toml", "--nproc", "1"], "model.n_layer = '4' is a string but must be a int"),
    ("toml-key-outside-section", ["train", "{user}/flat.toml"], "'steps' in"),
    ("out-under-proc", [*TRAIN, "--out", "/proc/meshtrain-run"], "train.out_dir = '/proc/meshtrain-run' cannot be written"),
    ("out-is-a-file", [*TRAIN, "--out", "{user}/notes.txt"], "is a file, not a folder"),
    ("out-dangling-symlink", [*TRAIN, "--out", "{user}/dangling"], "dangling' is a symbolic link to"),
    ("out-under-a-file", [*TRAIN, "--out", "{user}/notes.txt/run"], "which is a file: choose a folder path"),
    ("out-holds-a-run", [*TRAIN, "--out", "{run}"], "already holds a run (metrics.jsonl)"),
    ("out-holds-checkpoints", [*TRAIN, "--out", "{user}/only-checkpoints"], "already holds checkpoints"),
    ("resume-nothing", [*TRAIN, "--out", "{user}/new", "--resume", "{user}/new"], "holds no checkpoint"),
    ("resume-past-the-end", [*TRAIN, "--out", "{run}", "--resume", "--steps", "2"], "is already at step 2"),
    ("resume-other-global-batch", ["train", C, "--nproc", "2", "--out", "{run}", "--resume", "--steps", "4"],
     "was trained at global batch 12"),
    ("resume-other-model-size", [*TRAIN, "--out", "{run}", "--resume", "--steps", "4"],
     "holds a model with model.n_layer = 2, this config has 4: resume it with --model.n_layer 2"),
    ("resume-other-corpus", [*TRAIN, "--out", "{run}", "--resume", "--steps", "4", *RUN_MODEL, "--data.path",
                             "{user}/other.txt"], "was trained on a text with other characters"),
    ("resume-other-text-same-characters", [*TRAIN, "--out", "{run}", "--resume", "--steps", "4", *RUN_MODEL,
                                           "--data.path", "{user}/reversed.txt"], "same characters, other bytes"),
    ("resume-other-seed", [*TRAIN, "--out", "{run}", "--resume", "--steps", "4", *RUN_MODEL, "--seed", "7"],
     "was trained with train.seed = 1337, this config has 7, which would change the data order: resume it with --seed 1337"),
    ("resume-other-split", [*TRAIN, "--out", "{run}", "--resume", "--steps", "4", *RUN_MODEL, "--data.val_fraction",
                            "0.2"], "resume it with --data.val_fraction 0.1"),
    ("resume-crafted-metadata", [*TRAIN, "--out", "{user}/new", "--resume", "{user}/crafted", "--steps", "4"],
     "was not loaded: its .metadata names posix.system"),
    ("resume-damaged-shard", [*TRAIN, "--out", "{user}/new", "--resume", "{user}/damaged", "--steps", "4"],
     "changed since it was saved (SHA-256 differs)"),
    ("resume-no-files-record", [*TRAIN, "--out", "{user}/new", "--resume", "{user}/unrecorded", "--steps", "4"],
     "checkpoint file {user}/unrecorded/meta.json has no key 'files'"),
    ("resume-uncommitted-tmp", [*TRAIN, "--out", "{user}/new", "--resume", "{user}/cut-short/step_000002.tmp",
                                "--steps", "4"], "is a checkpoint that was never committed"),
    ("out-holds-other-files", [*TRAIN, "--out", "{user}"], "holds files meshtrain did not write ("),
    ("collective-timeout-zero", [*TRAIN, "--train.collective_timeout_s", "0"], "train.collective_timeout_s = 0.0 must be > 0"),
    ("collective-timeout-inf", [*TRAIN, "--train.collective_timeout_s", "inf"], "must be a finite number"),
    # train: launcher
    ("nproc-zero", ["train", C, "--nproc", "0"], "--nproc = 0 must be >= 1"),
    ("nnodes-word", [*TRAIN, "--nnodes", "abc"], "--nnodes = 'abc' is not valid: use N or MIN:MAX"),
    ("nnodes-min-above-max", [*TRAIN, "--nnodes", "4:2"], "--nnodes = '4:2' is not valid: MIN = 4 exceeds MAX = 2"),
    ("nnodes-zero", [*TRAIN, "--nnodes", "0"], "--nnodes = '0' is not valid: use N or MIN:MAX, each >= 1"),
    ("nnodes-without-endpoint", [*TRAIN, "--nnodes", "2"], "--nnodes = 2 needs --rdzv-endpoint HOST:PORT"),
    ("endpoint-without-port", [*TRAIN, "--rdzv-endpoint", "node0"], "--rdzv-endpoint = 'node0' is not HOST:PORT"),
    ("endpoint-port-range", [*TRAIN, "--rdzv-endpoint", "node0:99999"], "with a port in 1..65535"),
    ("node-rank-without-endpoint", [*TRAIN, "--node-rank", "1"], "--node-rank = 1 needs --rdzv-endpoint HOST:PORT"),
    ("node-rank-too-large", [*TRAIN, "--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--node-rank", "2"],
     "--node-rank = 2 must be below --nnodes = 2"),
    ("max-restarts-negative", [*TRAIN, "--max-restarts", "-1"], "argument --max-restarts: -1 must be an integer >= 0"),
    # generate
    ("generate-no-checkpoint", ["generate", "--checkpoint", "/nonexistent"], "holds no checkpoint"),
    ("generate-crafted-metadata", ["generate", "--checkpoint", "{user}/crafted"], "its .metadata names posix.system"),
    ("generate-damaged-shard", ["generate", "--checkpoint", "{user}/damaged"], "(SHA-256 differs)"),
    ("temperature-nan", ["generate", "--checkpoint", "{run}", "--temperature", "nan"], "argument --temperature: nan must be a finite number >= 0"),
    ("temperature-negative", ["generate", "--checkpoint", "{run}", "--temperature", "-1"], "argument --temperature: -1 must be a finite number >= 0"),
    ("max-new-tokens-zero", ["generate", "--checkpoint", "{run}", "--max-new-tokens", "0"], "--max-new-tokens = 0 must be >= 1"),
    ("top-k-zero", ["generate", "--checkpoint", "{run}", "--top-k", "0"], "--top-k = 0 must be >= 1"),
    ("prompt-outside-vocabulary", ["generate", "--checkpoint", "{run}", "--prompt", "€"], "is not in the vocabulary"),
    # plan
    ("plan-zero-gpus", ["plan", "--model", "gpt2-small", "--gpu", "A100", "--num-gpus", "0", "--global-batch-size", "8"],
     "argument --num-gpus: 0 must be an integer > 0"),
    ("plan-negative-batch", ["plan", "--model", "gpt2-small", "--gpu", "A100", "--num-gpus", "8", "--global-batch-size", "-8"],
     "argument --global-batch-size: -8 must be an integer > 0"),
    ("plan-top-zero", [*PLAN, "--top", "0"], "argument --top: 0 must be an integer > 0"),
    ("plan-epochs-nan", [*PLAN, "--epochs", "nan"], "argument --epochs: nan must be a finite number > 0"),
    ("plan-seq-len-zero", [*PLAN, "--seq-len", "0"], "argument --seq-len: 0 must be an integer > 0"),
    ("plan-token-budget-negative", [*PLAN, "--token-budget", "-5"], "argument --token-budget: -5 must be a finite number > 0"),
    ("plan-plot-under-proc", [*PLAN, "--plot", "/proc/plan.png"], "the folder of --plot = '/proc' cannot be written"),
    ("plan-plot-is-a-folder", [*PLAN, "--plot", "{user}"], "is a folder: give a file name"),
    ("plan-unknown-gpu", ["plan", "--model", "gpt2-small", "--gpu", "B300X", "--num-gpus", "8", "--global-batch-size", "8"],
     "unknown device 'B300X'"),
    ("plan-unknown-model", ["plan", "--model", "gpt5", "--gpu", "A100", "--num-gpus", "8", "--global-batch-size", "8"], "gpt5"),
    ("plan-nics-zero", [*PLAN, "--nics-per-node", "0"], "argument --nics-per-node: 0 must be an integer > 0"),
    ("plan-fix-unknown-field", [*PLAN, "--fix", "bogus=1"], "bogus"),
    ("plan-fix-tp-zero", [*PLAN, "--fix", "tp=0"], "--fix tp = 0 must be >= 1"),
    ("plan-fix-micro-batch-zero", [*PLAN, "--fix", "micro_batch_size=0"], "--fix micro_batch_size = 0 must be >= 1"),
    ("plan-lstm-config", ["plan", "{user}/lstm.toml"], "model.type = 'lstm' is not modelled by the planner yet"),
    # batch
    ("batch-time-nan", [*BATCH, "--time-per-step", "nan"], "argument --time-per-step: nan must be a finite number > 0"),
    ("batch-epochs-inf", [*BATCH, "--epochs", "inf", "--num-samples", "10"], "argument --epochs: inf must be a finite number > 0"),
    ("batch-samples-negative", [*BATCH, "--num-samples", "-3"], "num_samples = -3 must be >= 1"),
    ("batch-world-not-divisible", ["batch", "--world-size", "6", "--sp", "4", "--micro-batch-size", "1"], "world_size = 6 is not divisible"),
    ("batch-scaling-without-lr", [*BATCH, "--lr-scaling", "linear", "--reference-batch-size", "2"], "give --lr too"),
    # export
    ("export-not-safetensors", ["export", "--checkpoint", "{run}", "--out", "{user}/model.pt"], "must end in .safetensors"),
    ("export-over-a-file", ["export", "--checkpoint", "{run}", "--out", "{user}/taken.safetensors"], "already exists"),
    ("export-no-checkpoint", ["export", "--checkpoint", "/nonexistent", "--out", "{user}/m.safetensors"], "holds no checkpoint"),
    ("export-crafted-metadata", ["export", "--checkpoint", "{user}/crafted", "--out", "{user}/m.safetensors"],
     "its .metadata names posix.system"),
]


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A user's folder: a trained run (2 steps), files and folders the commands must not touch."""
    folder = tmp_path_factory.mktemp("user")
    train_here(folder / "run", **{"train.steps": "2"})
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "dangling").symlink_to(folder / "moved-away" / "run")  # --out at a link whose target is gone
    (folder / "taken.safetensors").write_bytes(b"not mine to overwrite")
    (folder / "broken.toml").write_text("[model\nn_layer = 4\n")
    (folder / "quoted.toml").write_text('[model]\nn_layer = "4"\n')
    (folder / "flat.toml").write_text("steps = 10\n")
    (folder / "lstm.toml").write_text('[model]\ntype = "lstm"\n')
    step = folder / "only-checkpoints" / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 1}')
    (folder / "other.txt").write_text("abcdefgh " * 2000)
    text = (ROOT / "src/meshtrain/assets/tinyshakespeare.txt").read_text()
    (folder / "reversed.txt").write_text(text[::-1])  # the run's characters, another text
    crafted = _checkpoint_copy(folder / "run", folder / "crafted")  # its .metadata runs `touch pwned` if unpickled
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(str(folder / "pwned"))))
    _rerecord(crafted)  # digests rewritten too, as an attacker would: the unpickler must stop it
    damaged = _checkpoint_copy(folder / "run", folder / "damaged")  # one flipped byte in a shard
    shard = next(f for f in sorted(damaged.iterdir()) if f.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    unrecorded = _checkpoint_copy(folder / "run", folder / "unrecorded")  # meta.json without its files record
    meta = json.loads((unrecorded / "meta.json").read_text())
    del meta["files"]
    (unrecorded / "meta.json").write_text(json.dumps(meta))
    _checkpoint_copy(folder / "run", folder / "cut-short" / "step_000002.tmp")  # a save cut short before its commit
    return folder


class _Payload:
    """Unpickles to ``os.system("touch MARKER")``: code a crafted checkpoint would run under ``pickle.load``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _checkpoint_copy(run: Path, to: Path) -> Path:
    """A copy of ``run``'s newest step folder at ``to``."""
    from meshtrain.checkpoint import store as ckpt

    shutil.copytree(ckpt.resolve_checkpoint(run), to)
    return to


def _rerecord(step_folder: Path) -> None:
    """meta.json's recorded sizes and digests made to match the folder's files."""
    from meshtrain.checkpoint import store as ckpt

    meta = json.loads((step_folder / "meta.json").read_text())
    meta["files"] = ckpt.file_digests(step_folder)
    (step_folder / "meta.json").write_text(json.dumps(meta))


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of everything under ``folder`` (a symbolic link's own, not its target's: one may dangle)."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")}


def documented_commands() -> list[tuple[str, str]]:
    """(id, the command line as docs/bad_inputs.md shows it) of each case, ``~/work`` standing for the user's folder."""
    def shown(arg: str) -> str:
        return arg.replace(C, "configs/shakespeare_char.toml").format(user="~/work", run="~/work/run")

    return [(ident, " ".join(["meshtrain", *map(shown, args)])) for ident, args, _ in CATALOGUE]


IN_A_FRESH_PROCESS = {"zero-layers", "resume-other-split", "top-k-zero", "plan-plot-under-proc",
                      "batch-samples-negative", "export-no-checkpoint"}
"""The cases that also run the installed CLI in a fresh process, which must say the same line: one per subcommand,
and for ``train`` a refusal before torch is imported and one after a checkpoint is read. The others run
``meshtrain.cli.main`` in this process, torchrun's engine trapped: a fresh ``generate``, ``export`` or resume costs
~5 s of imports (torch, DTensor) a case, one that refuses before torch ~0.4 s; most of this file's time."""


@pytest.mark.parametrize("ident, args, fragment", CATALOGUE, ids=[i for i, _, _ in CATALOGUE])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(user, doc_writer, ident, args, fragment):  # noqa: F811
    from artefacts import run_cli_here

    before = snapshot(user)
    argv = [a.format(user=user, run=user / "run") for a in args]
    code, stderr, stdout = run_cli_here(argv)
    command = args[0]
    assert code == 2, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(f"meshtrain {command}: error: ") and fragment.format(user=user) in lines[0], lines[0]
    assert "Traceback" not in stderr and stdout == ""
    assert snapshot(user) == before
    check(("catalogue", ident), lines[0].replace(str(user), "~/work"))
    if ident in IN_A_FRESH_PROCESS:
        proc = run_cli(*argv)
        assert proc.returncode == 2 and proc.stderr.strip() == stderr.strip() and proc.stdout == "", proc.stderr[-2000:]
        assert snapshot(user) == before


def test_the_catalogue_is_large_distinct_and_documented():
    ids = [i for i, _, _ in CATALOGUE]
    assert len(ids) >= 60 and len(set(ids)) == len(ids) and IN_A_FRESH_PROCESS <= set(ids)
    documented = {key[1] for key in parse(DOC.read_text()) if key[0] == "catalogue"}
    assert documented == set(ids), f"{sorted(set(ids) ^ documented)}: run python tests/gen_bad_inputs_doc.py"
    catalogue = DOC.read_text().split("\n## The matrix")[0]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \| `(.*?)` \|", catalogue, flags=re.MULTILINE)
    assert dict(rows) == dict(documented_commands()), "run python tests/gen_bad_inputs_doc.py"
