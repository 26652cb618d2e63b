"""Checks before any process starts: the config's layout against the ranks, the corpus, the output folder
(never reuse a folder that holds another run) and the checkpoint to resume (the same model, data, order
and global batch). Importing it imports no torch: ``meshtrain train`` runs it in the launcher before
starting the ranks, and a rank started by ``torchrun`` directly runs it before joining the group.
Every failed check raises :class:`meshtrain.errors.ConfigError` with one actionable line.
"""

from __future__ import annotations

import dataclasses
import http.client
import importlib.util
import re
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.resolved import ResolvedRun

if TYPE_CHECKING:
    from meshtrain.data.growth import VocabGrowth


def preflight(run: ResolvedRun) -> None:
    """Checks of a resolved run (its layout already fits its ranks) that need no process group. Raises
    ConfigError with one actionable line."""
    cfg = run.config
    from meshtrain.checkpoint import store as ckpt
    from meshtrain.data.corpus import corpus_of
    from meshtrain.data.growth import vocab_growth
    from meshtrain.fileio import check_writable_dir
    from meshtrain.metrics import METRICS_FILE, read_metrics

    d = cfg.diloco
    if cfg.elastic and importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"diloco.lighthouse = {d.lighthouse!r} needs torchft, which is not installed: "
                          f"pip install 'meshtrain[elastic]' (torchft>=0.2), or run the workers as one job without it")
    if cfg.elastic:
        check_lighthouse(d.lighthouse, d.worker, d.workers)
    corpus = corpus_of(cfg)
    out = Path(cfg.train.out_dir)
    resume = cfg.checkpoint.resume
    if cfg.model.init_from and not resume:
        check_init_from(cfg, corpus.tokenizer.vocab_size, corpus.added_tokens)
    growth = vocab_growth(cfg, corpus.tokenizer.vocab_size, corpus.added_tokens)
    if 0 < cfg.model.vocab_size < corpus.tokenizer.vocab_size and not growth:  # the ranks' own check, before they start
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is smaller than the vocabulary of data.path = "
                          f"'{cfg.data.resolved_path()}' ({corpus.tokenizer.vocab_size} ids): use 0 or >= that")
    if resume:
        found, meta = check_resume(run, corpus, growth)
    resuming_here = bool(resume) and out.resolve() in ckpt.resolve_checkpoint(resume).resolve().parents
    if resuming_here:
        read_metrics(out)  # rank 0 keeps its records up to the checkpoint's step: a damaged file is refused now
        interval, last = cfg.checkpoint.interval, cfg.train.steps
        saved = [p.name for p in ckpt.list_checkpoints(out) if meta["step"] < (step := int(p.name.split("_")[1]))
                 <= last and (step == last or (interval > 0 and step % interval == 0))]
        if saved:  # the run would save those steps again: torch refuses at the first, after the steps were trained
            raise ConfigError(f"checkpoint.resume = '{found}' goes back to step {meta['step']}, but train.out_dir = "
                              f"'{out}' holds later checkpoints this run would save again ({saved[0]}"
                              f"{f' .. {saved[-1]}' if len(saved) > 1 else ''}): resume from the newest with --resume "
                              f"alone, or keep this one's run in another folder: --resume '{found}' --out NEW_FOLDER")
    if out.is_symlink() and not out.exists():  # the ranks would fail to create it, after the launch
        raise ConfigError(f"train.out_dir = '{out}' is a symbolic link to '{out.readlink()}', which does not exist: "
                          f"create that folder, or choose another --out")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.out_dir = '{out}' is a file, not a folder: choose a folder path")
    if (out / METRICS_FILE).exists() and not resuming_here:
        if not ckpt.list_checkpoints(out):  # a run that stopped before its first checkpoint: nothing to continue
            raise ConfigError(f"train.out_dir = '{out}' holds a run that saved no checkpoint, so "
                              f"there is nothing to resume: start it afresh after removing {out / METRICS_FILE}, or "
                              f"choose another --out")
        raise ConfigError(f"train.out_dir = '{out}' already holds a run ({METRICS_FILE}): choose another --out, "
                          f"or continue it with --resume")
    if ckpt.list_checkpoints(out) and not resuming_here:
        raise ConfigError(f"train.out_dir = '{out}' already holds checkpoints: choose another --out, or continue "
                          f"from them with --resume")
    foreign = foreign_entries(out)
    if foreign and not resuming_here:
        raise ConfigError(f"train.out_dir = '{out}' holds files meshtrain did not write ({foreign[0]}"
                          f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}): choose a new or empty "
                          f"folder for --out")
    check_writable_dir(out, "train.out_dir")  # last: it probes the folder the run is about to write in


