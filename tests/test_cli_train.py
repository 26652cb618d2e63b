"""``meshtrain train`` / ``generate`` end to end through the real CLI, and its errors before any spawn.

Runs that train start the installed CLI in a fresh process (the launcher, torchrun's engine, the ranks). The errors
said before any rank is spawned run ``meshtrain.cli.main`` in this process (:func:`artefacts.run_cli_here`, torchrun's
engine replaced by a trap: a command that got past the checks reports "launched" and fails the test); one of them
also in a fresh process, which must say the same line (a process start and torch's import cost seconds a case)."""

from __future__ import annotations

import json

import pytest

from artefacts import run_cli_here
from conftest import CONFIG, TINY, losses, override_args, read_records, run_cli, train_here


def test_train_two_ranks_then_generate(tmp_path, capsys):
    out = tmp_path / "run"
    args = override_args({**TINY, "train.steps": "30", "train.log_interval": "5", "train.eval_interval": "10",
                          "checkpoint.interval": "10", "checkpoint.keep": "2", "train.dtype": "bfloat16"})
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_records(out)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    for r in train:
        assert set(r) >= {"step", "loss", "lr", "tokens_per_s", "grad_norm"}
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20, 30]
    assert losses(records)[30] < losses(records)[5]  # it learns something in 30 steps at lr 3e-3
    # the launcher compares the trainer's summary with the planner (the trainer does not import it)
    assert "plan vs actual: step time predicted" in proc.stderr
    compared = json.loads((out / "plan_vs_actual.json").read_text())
    assert compared["measured"]["step_time_s"] == json.loads((out / "summary.json").read_text())["step_time_s"]
    assert compared["predicted"]["layout"].startswith("dp2 tp1 pp1 sp1 z0") and compared["predicted"]["step_time_s"] > 0
    assert (out / "loss.png").stat().st_size > 1000
    # the last line names the run folder and its contents; the bar, written to a pipe, is not clipped at 80 columns
    assert proc.stderr.strip().splitlines()[-1] == (f"run folder {out}: checkpoints/ (2, newest step_000030), loss.png, "
                                                    "metrics.jsonl, plan_vs_actual.json, summary.json")
    bar = [line for line in proc.stderr.splitlines() if line.startswith("train ") and "30/30" in line]
    assert bar and "tok/s" in bar[-1] and "ETA" in bar[-1] and "…" not in bar[-1]
    import torch  # bf16 on a CPU without bf16 matmul is warned about (30-180x slower there), once, by the launcher
    slow_bf16 = not torch.cuda.is_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert proc.stderr.count("has no bf16 matmul, so bf16 runs far slower than float32 here") == int(slow_bf16)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == ["step_000020", "step_000030"]  # keep = 2, nothing half-written left behind
    meta = json.loads((out / "checkpoints" / "step_000030" / "meta.json").read_text())
    assert meta["step"] == 30 and meta["dp"] == 2

    from meshtrain.cli.main import main  # generate starts no rank: in this process

    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "40"]) == 0
    gen = capsys.readouterr()
    assert gen.out.startswith("ROMEO:") and len(gen.out.rstrip("\n")) == len("ROMEO:") + 40, gen.err[-2000:]


def test_a_run_too_short_to_time_says_why_it_has_no_plan_vs_actual(tmp_path, capsys):
    """What the launcher does once its ranks finished (``meshtrain.launch.outcome``; the two-rank run above shows it
    called, and its plan-vs-actual line), here on a run of the warm-up steps only, trained in this process: it has
    no step time to compare with the plan, says why, and writes no plan_vs_actual.json."""
    from meshtrain.config.load import load_config
    from meshtrain.launch.outcome import describe_run_folder, report_plan_vs_actual
    from meshtrain.metrics import TIMING_WARMUP_STEPS

    out = tmp_path / "run"
    overrides = {**TINY, "train.steps": str(TIMING_WARMUP_STEPS)}
    train_here(out, **overrides)
    capsys.readouterr()
    report_plan_vs_actual(load_config(CONFIG, {**overrides, "train.out_dir": str(out)}), 1)
    stderr = capsys.readouterr().err
    assert stderr.strip() == (f"meshtrain train: no step time and no plan vs actual: the first {TIMING_WARMUP_STEPS} "
                              f"steps of a run are warm-up and not timed, and this one ran no step past them "
                              f"(train.steps = {TIMING_WARMUP_STEPS}); run more steps to measure")
    assert not (out / "plan_vs_actual.json").exists() and "summary.json" in describe_run_folder(out)


