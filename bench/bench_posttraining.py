"""meshtrain's SFT and DPO against TRL's ``SFTTrainer`` and ``DPOTrainer``, side by side on this CPU.

One tiny Llama (``transformers.LlamaConfig`` below, random weights saved to a temporary folder, never downloaded)
and one tokenizer folder (a byte-level BPE trained here on the bundled Tiny Shakespeare, ChatML special tokens,
meshtrain's ChatML template with ``{% generation %}`` markers) are used by both sides: TRL loads them directly,
meshtrain through ``model.init_from`` and ``meshtrain prepare --tokenizer``. The data is
``scripts/shakespeare_chat.py``'s conversations (SFT) and pairs (``--preference``, DPO).

- SFT: ``meshtrain train --data.packing document`` (whole conversations packed greedily, in order, into windows of
  ``block + 1`` tokens, a block-diagonal mask) against ``SFTTrainer(packing=True, packing_strategy="bfd",
  assistant_only_loss=True, max_length=block + 1)`` (best-fit-decreasing bins of ``block + 1`` tokens, padding-free,
  the block-diagonal mask transformers builds from ``position_ids``). Both minimise the summed cross-entropy of the
  assistant tokens (each turn's ``<|im_end|>`` included) over their count in the step's batch.
- DPO: ``meshtrain train --train.objective dpo --data.packing pad`` against ``DPOTrainer(precompute_ref_log_probs=
  True, loss_type=["sigmoid"])``, same beta, ``max_length = block + 1`` (keep the start), on the same train pairs,
  one epoch each (steps * batch = the train pairs).

Both: fp32, one process, OMP_NUM_THREADS = every core, fused AdamW at the same lr (constant, no warmup), betas,
eps, no weight decay, grad clip 1.0, the same global batch (windows or pairs) and steps. tokens/s = real tokens
(those of the conversations a step trains on, each cut to ``block + 1``; no padding) over the steps after
``SKIP_STEPS``, divided by the sum of those steps' times (a step from the end of the previous one; start-up, data
preparation, the reference pass, evaluation and saving excluded). The rounds interleave the four runs.

    python bench/bench_posttraining.py [--steps 40] [--rounds 2] [--batch 8] [--block 256]   # ~4 min on 2 cores

Writes ``bench/results/posttraining.{md,json}`` and ``docs/posttraining_bench.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

CORPUS = REPO / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"
SKIP_STEPS = 5  # first steps of a run left out of tokens/s (allocator, thread pools, autograd warm-up)
VOCAB = 1024  # the BPE's ids, the three special tokens included
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MODEL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=1024)
"""configs/llama_tiny.toml's shape (4 layers, 128 wide, 4 query and 2 kv heads, SwiGLU 352) as a LlamaConfig."""
LR, BETAS, EPS, CLIP, BETA, SEED, VAL_FRACTION = 3e-4, (0.9, 0.95), 1e-8, 1.0, 0.1, 1337, 0.05


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=REPO, **kw)
    if proc.returncode:
        raise SystemExit(f"{' '.join(map(str, argv))} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def train_rows(n: int, f: float = VAL_FRACTION) -> list[int]:
    """Records ``meshtrain prepare`` keeps in train: record i is val when floor((i+1)f) > floor(i f)."""
    return [i for i in range(n) if math.floor((i + 1) * f) == math.floor(i * f)]


def build_inputs(work: Path, steps: int, batch: int) -> dict[str, Path]:
    """The tokenizer folder, the model folder, the jsonl files and meshtrain's prepared data, under ``work``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from meshtrain.data.chat import CHATML

    p = {k: work / k for k in ("tok", "model", "chat.jsonl", "pairs.jsonl", "sft_data", "dpo_data")}
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder, bpe.post_processor = decoders.ByteLevel(), processors.ByteLevel(trim_offsets=False)
    bpe.train([str(CORPUS)], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(p["tok"])
    import torch

    torch.manual_seed(SEED)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **MODEL)).save_pretrained(p["model"])
    run([sys.executable, REPO / "scripts" / "shakespeare_chat.py", "--out", p["chat.jsonl"]])
    every = work / "all_pairs.jsonl"
    run([sys.executable, REPO / "scripts" / "shakespeare_chat.py", "--preference", "--out", every])
    records, n = every.read_text().splitlines(), 0
    while len(train_rows(n)) < steps * batch or n < 1 / VAL_FRACTION:  # one epoch: each train pair trained once
        n += 1
    p["pairs.jsonl"].write_text("\n".join(records[:n]) + "\n")
    for fmt, src, out in (("chat", "chat.jsonl", "sft_data"), ("preference", "pairs.jsonl", "dpo_data")):
        run([*meshtrain_command(), "prepare", "--tokenizer", p["tok"], "--input", p[src], "--out", p[out],
             "--format", fmt, "--val-fraction", VAL_FRACTION])
    return p


def meshtrain_argv(kind: str, p: dict[str, Path], out: Path, steps: int, batch: int, block: int) -> list:
    objective = (["--data.packing", "document"] if kind == "sft" else
                 ["--data.packing", "pad", "--train.objective", "dpo", "--train.dpo_beta", BETA,
                  "--train.dpo_loss", "sigmoid"])
    return [*meshtrain_command(), "train", REPO / "configs" / "llama_tiny_sft.toml", "--nproc", "1",
            "--model.init_from", p["model"], "--model.block_size", block,
            "--data.path", p[f"{kind}_data"], *objective, "--batch.micro_batch_size", batch,
            "--batch.gradient_accumulation_steps", "1", "--optim.lr", LR, "--optim.min_lr", LR,
            "--optim.warmup_steps", "0", "--optim.weight_decay", "0", "--optim.grad_clip", CLIP,
            "--optim.beta1", BETAS[0], "--optim.beta2", BETAS[1], "--train.dtype", "float32",
            "--train.seed", SEED, "--steps", steps, "--train.log_interval", "1", "--train.eval_interval", "0",
            "--checkpoint.interval", "0", "--out", out]


def meshtrain_tokens(kind: str, data: Path, steps: int, batch: int, block: int) -> list[dict]:
    """Per step, the real and supervised tokens meshtrain trained on: its own sampler's windows, replayed."""
    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.sampler import ShardedSampler

    corpus = load_corpus(data, VAL_FRACTION, block, packing="document" if kind == "sft" else "pad",
                         objective=kind if kind == "dpo" else "lm")
    train = corpus.train
    sampler = ShardedSampler(train, block, batch, 1, 1, 0, SEED)
    lengths = train.starts[1:] - train.starts[:-1]  # (D,) tokens of each conversation
    out = []
    for s in range(steps):
        index = sampler.stream_starts(s * batch, (s + 1) * batch)  # (batch,) windows or pairs of step s + 1
        y = train.samples(index)[1]  # (rows, block) targets, -100 where not in the loss
        docs = [(2 * k, 2 * k + 2) for k in index.tolist()] if kind == "dpo" else [tuple(train.windows[k]) for k in index]
        held = [lengths[a:b] for a, b in docs]  # each window's (pair's) conversations
        real = sum(min(int(n.sum()), block + 1) if kind == "sft" else sum(min(int(x), block + 1) for x in n)
                   for n in held)
        out.append({"real_tokens": real, "computed_tokens": y.numel(), "supervised_tokens": int((y != -100).sum())})
    return out


def run_meshtrain(kind: str, p: dict[str, Path], out: Path, steps: int, batch: int, block: int) -> dict:
    t0 = time.perf_counter()
    run(meshtrain_argv(kind, p, out, steps, batch, block), env=ENV)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step_time_s" in r]
    counts = meshtrain_tokens(kind, p[f"{kind}_data"], steps, batch, block)
    return {"loss": [r["loss"] for r in records], "step_time_s": [r["step_time_s"] for r in records],
            "real_tokens": [c["real_tokens"] for c in counts], "computed_tokens": [c["computed_tokens"] for c in counts],
            "supervised_tokens": [c["supervised_tokens"] for c in counts], "wall_s": wall,
            "logged_supervised_tokens": [r.get("supervised_tokens") for r in records],
            "reward_accuracy": [r.get("reward_accuracy") for r in records]}


def run_trl(kind: str, p: dict[str, Path], out: Path, steps: int, batch: int, block: int) -> dict:
    result = out.with_suffix(".json")
    t0 = time.perf_counter()
    run([sys.executable, __file__, "--trl-worker", kind, "--work", p["tok"].parent, "--out", result, "--steps", steps,
         "--batch", batch, "--block", block], env={**ENV, "HF_DATASETS_CACHE": str(out / "hf_cache")})
    return {**json.loads(result.read_text()), "wall_s": time.perf_counter() - t0}


def trl_worker(kind: str, work: Path, out: Path, steps: int, batch: int, block: int) -> None:
    """One TRL run (in its own process, as meshtrain's): per-step loss, time and token counts to ``out``."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.mark, self.times = time.perf_counter(), []

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.times.append(now - self.mark)
            self.mark = now

    counts: list[dict] = []

    def counted(base):
        class Counted(base):
            def compute_loss(self, model, inputs, *a, **kw):
                if model.training:
                    real = (inputs["attention_mask"].sum() if "attention_mask" in inputs
                            else inputs["position_ids"].size(1))
                    sup = (inputs["labels"] != -100).sum() if "labels" in inputs else inputs["completion_mask"].sum()
                    counts.append({"real_tokens": int(real), "computed_tokens": inputs["input_ids"].numel(),
                                   "supervised_tokens": int(sup)})
                return super().compute_loss(model, inputs, *a, **kw)
        return Counted

    common = dict(output_dir=str(out.with_suffix("")), max_steps=steps, per_device_train_batch_size=batch,
                  gradient_accumulation_steps=1, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, max_grad_norm=CLIP,
                  optim="adamw_torch_fused", use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
                  seed=SEED, max_length=block + 1, disable_tqdm=True, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(work / "tok")
    source = work / ("chat.jsonl" if kind == "sft" else "pairs.jsonl")
    data = datasets.load_dataset("json", data_files=str(source), split="train")
    data = data.select(train_rows(len(data)))  # the train split meshtrain prepare kept
    t0 = time.perf_counter()
    if kind == "sft":
        trainer = counted(SFTTrainer)(model=model, processing_class=tok, train_dataset=data, callbacks=[Clock()],
                                      args=SFTConfig(packing=True, packing_strategy="bfd", assistant_only_loss=True,
                                                     **common))
    else:
        trainer = counted(DPOTrainer)(model=model, processing_class=tok, train_dataset=data, callbacks=[Clock()],
                                      args=DPOConfig(precompute_ref_log_probs=True, loss_type=["sigmoid"], beta=BETA,
                                                     **common))
    setup = time.perf_counter() - t0
    trainer.train()
    clock = next(c for c in trainer.callback_handler.callbacks if isinstance(c, Clock))
    logs = [r for r in trainer.state.log_history if "loss" in r]
    out.write_text(json.dumps({
        "loss": [r["loss"] for r in logs], "step_time_s": clock.times, "setup_s": setup,
        "real_tokens": [c["real_tokens"] for c in counts], "computed_tokens": [c["computed_tokens"] for c in counts],
        "supervised_tokens": [c["supervised_tokens"] for c in counts],
        "reward_accuracy": [r.get("rewards/accuracies") for r in logs], "packed_rows": len(trainer.train_dataset)}))


ENV = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "PYTHONUNBUFFERED": "1",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
RUNS = [("meshtrain SFT", "sft", run_meshtrain), ("TRL SFTTrainer", "sft", run_trl),
        ("meshtrain DPO", "dpo", run_meshtrain), ("TRL DPOTrainer", "dpo", run_trl)]
PAIRS = [("meshtrain SFT", "TRL SFTTrainer"), ("meshtrain DPO", "TRL DPOTrainer")]


def tokens_per_s(r: dict, key: str = "real_tokens") -> float:
    return sum(r[key][SKIP_STEPS:]) / sum(r["step_time_s"][SKIP_STEPS:])


def summarize(rounds: list[dict]) -> dict:
    per_round = [tokens_per_s(r) for r in rounds]
    return {"tokens_per_s": statistics.median(per_round), "tokens_per_s_rounds": per_round,
            "computed_tokens_per_s": statistics.median(tokens_per_s(r, "computed_tokens") for r in rounds),
            "supervised_tokens_per_s": statistics.median(tokens_per_s(r, "supervised_tokens") for r in rounds),
            "step_s": statistics.median(statistics.median(r["step_time_s"][SKIP_STEPS:]) for r in rounds),
            "wall_s": statistics.median(r["wall_s"] for r in rounds), "loss": rounds[0]["loss"]}


def plot(stats: dict, path: Path, title: str) -> None:
    """Loss per step of each side, SFT and DPO side by side (round 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (mine, theirs), what in zip(axes, PAIRS, ("SFT: assistant-token cross-entropy", "DPO: sigmoid loss")):
        for name, style in ((mine, "-"), (theirs, "--")):
            loss = stats[name]["loss"]
            ax.plot(range(1, len(loss) + 1), loss, style, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (nats)")
        ax.set_title(what)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_line() -> str:
    """This CPU's model name and the SIMD flags that matter for fp32 GEMMs, from /proc/cpuinfo."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = set(fields.get("flags\t\t", fields.get("flags", "")).split())
    model = next((v.strip() for k, v in fields.items() if k.strip() == "model name"), "unknown CPU")
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return f"{model}; flags: {', '.join(f for f in wanted if f in flags) or 'none of ' + '/'.join(wanted)}"


def at(loss: list[float], steps: list[int]) -> str:
    return " / ".join(f"{loss[s - 1]:.4f}" for s in steps if s <= len(loss))


def report(stats: dict, rounds: dict, args, inputs: dict) -> Path:
    import tokenizers
    import transformers
    import trl

    marks = sorted({1, 2, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps} - {0})
    tail = max(1, args.steps // 4)
    columns = ["run", "real tokens/s (median)", "per round", "meshtrain / TRL (same round)", "supervised tokens/s",
               "computed tokens/s (incl. padding)", "ms/step", f"loss at steps {', '.join(map(str, marks))}",
               f"mean loss, last {tail} steps", "wall s (whole run)"]
    rows = []
    for name, _, _ in RUNS:
        s = stats[name]
        mine, theirs = next((m, t) for m, t in PAIRS if name in (m, t))
        ratios = [a / b for a, b in zip(stats[mine]["tokens_per_s_rounds"], stats[theirs]["tokens_per_s_rounds"])]
        ratio = f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})" if name == mine else ""
        rows.append([name, f"{s['tokens_per_s']:,.0f}", " / ".join(f"{t:,.0f}" for t in s["tokens_per_s_rounds"]),
                     ratio, f"{s['supervised_tokens_per_s']:,.0f}", f"{s['computed_tokens_per_s']:,.0f}",
                     f"{1000 * s['step_s']:.1f}", at(s["loss"], marks), f"{statistics.mean(s['loss'][-tail:]):.4f}",
                     f"{s['wall_s']:.0f}"])
    notes = [
        f"CPU: {cpu_line()}; transformers {transformers.__version__}, trl {trl.__version__}, tokenizers "
        f"{tokenizers.__version__}.",
        f"Model: LlamaForCausalLM {MODEL['num_hidden_layers']} layers x {MODEL['hidden_size']}, "
        f"{MODEL['num_attention_heads']} query / {MODEL['num_key_value_heads']} kv heads, SwiGLU "
        f"{MODEL['intermediate_size']}, untied head, vocab {VOCAB} (byte-level BPE trained on Tiny Shakespeare with "
        f"{', '.join(SPECIALS)}), random weights (seed {SEED}); meshtrain loads them through model.init_from.",
        f"Settings, both sides: fp32, 1 process, {os.cpu_count()} threads, {args.steps} steps, {args.batch} windows "
        f"(SFT) or pairs (DPO) per step, block {args.block} (TRL max_length {args.block + 1}: the window of "
        f"{args.block + 1} tokens meshtrain cuts {args.block} inputs and targets from), fused AdamW lr {LR} constant, "
        f"betas {BETAS}, eps {EPS}, weight decay 0, grad clip {CLIP}, seed {SEED}; DPO beta {BETA}, sigmoid loss, "
        f"reference log-probabilities computed once before step 1 on both sides. {args.rounds} rounds, the four "
        "runs interleaved in each.",
        f"tokens/s = real tokens (of the conversations each step trains on, each cut to {args.block + 1}; padding "
        f"not counted) of steps {SKIP_STEPS + 1}..{args.steps} / the sum of those steps' times; start-up, "
        "tokenization, the reference pass, the final evaluation and save are excluded (they are in 'wall s'). "
        "Computed tokens/s counts the padded rows the model ran on. Ratios are same-round.",
        f"Data: scripts/shakespeare_chat.py; train split = prepare's rule at --val-fraction {VAL_FRACTION} on both "
        f"sides. SFT: {inputs['sft_conversations']} train conversations; meshtrain packs them greedily in order into "
        f"{inputs['sft_windows']} windows, TRL's best-fit decreasing into {inputs['trl_bins']} bins, so the two "
        f"draw different batches (and TRL's shuffle differs from meshtrain's sampler): train losses agree in trend, "
        f"not step by step. DPO: the first {inputs['dpo_pairs']} train pairs = {args.steps} x {args.batch}, one "
        "epoch on both sides, in each side's own shuffled order.",
    ]
    notes += inputs["differences"]
    path = write_results("posttraining", "meshtrain SFT and DPO against TRL's SFTTrainer and DPOTrainer", columns,
                         rows, notes, {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "cpu": cpu_line(), "stats": stats, "rounds": rounds,
                                       "inputs": {k: v for k, v in inputs.items() if k != "differences"}})
    plot(stats, REPO / "docs" / "posttraining_bench.png",
         f"Llama {MODEL['num_hidden_layers']}x{MODEL['hidden_size']}, {args.batch} x {args.block}, fp32, 1 process "
         "(round 1)")
    return path


DIFFERENCES = [
    "Not the same between the sides (not removable with either's options): (1) packing: meshtrain's next-fit in "
    "order vs TRL's best-fit decreasing, so TRL's bins are fuller and hold other conversations; (2) data order: "
    "meshtrain's sampler vs the Trainer's RandomSampler, both seeded but differently; (3) SFT layout: TRL's "
    "padding-free collator flattens the whole batch into one row of up to batch x (block + 1) tokens with a "
    "block-diagonal mask that transformers builds from position_ids for SDPA (without flash attention on a CPU the "
    "mask is batch x (block + 1) squared), meshtrain keeps batch rows of block tokens, the padding after the last "
    "conversation included; (4) DPO padding: TRL pads each batch to its longest sequence, meshtrain every row to the "
    "block; (5) the model code: transformers' LlamaForCausalLM with TRL's fused LM head (log-probabilities, entropy "
    "and top-1 accuracy without materialising logits, plus a .item() sync for its metrics each step) vs meshtrain's "
    "own Llama with the same weights; (6) TRL feeds block + 1 tokens of a full bin and drops the last prediction, "
    "meshtrain feeds block.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="windows (SFT) or pairs (DPO) per step")
    parser.add_argument("--block", type=int, default=256, help="model.block_size; TRL's max_length is one more")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--trl-worker", choices=["sft", "dpo"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker, args.work, args.out, args.steps, args.batch, args.block)
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-posttraining-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        p = build_inputs(work, args.steps, args.batch)
        print(f"inputs built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        rounds: dict[str, list[dict]] = {name: [] for name, _, _ in RUNS}
        for r in range(args.rounds):
            for name, kind, fn in RUNS:
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                rounds[name].append(fn(kind, p, work / f"{r}-{name.replace(' ', '_')}", args.steps, args.batch,
                                       args.block))
        inputs = corpus_facts(p, args.block, rounds["TRL SFTTrainer"][0]["packed_rows"])
    stats = {name: summarize(rs) for name, rs in rounds.items()}
    path = report(stats, rounds, args, {**inputs, "differences": DIFFERENCES})
    print(path.read_text())
    print(f"whole bench: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def corpus_facts(p: dict[str, Path], block: int, trl_bins: int) -> dict:
    from meshtrain.data.corpus import load_corpus

    sft = load_corpus(p["sft_data"], VAL_FRACTION, block, packing="document").train
    dpo = load_corpus(p["dpo_data"], VAL_FRACTION, block, packing="pad", objective="dpo").train
    return {"sft_conversations": sft.conversations, "sft_windows": len(sft), "trl_bins": trl_bins,
            "dpo_pairs": len(dpo), "sft_truncated": sft.truncated, "dpo_truncated": dpo.truncated}


if __name__ == "__main__":
    main()
