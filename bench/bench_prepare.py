"""Throughput of ``meshtrain prepare`` (tokens/s) with --workers 1 and 2, on Tiny Shakespeare replicated.

    python bench/bench_prepare.py [--copies 20] [--rounds 3] [--vocab-size 4096]      # ~2 min on 2 cores

The tokenizer is a byte-level BPE trained by ``meshtrain tokenizer train`` on the bundled text. The corpus is
the bundled text repeated ``--copies`` times (~1.1 MB each), as two inputs: one text file split at blank
lines (~7,000 short documents per copy, ~150 characters each) and jsonl files of 10 KB documents (the same
text). Each row is the real command line, timed end to end (interpreter start-up, hashing the inputs, spawning
the workers and writing included), rows interleaved in rounds; tokens/s = tokens written / wall seconds. The
"encode alone" row is the tokenizer's ``encode`` called in one process over the same documents, with no
reading or writing: the ceiling one worker can reach. Writes ``bench/results/prepare.md`` and ``prepare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

SHAKESPEARE = REPO / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"
JSONL_DOC_CHARS = 10_000


def make_inputs(folder: Path, copies: int) -> dict[str, tuple[list[str], list[str]]]:
    """{input kind: (--input arguments, extra options)} for the replicated corpus."""
    text = SHAKESPEARE.read_text()
    (folder / "corpus.txt").write_text("\n\n".join([text.strip("\n")] * copies) + "\n")
    docs = [text[i:i + JSONL_DOC_CHARS] for i in range(0, len(text), JSONL_DOC_CHARS)]
    for c in range(copies):
        (folder / f"part_{c:03d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return {"text, blank-line documents": ([str(folder / "corpus.txt")], ["--doc-split", "blank-line"]),
            "jsonl, 10 KB documents": ([str(folder / "part_*.jsonl")], [])}


def run_prepare(tokenizer: Path, inputs: list[str], extra: list[str], out: Path,
                workers: int) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of the command and its workers, meta.json) of one ``meshtrain prepare``."""
    cmd = [*meshtrain_command(), "prepare", "--tokenizer", str(tokenizer), "--input", *inputs, "--out", str(out),
           "--workers", str(workers), "--val-fraction", "0.01", *extra]  # 1%: a val document even at --copies 1
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers were waited for by the command: included
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seconds, cpu, json.loads((out / "meta.json").read_text())


def encode_alone(tokenizer: Path, folder: Path) -> tuple[float, int]:
    """(seconds, tokens) of the tokenizer's encode over the blank-line documents, in this process."""
    from meshtrain.data.sources import fingerprint, iter_documents
    from meshtrain.data.tokenizers import load_tokenizer

    tok = load_tokenizer(str(tokenizer))
    docs = list(iter_documents(fingerprint(folder / "corpus.txt"), "text", "blank-line"))
    t0 = time.perf_counter()
    n = sum(len(tok.encode(d)) + 1 for d in docs)
    return time.perf_counter() - t0, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        folder = Path(tmp)
        tokenizer = folder / "tokenizer.json"
        subprocess.run([*meshtrain_command(), "tokenizer", "train", "--input", str(SHAKESPEARE), "--vocab-size",
                        str(args.vocab_size), "--out", str(tokenizer)], check=True, capture_output=True, cwd=REPO)
        inputs = make_inputs(folder, args.copies)
        mb = (folder / "corpus.txt").stat().st_size / 1e6
        rows_of = {(kind, w): [] for kind in inputs for w in (1, 2)}  # [(wall s, CPU s)] per round
        tokens_of, alone, loads = {}, [], []
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for (kind, w), runs in rows_of.items():
                seconds, cpu, meta = run_prepare(tokenizer, *inputs[kind], folder / "out", w)
                runs.append((seconds, cpu))
                tokens_of[kind] = sum(s["tokens"] for s in meta["splits"].values())
                shutil.rmtree(folder / "out")
            alone.append(encode_alone(tokenizer, folder))
    rows, data = [], []
    for (kind, w), runs in rows_of.items():
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        one = statistics.median(r[0] for r in rows_of[(kind, 1)])
        rows.append([kind, w, f"{tokens_of[kind]:,}", f"{wall:.2f} ({', '.join(f'{r[0]:.2f}' for r in runs)})",
                     f"{tokens_of[kind] / wall:,.0f}", f"{one / wall:.2f}x", f"{cpu:.2f}",
                     f"{tokens_of[kind] / cpu:,.0f}"])
        data.append({"input": kind, "workers": w, "tokens": tokens_of[kind], "wall_s": [r[0] for r in runs],
                     "cpu_s": [r[1] for r in runs]})
    alone_s = statistics.median(a[0] for a in alone)
    rows.append(["encode alone (blank-line documents, in-process)", 1, f"{alone[0][1]:,}", f"{alone_s:.2f}",
                 f"{alone[0][1] / alone_s:,.0f}", "—", "—", "—"])
    path = write_results("prepare", "meshtrain prepare: throughput", [
        "input", "workers", "tokens", "wall s (median; each round)", "tokens/s", "vs 1 worker", "CPU s",
        "tokens per CPU s"], rows,
        [f"Corpus: Tiny Shakespeare x {args.copies} ({mb:.1f} MB of text); byte-level BPE of "
         f"{args.vocab_size} ids trained by `meshtrain tokenizer train` on one copy.",
         "wall s is the whole command line: interpreter start-up, SHA-256 of the inputs, spawning the workers, "
         "reading, tokenizing, writing shards and meta.json.",
         "With 2 workers the main process still reads the inputs and writes the shards, on the same 2 cores.",
         "CPU s: user + system time of the command and its worker processes (median); tokens per CPU s does not "
         "depend on other load on the machine, wall time does.",
         f"1-minute load average at the start of each round: {', '.join(f'{x:.1f}' for x in loads)} "
         f"({os.cpu_count()} CPUs)."],
        {"copies": args.copies, "load_average": loads, "vocab_size": args.vocab_size, "rows": data,
         "encode_alone_s": [a[0] for a in alone], "encode_alone_tokens": alone[0][1]})
    print(path.read_text())


if __name__ == "__main__":
    main()
