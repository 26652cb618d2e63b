"""A config from its TOML file and the command line: parsing, typing each value, the short flags, and the model
keys ``model.init_from`` reads from a Hugging Face folder. Torch-free."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from meshtrain import axes
from meshtrain.config.checks import validate
from meshtrain.config.sections import AdapterConfig, Config
from meshtrain.errors import ConfigError
from meshtrain.errors import require as _require
from meshtrain.models.registry import ModelConfig, family
from meshtrain.paths import path_problem

SHORT_FLAGS = {
    **axes.SHORT_FLAGS,
    "steps": "train.steps",
    "seed": "train.seed",
    "out": "train.out_dir",
}


MOVED_KEYS = {**{f"parallel.{old}": f"local_sgd.{new}" for old, new in (("local_sgd_steps", "steps"),
                                                                            ("local_sgd_warmup", "warmup"))},
              **{f"parallel.{old}": f"parameter_server.{new}" for old, new in (
                  ("ps_servers", "servers"), ("max_staleness", "max_staleness"), ("stale_policy", "stale_policy"))},
              **{f"parallel.{old}": f"diloco.{old.removeprefix('diloco_')}" for old in (
                  "diloco_group", "diloco_inner_steps", "outer_lr", "outer_momentum", "diloco_fragments", "diloco_delay",
                  "diloco_alpha", "diloco_precision", "diloco_lighthouse", "diloco_worker", "diloco_workers")}}
"""Keys that moved (issue 53: each sync mode's keys in its own section) -> where they are now. Config files, command
lines and saved run configs that use the old names keep working."""


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    """A config dataclass's field names -> their types (the annotations evaluated once per class: ``get_type_hints``
    compiles every annotation string anew, and took 95% of ``load_config``)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _sections() -> dict[str, type]:
    return _field_types(Config)


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'? " if close else ""


def _coerce(key: str, value: Any, typ: type, from_text: bool = True) -> Any:
    """Convert ``value`` to ``typ``, or raise ConfigError naming ``key``. A string is parsed when it comes
    from the command line (``from_text``); in a TOML file, which is typed, a quoted number is an error."""
    if isinstance(typ, types.UnionType):  # pragma: no cover - no union fields today
        typ = typing.get_args(typ)[0]
    if typing.get_origin(typ) is list:
        return _coerce_list(key, value, typing.get_args(typ)[0], from_text)
    if isinstance(value, str) and typ is not str:
        if not from_text:
            raise ConfigError(f"{key} = {value!r} is a string but must be a {typ.__name__}: write it without quotes")
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return text.lower() in ("true", "1", "yes")
            if typ is int:
                return int(text)
            if typ is float:
                value = float(text)
        except ValueError:
            raise ConfigError(f"{key} = {value!r} is not a valid {typ.__name__}") from None
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {value} must be a finite number")
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r} is not a valid bool (use true or false)")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key} = {value!r} is not a valid int")
    if not isinstance(value, typ):
        raise ConfigError(f"{key} = {value!r} is not a valid {typ.__name__}")
    return value


def _coerce_list(key: str, value: Any, item: type, from_text: bool) -> list:
    """A list key: a TOML array, or on the command line comma-separated items (``3,5``, ``[3, 5]``; ``""`` or
    ``[]`` is empty); each item converted as ``item``."""
    if isinstance(value, str) and from_text:
        text = value.strip().removeprefix("[").removesuffix("]").strip()
        value = [part.strip() for part in text.split(",")] if text else []
    if not isinstance(value, list):
        raise ConfigError(f"{key} = {value!r} is not a list: write an array such as [3, 5]")
    return [_coerce(key, v, item, from_text) for v in value]