@pytest.mark.parametrize("args,needle", [
    (["--nproc", "3", "--tp", "1", "--dp", "2"], "parallel.dp = 2 does not match --nproc = 3"),
    (["--parallel.pp", "2"], "batch.gradient_accumulation_steps = 1 is below pp = 2"),
    (["--nproc", "6", "--tp", "2", "--sp", "2"], "--nproc = 6 is not divisible by pp*sp*tp = 4"),
    (["--nproc", "2", "--sp", "2", "--parallel.sp_mode", "ring", "--model.block_size", "66"],
     "model.block_size = 66 is not divisible by sp * 2 (ring chunks) = 4"),
    (["--nproc", "8", "--sp", "8"], "model.n_head = 4 is not divisible by tp*sp = 8"),
    (["--model.n_layers", "2"], "did you mean 'n_layer'"),
    (["--batch.micro_batch_size", "twelve"], "batch.micro_batch_size"),
    (["--frobnicate", "1"], "unknown option --frobnicate"),
    (["--resume", "/nonexistent/run"], "checkpoint.resume = '/nonexistent/run' holds no checkpoint"),
    (["--data.path", "/nonexistent.txt"], "data.path"),
])
def test_bad_train_commands_fail_fast_with_one_line(tmp_path, args, needle):
    argv = ["train", str(CONFIG), "--out", str(tmp_path / "o"), *args]
    code, stderr, stdout = run_cli_here(argv)
    assert code == 2, stderr[-3000:]
    assert needle in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1 and stdout == ""
    assert not (tmp_path / "o").exists()  # nothing was started
    if args[0] == "--resume":  # the case that imports torch before it refuses: a fresh process says the same line
        proc = run_cli(*argv, timeout=60)
        assert proc.returncode == 2 and proc.stderr.strip() == stderr.strip() and proc.stdout == "", proc.stderr
        assert not (tmp_path / "o").exists()


def test_out_dir_with_a_run_is_never_reused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    code, stderr, _ = run_cli_here(["train", str(CONFIG), "--out", str(tmp_path)])
    assert code == 2 and "holds a run that saved no checkpoint" in stderr, stderr
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 4.0}\n'


def test_a_run_that_failed_before_its_first_checkpoint_is_no_dead_end(tmp_path):
    """Run again or --resume: both say there is nothing to resume and how to start afresh; done so, the checks
    before launch pass."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)  # what a run that failed in its first steps leaves
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    tiny = override_args({**TINY, "train.steps": "1"})
    for extra in ([], ["--resume"]):
        code, stderr, _ = run_cli_here(["train", str(CONFIG), "--nproc", "1", "--out", str(out), *extra, *tiny])
        assert code == 2 and "saved no checkpoint, so there is nothing to resume" in stderr, stderr
        assert f"after removing {out / 'metrics.jsonl'}" in stderr and len(stderr.splitlines()) == 1
    (out / "metrics.jsonl").unlink()  # as the line says: then the launcher's checks pass
    from meshtrain.config.load import load_config
    from meshtrain.preflight import preflight
    from meshtrain.resolved import ResolvedRun

    preflight(ResolvedRun.resolve(load_config(CONFIG, {**TINY, "train.out_dir": str(out)}), 1))


def test_ranks_started_without_meshtrain_train_never_reuse_a_run_folder(tmp_path):
    """``torchrun ... -m meshtrain.train`` skips the launcher, so the ranks run its checks themselves."""
    import subprocess
    import sys

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", str(CONFIG), "--train.out_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "holds a run" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 4.0}\n'
    assert not (tmp_path / "checkpoints").exists()


def test_generate_without_checkpoint_is_a_clear_error(tmp_path):
    code, stderr, _ = run_cli_here(["generate", "--checkpoint", str(tmp_path), "--prompt", "x"])
    assert code == 2 and "--checkpoint" in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("codes, config_error", [
    ([2, 2], True),  # every rank said its line
    ([2, -15], True),  # one said it, torchrun's SIGTERM stopped the other first (the race a 2-rank data error hit)
    ([-9, 2], True),
    ([1, -15], False),  # a crash: the launcher's own line with the resume hint
    ([-15, -15], False),  # stopped from outside
    ([2, 1], False),  # a rank crashed beside the one that said its error
])
def test_the_launcher_exits_2_when_a_rank_said_a_config_or_data_error(codes, config_error):
    from meshtrain.cli.train import said_in_one_line

    assert said_in_one_line(codes) is config_error
