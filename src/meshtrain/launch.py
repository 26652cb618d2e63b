"""``meshtrain train CONFIG [--nproc N] [overrides]``: validate, then start the ranks with torchrun's engine.

Everything that can be checked without a process group is checked here, before any process is
spawned: the config, the layout against ``--nproc``, the corpus, the output folder (never reuse a
folder that holds another run) and the checkpoint to resume. Then ``torch.distributed.run`` starts
``nproc`` ranks of ``python -m meshtrain.train`` (the elastic agent, so ``--max-restarts`` and
multi-node rendezvous work exactly as with ``torchrun``). Ctrl-C or SIGTERM here is forwarded to the
ranks, which stop after a step and save (:mod:`meshtrain.faults`); the launcher then exits 128 + N.

After a successful run, node rank 0 compares plan and actual (DESIGN.md, "Composition": the trainer
does not import the planner): it reads ``OUT/summary.json``, which global rank 0 writes at the end of
every run, predicts the same layout with the planner (:func:`meshtrain.planner.actual.report_run`),
prints one ``plan vs actual: ...`` line to stderr and writes ``OUT/plan_vs_actual.json``. Ranks started
by ``torchrun -m meshtrain.train`` directly write ``summary.json`` but no comparison.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from meshtrain.argtypes import nonnegative_int
from meshtrain.config import Config, ConfigError, load_config, parse_overrides, resolve_world

SHORT = ("dp", "tp", "pp", "sp", "steps", "seed")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", allow_abbrev=False, help="train a model on the device mesh (starts the ranks through torchrun)",
        description="Train CONFIG (TOML) on N local ranks, or on several nodes with --nnodes/--rdzv-endpoint. "
                    "Any config key can be overridden as --section.key VALUE, e.g. --parallel.zero_stage 3 "
                    "--train.dtype bfloat16.",
        epilog="Equivalent without meshtrain's checks: torchrun --nproc-per-node N -m meshtrain.train CONFIG [overrides]")
    p.add_argument("config", help="TOML config, e.g. configs/shakespeare_char.toml")
    p.add_argument("--nproc", type=int, help="ranks on this node (default: pp*dp*sp*tp of the config)")
    for name in SHORT:
        p.add_argument(f"--{name}", type=str, help=f"short for --{'parallel' if len(name) == 2 else 'train'}.{name}")
    p.add_argument("--out", help="output folder (short for --train.out_dir); must not hold another run")
    p.add_argument("--resume", nargs="?", const="@out", metavar="PATH",
                   help="continue from a checkpoint: a step folder or a run folder (its latest); "
                        "without PATH, the latest checkpoint in the output folder")
    p.add_argument("--nnodes", default="1", help="torchrun --nnodes (e.g. 2 or 1:4 for elastic)")
    p.add_argument("--node-rank", type=nonnegative_int, default=None,
                   help="this node's rank, 0..nnodes-1 (static rendezvous at --rdzv-endpoint; without it the c10d "
                        "rendezvous numbers the nodes as they join)")
    p.add_argument("--rdzv-endpoint", default="", help="torchrun --rdzv-endpoint HOST:PORT for multi-node")
    p.add_argument("--max-restarts", type=nonnegative_int, default=0,
                   help="restart all ranks this often after a failure; they resume from the latest checkpoint")
    p.set_defaults(func=run, accepts_overrides=True)


def build_config(args: argparse.Namespace, extra: list[str]) -> Config:
    """The validated config of a ``train`` command line. Raises ConfigError."""
    overrides = parse_overrides(extra)
    for name in SHORT:
        if getattr(args, name) is not None:
            overrides[f"{'parallel' if len(name) == 2 else 'train'}.{name}"] = getattr(args, name)
    if args.out is not None:
        overrides["train.out_dir"] = args.out
    if args.resume is not None:
        overrides["checkpoint.resume"] = args.resume
    cfg = load_config(args.config, overrides)
    if cfg.checkpoint.resume == "@out":
        cfg.checkpoint.resume = cfg.train.out_dir
    return cfg


def preflight(cfg: Config, nproc_total: int) -> None:
    """Checks that need no process group. Raises ConfigError with one actionable line."""
    resolve_world(cfg, nproc_total)  # before importing torch: layout mistakes are reported at once
    from meshtrain import checkpoint as ckpt
    from meshtrain.data.corpus import load_corpus
    from meshtrain.fileio import check_writable_dir
    from meshtrain.metrics import METRICS_FILE

    corpus = load_corpus(cfg.data.resolved_path(), cfg.data.val_fraction, cfg.model.block_size)
    out = Path(cfg.train.out_dir)
    resume = cfg.checkpoint.resume
    if resume:
        found = ckpt.resolve_checkpoint(resume, verify=True)
        cfg.checkpoint.resume = str(found)  # the ranks load exactly the checkpoint checked here
        meta = ckpt.read_meta(found)
        ckpt.read_metadata(found)  # refuses a crafted .metadata here, before any rank would unpickle it
        if meta["step"] >= cfg.train.steps:
            raise ConfigError(f"train.steps = {cfg.train.steps} but checkpoint {found} is already at step "
                              f"{meta['step']}: give --steps larger than {meta['step']}")
        check_global_batch(cfg, meta, nproc_total, found)
        check_same_model(cfg, meta, corpus.tokenizer.to_dict(), found)
        check_same_data(cfg, meta, corpus.sha256, found)
    resuming_here = bool(resume) and out.resolve() in ckpt.resolve_checkpoint(resume).resolve().parents
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.out_dir = '{out}' is a file, not a folder: choose a folder path")
    if (out / METRICS_FILE).exists() and not resuming_here:
        raise ConfigError(f"train.out_dir = '{out}' already holds a run ({METRICS_FILE}): choose another --out, "
                          f"or continue it with --resume")
    if ckpt.list_checkpoints(out) and not resuming_here:
        raise ConfigError(f"train.out_dir = '{out}' already holds checkpoints: choose another --out, or continue "
                          f"from them with --resume")
    check_writable_dir(out, "train.out_dir")  # last: it probes the folder the run is about to write in


def check_rendezvous(args: argparse.Namespace, nnodes: int) -> None:
    """The multi-node options make sense together. Raises ConfigError with one line."""
    if args.rdzv_endpoint:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"--rdzv-endpoint = {args.rdzv_endpoint!r} is not HOST:PORT with a port in 1..65535, "
                              f"e.g. node0.cluster:29500")
    elif nnodes > 1:
        raise ConfigError(f"--nnodes = {args.nnodes} needs --rdzv-endpoint HOST:PORT, where the nodes meet")
    if args.node_rank is not None:
        if not args.rdzv_endpoint:
            raise ConfigError(f"--node-rank = {args.node_rank} needs --rdzv-endpoint HOST:PORT (one node numbers "
                              f"itself 0 without it)")
        if ":" in str(args.nnodes):
            raise ConfigError(f"--node-rank needs a fixed --nnodes, got {args.nnodes!r}: drop --node-rank for an "
                              f"elastic range")
        if args.node_rank >= nnodes:
            raise ConfigError(f"--node-rank = {args.node_rank} must be below --nnodes = {nnodes}")
    if args.rdzv_endpoint:
        check_port(args.rdzv_endpoint, static_host=args.node_rank == 0)


def check_port(endpoint: str, static_host: bool) -> None:
    """The rendezvous port, where this machine is its host, is free or held by another meshtrain/torchrun
    launcher (the c10d rendezvous of another node started here). A port held by any other program would
    make torchrun's agent wait on it forever (c10d) or fail with a traceback (static, ``--node-rank 0``,
    which must bind it itself). Ports on other machines cannot be inspected and are left to torchrun.

    Raises:
        ConfigError: the port is held by another program, named by pid and command line when readable.
    """
    import socket

    host, port = endpoint.rsplit(":", 1)
    if not _is_this_machine(host):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds
        try:
            probe.bind(("", int(port)))
            return
        except OSError:
            pass
    holder = port_holder(int(port))
    if holder and not static_host and _is_launcher(holder[1]):
        return  # another node's launcher on this machine hosts the c10d rendezvous: join it
    held_by = f"pid {holder[0]} ({' '.join(' '.join(holder[1]).split())[:100]})" if holder else "another program"
    raise ConfigError(f"--rdzv-endpoint = {endpoint}: port {port} on this machine is already held by {held_by}; "
                      f"choose a free port")


def _is_launcher(argv: list[str]) -> bool:
    """``meshtrain train`` or torchrun, by the program or module its command line runs."""
    return (any(Path(a).name in ("meshtrain", "torchrun") for a in argv[:2])
            or any(a in ("meshtrain.cli", "torch.distributed.run") for a in argv[1:3]))


def _is_this_machine(host: str) -> bool:
    import socket

    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False  # torchrun reports an unknown host itself
    if address.startswith("127.") or address == "0.0.0.0":
        return True
    try:
        return address in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def port_holder(port: int) -> tuple[int, list[str]] | None:
    """(pid, argv) of the process listening on TCP ``port`` (``/proc/net/tcp{,6}`` gives the socket's
    inode, ``/proc/PID/fd`` its owner); None when not found or not readable (Linux only)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
                return int(proc.name), [a for a in argv if a]
        except OSError:
            continue
    return None


