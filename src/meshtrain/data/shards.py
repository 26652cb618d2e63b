"""The format of a dataset ``meshtrain prepare`` writes: the shard writer, and the reader that sees the shards as
lazily concatenated ``numpy.memmap`` views.

A prepared folder (docs/data.md, "Preparing a dataset") holds, per split ``train`` and ``val``, token shards
``<split>_00000.bin, ...`` (raw little-endian ``uint16``, or ``uint32`` when the vocabulary exceeds 65,536 ids),
a document index ``<split>_docs.npy`` (int64 token offsets of document starts) and ``meta.json``, written last.
Conversation formats (``--format chat|prompt-completion``, :mod:`meshtrain.data.chat`) add a loss mask beside the
tokens: shards ``<split>_mask_00000.bin, ...`` of ``uint8`` (1 = supervised), one byte per token, cut at exactly
the token shards' boundaries (meta.json ``splits.<split>.mask_shards``; ``loss_mask: true``). Preference pairs
(``--format preference``, :mod:`meshtrain.data.preference`; ``content: "preference"``) are two documents each:
pair k of a split is documents 2k (chosen) and 2k + 1 (rejected); ``splits.<split>.pairs`` counts them.

The reader reads a window with ``os.pread`` from the shard files (kept open), so a window costs O(window) memory
and time whatever the corpus size (:meth:`TokenView.shard` maps a whole shard for those who want one): the training sampler asks for random windows of
``block_size + 1`` tokens (:meth:`TokenView.window`, :meth:`TokenView.windows`); a window may cross shard
boundaries. The reader holds no position: the sampler's position stays the only state (as in torchtitan's
``components/data``, Megatron's ``indexed_dataset.py``, nanotron's Nanoset).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.config.sections import TOKENIZER_KINDS
from meshtrain.errors import ConfigError
from meshtrain.data.chat import PREFERENCE
from meshtrain.fileio import read_text_checked
from meshtrain.paths import path_problem

FORMAT = "meshtrain-prepared"
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Shard dtypes by name: explicit little-endian, whatever the machine."""
MASK_DTYPE = np.dtype("u1")
"""Loss-mask shards: one byte per token, 1 = supervised."""


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


def mask_shard_name(split: str, index: int) -> str:
    return f"{split}_mask_{index:05d}.bin"


def docs_name(split: str) -> str:
    return f"{split}_docs.npy"


