"""``meshtrain prepare``: tokenize documents into fixed-size token shards, a document index and ``meta.json``.

The pipeline. The main process reads the documents of the inputs in order (:mod:`meshtrain.data.sources`),
skips empty ones, and cuts them into tasks of about :data:`TASK_CHARS` characters. With ``workers > 1`` a
``ProcessPoolExecutor`` (spawned processes, each loading the tokenizer once and checking its SHA-256) encodes
the tasks; the results are taken back in submission order, at most ``2 * workers`` in flight, so memory stays
bounded and the output does not depend on scheduling. With ``workers == 1`` the main process encodes them.
Each document becomes ``tokenizer.encode(text) + [eos_id]``.

The split. Document ``i`` (counted from 0 over all non-empty documents, in input order) goes to val when
``floor((i + 1) * f) > floor(i * f)`` with ``f = --val-fraction``: one in every ``1/f`` documents, spread
evenly through the corpus (with f = 0.005: documents 199, 399, ...), decided while streaming. Both splits
must end up non-empty.

The output (:mod:`meshtrain.data.shards` reads it). Each split's tokens are one stream cut into shards of
``--shard-tokens`` tokens (the last one shorter; documents run across shard boundaries). Everything is written
into ``OUT.tmp`` next to ``OUT``, ``meta.json`` last, each file flushed to disk, then the folder is renamed to
``OUT``: a killed prepare leaves no ``OUT``, only ``OUT.tmp``, which the next prepare removes (it holds a lock
file, so a prepare still running is never removed). The bytes depend only on the inputs, the tokenizer and the
options, never on ``--workers``.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import json
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.config import ConfigError
from meshtrain.data.shards import (TOKEN_DTYPES, FORMAT, FORMAT_VERSION, META_FILE, SPLITS, PreparedData, ShardWriter,
                                     read_prepared_meta)
from meshtrain.data.sources import DOC_SPLITS, InputFile, expand_inputs, fingerprint, iter_documents
from meshtrain.fileio import check_writable_dir

DEFAULT_SHARD_TOKENS = 100_000_000
"""Tokens per shard: 200 MB as uint16 (llm.c's FineWeb shards hold 100M tokens)."""
DEFAULT_VAL_FRACTION = 0.005
TASK_CHARS = 1 << 20
"""Characters of text per worker task (~1 MB): large enough to amortize pickling, small enough to balance."""
LOCK_FILE = ".prepare.lock"
SPLIT_RULE = "document i (from 0, non-empty documents in input order) is val when floor((i+1)*F) > floor(i*F)"

Progress = Callable[[int, int, int, int], None]
"""``progress(input_bytes_done, input_bytes_total, documents, tokens)``, called after each task is written."""


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass
class Result:
    out: Path
    meta: dict[str, Any]
    already_done: bool = False
    """True when ``out`` already held this very dataset (nothing was done)."""
    removed_leftover: bool = False
    """True when an interrupted prepare's ``OUT.tmp`` was removed first."""


def prepare(tokenizer: str, inputs: list[str], out: str | Path, *, text_field: str = "text",
            val_fraction: float = DEFAULT_VAL_FRACTION, workers: int = 1, doc_split: str = "file",
            shard_tokens: int = DEFAULT_SHARD_TOKENS, progress: Progress | None = None) -> Result:
    """Tokenize ``inputs`` with ``tokenizer`` (a spec as ``data.tokenizer``) into the folder ``out``.

    Raises:
        ConfigError: a bad option, tokenizer or input (one line; see :mod:`meshtrain.data.sources`), an empty
            split, or an ``out`` that exists and is not this very dataset. Nothing is left under ``out``.
    """
    _check_options(tokenizer, val_fraction, workers, doc_split, shard_tokens)
    out = Path(out).expanduser().absolute()
    files = expand_inputs(inputs)
    tok = _load_tokenizer(tokenizer)
    sources = [fingerprint(f) for f in files]
    recipe = {"tokenizer": tok.to_dict(), "inputs": [s.to_dict() for s in sources],
              "options": {"text_field": text_field, "doc_split": doc_split, "val_fraction": val_fraction,
                          "shard_tokens": shard_tokens}}
    if out.exists():
        return Result(out, _existing(out, recipe), already_done=True)
    check_writable_dir(out.parent, "the folder of --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    lock, removed = _claim(tmp)
    try:
        meta = _write(tmp, tok, sources, recipe, workers, progress)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.close()
    return Result(out, meta, removed_leftover=removed)


def _check_options(tokenizer: str, val_fraction: float, workers: int, doc_split: str, shard_tokens: int) -> None:
    if tokenizer == "char":
        raise ConfigError("--tokenizer = 'char' builds its vocabulary from the whole text, so it cannot prepare "
                          "shards: train a tokenizer.json with meshtrain tokenizer train, or keep data.path on the "
                          "text file")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val-fraction = {val_fraction} must be in (0, 1): e.g. 0.005 puts one document in "
                          f"200 in val")
    if doc_split not in DOC_SPLITS:
        raise ConfigError(f"--doc-split = '{doc_split}' is not valid: use one of {', '.join(DOC_SPLITS)}")
    for name, value in (("--workers", workers), ("--shard-tokens", shard_tokens)):
        if value < 1:
            raise ConfigError(f"{name} = {value} must be >= 1")


def _load_tokenizer(spec: str):
    from meshtrain.data.tokenizers import load_tokenizer

    try:
        tok = load_tokenizer(spec)
    except ConfigError as e:
        raise ConfigError(str(e).replace("data.tokenizer = ", "--tokenizer = ", 1)) from None
    if tok.eos_id is None:
        raise ConfigError(f"--tokenizer = '{spec}' has no end-of-text token to separate documents: use a "
                          f"tokenizer with one (e.g. <|endoftext|> or </s>)")
    return tok


def _existing(out: Path, recipe: dict[str, Any]) -> dict[str, Any]:
    """meta.json of ``out`` when it is a complete dataset made from ``recipe``; else ConfigError."""
    from meshtrain.data.tokenizers import same_tokenizer

    try:
        meta = read_prepared_meta(out)
        PreparedData.open(out)
    except ConfigError:
        raise ConfigError(f"--out = '{out}' exists and is not a complete prepared dataset: choose another --out "
                          f"(prepare never writes into an existing folder)") from None
    differ = [key for key in ("inputs", "options") if meta[key] != recipe[key]]
    differ += [] if same_tokenizer(meta["tokenizer"], recipe["tokenizer"]) else ["tokenizer"]
    if differ:
        raise ConfigError(f"--out = '{out}' holds a dataset prepared with other {', '.join(differ)}: choose "
                          f"another --out, or remove it to prepare it again")
    return meta


def _claim(tmp: Path):
    """Make ``tmp`` and hold its lock file (returned; released when closed or when the process dies); first
    remove a leftover ``tmp`` of a killed prepare. Returns (lock file, whether a leftover was removed).

    Raises:
        ConfigError: ``tmp`` is locked by a prepare still running, or is not a prepare's folder.
    """
    removed = False
    if tmp.exists():
        if not (tmp / LOCK_FILE).is_file():
            raise ConfigError(f"'{tmp}' exists and was not made by meshtrain prepare: remove it or choose another "
                              f"--out")
        with open(tmp / LOCK_FILE, "a") as old:
            try:
                fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError(f"another meshtrain prepare is writing '{tmp}': wait for it to finish or choose "
                                  f"another --out") from None
            shutil.rmtree(tmp)
            removed = True
    tmp.mkdir()
    lock = open(tmp / LOCK_FILE, "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return lock, removed


def _write(tmp: Path, tok, sources: list[InputFile], recipe: dict[str, Any], workers: int,
           progress: Progress | None) -> dict[str, Any]:
    """Tokenize into ``tmp``: shards and indices, then meta.json. Returns the meta."""
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    opts = recipe["options"]
    writers = {split: ShardWriter(tmp, split, TOKEN_DTYPES[dtype], opts["shard_tokens"]) for split in SPLITS}
    tasks = _tasks(sources, opts["text_field"], opts["doc_split"])
    total_bytes = sum(s.size for s in sources)
    docs = tokens = 0
    for (ids, lengths), (_, done_bytes) in _encoded(tasks, tok, workers, dtype):
        _route(writers, ids, lengths, docs, opts["val_fraction"])
        docs, tokens = docs + len(lengths), tokens + len(ids)
        if progress:
            progress(done_bytes, total_bytes, docs, tokens)
    for writer in writers.values():
        writer.close()
    if docs == 0:
        named = ", ".join(f"'{s.path}'" for s in sources[:3]) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
        verb = "holds" if len(sources) == 1 else "hold"
        raise ConfigError(f"--input {named} {verb} no document (empty, or no text in --text-field): check --input "
                          f"and --text-field")
    if writers["val"].documents == 0:
        raise ConfigError(f"the val split is empty: {docs} document(s) at --val-fraction {opts['val_fraction']} give "
                          f"none (one in every {1 / opts['val_fraction']:g}): give more documents (--doc-split "
                          f"blank-line cuts a text file at blank lines) or a larger --val-fraction")
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "tokenizer": recipe["tokenizer"],
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id, "dtype": dtype,
            "shard_tokens": opts["shard_tokens"], "split_rule": SPLIT_RULE.replace("F", str(opts["val_fraction"])),
            "splits": {split: w.summary() for split, w in writers.items()}, "options": opts,
            "inputs": recipe["inputs"]}
    with open(tmp / META_FILE, "w") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.unlink(tmp / LOCK_FILE)  # the lock stays held through the open file until prepare() closes it
    return meta


def _tasks(sources: list[InputFile], text_field: str, doc_split: str) -> Iterator[tuple[list[str], int]]:
    """(texts, input bytes read so far) of ~TASK_CHARS characters each; empty documents skipped. The byte count
    is exact at the end of each file and estimated from the characters read inside one."""
    texts: list[str] = []
    chars = before = 0
    for source in sources:
        read = 0
        for text in iter_documents(source, text_field, doc_split):
            if not text:
                continue
            texts.append(text)
            chars, read = chars + len(text), read + len(text)
            if chars >= TASK_CHARS:
                yield texts, before + min(read, source.size)
                texts, chars = [], 0
        before += source.size
    if texts:
        yield texts, before


def _encoded(tasks: Iterator[tuple[list[str], int]], tok, workers: int, dtype: str):
    """((ids, lengths), task) for each task, in order: ids (sum(lengths),) of ``dtype``, lengths (D,) int64."""
    if workers == 1:
        for task in tasks:
            yield encode_documents(tok, task[0], dtype), task
        return
    import multiprocessing

    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                               initargs=(tok.to_dict(), dtype))
    pending: collections.deque = collections.deque()
    try:
        for task in tasks:
            pending.append((pool.submit(_encode_in_worker, task[0]), task))
            if len(pending) >= 2 * workers:
                future, done = pending.popleft()
                yield future.result(), done
        while pending:
            future, done = pending.popleft()
            yield future.result(), done
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_worker: dict[str, Any] = {}


