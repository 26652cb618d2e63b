"""``meshtrain prepare``: tokenize documents into fixed-size token shards, a document index and ``meta.json``.

The pipeline. The main process reads the documents of the inputs in order (:mod:`meshtrain.data.sources`),
skips empty ones, and cuts them into tasks of about :data:`TASK_CHARS` characters. With ``workers > 1`` a
``ProcessPoolExecutor`` (spawned processes, each loading the tokenizer once and checking its SHA-256) encodes
the tasks; the results are taken back in submission order, at most ``2 * workers`` in flight, so memory stays
bounded and the output does not depend on scheduling. With ``workers == 1`` the main process encodes them.
Each document becomes ``tokenizer.encode(text) + [eos_id]``.

Conversations (``--format chat|prompt-completion``, :mod:`meshtrain.data.chat`): each jsonl line or parquet row
is one record, one document: its ids only (no EOS added: the template's end-of-turn token ends it) and a loss
mask written beside the tokens. A tokenizer without a template and without the ChatML tokens gets them: the
extended ``tokenizer.json`` (a tiktoken or sentencepiece file: a copy of it, ``tokenizer.tiktoken`` or
``tokenizer.model``, whose ``tokenizer_config.json`` adds the two tokens), with a ``tokenizer_config.json`` holding the
template, is written into the folder and is meta.json's ``tokenizer`` (the one given stays as ``source_tokenizer``, the ids added are ``added_tokens``: a
model started from the one given grows its vocabulary by them, :mod:`meshtrain.data.growth`). Every split needs a
supervised token.
Preference pairs (``--format preference``, :mod:`meshtrain.data.preference`): each record is two consecutive
documents, chosen then rejected, with their masks.

The split. Document ``i`` (counted from 0 over all non-empty documents, in input order) goes to val when
``floor((i + 1) * f) > floor(i * f)`` with ``f = --val-fraction``: one in every ``1/f`` documents, spread
evenly through the corpus (with f = 0.005: documents 199, 399, ...), decided while streaming. Preference data
counts pairs instead: pair ``i`` (documents ``2i`` and ``2i + 1``) goes to val by the same rule, so a pair is never
split. Both splits must end up non-empty.

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

from meshtrain.errors import ConfigError
from meshtrain.data.chat import CONTENTS, PREFERENCE, PROMPT_COMPLETION, ChatFormat, chat_format, encode_records
from meshtrain.data.preference import encode_pairs
from meshtrain.data.shards import (TOKEN_DTYPES, FORMAT, FORMAT_VERSION, META_FILE, SPLITS, PreparedData, ShardWriter,
                                     read_prepared_meta)
from meshtrain.data.sources import DOC_SPLITS, InputFile, expand_inputs, fingerprint, iter_documents, iter_records
from meshtrain.fileio import check_writable_dir

DEFAULT_SHARD_TOKENS = 100_000_000
"""Tokens per shard: 200 MB as uint16 (llm.c's FineWeb shards hold 100M tokens)."""
DEFAULT_VAL_FRACTION = 0.005
TEXT = "text"
FORMATS = (TEXT, *CONTENTS)
"""``--format``: plain documents, or conversations with a loss mask."""
TASK_CHARS = 1 << 20
"""Characters of text per worker task (~1 MB): large enough to amortize pickling, small enough to balance."""
LOCK_FILE = ".prepare.lock"
SPLIT_RULE = "document i (from 0, non-empty documents in input order) is val when floor((i+1)*F) > floor(i*F)"
PAIR_SPLIT_RULE = "pair i (from 0, in input order; documents 2i and 2i+1) is val when floor((i+1)*F) > floor(i*F)"

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
            shard_tokens: int = DEFAULT_SHARD_TOKENS, data_format: str = TEXT, prompt_loss: bool = False,
            progress: Progress | None = None) -> Result:
    """Tokenize ``inputs`` with ``tokenizer`` (a spec as ``data.tokenizer``) into the folder ``out``;
    ``data_format`` is ``--format`` (text, chat, prompt-completion), ``prompt_loss`` supervises prompt-completion
    prompts too.

    Raises:
        ConfigError: a bad option, tokenizer, input or record (one line; see :mod:`meshtrain.data.sources` and
            :mod:`meshtrain.data.chat`), an empty split, a split with no supervised token, or an ``out`` that
            exists and is not this very dataset. Nothing is left under ``out``.
    """
    _check_options(tokenizer, val_fraction, workers, doc_split, shard_tokens)
    _check_format(data_format, prompt_loss)
    out = Path(out).expanduser().absolute()
    files = expand_inputs(inputs)
    tok = _load_tokenizer(tokenizer)
    chat, extension = chat_format(tok, data_format, prompt_loss) if data_format != TEXT else (None, {})
    sources = [fingerprint(f) for f in files]
    options = {"text_field": text_field, "doc_split": doc_split, "val_fraction": val_fraction,
               "shard_tokens": shard_tokens}
    if chat is not None:  # text keeps its options (and so its meta.json) as they were
        options |= {"format": data_format, "prompt_loss": prompt_loss, "chat_template_sha256": chat.template_sha256}
    recipe = {"tokenizer": tok.to_dict(), "inputs": [s.to_dict() for s in sources], "options": options}
    if out.exists():
        return Result(out, _existing(out, recipe), already_done=True)
    check_writable_dir(out.parent, "the folder of --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    lock, removed = _claim(tmp)
    try:
        entry, given_vocab = recipe["tokenizer"], tok.vocab_size
        if extension:
            tok = _extend_tokenizer(tmp, extension)
            entry = tok.to_dict() | {"path": str(out / next(iter(extension)))}  # where it lies after the rename
        meta = _write(tmp, tok, chat, entry, sources, recipe, workers, progress, given_vocab)
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


def _check_format(data_format: str, prompt_loss: bool) -> None:
    if data_format not in FORMATS:
        raise ConfigError(f"--format = '{data_format}' is not valid: use one of {', '.join(FORMATS)}")
    if prompt_loss and data_format != PROMPT_COMPLETION:
        raise ConfigError(f"--prompt-loss applies to --format {PROMPT_COMPLETION} only, not --format {data_format}")


def _extend_tokenizer(tmp: Path, files: dict[str, str | bytes]):
    """Write the extended tokenizer ``files`` (:func:`meshtrain.data.chat.chat_format`: the tokenizer file first) into
    ``tmp``; load it."""
    from meshtrain.data.tokenizers import load_tokenizer

    for name, content in files.items():
        with open(tmp / name, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
    return load_tokenizer(str(tmp / next(iter(files))))


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
    given = meta.get("source_tokenizer", meta["tokenizer"])  # the tokenizer before prepare extended it
    differ += [] if same_tokenizer(given, recipe["tokenizer"]) else ["tokenizer"]
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


def _write(tmp: Path, tok, chat: ChatFormat | None, tokenizer_entry: dict[str, Any], sources: list[InputFile],
           recipe: dict[str, Any], workers: int, progress: Progress | None, given_vocab: int) -> dict[str, Any]:
    """Tokenize into ``tmp``: shards (and mask shards for ``chat``) and indices, then meta.json (``given_vocab``: the
    ids of the tokenizer given, before prepare extended it). Returns the meta."""
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    opts = recipe["options"]
    writers = {split: ShardWriter(tmp, split, TOKEN_DTYPES[dtype], opts["shard_tokens"], masks=chat is not None)
               for split in SPLITS}
    tasks = _tasks(sources, opts["text_field"], opts["doc_split"]) if chat is None else _record_tasks(sources)
    total_bytes = sum(s.size for s in sources)
    group = 2 if chat is not None and chat.content == PREFERENCE else 1  # documents the split rule keeps together
    docs = tokens = 0
    for (ids, lengths, mask), (_, done_bytes) in _encoded(tasks, tok, chat, workers, dtype):
        _route(writers, ids, lengths, mask, docs, opts["val_fraction"], group)
        docs, tokens = docs + len(lengths), tokens + len(ids)
        if progress:
            progress(done_bytes, total_bytes, docs, tokens)
    for writer in writers.values():
        writer.close()
    _check_splits(writers, sources, docs, opts["val_fraction"], chat)
    rule = SPLIT_RULE if group == 1 else PAIR_SPLIT_RULE
    splits = {split: ({} if group == 1 else {"pairs": w.documents // 2}) | w.summary() for split, w in writers.items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "tokenizer": tokenizer_entry,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id, "dtype": dtype,
            "shard_tokens": opts["shard_tokens"], "split_rule": rule.replace("F", str(opts["val_fraction"])),
            "splits": splits, "options": opts, "inputs": recipe["inputs"]}
    if chat is not None:
        meta |= _chat_meta(chat, recipe["tokenizer"], tokenizer_entry, tok, given_vocab)
    with open(tmp / META_FILE, "w") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.unlink(tmp / LOCK_FILE)  # the lock stays held through the open file until prepare() closes it
    return meta


def _chat_meta(chat: ChatFormat, given: dict[str, Any], used: dict[str, Any], tok,
               given_vocab: int) -> dict[str, Any]:
    """meta.json's keys for conversations: ``content``, ``loss_mask``, ``chat_template``, and when prepare extended
    the tokenizer, ``source_tokenizer`` (the tokenizer given) and ``added_tokens`` (``[{"id", "content"}]`` of the ids
    it added: those of ``tok``, the extended tokenizer, past the ``given_vocab`` ids of the one given; a starting
    model's vocabulary may grow by them, :mod:`meshtrain.data.growth`)."""
    meta = {"content": chat.content, "loss_mask": True,
            "chat_template": {"source": chat.source, "sha256": chat.template_sha256,
                              "generation_markers": chat.markers}}
    if used is not given:
        meta["source_tokenizer"] = given
        meta["added_tokens"] = [{"id": i, "content": tok.id_to_token(i)}
                                for i in range(given_vocab, tok.vocab_size)]
    return meta


def _check_splits(writers: dict[str, ShardWriter], sources: list[InputFile], docs: int, f: float,
                  chat: ChatFormat | None) -> None:
    """Raises ConfigError: no document at all, an empty val split, or a split with no supervised token."""
    if docs == 0:
        named = ", ".join(f"'{s.path}'" for s in sources[:3]) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
        verb = "holds" if len(sources) == 1 else "hold"
        if chat is not None:
            raise ConfigError(f"--input {named} {verb} no record: give jsonl or parquet files with one conversation "
                              f"per line or row")
        raise ConfigError(f"--input {named} {verb} no document (empty, or no text in --text-field): check --input "
                          f"and --text-field")
    if writers["val"].documents == 0:
        count, more = ((f"{docs // 2} pair(s)", "more pairs") if chat is not None and chat.content == PREFERENCE else
                       (f"{docs} document(s)", "more documents (--doc-split blank-line cuts a text file at blank lines)"))
        raise ConfigError(f"the val split is empty: {count} at --val-fraction {f} give none (one in every "
                          f"{1 / f:g}): give {more} or a larger --val-fraction")
    for split, writer in writers.items():
        if chat is not None and writer.supervised == 0:
            raise ConfigError(f"the {split} split's {writer.documents} conversation(s) hold no supervised token (no "
                              f"assistant content or completion survives the template): check the records and the "
                              f"chat template of {chat.source}")


def _tasks(sources: list[InputFile], text_field: str, doc_split: str) -> Iterator[tuple[list[str], int]]:
    """(texts, input bytes read so far) of ~TASK_CHARS characters each; empty documents skipped. The byte count
    is exact at the end of each file and estimated from the characters read inside one."""
    texts = (lambda source: (t for t in iter_documents(source, text_field, doc_split) if t))
    return _chunked(sources, texts, len)


def _record_tasks(sources: list[InputFile]) -> Iterator[tuple[list[tuple[str, Any]], int]]:
    """((where, record) pairs, input bytes read so far) of ~TASK_CHARS characters each (a record's size estimated
    by its ``repr``), as :func:`_tasks`."""
    return _chunked(sources, iter_records, lambda item: len(repr(item[1])))


def _chunked(sources: list[InputFile], items: Callable[[InputFile], Iterator], size: Callable[[Any], int]
             ) -> Iterator[tuple[list, int]]:
    """(items, input bytes read so far) of about TASK_CHARS characters (``size`` of each) from every source's
    ``items`` in order; the byte count is exact at the end of each file, estimated from ``size`` inside one."""
    chunk: list = []
    chars = before = 0
    for source in sources:
        read = 0
        for item in items(source):
            chunk.append(item)
            n = size(item)
            chars, read = chars + n, read + n
            if chars >= TASK_CHARS:
                yield chunk, before + min(read, source.size)
                chunk, chars = [], 0
        before += source.size
    if chunk:
        yield chunk, before


def _encoded(tasks: Iterator[tuple[list, int]], tok, chat: ChatFormat | None, workers: int, dtype: str):
    """((ids, lengths, mask), task) for each task, in order: ids (sum(lengths),) of ``dtype``, lengths (D,) int64,
    mask (sum(lengths),) uint8 for conversations, else None."""
    if workers == 1:
        for task in tasks:
            yield _encode_task(tok, chat, task[0], dtype), task
        return
    import multiprocessing

    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
                               initargs=(tok.to_dict(), dtype, chat and chat.to_dict()))
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


def _init_worker(tokenizer: dict[str, Any], dtype: str, chat: dict[str, Any] | None) -> None:
    from meshtrain.data.tokenizers import tokenizer_from_dict

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process handles it
    _worker.update(tok=tokenizer_from_dict(tokenizer), dtype=dtype, chat=chat and ChatFormat.from_dict(chat))


def _encode_in_worker(items: list) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    return _encode_task(_worker["tok"], _worker["chat"], items, _worker["dtype"])


def _encode_task(tok, chat: ChatFormat | None, items: list, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(ids, lengths, mask or None) of one task: texts, or (where, record) pairs for ``chat`` (two documents each
    for preference pairs)."""
    if chat is None:
        return (*encode_documents(tok, items, dtype), None)
    encode = encode_pairs if chat.content == PREFERENCE else encode_records
    return encode(tok, chat, items, TOKEN_DTYPES[dtype])


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


def _route(writers: dict[str, ShardWriter], ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None, first: int,
           f: float, group: int = 1) -> None:
    """Write documents ``first, first + 1, ...`` (their ``ids`` and ``mask``, concatenated) to the split the rule
    gives each, counting groups of ``group`` documents (2: preference pairs, ``first`` even) as one; runs of
    consecutive documents of one split are written in one call."""
    assert first % group == 0 and len(lengths) % group == 0
    index = (np.arange(first, first + len(lengths)) // group).astype(np.float64)  # (D,) the pair (or document)
    is_val = np.floor((index + 1) * f) > np.floor(index * f)  # (D,)
    ends = np.cumsum(lengths)  # (D,) token end of each document in ids
    cuts = np.flatnonzero(np.diff(is_val.astype(np.int8))) + 1  # first document of each run after the first
    for lo, hi in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [len(lengths)]))):
        start = int(ends[lo - 1]) if lo else 0
        stop = int(ends[hi - 1])
        parts = (ids[start:stop], lengths[lo:hi]) + (() if mask is None else (mask[start:stop],))
        writers["val" if is_val[lo] else "train"].write(*parts)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
