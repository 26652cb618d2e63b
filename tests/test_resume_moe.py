"""Resuming a mixture-of-experts run with a changed expert key is refused before launch (``preflight.check_same_tensors``),
in one line naming the key, the checkpoint's value and the override that resumes it: an expert's width
(``model.ffn_hidden``), a shared expert added, and routing biases dropped (rate 0 on a run that trained them: they
would be left behind silently). The same run resumed unchanged passes the check.

Routing biases added (``router_bias_update_rate`` > 0 on a run saved without them) is a change that means something:
the biases start at 0, as in a new run, and rank 0 says so in one line. With biases at 0 the routing is the saved
run's, so the first resumed step's loss is the one a resume without biases computes, bit for bit; then they move.
Checked in one process, and (``make test-slow``) at ep2 over 2 ranks."""

from __future__ import annotations

import pytest

import torch

from conftest import CONFIG, TINY, cli_here, losses, override_args, read_records, run_cli, train_here

MOE = {"model.type": "mixtral", "model.n_kv_head": "1", "model.ffn_hidden": "48", "model.num_experts": "4",
       "train.steps": "2", "checkpoint.interval": "2"}
BIASED = {"model.router_bias_update_rate": "0.01"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two 2-step runs in this process: without routing biases, and with them."""
    root = tmp_path_factory.mktemp("moe")
    train_here(root / "plain", **MOE)
    train_here(root / "biased", **MOE, **BIASED)
    return root


CHANGES = {  # id: (saved run, the resume's overrides, the key named, the checkpoint's value)
    "ffn_hidden": ("plain", {"model.ffn_hidden": "64"}, "ffn_hidden", "48"),
    "shared-expert-added": ("plain", {"model.shared_expert_ffn": "16"}, "shared_expert_ffn", "0"),
    "biases-dropped": ("biased", {}, "router_bias_update_rate", "0.01"),
}


def _preflight(saved, run: str, overrides: dict[str, str]) -> None:
    from meshtrain.config.load import load_config
    from meshtrain.preflight import preflight
    from meshtrain.resolved import ResolvedRun

    cfg = load_config(CONFIG, {**TINY, **MOE, "train.steps": "4", **overrides, "checkpoint.resume": str(saved / run),
                               "train.out_dir": str(saved / "resumed")})
    preflight(ResolvedRun.resolve(cfg, 1))


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_expert_key_is_refused_naming_the_key_and_the_checkpoints_value(saved, change):
    from meshtrain.errors import ConfigError

    run, overrides, key, value = CHANGES[change]
    with pytest.raises(ConfigError) as error:
        _preflight(saved, run, overrides)
    message = str(error.value)
    assert "\n" not in message
    assert f"holds a model with model.{key} = {value}, this config has" in message, message
    assert f"resume it with --model.{key} {value}" in message, message


@pytest.mark.parametrize("run,overrides", [("plain", {}), ("biased", BIASED), ("plain", BIASED)])
def test_the_same_model_resumes(saved, run, overrides):
    _preflight(saved, run, overrides)


def _resume_here(saved, out, overrides: dict[str, str]) -> list[dict]:
    from conftest import train_here

    return train_here(out, **{**MOE, **overrides, "train.steps": "4", "checkpoint.resume": str(saved / "plain")})


@pytest.fixture(scope="module")
def unbiased_resume(saved):
    """The plain run resumed without biases for steps 3 and 4: the reference of the first biased step."""
    return losses(_resume_here(saved, saved / "unbiased", {}))


def test_routing_biases_added_on_resume_start_at_zero_and_say_so(saved, unbiased_resume, capfd):
    import torch.distributed.checkpoint as dcp

    from meshtrain.checkpoint import store as ckpt

    got = losses(_resume_here(saved, saved / "biases-added", BIASED))
    said = [line for line in capfd.readouterr().err.splitlines() if "routing biases" in line]
    assert len(said) == 1 and said[0].startswith("model.router_bias_update_rate = 0.01 on checkpoint "), said
    assert "saved with 0.0, which holds no routing biases: they start at 0 (2 tensors: " in said[0], said
    assert got[3] == unbiased_resume[3]  # biases at 0 pick the experts the saved run's router picks
    biases = {f"model.blocks.{i}.mlp.expert_bias": torch.zeros(4) for i in range(2)}
    dcp.load(biases, checkpoint_id=str(ckpt.resolve_checkpoint(saved / "biases-added")))
    for name, bias in biases.items():  # two steps, each moving a bias by the rate towards balance, or not at all
        assert bias.abs().max() > 0 and torch.all(bias.abs() <= 2 * 0.01 + 1e-9), (name, bias)


@pytest.mark.slow  # ~20 s: a 2-rank launch
def test_routing_biases_added_on_resume_at_ep2(saved, unbiased_resume, tmp_path):
    """The same resume through ``meshtrain train`` with the experts split over ep = 2 ranks: each rank loads its
    experts and starts the (replicated) biases at 0; the first step's loss is the one-process resume's without them."""
    out = tmp_path / "ep2"
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--out", str(out), "--resume", str(saved / "plain"),
                   *override_args({**TINY, **MOE, **BIASED, "train.steps": "4", "parallel.ep": "2",
                                   "batch.micro_batch_size": "6"}))  # dp2: the saved global batch of 12
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "routing biases" in line]
    assert len(said) == 1 and "they start at 0" in said[0], proc.stderr[-3000:]
    got = losses(read_records(out))
    assert got[3] == pytest.approx(unbiased_resume[3], rel=1e-5)  # the contract's tolerance: ep's sums in another order


def test_the_refusal_comes_before_launch_and_writes_nothing(saved, tmp_path):
    out = tmp_path / "out"
    proc = cli_here("train", str(CONFIG), "--nproc", "1", "--out", str(out), "--resume", str(saved / "biased"),
                   *override_args({**TINY, **MOE, "train.steps": "4"}))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model.router_bias_update_rate = 0.01, this config has 0.0" in lines[0]
    assert not out.exists()
