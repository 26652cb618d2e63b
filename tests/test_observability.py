"""Seeing a run (docs/training.md, "Watching a run"): ``train.tensorboard`` writes metrics.jsonl's numbers as
TensorBoard scalars, ``train.profile_steps`` a profiler trace per rank; both keys validated in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import CONFIG, train_cli, train_here

from meshtrain.config.load import load_config
from meshtrain.errors import ConfigError


def tensorboard_scalars(out: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


def assert_tensorboard_matches(out: Path, records: list[dict]) -> None:
    """Every record's loss, val loss, lr, grad norm and memory at its step: TensorBoard stores float32, so
    each equals the float32 of metrics.jsonl's value exactly."""
    for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_bytes"):
        want = {r["step"]: float(np.float32(r[key])) for r in records if key in r}
        assert want, key
        assert tensorboard_scalars(out, key) == want, key


def test_one_rank_tensorboard_equals_metrics_and_no_profile_when_off(tmp_path):
    records = train_here(tmp_path, **{"train.tensorboard": "true"})
    assert_tensorboard_matches(tmp_path, records)
    assert not (tmp_path / "profile").exists()


@pytest.mark.slow  # 2 ranks through the launcher, ~20 s: `make test` keeps the 1-rank check, under 15 min
def test_two_ranks_tensorboard_and_a_trace_per_rank(tmp_path):
    records = train_cli(tmp_path, 2, **{"train.tensorboard": "true", "train.profile_steps": "2,3"})
    assert_tensorboard_matches(tmp_path, records)
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["rank0.json", "rank1.json"]
    for rank in (0, 1):
        events = json.loads((tmp_path / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        spans = {e["name"] for e in events if e.get("name", "").startswith("step ")}
        assert spans == {"step 2", "step 3"}, spans
        assert any(e.get("name") == "[memory]" for e in events)  # profile_memory=True


def test_tensorboard_off_writes_no_tb_folder(tmp_path):
    train_here(tmp_path, **{"train.steps": "2"})
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("value, message", [
    ("3", "train.profile_steps = [3] must be two steps [first, last] or empty (off)"),
    ("3,2", "train.profile_steps = [3, 2] must satisfy 1 <= first <= last <= train.steps = 10"),
    ("0,2", "train.profile_steps = [0, 2] must satisfy 1 <= first <= last <= train.steps = 10"),
    ("5,11", "train.profile_steps = [5, 11] must satisfy 1 <= first <= last <= train.steps = 10"),
    ("2,x", "train.profile_steps = 'x' is not a valid int"),
])
def test_profile_steps_errors_are_one_line(value, message):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, {"train.steps": "10", "train.profile_steps": value})
    assert str(err.value) == message


@pytest.mark.parametrize("value, expected", [("3,5", [3, 5]), ("[3, 5]", [3, 5]), ("[]", []), ("", [])])
def test_profile_steps_on_the_command_line(value, expected):
    assert load_config(CONFIG, {"train.profile_steps": value}).train.profile_steps == expected


def test_profile_steps_in_toml_is_an_array(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 10\nprofile_steps = [2, 4]\n")
    assert load_config(path).train.profile_steps == [2, 4]
    path.write_text('[train]\nprofile_steps = "2,4"\n')
    with pytest.raises(ConfigError, match=r"train.profile_steps = '2,4' is not a list"):
        load_config(path)


def test_profile_steps_refused_with_the_parameter_server():
    with pytest.raises(ConfigError, match="parallel.sync_mode = 'async'"):
        load_config(CONFIG, {"train.profile_steps": "1,2", "parallel.sync_mode": "async"})


def test_tensorboard_missing_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, {"train.tensorboard": "true"})
    assert str(err.value) == ("train.tensorboard = true needs the tensorboard package: pip install 'meshtrain[tb]', "
                              "or use false")


def test_resumed_run_drops_the_events_after_its_step_as_metrics_does(tmp_path):
    """A run of 6 steps resumed from its step-3 checkpoint as a run of 5: TensorBoard, like metrics.jsonl,
    keeps steps 1..5 once each and nothing of the first run's step 6 (train or val)."""
    train_here(tmp_path, **{"train.tensorboard": "true", "train.steps": "6", "checkpoint.interval": "3"})
    records = train_here(tmp_path, **{"train.tensorboard": "true", "train.steps": "5",
                                      "checkpoint.resume": str(tmp_path / "checkpoints" / "step_000003")})
    assert max(r["step"] for r in records) == 5
    assert_tensorboard_matches(tmp_path, records)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