def _init_worker(tokenizer: dict[str, Any], dtype: str) -> None:
    from meshtrain.data.tokenizers import tokenizer_from_dict

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process handles it
    _worker.update(tok=tokenizer_from_dict(tokenizer), dtype=dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_documents(_worker["tok"], texts, _worker["dtype"])


def encode_documents(tok, texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths): each text's ``tok.encode(text) + [eos_id]`` concatenated, ids (sum(lengths),) of ``dtype``,
    and lengths (len(texts),) int64.

    Raises:
        ConfigError: a text the tokenizer cannot encode, or an id outside ``[0, vocab_size)`` (a broken file).
    """
    encoded = []
    for text in texts:
        try:
            encoded.append(tok.encode(text) + [tok.eos_id])
        except ValueError as e:
            raise ConfigError(f"the document starting {text[:40]!r} cannot be tokenized: {e}") from None
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
    if len(ids) and (ids.min() < 0 or ids.max() >= tok.vocab_size):
        raise ConfigError(f"--tokenizer gave id {int(ids.max())}, outside its {tok.vocab_size} ids: the tokenizer "
                          f"file is inconsistent")
    return ids.astype(TOKEN_DTYPES[dtype]), lengths


def _route(writers: dict[str, ShardWriter], ids: np.ndarray, lengths: np.ndarray, first: int, f: float) -> None:
    """Write documents ``first, first + 1, ...`` (their ``ids``, concatenated) to the split the rule gives each;
    runs of consecutive documents of one split are written in one call."""
    index = np.arange(first, first + len(lengths), dtype=np.float64)  # (D,)
    is_val = np.floor((index + 1) * f) > np.floor(index * f)  # (D,)
    ends = np.cumsum(lengths)  # (D,) token end of each document in ids
    cuts = np.flatnonzero(np.diff(is_val.astype(np.int8))) + 1  # first document of each run after the first
    for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(lengths)]))):
        start = int(ends[lo - 1]) if lo else 0
        writers["val" if is_val[lo] else "train"].write(ids[start:int(ends[hi - 1])], lengths[lo:hi])


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