LIGHTHOUSE_WAIT_S = 5.0
"""How long the pre-launch check waits for a lighthouse's answer (a refused connection is tried again meanwhile: a
lighthouse started a moment before its workers may still be binding its port)."""
LIVE_HEARTBEAT_S = 3.0
"""A worker the lighthouse heard from less than this long ago is running (torchft's managers beat every 0.1 s)."""


def check_lighthouse(url: str, worker: int, workers: int) -> None:
    """An elastic worker's lighthouse answers at ``url`` (within :data:`LIGHTHOUSE_WAIT_S`, resolving the host
    included), is a torchft lighthouse (its ``/status`` page), and hears no living worker ``worker`` already (another
    job with the same ``diloco.worker`` would read the same data share, and no job the other one's).

    Raises:
        ConfigError: one line: nothing answers, something that is not a lighthouse answers, or the worker is taken.
    """
    key = f"diloco.lighthouse = {url!r}"
    start = "start one there first (torchft_lighthouse --bind HOST:PORT --min_replicas 1), or fix the address"
    answer = _http_get(url.rstrip("/") + "/status", LIGHTHOUSE_WAIT_S)
    if answer is None:
        raise ConfigError(f"{key}: nothing answered within {LIGHTHOUSE_WAIT_S:g} s: {start}")
    if isinstance(answer, socket.gaierror):
        raise ConfigError(f"{key}: the host {urllib.parse.urlsplit(url).hostname!r} does not resolve ({answer.strerror}):"
                          f" fix the address")
    if isinstance(answer, OSError):
        raise ConfigError(f"{key}: nothing answers there ({answer.strerror or answer}): {start}")
    if isinstance(answer, Exception) or answer[0] != 200 or "quorum_id" not in answer[1]:
        what = f"HTTP {answer[0]} for /status" if isinstance(answer, tuple) else f"{type(answer).__name__}"
        raise ConfigError(f"{key}: something answers there, but not a torchft lighthouse ({what}): give the address "
                          f"torchft_lighthouse --bind listens on")
    for amount, unit in re.findall(rf"\bworker{worker}:\S*: seen ([\d.]+)(ns|µs|us|ms|s) ago", answer[1]):
        age = float(amount) * {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
        if age < LIVE_HEARTBEAT_S:
            raise ConfigError(f"diloco.worker = {worker} is taken: the lighthouse at {url} hears a running "
                              f"worker {worker} (another job, last heard {age:.1f} s ago): give this job another index "
                              f"in [0, {workers}) (diloco.workers), or stop the other job first")


def _http_get(url: str, wait_s: float) -> tuple[int, str] | Exception | None:
    """``GET url`` without proxies: (status, the first MiB of the body as text), the error that ended it, or None
    when no answer came within ``wait_s`` (host name resolution included, which has no timeout of its own)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    result: list[tuple[int, str] | Exception] = []

    def ask() -> None:
        deadline = time.monotonic() + wait_s
        while True:
            conn = connection(parts.hostname, parts.port, timeout=wait_s)
            try:
                conn.request("GET", parts.path or "/")
                response = conn.getresponse()
                result.append((response.status, response.read(1 << 20).decode("utf-8", "replace")))
                return
            except ConnectionRefusedError as e:  # not listening (yet): ask again until the deadline
                if time.monotonic() + 0.2 > deadline:
                    result.append(e)
                    return
                time.sleep(0.2)
            except (OSError, http.client.HTTPException, ValueError) as e:
                result.append(e)
                return
            finally:
                conn.close()

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(wait_s + 1)
    return result[0] if result else None


RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", "plan_vs_actual.json", "pipeline_trace.json",
             "pipeline_schedule.png")
"""The files a run writes at the top of its output folder (``metrics``, ``planner.actual``, the pipeline's
report); each may also be there as ``NAME.tmp`` or ``.NAME.<random>.tmp``, an atomic write cut short
(:func:`meshtrain.fileio.fresh_temp_file`). All but ``metrics.jsonl``, which a run writes first, are a run's only
beside its ``metrics.jsonl`` or checkpoints: alone, they are the user's."""
RUN_DIRS = ("checkpoints", "tb", "profile")
"""Its folders: checkpoints (:mod:`meshtrain.checkpoint`), TensorBoard events, profiler traces."""


def foreign_entries(out: Path) -> list[str]:
    """Names in ``out`` that no run writes (:data:`RUN_FILES` and their temporaries, :data:`RUN_DIRS`,
    ``.meshtrain-*`` probes), sorted; empty when ``out`` is missing. A run never writes into a folder that holds
    someone else's files, a ``summary.json``, ``loss.png`` or ``plan_vs_actual.json`` with no run beside it included."""
    if not out.is_dir():
        return []
    has_run = (out / RUN_FILES[0]).is_file() or (out / RUN_DIRS[0]).is_dir()
    files = RUN_FILES if has_run else RUN_FILES[:1]  # a summary.json with no run beside it is someone else's
    ours = {*files, *(name + ".tmp" for name in files)}

    def is_ours(p: Path) -> bool:
        temporary = p.name.startswith(".") and p.name.endswith(".tmp") and p.name[1:].startswith(
            tuple(f"{name}." for name in files))
        return ((p.name in ours or temporary) and p.is_file() or p.name in RUN_DIRS and p.is_dir()
                or p.name.startswith(".meshtrain-"))

    return sorted(p.name for p in out.iterdir() if not is_ours(p))


def check_init_from(cfg: Config, corpus_vocab: int, added: dict[int, str] | None = None) -> None:
    """``model.init_from``'s weights can start this run (one that does not resume): every tensor of the model
    in whole files with the shapes its ``config.json`` gives (headers only,
    :func:`meshtrain.models.registry.check_hf_weights`), and a vocabulary that holds the corpus's tokens, or that
    grows by the tokens ``added`` by prepare (:func:`meshtrain.data.growth.vocab_growth`).
    Raises ConfigError with one actionable line."""
    from meshtrain.data.growth import vocab_growth
    from meshtrain.models import hf_io as hf
    from meshtrain.models.registry import check_hf_weights

    m = cfg.model
    try:
        check_hf_weights(Path(m.init_from).expanduser(), m)
    except hf.HFFormatError as e:
        raise ConfigError(str(e)) from None
    vocab_growth(cfg, corpus_vocab, added or {})


def check_resume(run: ResolvedRun, corpus, growth) -> tuple[Path, dict]:
    """The checkpoint ``checkpoint.resume`` names, verified and continuable by this run (the same start, adapters,
    global batch, model, tensors and data; :func:`check_same_start` and its siblings), resolved in the config so the
    ranks load exactly it; returns (its step folder, its meta.json). Raises ConfigError (one line)."""
    from meshtrain.checkpoint import store as ckpt

    cfg = run.config
    found = ckpt.resolve_checkpoint(cfg.checkpoint.resume, verify=True)
    cfg.checkpoint.resume = str(found)  # the ranks load exactly the checkpoint checked here
    meta = ckpt.read_meta(found)
    ckpt.read_metadata(found)  # refuses a crafted .metadata here, before any rank would unpickle it
    if meta["step"] >= cfg.train.steps:
        raise ConfigError(f"train.steps = {cfg.train.steps} but checkpoint {found} is already at step "
                          f"{meta['step']}: give --steps larger than {meta['step']}")
    check_same_start(cfg, meta, found)
    check_adapter_resume(cfg, meta, found)
    check_global_batch(run, meta, found)
    check_same_model(cfg, meta, corpus.tokenizer.to_dict(), found, growth)
    check_same_tensors(cfg, meta, found)
    check_same_data(cfg, meta, corpus.sha256, found)
    check_same_optimizer(cfg, meta, found)
    return found, meta


def check_same_optimizer(cfg: Config, meta: dict, found: Path) -> None:
    """A checkpoint's optimizer states resume only the optimizer that made them (AdamW's moments are not Muon's
    momentum), unless ``checkpoint.fresh_optimizer`` starts the states anew. Raises ConfigError (one line)."""
    saved = meta["config"].get("optim", {}).get("name", "adamw")
    if saved != cfg.optim.name and not cfg.checkpoint.fresh_optimizer:
        raise ConfigError(f"checkpoint {found} holds the states of optim.name = {saved!r} and this run has "
                          f"{cfg.optim.name!r}: resume with --optim.name {saved}, or add --checkpoint.fresh_optimizer "
                          f"true to load the weights and start {cfg.optim.name}'s states fresh")


def check_adapter_resume(cfg: Config, meta: dict, found: Path) -> None:
    """A checkpoint of LoRA adapters (``meta.json``'s ``adapter_base``) resumes with the same ``[adapter]`` keys and on
    the base it was trained on, whose ``model.init_from`` the ranks then read again (it is not in the checkpoint;
    set here when the command line left it out). Raises ConfigError naming what differs."""
    from meshtrain.adapters.spec import BASE_KEY, base_record, check_same_base

    saved = meta["config"].get("adapter", {})
    now = dataclasses.asdict(cfg.adapter)
    if not saved.get("lora_rank") and not now["lora_rank"]:
        return
    defaults = dataclasses.asdict(type(cfg.adapter)())  # keys added since the checkpoint was saved
    for key, value in now.items():
        if saved.get(key, defaults[key]) != value:
            raise ConfigError(f"checkpoint {found} was trained with adapter.{key} = {saved.get(key)!r}, this config has "
                              f"{value!r}: resume it with the same [adapter] keys, or start a new run")
    cfg.model.init_from = cfg.model.init_from or meta["config"]["model"].get("init_from", "")
    check_same_base(meta.get(BASE_KEY), base_record(cfg.model.init_from, cfg.train.seed), found)


def check_same_start(cfg: Config, meta: dict, found: Path) -> None:
    """A checkpoint resumes only the run it belongs to: ``model.init_from`` given with ``--resume`` must be the
    folder that run started from (its ``config.json`` still gives the model keys; the weights come from the
    checkpoint). Raises ConfigError naming both starting points."""
    given = cfg.model.init_from
    saved = meta["config"]["model"].get("init_from", "")
    if given and (not saved or Path(saved).expanduser().resolve() != Path(given).expanduser().resolve()):
        keep = (f"resume it with --model.init_from '{saved}', the folder it started from" if saved else
                "drop model.init_from to continue it")
        raise ConfigError(f"model.init_from = '{given}' and checkpoint.resume = '{found}' both give the starting "
                          f"weights, and that checkpoint {'started from ' + repr(saved) if saved else 'did not start from it'}"
                          f": {keep}, or drop --resume to start from '{given}'")


def check_same_model(cfg: Config, meta: dict, tokenizer: dict, found: Path, growth: VocabGrowth | None = None) -> None:
    """The checkpoint's model and tokenizer are the config's: the shapes DCP loads into (type, layers,
    width, and the family's other :attr:`meshtrain.models.family.Family.resume_keys`) and the tokenizer (the characters of the corpus, or the
    same tokenizer file contents, :func:`meshtrain.data.tokenizers.same_tokenizer`), and its vocabulary
    (``model.init_from``'s as ``growth`` grows it for the tokens prepare added, as the ranks will). Raises ConfigError
    naming the override that makes it loadable."""
    from meshtrain.data.tokenizers import same_tokenizer

    saved = {"bias": False, **meta["config"]["model"]}  # checkpoints from before model.bias have no biases
    for key in cfg.model.family().resume_keys:
        if saved.get(key) != getattr(cfg.model, key):
            raise ConfigError(f"checkpoint {found} holds a model with model.{key} = {saved.get(key)!r}, this config "
                              f"has {getattr(cfg.model, key)!r}: resume it with --model.{key} {saved.get(key)}")
    saved_tok = meta.get("tokenizer") or {}
    if saved_tok.get("kind") != tokenizer.get("kind") or (saved_tok.get("kind") != "char" and
                                                          not same_tokenizer(saved_tok, tokenizer)):
        was = saved_tok.get("path", saved_tok.get("kind"))
        same_path = was and tokenizer.get("path") and (Path(str(was)).expanduser().resolve()
                                                        == Path(tokenizer["path"]).expanduser().resolve())
        if saved_tok.get("kind") == tokenizer.get("kind") and same_path:  # one path, new bytes
            raise ConfigError(f"checkpoint {found} was trained with the {saved_tok.get('kind')} tokenizer '{was}', "
                              f"whose file has changed since (SHA-256 {str(saved_tok.get('sha256'))[:12]}... then, "
                              f"{str(tokenizer.get('sha256'))[:12]}... now): put back the file it was trained with")
        raise ConfigError(f"checkpoint {found} was trained with data.tokenizer = '{was}', this config has "
                          f"'{cfg.data.tokenizer}' (other kind or file contents): resume it with --data.tokenizer "
                          f"'{was}'")
    if not same_tokenizer(saved_tok, tokenizer):
        raise ConfigError(f"checkpoint {found} was trained on a text with other characters than data.path = "
                          f"'{cfg.data.resolved_path()}': resume it with the data it was trained on")
    if growth and growth.new != meta["vocab_size"]:
        raise ConfigError(f"checkpoint {found} has vocab_size {meta['vocab_size']}, and this run grows model.init_from's "
                          f"{growth.old} rows to {growth.new} (the tokenizer's ids padded to a multiple of 128 * tp, "
                          f"tp = {cfg.parallel.tp}): resume it at the tp it was trained with")
    if cfg.model.vocab_size and not growth and cfg.model.vocab_size != meta["vocab_size"]:
        raise ConfigError(f"checkpoint {found} has vocab_size {meta['vocab_size']}, this config "
                          f"{cfg.model.vocab_size}: resume it with --model.vocab_size {meta['vocab_size']} (or 0)")


STARTS_AT_BUILD = {"router_bias_update_rate": ("routing biases", "0")}
"""Model keys (-> what they add, and its start) a resume may turn on although the tensors they add are not in the checkpoint, because the value the
model builds them with means something there: routing biases at 0 pick each expert as its router alone would, as at
a run's first step. Any other added tensor is refused (:func:`check_same_tensors`): it would start from a random
init in the middle of a run."""


def check_same_tensors(cfg: Config, meta: dict, found: Path) -> list[str]:
    """The config's model has the checkpoint's tensors, name for name and shape for shape: a model key that
    :func:`check_same_model`'s family keys do not list changed since (an expert's ``model.ffn_hidden``, a shared
    expert added, routing biases dropped) would fail inside every rank's load, or leave a trained tensor behind
    without a word. Both models are built on the meta device (no memory, no weights read); the checkpoint's own config
    describes its tensors (``checkpoint.store.check_model_tensors``). Returns the names of the tensors the config adds
    by turning on a key of :data:`STARTS_AT_BUILD` (routing biases added), which start at the value the model builds
    them with; empty for the same tensors. Raises ConfigError naming the key, its value in the checkpoint and the
    override that makes the run resume."""
    import dataclasses

    import torch

    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model

    def shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in build_model(m, meta["vocab_size"]).state_dict().items()}

    saved, now = ModelConfig(**meta["config"]["model"]), shapes(cfg.model)
    was = shapes(saved)
    if was == now:
        return []
    turned_on = {k: getattr(saved, k) for k in STARTS_AT_BUILD if not getattr(saved, k) and getattr(cfg.model, k)}
    if turned_on and shapes(dataclasses.replace(cfg.model, **turned_on)) == was and was.items() <= now.items():
        return sorted(set(now) - set(was))  # only tensors added, and by those keys alone
    name = next(n for n in sorted({*was, *now}) if was.get(n) != now.get(n))
    what = (f"has no {name}, which this config adds" if name not in was else
            f"holds {name}, which this config has no place for and would drop" if name not in now else
            f"holds {name} of shape {was[name]}, {now[name]} in this config")
    changed = [f.name for f in dataclasses.fields(ModelConfig) if getattr(saved, f.name) != getattr(cfg.model, f.name)]
    key = next((k for k in changed if shapes(dataclasses.replace(cfg.model, **{k: getattr(saved, k)})) != now), None)
    if key is None:
        raise ConfigError(f"checkpoint {found} {what}: resume it with the model config it was saved with")
    value, given = getattr(saved, key), getattr(cfg.model, key)
    raise ConfigError(f"checkpoint {found} holds a model with model.{key} = {value!r}, this config has {given!r} (the "
                      f"checkpoint {what}): resume it with --model.{key} {value}, or start a new run with {given!r}")


