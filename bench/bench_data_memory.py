"""Peak RSS of a training run on prepared data of a few MB against the same run on several GB.

    python bench/bench_data_memory.py [--gb 4] [--steps 20]      # ~2 min on 2 cores, --gb GB of disk

The small dataset is Tiny Shakespeare as ``meshtrain prepare`` writes it, with a byte-level BPE of 512 ids
trained by ``meshtrain tokenizer train``. The large one has the same tokenizer and the same ``meta.json`` format,
but its train split holds ``--gb`` GB of uniformly random token ids in 500 M-token shards. They are written
directly, since tokenizing that much text on 2 cores would take an hour. Its ``meta.json`` is the small one's
with the shard list and counts replaced.

Both runs are the real command line, ``meshtrain train configs/llama_tiny.toml --nproc 1`` for ``--steps`` steps,
run one after the other. Peak memory is the rank's ``ru_maxrss`` from ``summary.json``. A sampler that read the
whole train split would add the split's size (as int64: 4x the uint16 file) to the large run. Writes
``bench/results/data_memory.md`` and ``data_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

SHAKESPEARE = REPO / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"
SHARD_TOKENS = 500_000_000


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")


def grow(small: Path, large: Path, gb: float) -> int:
    """Write ``large``: ``small``'s val split and meta, a train split of ``gb`` GB of random uint16 ids; return
    its train tokens."""
    meta = json.loads((small / "meta.json").read_text())
    large.mkdir()
    for name in ("val_00000.bin", "val_docs.npy", "train_docs.npy"):
        shutil.copyfile(small / name, large / name)
    total = int(gb * 1e9) // 2
    rng = np.random.default_rng(0)
    shards, left, k = [], total, 0
    while left:
        n = min(SHARD_TOKENS, left)
        out = np.memmap(large / f"train_{k:05d}.bin", dtype="<u2", mode="w+", shape=(n,))
        for i in range(0, n, 50_000_000):  # 100 MB at a time
            out[i:i + 50_000_000] = rng.integers(0, meta["vocab_size"], min(50_000_000, n - i), dtype=np.uint16)
        out.flush()
        del out
        shards.append({"file": f"train_{k:05d}.bin", "tokens": n})
        left, k = left - n, k + 1
    meta["splits"]["train"].update(tokens=total, shards=shards)
    (large / "meta.json").write_text(json.dumps(meta, indent=1))
    return total


def train(data: Path, out: Path, steps: int) -> dict:
    run([*meshtrain_command(), "train", str(REPO / "configs" / "llama_tiny.toml"), "--nproc", "1", "--data.path",
         str(data), "--steps", str(steps), "--train.eval_interval", "0", "--train.eval_steps", "5",
         "--checkpoint.interval", "0", "--out", str(out)])
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-memory-") as tmp:
        folder = Path(tmp)
        tok, small, large = folder / "tokenizer.json", folder / "small", folder / "large"
        run([*meshtrain_command(), "tokenizer", "train", "--input", str(SHAKESPEARE), "--vocab-size", "512",
             "--out", str(tok)])
        run([*meshtrain_command(), "prepare", "--tokenizer", str(tok), "--input", str(SHAKESPEARE), "--out", str(small),
             "--doc-split", "blank-line", "--val-fraction", "0.1"])
        big = grow(small, large, args.gb)
        rows, data = [], []
        for name, folder_ in (("small", small), ("large", large)):
            tokens = json.loads((folder_ / "meta.json").read_text())["splits"]["train"]["tokens"]
            disk = sum(f.stat().st_size for f in folder_.glob("train_*.bin"))
            summary = train(folder_, folder / f"run-{name}", args.steps)
            peak = summary["peak_memory_bytes"]
            rows.append([name, f"{tokens:,}", f"{disk / 2**20:,.1f}", f"{peak / 2**20:,.1f}",
                         f"{summary['val_loss']:.3f}"])
            data.append({"dataset": name, "train_tokens": tokens, "train_bytes": disk, "peak_rss_bytes": peak,
                         "val_loss": summary["val_loss"]})
    diff = (data[1]["peak_rss_bytes"] - data[0]["peak_rss_bytes"]) / 2**20
    path = write_results("data_memory", "Peak RSS of a run: prepared data of a few MB vs several GB", [
        "dataset", "train tokens", "train shards MiB", "peak RSS MiB", "val loss"], rows,
        [f"configs/llama_tiny.toml, 1 rank, {args.steps} steps, each run a separate `meshtrain train` command.",
         f"Large minus small: {diff:+.1f} MiB, for a train split {data[1]['train_bytes'] / data[0]['train_bytes']:,.0f}x "
         f"larger ({big:,} tokens, {data[1]['train_bytes'] / 2**30:.1f} GiB on disk, "
         f"{8 * big / 2**30:.1f} GiB as int64 if it were read whole).",
         "The large split is random ids, hence its val loss on the real val split is meaningless; memory is the point."],
        {"gb": args.gb, "steps": args.steps, "rows": data, "difference_mib": diff})
    print(path.read_text())


if __name__ == "__main__":
    main()