@dataclass
class TokenView:
    """The tokens of one split as one sequence: shards concatenated in order, read through ``numpy.memmap``."""

    paths: list[Path]
    counts: list[int]
    """Tokens per shard (from meta.json, checked against the files' sizes)."""
    dtype: np.dtype
    starts: np.ndarray = field(init=False)
    """(S + 1,) int64: token offset of each shard, then the total."""
    _maps: list[np.memmap | None] = field(init=False)

    def __post_init__(self) -> None:
        self.starts = np.concatenate(([0], np.cumsum(self.counts, dtype=np.int64)))
        self._maps = [None] * len(self.paths)
        self._files: dict[int, int] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard(self, k: int) -> np.memmap:
        """(counts[k],) the k-th shard, mapped read-only on first use (numpy closes the file; the map stays)."""
        if self._maps[k] is None:
            self._maps[k] = np.memmap(self.paths[k], dtype=self.dtype, mode="r", shape=(self.counts[k],))
        return self._maps[k]

    def window(self, start: int, length: int) -> np.ndarray:
        """(length,) int64: tokens ``[start, start + length)`` of the split, across shard boundaries, read with
        ``os.pread`` into the returned array only.

        Not through :meth:`shard`'s memory maps: a page fault on a mapped file reads ahead and keeps the pages
        mapped, so a process sampling random windows of a 3.7 GiB split grew its resident set by ~400 MiB in 20
        steps (bench/bench_data_memory.py); what ``pread`` makes the kernel read ahead stays in its
        reclaimable page cache.

        Raises:
            IndexError: the window does not lie inside ``[0, len(self))``.
        """
        start, length = int(start), int(length)
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) is outside the split's {len(self)} tokens")
        out = np.empty(length, dtype=np.int64)
        k = bisect.bisect_right(self.starts, start) - 1
        done, size = 0, self.dtype.itemsize
        while done < length:
            local = start + done - int(self.starts[k])
            n = min(length - done, self.counts[k] - local)
            if k not in self._files:
                self._files[k] = os.open(self.paths[k], os.O_RDONLY)
            out[done:done + n] = np.frombuffer(os.pread(self._files[k], n * size, local * size), dtype=self.dtype)
            done += n
            k += 1
        return out

    def __del__(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            os.close(fd)

    def windows(self, starts: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int64: one :meth:`window` per start (a batch of ``block_size + 1`` windows)."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for i, s in enumerate(starts):
            out[i] = self.window(s, length)
        return out


class ShardWriter:
    """Appends one split's documents to shards ``<split>_00000.bin, ...`` of ``shard_tokens`` tokens each (and,
    with ``masks``, their loss masks to ``<split>_mask_00000.bin, ...`` cut at the same tokens) and keeps the
    token offset of every document start."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int, masks: bool = False) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.masks = masks
        self.counts: list[int] = []  # tokens in each shard so far
        self.starts: list[np.ndarray] = []  # (D_i,) int64 document starts, one array per write
        self.tokens = self.documents = self.supervised = 0
        self.files: list = []  # the open token shard, then its mask shard

    def write(self, ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append documents: ``ids`` (sum(lengths),) of the shard dtype, ``lengths`` (D,) int64, ``mask``
        (sum(lengths),) uint8 when the writer keeps masks."""
        assert (mask is not None) == self.masks and (mask is None or len(mask) == len(ids))
        self.starts.append(self.tokens + np.concatenate(([0], np.cumsum(lengths)[:-1])))
        streams = [ids] if mask is None else [ids, mask.astype(MASK_DTYPE)]
        pos = 0
        while pos < len(ids):
            if not self.files or self.counts[-1] == self.shard_tokens:
                self._next_shard()
            n = min(len(ids) - pos, self.shard_tokens - self.counts[-1])
            for file, stream in zip(self.files, streams):
                file.write(stream[pos:pos + n].tobytes())
            self.counts[-1] += n
            pos += n
        self.tokens += len(ids)
        self.documents += len(lengths)
        self.supervised += 0 if mask is None else int(np.count_nonzero(mask))

    def _next_shard(self) -> None:
        self._close_files()
        k = len(self.counts)
        names = [shard_name(self.split, k)] + ([mask_shard_name(self.split, k)] if self.masks else [])
        self.files = [open(self.folder / name, "wb") for name in names]
        self.counts.append(0)

    def _close_files(self) -> None:
        for file in self.files:
            file.flush()
            os.fsync(file.fileno())
            file.close()
        self.files = []

    def close(self) -> None:
        """Finish the last shard and write ``<split>_docs.npy``."""
        self._close_files()
        starts = np.concatenate(self.starts) if self.starts else np.zeros(0, dtype=np.int64)
        with open(self.folder / docs_name(self.split), "wb") as f:
            np.save(f, starts.astype(np.int64))
            f.flush()
            os.fsync(f.fileno())

    def summary(self) -> dict[str, Any]:
        """The split's entry of meta.json (``mask_shards`` and ``supervised_tokens`` only with masks)."""
        out = {"documents": self.documents, "tokens": self.tokens, "index": docs_name(self.split),
               "shards": [{"file": shard_name(self.split, k), "tokens": n} for k, n in enumerate(self.counts)]}
        if self.masks:
            out["supervised_tokens"] = self.supervised
            out["mask_shards"] = [{"file": mask_shard_name(self.split, k), "tokens": n}
                                  for k, n in enumerate(self.counts)]
        return out


class PreparedData:
    """A prepared dataset folder, checked when opened (see the module docstring)."""

    def __init__(self, folder: Path, meta: dict[str, Any]) -> None:
        self.folder, self.meta = folder, meta
        self.dtype = TOKEN_DTYPES[meta["dtype"]]
        self._views: dict[str, TokenView] = {}

    @classmethod
    def open(cls, folder: str | Path) -> PreparedData:
        """Open ``folder`` and check it: meta.json present and of this format version, both splits non-empty,
        every shard (and mask shard) present with the size meta.json records.

        Raises:
            ConfigError: one line naming the folder and what is wrong.
        """
        folder = Path(folder).expanduser()
        meta = read_prepared_meta(folder)
        data = cls(folder, meta)
        for split in SPLITS:
            info = meta["splits"][split]
            if info["tokens"] == 0 or info["documents"] == 0:
                raise ConfigError(f"prepared data '{folder}' has an empty {split} split: prepare it again with "
                                  f"more documents or another --val-fraction")
            for shard in info["shards"]:
                _check_shard(folder, shard, data.dtype.itemsize)
            if data.has_masks:
                _check_masks(folder, split, info)
            if data.is_preference and not (_count(info.get("pairs")) and 2 * info["pairs"] == info["documents"]
                                           and data.has_masks):
                raise ConfigError(f"prepared data '{folder}': 'splits.{split}.pairs' = {info.get('pairs')!r} must be "
                                  f"half its {info['documents']} documents, with loss masks: the prepared data is "
                                  f"damaged or was edited; run meshtrain prepare again")
        return data

    @property
    def has_masks(self) -> bool:
        """Whether the folder holds loss masks (``--format chat|prompt-completion|preference``)."""
        return self.meta.get("loss_mask") is True

    @property
    def is_preference(self) -> bool:
        """Whether the folder holds preference pairs (``--format preference``): pair k of a split is its documents
        2k (prompt + chosen) and 2k + 1 (prompt + rejected), in :meth:`documents` order."""
        return self.meta.get("content") == PREFERENCE

    def masks(self, split: str) -> TokenView:
        """The split's loss mask (1 = supervised), one value per token of :meth:`tokens`, with the same windows.

        Raises:
            ValueError: the folder holds no masks (prepared with ``--format text``).
        """
        if not self.has_masks:
            raise ValueError(f"prepared data '{self.folder}' holds no loss masks: it was prepared with --format text")
        split = _split(split)
        key = f"{split}_mask"
        if key not in self._views:
            shards = self.meta["splits"][split]["mask_shards"]
            self._views[key] = TokenView([self.folder / s["file"] for s in shards], [s["tokens"] for s in shards],
                                         MASK_DTYPE)
        return self._views[key]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def num_tokens(self, split: str) -> int:
        return int(self.meta["splits"][_split(split)]["tokens"])

    def tokens(self, split: str) -> TokenView:
        """The split's tokens as one lazily concatenated sequence (nothing is read until a window asks)."""
        split = _split(split)
        if split not in self._views:
            shards = self.meta["splits"][split]["shards"]
            self._views[split] = TokenView([self.folder / s["file"] for s in shards], [s["tokens"] for s in shards],
                                           self.dtype)
        return self._views[split]

    def documents(self, split: str) -> np.ndarray:
        """(D,) int64 token offsets of the split's document starts (each document ends with EOS; a conversation
        with its template's end-of-turn token), memory-mapped."""
        return np.load(self.folder / docs_name(_split(split)), mmap_mode="r")


def _check_shard(folder: Path, shard: dict[str, Any], itemsize: int) -> None:
    """Raises ConfigError when ``folder / shard["file"]`` is not ``shard["tokens"] * itemsize`` bytes."""
    path = folder / shard["file"]
    want = shard["tokens"] * itemsize
    problem = path_problem(path)
    size = None if problem else path.stat().st_size
    if size != want:
        found = ("is missing" if problem == "does not exist" else problem) if problem else f"has {size} bytes"
        raise ConfigError(f"prepared data '{folder}': shard {shard['file']} {found}, meta.json says "
                          f"{want} ({shard['tokens']} tokens): run meshtrain prepare again")


def _check_masks(folder: Path, split: str, info: dict[str, Any]) -> None:
    """Raises ConfigError when the split's mask shards are not listed shard for shard like its token shards, or a
    file is missing or of another size."""
    masks = info.get("mask_shards")
    if not _shards_ok(masks) or [s["tokens"] for s in masks] != [s["tokens"] for s in info["shards"]]:
        raise ConfigError(f"prepared data '{folder}': 'splits.{split}.mask_shards' must list one mask shard per "
                          f"token shard with the same tokens: the prepared data is damaged or was edited; run "
                          f"meshtrain prepare again")
    for shard in masks:
        _check_shard(folder, shard, MASK_DTYPE.itemsize)


def read_prepared_meta(folder: Path) -> dict[str, Any]:
    """meta.json of a prepared folder.

    Raises:
        ConfigError: no folder, no meta.json (an unfinished prepare), unreadable JSON, or another format version.
    """
    if not folder.is_dir():
        raise ConfigError(f"prepared data '{folder}' does not exist: make it with meshtrain prepare")
    path = folder / META_FILE
    text = read_text_checked(path, "prepared metadata", "run meshtrain prepare again", missing_ok=True)
    if text is None:
        raise ConfigError(f"'{folder}' is not a complete prepared dataset (no {META_FILE}): run meshtrain prepare "
                          f"again")
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"'{path}' cannot be read ({e}): run meshtrain prepare again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"'{path}' is not the meta.json of a meshtrain prepared dataset: run meshtrain prepare")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"'{path}' (prepared data) has format version {meta.get('format_version')!r}; this "
                          f"meshtrain reads version {FORMAT_VERSION}: run meshtrain prepare again")
    for key, want, ok in _META_SCHEMA:
        value = meta
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if not ok(value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ConfigError(f"'{path}': '{key}' = {shown} must be {want}: the prepared data is damaged or was "
                              f"edited; run meshtrain prepare again")
    largest = np.iinfo(TOKEN_DTYPES[meta["dtype"]]).max
    if meta["vocab_size"] > largest + 1:  # prepare picks uint32 above 65,536 tokens
        raise ConfigError(f"'{path}': 'vocab_size' = {meta['vocab_size']} does not fit its shards' dtype "
                          f"{meta['dtype']} (ids up to {largest}): the prepared data is damaged or was edited; run "
                          f"meshtrain prepare again")
    for split in SPLITS:
        info = meta["splits"][split]
        total = sum(s["tokens"] for s in info["shards"])
        if total != info["tokens"] and info["tokens"] and info["documents"]:  # an empty split: PreparedData.open says so
            raise ConfigError(f"'{path}': 'splits.{split}.tokens' = {info['tokens']} is not the sum of its shards' "
                              f"tokens ({total}): the prepared data is damaged or was edited; run meshtrain prepare "
                              f"again")
    return meta


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shards_ok(shards: Any) -> bool:
    """A list of ``{"file": plain name, "tokens": n >= 0}``."""
    return isinstance(shards, list) and all(
        isinstance(s, dict) and isinstance(s.get("file"), str) and s["file"] == Path(s["file"]).name
        and s["file"] not in ("", ".", "..") and _count(s.get("tokens")) for s in shards)


_META_SCHEMA = [
    ("vocab_size", "an integer >= 1", lambda v: _count(v) and v >= 1),
    ("dtype", f"one of {', '.join(TOKEN_DTYPES)}", lambda v: isinstance(v, str) and v in TOKEN_DTYPES),
    ("tokenizer", "an object", lambda v: isinstance(v, dict)),
    ("tokenizer.kind", f"one of {', '.join(TOKENIZER_KINDS[1:])}", lambda v: v in TOKENIZER_KINDS[1:]),
    *((f"tokenizer.{key}", "a string", lambda v: isinstance(v, str)) for key in ("path", "sha256")),
    ("splits", "an object", lambda v: isinstance(v, dict)),
    *((f"splits.{split}", "an object", lambda v: isinstance(v, dict)) for split in SPLITS),
    *((f"splits.{split}.{key}", "an integer >= 0", _count) for split in SPLITS for key in ("documents", "tokens")),
    *((f"splits.{split}.shards", "a list of {\"file\": name, \"tokens\": n}", _shards_ok) for split in SPLITS),
]
"""(dotted key, what it must be, its check) of meta.json, in order: what the reader and the planner use."""


def _split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    return split