def check_same_model(cfg: Config, meta: dict, tokenizer: dict, found: Path) -> None:
    """The checkpoint's model and tokenizer are the config's: the shapes DCP loads into (type, layers,
    width, heads, and the GPT's positions) and the characters of the corpus. Raises ConfigError naming
    the override that makes it loadable."""
    saved = meta["config"]["model"]
    keys = ("type", "n_layer", "n_embd") + (("n_head", "block_size") if cfg.model.type == "gpt" else ())
    for key in keys:
        if saved.get(key) != getattr(cfg.model, key):
            raise ConfigError(f"checkpoint {found} holds a model with model.{key} = {saved.get(key)!r}, this config "
                              f"has {getattr(cfg.model, key)!r}: resume it with --model.{key} {saved.get(key)}")
    if meta.get("tokenizer") != tokenizer:
        raise ConfigError(f"checkpoint {found} was trained on a text with other characters than data.path = "
                          f"'{cfg.data.resolved_path()}': resume it with the data it was trained on")
    if cfg.model.vocab_size and cfg.model.vocab_size != meta["vocab_size"]:
        raise ConfigError(f"checkpoint {found} has vocab_size {meta['vocab_size']}, this config "
                          f"{cfg.model.vocab_size}: resume it with --model.vocab_size {meta['vocab_size']} (or 0)")


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