def set_key(cfg: Config, dotted: str, value: Any, from_text: bool = True) -> None:
    """Set ``section.key`` on ``cfg`` from a TOML value or CLI string.

    Raises:
        ConfigError: unknown section/key (with the closest valid name) or a value of the wrong type.
    """
    sections = _sections()
    if "." not in dotted:
        raise ConfigError(f"'{dotted}' is not a config key: use section.key, e.g. parallel.dp")
    dotted = MOVED_KEYS.get(dotted, dotted)
    section, key = dotted.split(".", 1)
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}': {_suggest(section, list(sections))}"
                          f"valid sections are {', '.join(sections)}")
    obj = getattr(cfg, section)
    ftypes = _field_types(type(obj))
    if key not in ftypes:
        raise ConfigError(f"unknown config key '{dotted}': {_suggest(key, list(ftypes))}"
                          f"valid keys of [{section}] are {', '.join(ftypes)}")
    setattr(obj, key, _coerce(dotted, value, ftypes[key], from_text))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                schedule: bool = True) -> Config:
    """Build a :class:`Config` from an optional TOML file, then apply ``overrides`` (``"section.key" -> value``);
    ``schedule``: as :func:`validate`'s.

    Raises:
        ConfigError: missing/unparsable file, unknown keys, wrong types or impossible values
            (see :func:`validate`).
    """
    cfg = Config()
    given: set[str] = set()  # the keys by their names now (MOVED_KEYS)
    if path is not None:
        p = Path(path)
        data = read_toml(p, "config file")
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"'{section}' in {p} must be a [section] table, got {table!r}")
            for key, value in table.items():
                set_key(cfg, f"{section}.{key}", value, from_text=False)
                given.add(MOVED_KEYS.get(f"{section}.{key}", f"{section}.{key}"))
    for dotted, value in (overrides or {}).items():
        set_key(cfg, dotted, value)
        given.add(MOVED_KEYS.get(dotted, dotted))
    apply_init_from(cfg.model, given)
    # '~/x' (quoted in a shell, or in a config file) is the user's home, as for data.path and model.init_from: the
    # run lock, the pre-launch checks and the ranks then all mean the same folder
    if cfg.train.out_dir.startswith("~"):
        cfg.train.out_dir = str(Path(cfg.train.out_dir).expanduser())
    if cfg.checkpoint.resume.startswith("~"):
        cfg.checkpoint.resume = str(Path(cfg.checkpoint.resume).expanduser())
    validate(cfg, schedule)
    return cfg


SAVED_KEYS = ("data.val_fraction", "train.seed")
"""Keys of a saved config besides ``[model]`` that a resume compares with the run's (:mod:`meshtrain.preflight`)."""


CORE_MODEL_KEYS = ("type", "n_layer", "n_head", "n_embd", "block_size")
"""``[model]`` keys every checkpoint and export meshtrain ever wrote holds: a saved config without one was damaged or
edited (the keys added since take their defaults in older checkpoints)."""


def check_saved_config(saved: dict[str, Any], required: tuple[str, ...] = ()) -> ModelConfig:
    """The model of a config a checkpoint saved (``meta.json["config"]``): each ``[model]`` key present, typed
    and in range as :func:`validate` checks a config (the other sections at their defaults), and
    :data:`SAVED_KEYS` too; keys it lacks (older checkpoints) take their defaults, but :data:`CORE_MODEL_KEYS`
    and the dotted keys ``required`` must be there.

    Raises:
        ConfigError: the first missing or wrong key, e.g. "model.n_layer = 0 must be >= 1".
    """
    for dotted in [f"model.{key}" for key in CORE_MODEL_KEYS] + list(required):
        section, key = dotted.split(".")
        table = saved.get(section)
        if not isinstance(table, dict) or key not in table:
            raise ConfigError(f"{dotted} is missing (every meshtrain checkpoint records it)")
    return _saved(saved).model


def saved_adapter(saved: dict[str, Any]) -> AdapterConfig:
    """The ``[adapter]`` section of a config a checkpoint saved (defaults, no adapters, where it has none), checked
    with its model as :func:`check_saved_config` checks the model.

    Raises:
        ConfigError: the first wrong key."""
    return _saved(saved).adapter


def _saved(saved: dict[str, Any]) -> Config:
    """A config with the ``[model]`` and ``[adapter]`` keys and :data:`SAVED_KEYS` of ``saved``, validated."""
    cfg = Config()
    adapter = saved.get("adapter", {})
    dotted_keys = [f"model.{key}" for key in saved["model"]] + list(SAVED_KEYS)
    dotted_keys += [f"adapter.{key}" for key in adapter] if isinstance(adapter, dict) else ["adapter.table"]
    for dotted in dotted_keys:
        section, key = dotted.split(".")
        table = saved.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"'{section}' = {table!r} (it must be a table)")
        if key in table:
            set_key(cfg, dotted, table[key], from_text=False)
    validate(cfg)
    return cfg