def started_tensors(cfg: Config, meta: dict, found: Path) -> tuple[list[str], str]:
    """On a rank, before it loads checkpoint ``found``: the tensors the checkpoint lacks that this run starts at the
    model's built values (:func:`check_same_tensors`), and one line saying so ("" when there are none)."""
    saved = meta["config"]["model"]
    if all(saved.get(k) == getattr(cfg.model, k) for k in STARTS_AT_BUILD):
        return [], ""
    names = check_same_tensors(cfg, meta, found)
    keys = [k for k in STARTS_AT_BUILD if not saved.get(k) and getattr(cfg.model, k)]
    if not names:
        return [], ""
    said = ", ".join(f"model.{k} = {getattr(cfg.model, k)!r}" for k in keys)
    what = " and ".join(f"{STARTS_AT_BUILD[k][0]}: they start at {STARTS_AT_BUILD[k][1]}" for k in keys)
    return names, (f"{said} on checkpoint {found}, saved with {', '.join(f'{saved.get(k, 0)!r}' for k in keys)}, "
                   f"which holds no {what} ({len(names)} tensors: {names[0]}{', ...' if len(names) > 1 else ''}), "
                   f"as in a new run")


def check_same_data(cfg: Config, meta: dict, corpus_sha256: str, found: Path) -> None:
    """The run continues on the same data in the same order: the text (its SHA-256, recorded since
    checkpoints carry it), the train/val split and ``train.seed`` (which orders the samples and seeds
    dropout). Raises ConfigError naming the value that makes it continue."""
    saved = meta["config"]
    if meta.get("corpus_sha256", corpus_sha256) != corpus_sha256:
        raise ConfigError(f"checkpoint {found} was trained on another text than data.path = "
                          f"'{cfg.data.resolved_path()}' (same characters, other bytes: SHA-256 differs): resume it "
                          f"with the file it was trained on")
    for section, key, flag in (("data", "val_fraction", "--data.val_fraction"), ("train", "seed", "--seed")):
        was, now = saved[section][key], getattr(getattr(cfg, section), key)
        if was != now:
            raise ConfigError(f"checkpoint {found} was trained with {section}.{key} = {was}, this config has {now}, "
                              f"which would change the data order: resume it with {flag} {was}")


