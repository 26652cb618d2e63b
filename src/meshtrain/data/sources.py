"""The documents of ``meshtrain prepare``'s inputs: plain text, jsonl and parquet files, in a fixed order.

Inputs (:func:`expand_inputs`): each ``--input`` is a path or a glob (``*``, ``?``, ``[...]``, ``**`` for any
depth); a glob's matches are taken in sorted order, the arguments in the order given, a file named twice once.
The kind follows the suffix:

- ``.jsonl`` / ``.ndjson``: one JSON object per line, the document is its ``--text-field`` string; read by
  pyarrow's streaming JSON reader (blank lines are skipped).
- ``.parquet``: the ``--text-field`` column, one document per row, read by pyarrow in record batches.
- anything else: UTF-8 text. ``--doc-split file``: the whole file is one document. ``--doc-split blank-line``:
  a document is a maximal run of non-blank lines, their line breaks included (a blank line is empty or holds
  only whitespace), so ``"A\\nB\\n\\n\\nC\\n"`` is the two documents ``"A\\nB\\n"`` and ``"C\\n"``.

Records (:func:`iter_records`, for ``--format chat`` and ``prompt-completion``): each jsonl line (an object) or
parquet row (all its columns, nested lists and structs as Python lists and dicts) is one record, named in errors
by its line (from 1) or row (from 0); text files hold no records.

Errors are one line naming the file and where in it (:class:`ConfigError`): a jsonl line that is not JSON, not
an object, or has no string ``--text-field`` (line number, counted from 1, blank lines included); a parquet file
without that column, with a non-string one, or with a null row (row number, from 0); bytes of a text file that
are not UTF-8 (byte offset, from 0). Nothing is replaced or skipped silently.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.paths import path_problem

TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
KIND_BY_SUFFIX = {".jsonl": JSONL, ".ndjson": JSONL, ".parquet": PARQUET}
DOC_SPLITS = ("file", "blank-line")
JSONL_BLOCK_BYTES = 32 * 2**20
"""pyarrow reads jsonl in blocks of this many bytes; one line (one document) must fit in a block."""
PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class InputFile:
    """One input file: where it is, how to read it, and its fingerprint (so a finished dataset can tell
    whether it was made from these very bytes)."""

    path: Path
    """Absolute path."""
    kind: str
    """"text", "jsonl" or "parquet"."""
    size: int
    """Bytes."""
    sha256: str
    """Hex SHA-256 of the file's bytes."""

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "bytes": self.size, "sha256": self.sha256}


def expand_inputs(patterns: list[str]) -> list[Path]:
    """The files ``--input`` names, in order (see the module docstring), as absolute paths.

    Raises:
        ConfigError: an empty list, a path that is not a regular file (missing, a dangling link, a folder, a FIFO,
            a device: :func:`meshtrain.paths.path_problem`), or a glob that matches no file.
    """
    if not patterns:
        raise ConfigError("--input names no file: give text, jsonl or parquet files or globs")
    files: dict[Path, None] = {}  # ordered set
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if any(ch in pattern for ch in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(expanded, recursive=True)) if os.path.isfile(m)]
            if not matches:
                raise ConfigError(f"--input '{pattern}' matches no file: check the pattern")
        else:
            path = Path(expanded)
            if path.is_dir():
                raise ConfigError(f"--input '{pattern}' is a folder: give its files, e.g. '{pattern}/*.jsonl'")
            problem = path_problem(path)
            if problem:
                raise ConfigError(f"--input '{pattern}' {problem}: give text, jsonl or parquet files or globs")
            matches = [path]
        files.update((m.absolute(), None) for m in matches)
    return list(files)


def fingerprint(path: Path) -> InputFile:
    """Kind, size and SHA-256 of ``path`` (reads the whole file once).

    Raises:
        ConfigError: the file cannot be read.
    """
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"--input '{path}' cannot be read: {e.strerror}") from None
    return InputFile(path, KIND_BY_SUFFIX.get(path.suffix.lower(), TEXT), size, digest)


def iter_documents(inp: InputFile, text_field: str, doc_split: str) -> Iterator[str]:
    """The documents of ``inp`` in file order (empty ones included; the caller skips them).

    Raises:
        ConfigError: damaged input (see the module docstring), naming the file and the line, row or byte.
    """
    if inp.kind == JSONL:
        return _jsonl_documents(inp.path, text_field)
    if inp.kind == PARQUET:
        return _parquet_documents(inp.path, text_field)
    return _text_documents(inp.path, doc_split)