def check_global_batch(cfg: Config, meta: dict, nproc_total: int, found: Path) -> None:
    """Refuse to resume at another global batch than the checkpoint's (it changes the loss and what a step
    means) unless ``checkpoint.allow_batch_change``; name the flag that keeps it. Raises ConfigError."""
    saved = meta.get("global_batch_size")
    b = cfg.batch
    dp = resolve_world(cfg, nproc_total)[1]
    per_rank = 1 if cfg.parallel.sync_mode == "async" else dp
    now = b.micro_batch_size * b.gradient_accumulation_steps * per_rank
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


def torchrun_argv(cfg_path: str, extra: list[str], args: argparse.Namespace, cfg: Config, nproc: int,
                  local_store: str | None) -> list[str]:
    """torchrun's arguments. ``local_store`` (a file path; needed without ``--rdzv-endpoint``, one machine):
    the agents' rendezvous goes through that file instead of a TCP server, so nothing of the launcher
    listens on the network (:func:`meshtrain.mesh.init_distributed` binds the ranks' store to 127.0.0.1)."""
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={args.nnodes}", f"--max-restarts={args.max_restarts}"]
    if args.rdzv_endpoint and args.node_rank is not None:  # the user numbered the nodes: static rendezvous
        host, port = args.rdzv_endpoint.rsplit(":", 1)
        argv += [f"--node-rank={args.node_rank}", "--rdzv-backend=static", f"--master-addr={host}",
                 f"--master-port={port}"]
    elif args.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={local_store}", "--rdzv-conf=store_type=file"]
    argv += ["-m", "meshtrain.train", cfg_path, *extra, "--train.out_dir", cfg.train.out_dir,
             "--parallel.dp", str(resolve_world(cfg, nproc * _nnodes_max(args.nnodes))[1])]
    for name in ("steps", "seed", "tp", "pp", "sp"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", getattr(args, name)]
    if cfg.checkpoint.resume:
        argv += ["--checkpoint.resume", cfg.checkpoint.resume]
    return argv


def _nnodes_max(nnodes: str) -> int:
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        raise ConfigError(f"--nnodes = {nnodes!r} is not valid: use N or MIN:MAX") from None


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    extra = list(extra or [])
    cfg = build_config(args, extra)
    nnodes = _nnodes_max(args.nnodes)
    if args.nproc is None:
        world, _ = resolve_world(cfg, None)
        if world % nnodes:
            raise ConfigError(f"world size {world} is not divisible by --nnodes {nnodes}: give --nproc")
        nproc = world // nnodes
    else:
        nproc = args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc} must be >= 1")
    check_rendezvous(args, nnodes)
    preflight(cfg, nproc * nnodes)
    if cfg.train.check_memory:
        check_memory(cfg, nproc, nnodes)
    warn_slow_bf16(cfg)
    if cfg.parallel.pp > 1:
        print_pipeline_split(cfg)

    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from meshtrain.faults import LAUNCHER_PID_ENV
    from meshtrain.mesh import LOOPBACK_ENV

    rdzv_dir = None if args.rdzv_endpoint else tempfile.mkdtemp(prefix="meshtrain-rdzv-")
    local_store = str(Path(rdzv_dir) / "store") if rdzv_dir else None
    torch_args = get_args_parser().parse_args(torchrun_argv(args.config, extra, args, cfg, nproc, local_store))
    threads = rank_threads(nproc)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the ranks inherit it (torchrun would set 1)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # each rank checks it is still this process's child
    # A store of their own for each restart's ranks: on the agent's shared store, gloo's ranks of a later
    # restart can read a dead rank's address from an earlier one and hang connecting (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if local_store:  # one machine: every socket of the run listens on 127.0.0.1 only
        os.environ[LOOPBACK_ENV] = "1"
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, "lo")
    quiet = _QuietForwarding()
    for name in _FORWARDING_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        torchrun(torch_args)
    except SignalException as e:  # Ctrl-C or SIGTERM here: torchrun forwarded it; rank 0 said where it stopped
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(f"meshtrain train: error: {len(e.failures)} rank(s) failed; see their output above", file=sys.stderr)
        return 1
    finally:
        os.environ.pop(LAUNCHER_PID_ENV, None)
        os.environ.pop(LOOPBACK_ENV, None)
        if rdzv_dir:
            shutil.rmtree(rdzv_dir, ignore_errors=True)
        for name in _FORWARDING_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
    if not args.node_rank:  # None (one node, or c10d) or 0; only the node holding summary.json reports
        report_plan_vs_actual(cfg, threads)
    return 0