def check_global_batch(run: ResolvedRun, meta: dict, found: Path) -> None:
    """Refuse to resume at another global batch than the checkpoint's (it changes the loss and what a step
    means) unless ``checkpoint.allow_batch_change``; name the flag that keeps it. Raises ConfigError."""
    saved = meta.get("global_batch_size")
    cfg, b, dp, now = run.config, run.config.batch, run.dp, run.global_batch_size
    per_rank = now // (b.micro_batch_size * b.gradient_accumulation_steps)  # dp; 1 for the parameter server
    if saved is None or saved == now or cfg.checkpoint.allow_batch_change:
        return
    fixes = []
    if saved % (b.micro_batch_size * per_rank) == 0:
        fixes.append(f"--batch.gradient_accumulation_steps {saved // (b.micro_batch_size * per_rank)}")
    if saved % (b.gradient_accumulation_steps * per_rank) == 0:
        fixes.append(f"--batch.micro_batch_size {saved // (b.gradient_accumulation_steps * per_rank)}")
    keep = f"keep it with {' or '.join(fixes)}, " if fixes else ""
    raise ConfigError(f"checkpoint {found} was trained at global batch {saved}; this layout (dp = {dp}, "
                      f"micro_batch_size {b.micro_batch_size}, gradient_accumulation_steps "
                      f"{b.gradient_accumulation_steps}) gives {now}: {keep}or change it on purpose with "
                      f"--checkpoint.allow_batch_change true")
