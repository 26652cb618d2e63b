"""A sync mode's own keys (its section, ``meshtrain.axes.SYNC_MODE_SECTIONS``: DiLoCo's, local SGD's, the parameter
server's; and the hierarchical all-reduce's) set under another ``parallel.sync_mode`` are refused in one line naming
the key, the mode it belongs to and the default to use, as a model family's keys are under another family; at their
defaults (as the example config writes every one of them) they are accepted under every mode. The keys' old names
(``parallel.diloco_group``, ...) still work."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import CONFIG, TINY, cli_here, override_args

OTHER_VALUES = {"diloco.precision": "bf16", "parameter_server.stale_policy": "wait",
                "diloco.lighthouse": "http://127.0.0.1:29510"}
"""A valid value other than the default of the string keys (numbers: the default + 1, booleans: the other one)."""


def _other(key: str) -> str:
    from meshtrain.config.sections import Config

    section, name = key.split(".")
    default = {f.name: f.default for f in dataclasses.fields(type(getattr(Config(), section)))}[name]
    if isinstance(default, bool):
        return str(not default).lower()
    if isinstance(default, int | float) and key != "diloco.outer_momentum":
        return str(default + 1)
    return OTHER_VALUES.get(key, "0.5")


def _cases() -> list[tuple[str, str, str]]:
    from meshtrain.axes import SYNC_MODE_SECTIONS, SYNC_MODES
    from meshtrain.config.sections import Config

    keys = {"sync": ["parallel.hierarchical_allreduce"]} | {
        mode: [f"{section}.{f.name}" for f in dataclasses.fields(type(getattr(Config(), section)))]
        for mode, section in SYNC_MODE_SECTIONS.items()}
    return [(key, mode, other) for mode, names in keys.items() for key in names for other in SYNC_MODES if other != mode]


@pytest.mark.parametrize("key,owner,mode", _cases())
def test_a_sync_modes_key_under_another_mode_is_refused_in_one_line(key, owner, mode):
    from meshtrain.config.load import load_config
    from meshtrain.errors import ConfigError

    value = _other(key)
    with pytest.raises(ConfigError) as error:
        load_config(CONFIG, {**TINY, "parallel.sync_mode": mode, key: value})
    message = str(error.value)
    assert "\n" not in message
    if key == "parallel.hierarchical_allreduce":  # its own line says what it needs (sync, zero_stage 0, tp 1)
        assert message.startswith("parallel.hierarchical_allreduce = true replaces DDP's gradient all-reduce"), message
        return
    assert message.startswith(f"{key} = ") and f"applies to parallel.sync_mode = '{owner}' only" in message
    assert f"--parallel.sync_mode {owner}" in message


@pytest.mark.parametrize("mode", ["sync", "async", "local-sgd", "diloco"])
def test_every_key_at_its_default_is_accepted_under_every_mode(mode):
    from meshtrain.config.load import load_config

    assert load_config(CONFIG, {**TINY, "parallel.sync_mode": mode}).parallel.sync_mode == mode


def test_diloco_keys_with_sync_are_refused_before_launch(tmp_path):
    out = tmp_path / "out"
    proc = cli_here("train", str(CONFIG), "--nproc", "2", "--out", str(out),
                    *override_args({**TINY, "parallel.diloco_inner_steps": "4", "parallel.outer_lr": "0.5"}))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0] == ("meshtrain train: error: diloco.inner_steps = 4 applies to parallel.sync_mode = "
                        "'diloco' only: use 8 with sync_mode = 'sync', or set --parallel.sync_mode diloco")  # old names
    assert not out.exists()


def test_the_old_names_of_moved_keys_set_the_new_ones():
    """Each sync mode's keys moved from ``[parallel]`` to its own section (``config.load.MOVED_KEYS``): a config file
    or command line with the old names means the same run."""
    from meshtrain.config.load import MOVED_KEYS, load_config

    old = {"parallel.sync_mode": "diloco", "parallel.diloco_group": "1", "parallel.diloco_inner_steps": "6",
           "parallel.outer_lr": "0.5", "parallel.diloco_fragments": "2", "parallel.diloco_precision": "int8"}
    new = {MOVED_KEYS.get(k, k): v for k, v in old.items()}
    assert new["diloco.group"] == "1" and new["diloco.outer_lr"] == "0.5"
    assert load_config(CONFIG, {**TINY, **old}) == load_config(CONFIG, {**TINY, **new})
    assert set(MOVED_KEYS.values()) <= {f"{section}.{key}" for section in ("local_sgd", "parameter_server", "diloco")
                                        for key in load_config(None).to_dict()[section]}