def _decode(raw: bytes, path: Path, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"'{path}' is not UTF-8 text at byte {offset + e.start} "
                          f"({raw[e.start:e.start + 4]!r}): convert it to UTF-8") from None


def _text_documents(path: Path, doc_split: str) -> Iterator[str]:
    if doc_split == "file":
        yield _decode(path.read_bytes(), path, 0)
        return
    block: list[str] = []
    offset = 0
    with open(path, "rb") as f:
        for raw in f:  # (line with its b"\n")
            if raw.strip():
                block.append(_decode(raw, path, offset))
            elif block:
                yield "".join(block)
                block = []
            offset += len(raw)
    if block:
        yield "".join(block)


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.json as pj

    if path.stat().st_size == 0:
        return
    parse = pj.ParseOptions(explicit_schema=pa.schema([(field, pa.string())]), unexpected_field_behavior="ignore")
    try:
        reader = pj.open_json(path, read_options=pj.ReadOptions(block_size=JSONL_BLOCK_BYTES), parse_options=parse)
        for batch in reader:
            column = batch.column(0)
            if column.null_count:  # a line without the field, or with null
                raise _jsonl_error(path, field, "a value is missing")
            yield from column.to_pylist()
    except (pa.ArrowException, UnicodeDecodeError) as e:  # (pyarrow passes bad UTF-8 on; to_pylist refuses it)
        raise _jsonl_error(path, field, str(e)) from None


def _json_lines(path: Path, wanted: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) of each non-blank line of the jsonl file ``path``, with the standard library's ``json``.

    Raises:
        ConfigError: naming the line: not UTF-8, not JSON, or not an object (``wanted`` says what it must be).
    """
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"'{path}' line {lineno}"
            try:
                obj = json.loads(raw)
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where} is not UTF-8 (byte {e.start} of the line): convert the file to "
                                  f"UTF-8") from None
            except ValueError as e:
                raise ConfigError(f"{where} is not JSON ({e}): each line must be one JSON object") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{where} is a JSON {type(obj).__name__}, not an object: each line must be "
                                  f"{wanted}")
            yield where, obj


def _jsonl_error(path: Path, field: str, arrow_message: str) -> ConfigError:
    """The first bad line of a jsonl file pyarrow refused, found with the standard library's ``json``."""
    try:
        for where, obj in _json_lines(path, f"an object with a '{field}' string"):
            if field not in obj:
                keys = ", ".join(list(obj)[:8]) or "none"
                return ConfigError(f"{where} has no '{field}' field (its fields: {keys}): name the text field "
                                   f"with --text-field")
            if not isinstance(obj[field], str):
                return ConfigError(f"{where}: '{field}' is {json.dumps(obj[field])[:40]}, not a string: "
                                   f"the text field must hold the document's text")
    except ConfigError as e:
        return e
    return ConfigError(f"'{path}' cannot be read as jsonl: {arrow_message}")


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
        if field not in schema.names:
            raise ConfigError(f"'{path}' has no column '{field}' (its columns: {', '.join(schema.names[:8])}): "
                              f"name the text column with --text-field")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise ConfigError(f"'{path}' column '{field}' holds {kind}, not strings: name the text column "
                              f"with --text-field")
        row = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            column = batch.column(0)
            if column.null_count:
                first = row + column.is_null().to_pylist().index(True)
                raise ConfigError(f"'{path}' row {first} has no text ('{field}' is null): drop or fill that row")
            yield from column.to_pylist()
            row += len(batch)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"'{path}' is not a readable parquet file: {reason}") from None


def iter_records(inp: InputFile) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for each record of ``inp`` in file order: ``where`` names it in errors (``'f.jsonl' line
    3``, ``'f.parquet' row 0``).

    Raises:
        ConfigError: a text file, or a jsonl line that is not one JSON object (naming the line).
    """
    if inp.kind == JSONL:
        return _jsonl_records(inp.path)
    if inp.kind == PARQUET:
        return _parquet_records(inp.path)
    raise ConfigError(f"--input '{inp.path}' is a text file: conversation formats read records from *.jsonl or "
                      f"*.parquet files (one conversation per line or row)")


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    return _json_lines(path, "one record object")


def _parquet_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for record in batch.to_pylist():
                yield f"'{path}' row {row}", record
                row += 1
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"'{path}' is not a readable parquet file: {reason}") from None
