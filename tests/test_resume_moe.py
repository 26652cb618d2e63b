"""Resuming a mixture-of-experts run with a changed expert key is refused before launch (``preflight.check_same_tensors``),
in one line naming the key, the checkpoint's value and the override that resumes it: an expert's width
(``model.ffn_hidden``), routing biases added (``router_bias_update_rate`` > 0 on a run saved without them), a shared
expert added, and routing biases dropped (rate 0 on a run that trained them: they would be left behind silently).
The same run resumed unchanged passes the check."""

from __future__ import annotations

import pytest

from conftest import CONFIG, TINY, override_args, run_cli, train_here

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
    "biases-added": ("plain", BIASED, "router_bias_update_rate", "0.0"),
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


@pytest.mark.parametrize("run,overrides", [("plain", {}), ("biased", BIASED)])
def test_the_same_model_resumes(saved, run, overrides):
    _preflight(saved, run, overrides)


def test_the_refusal_comes_before_launch_and_writes_nothing(saved, tmp_path):
    out = tmp_path / "out"
    proc = run_cli("train", str(CONFIG), "--nproc", "1", "--out", str(out), "--resume", str(saved / "biased"),
                   *override_args({**TINY, **MOE, "train.steps": "4"}))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model.router_bias_update_rate = 0.01, this config has 0.0" in lines[0]
    assert not out.exists()