_FORWARDING_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


class _QuietForwarding(logging.Filter):
    """Drops torchrun's warnings that it received a signal and forwards it to each rank: the ranks stop
    after a step, save, and rank 0 says so in one line (:mod:`meshtrain.faults`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in ("death signal", "closing signal"))


def warn_slow_bf16(cfg: Config) -> None:
    """One warning line when ``train.dtype = bfloat16`` runs on a CPU without bf16 matmul instructions
    (no AVX512-BF16/AMX: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False). torch's bf16 GEMMs
    there are emulated and ran 30-180x slower than fp32 on this model's shapes (AVX2-only EPYC,
    docs/benchmarks.md). The user's choice stands: it is a warning, not an error. ``auto`` picks float32
    there by itself (:func:`meshtrain.mesh.compute_dtype`)."""
    if cfg.train.dtype != "bfloat16":
        return
    import torch

    if torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return
    print(f"meshtrain train: warning: train.dtype = bfloat16, but this CPU ({torch.backends.cpu.get_cpu_capability()}) "
          f"has no bf16 matmul, so bf16 runs far slower than float32 here (docs/benchmarks.md): "
          f"use --train.dtype float32", file=sys.stderr)


def available_memory() -> tuple[str, float]:
    """(what, bytes) one device of this node offers: the smallest CUDA device's memory, or the CPU's
    MemAvailable (``/proc/meminfo``; ``os.sysconf`` physical pages where there is none)."""
    import torch

    if torch.cuda.is_available():
        return "GPU", min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return "CPU (MemAvailable)", int(line.split()[1]) * 1024
    except OSError:
        pass
    return "CPU", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(cfg: Config, nproc: int, nnodes: int) -> None:
    """Refuse a run that cannot fit: the planner's predicted peak per rank (:func:`meshtrain.planner.actual.
    predict_for_run`), times the ranks sharing this node's CPU memory, against what is available. Models
    the planner does not cover (lstm, gru) are not checked. Raises ConfigError with the numbers."""
    if cfg.model.type != "gpt":
        return
    from meshtrain.planner.actual import predict_for_run
    from meshtrain.planner.models import corpus_vocab_size

    what, available = available_memory()
    world = resolve_world(cfg, nproc * nnodes)[0]
    vocab = cfg.model.vocab_size or corpus_vocab_size(cfg)
    predicted = predict_for_run(cfg, world, vocab, "cuda" if what == "GPU" else "cpu", threads=1)
    peak = predicted["peak_memory_bytes"]
    needed = peak * (1 if what == "GPU" else nproc)
    if needed == needed and needed > available:  # NaN (unknown GPU) is never refused
        per = "per GPU" if what == "GPU" else f"for {nproc} rank(s) of {peak / 2**30:,.2f} GiB"
        raise ConfigError(f"the run needs about {needed / 2**30:,.2f} GiB {per} (planner prediction), this node has "
                          f"{available / 2**30:,.2f} GiB {what}: shrink the model or batch, add ranks to shard it "
                          f"(zero_stage 3, tp, pp), or skip this check with --train.check_memory false")


def print_pipeline_split(cfg: Config) -> None:
    """Print where the pipeline cuts the model (the split the ranks will make, :mod:`meshtrain.models.split`)."""
    from meshtrain.models.split import chunk_ranks, describe_split, item_costs, split_layers
    from meshtrain.planner.models import corpus_vocab_size
    from meshtrain.schedules import RULES

    m, p, b = cfg.model, cfg.parallel, cfg.batch
    vocab = m.vocab_size or corpus_vocab_size(cfg)
    n_chunks = p.pp * p.virtual_stages
    tokens = b.gradient_accumulation_steps * b.micro_batch_size * m.block_size
    chunks = split_layers(m.n_layer, n_chunks, item_costs(m.n_layer, m.n_embd, m.block_size, vocab, tokens, m.type))
    print(f"pipeline split ({p.pp_schedule}, pp={p.pp}, {p.virtual_stages} chunk(s) per rank, balanced by cost):\n"
          + describe_split(chunks, chunk_ranks(p.pp, n_chunks, RULES[p.pp_schedule].placement)), file=sys.stderr)


def rank_threads(nproc: int) -> int:
    """Torch threads of each of the ``nproc`` ranks on this node: ``OMP_NUM_THREADS`` if set, else the
    cores this process may run on shared out (``cores // nproc``, at least 1; torchrun alone would give
    every rank 1 thread and leave the other cores idle), and torch's default (one per core) for one rank."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) >= 1:
        return int(value)
    if nproc > 1:
        return max(1, len(os.sched_getaffinity(0)) // nproc)
    import torch
    return torch.get_num_threads()


def report_plan_vs_actual(cfg: Config, threads: int) -> None:
    """Print and save the planner's prediction next to what the run measured (``OUT/summary.json``).
    No summary here (global rank 0 ran on another node) or no measured step: nothing to compare. The
    planner failing never fails a finished run: it costs one warning line."""
    from meshtrain.train import SUMMARY_FILE

    path = Path(cfg.train.out_dir) / SUMMARY_FILE
    if not path.is_file():
        return
    try:
        summary = json.loads(path.read_text())
        if summary.get("step_time_s") is None:
            return
        pipeline = summary.get("pipeline")
        if pipeline:
            print(f"pipeline bubble: {pipeline['bubble_measured']:.1%} measured, {pipeline['bubble_theory']:.1%} in "
                  f"theory; timeline {path.parent / 'pipeline_schedule.png'}, trace "
                  f"{path.parent / 'pipeline_trace.json'}", file=sys.stderr)
        from meshtrain.planner.actual import report_run
        report_run(cfg, summary, threads)
    except (ConfigError, OSError, KeyError, TypeError, ValueError) as e:
        print(f"meshtrain train: warning: no plan vs actual: {e}", file=sys.stderr)