def apply_init_from(m: ModelConfig, given: set[str]) -> None:
    """Set the model keys from ``model.init_from``'s ``config.json`` (its family's reader,
    :func:`meshtrain.models.registry.hf_model_keys`, a key the file lacks at its ``transformers`` default); nothing
    when it is empty. ``given`` holds the dotted keys the user set: one of them with another value than the
    checkpoint's is a contradiction, not an override (the weights could not load) -- but a key at its "derive" value
    (0) is no contradiction when it derives to the file's value (``ffn_hidden = 0`` by Llama's rule,
    :attr:`meshtrain.models.family.Family.derived`), ``vocab_size = 0`` ("from the tokenizer") takes the checkpoint's
    (the pre-launch check then proves the tokenizer fits it), and a training key the file holds (``dropout``,
    ``router_aux_loss_coef``: :func:`meshtrain.models.registry.hf_training_keys`) is the run's where given, else the
    file's (:func:`init_from_origins` says which). ``block_size`` (the training context) is the run's, at most the
    checkpoint's positions; a default above them is lowered.

    Raises:
        ConfigError: no such folder, no or a broken ``config.json``, an architecture meshtrain does not build,
            a contradicting key, a training key the file leaves open and the run does not set (GPT-2's dropouts
            unequal), or ``model.block_size`` past the checkpoint's positions.
    """
    if not m.init_from:
        return
    from meshtrain.models import hf_io as hf
    from meshtrain.models.registry import hf_max_positions, hf_model_keys, hf_training_keys

    folder = Path(m.init_from).expanduser()
    _require(folder.is_dir(), f"model.init_from = '{m.init_from}' is not a folder: give a local Hugging Face model "
                              f"folder ({hf.CONFIG_FILE} + safetensors weights)")
    where = folder / hf.CONFIG_FILE
    try:
        data = hf.read_json(where, "model.init_from's")
        keys = hf_model_keys(data, where)
        training, limit = hf_training_keys(data, where), hf_max_positions(data, where)
    except hf.HFFormatError as e:
        raise ConfigError(str(e)) from None
    keys = {key: value for key, value in keys.items() if not (key in training and f"model.{key}" in given)}
    for key, value in keys.items():
        _require(not isinstance(value, hf.Undecided), f"{value}: set model.{key}")
    mine = {key: getattr(m, key) for key in keys if f"model.{key}" in given}
    for key, value in keys.items():
        setattr(m, key, value)
    _check_file_model(m, keys, where)
    derived = family(m.type).derived
    for key, value in mine.items():
        derives = value == 0 and (key == "vocab_size" or (key in derived and derived[key](_with(m, key, 0)) == keys[key]))
        if value != keys[key] and not derives:
            raise ConfigError(f"model.{key} = {value!r} contradicts '{where}', which gives {keys[key]!r}: "
                              f"remove model.{key} or set it to {keys[key]!r}")
    if limit is not None and "model.block_size" not in given:
        m.block_size = min(m.block_size, limit)
    _require(limit is None or m.block_size <= limit, f"model.block_size = {m.block_size} exceeds the "
                                                     f"{limit} positions of '{where}': use <= {limit}")


def _check_file_model(m: ModelConfig, keys: dict[str, Any], where: Path) -> None:
    """The family's rules hold for the model ``config.json`` describes (its keys, every other at its default): a
    file whose keys -- given, or ``transformers``' defaults of keys it lacks (20 heads for a width of 32) -- make no
    model meshtrain builds is named in the error. Raises ConfigError."""
    from meshtrain.models.registry import DEFAULTS

    probe = ModelConfig(**{key: keys.get(key, DEFAULTS[key]) for key in DEFAULTS})
    try:
        family(m.type).check(probe)
    except ConfigError as e:
        raise ConfigError(f"'{where}' describes a model meshtrain cannot build: {e}") from None


def init_from_origins(m: ModelConfig) -> list[str]:
    """One line per training key ``model.init_from``'s ``config.json`` holds (:func:`apply_init_from`): the value this
    run uses and where it comes from -- the file, the file's ``transformers`` default (it lacks the key), or the
    run's own config, with the file's value beside it. Empty without ``init_from`` or where the folder cannot be read
    (the pre-launch checks say why)."""
    if not m.init_from:
        return []
    from meshtrain.models import hf_io as hf
    from meshtrain.models.registry import hf_model_keys, hf_training_keys

    where = Path(m.init_from).expanduser() / hf.CONFIG_FILE
    try:
        data = hf.read_json(where, "model.init_from's")
        keys, training = hf_model_keys(data, where), hf_training_keys(data, where)
    except hf.HFFormatError:
        return []
    lines = []
    for key, spelled in training.items():
        value, theirs = getattr(m, key), keys[key]
        named = " and ".join(spelled)
        if isinstance(theirs, hf.Undecided) or value != theirs:
            told = theirs if isinstance(theirs, hf.Undecided) else f"'{where}' gives {named} = {theirs!r}"
            lines.append(f"model.{key} = {value!r}, the run's config ({told})")
        elif any(name in data for name in spelled):
            lines.append(f"model.{key} = {value!r}, from {named} in '{where}'")
        else:
            lines.append(f"model.{key} = {value!r}, transformers' default for {', '.join(family(m.type).hf.architectures)}"
                         f" ('{where}' has no {named})")
    return lines


def _with(m: ModelConfig, key: str, value: Any) -> ModelConfig:
    """A copy of ``m`` with ``key`` set to ``value``."""
    return dataclasses.replace(m, **{key: value})


MAX_TOML_BYTES = 16 * 2**20
"""Most bytes of a TOML file :func:`read_toml` reads (16 MiB; a config, a model table or a saved run config is a few
KiB): a larger one is refused before it is read whole."""


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The parsed TOML document at ``path``; ``what`` names the file in errors ("config file", ...).

    Raises:
        ConfigError: the file does not exist, is not a regular file, is over :data:`MAX_TOML_BYTES`, or is not valid
            UTF-8 TOML (one line naming the file).
    """
    require_regular_file(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TOML_BYTES + 1)  # bounded: a file that is not a config may be any size
    except OSError as e:
        raise ConfigError(f"{what} '{path}' cannot be read: {e.strerror}") from None
    if len(data) > MAX_TOML_BYTES:
        raise ConfigError(f"{what} '{path}' is larger than {MAX_TOML_BYTES // 2**20} MiB, far more than a TOML config "
                          f"(a few KiB): give the config file itself")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {e.start}): save it as UTF-8 TOML") from None
    if not text.strip():
        raise ConfigError(f"{what} '{path}' is empty: give a TOML file with [section] tables, e.g. "
                          f"configs/shakespeare_char.toml")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not valid TOML: {e}") from None


def require_regular_file(path: Path, what: str) -> None:
    """Raise ConfigError (one line naming ``what`` and the path) unless ``path`` is a regular file."""
    problem = path_problem(path)
    if problem:
        raise ConfigError(f"{what} '{path}' {problem}")


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """``["--parallel.dp", "2", "--steps=10"]`` -> ``{"parallel.dp": "2", "train.steps": "10"}``.

    Accepts ``--section.key VALUE``, ``--section.key=VALUE`` and the short flags of ``SHORT_FLAGS``.

    Raises:
        ConfigError: a token that is not such a flag, or a flag without a value.
    """
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"unexpected argument '{token}': overrides look like --section.key VALUE")
        name, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens) or (tokens[i + 1].startswith("--") and len(tokens[i + 1]) > 2):
                raise ConfigError(f"--{name} needs a value, e.g. --{name} VALUE")
            value = tokens[i + 1]
            i += 1
        if "." not in name:
            if name not in SHORT_FLAGS:
                short = ", ".join(f"--{s}" for s in SHORT_FLAGS)
                raise ConfigError(f"unknown option --{name}: {_suggest(name, list(SHORT_FLAGS))}"
                                  f"use --section.key VALUE or one of {short}")
            name = SHORT_FLAGS[name]
        out[name] = value
        i += 1
    return out
