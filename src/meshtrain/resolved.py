"""The resolved run: what every rank executes, decided once by the launcher and handed to the ranks as a file.

``meshtrain train`` reads the TOML and the command line, applies ``--layout auto``'s choice, fills
``parallel.dp = -1`` from the ranks, checks it all, and writes ``resolved.json`` (:meth:`ResolvedRun.write`)
into its private temporary folder; its ranks start as ``python -m meshtrain.train --resolved PATH`` and read
it (:meth:`ResolvedRun.read`) instead of parsing the TOML again and re-deriving the layout. Ranks started by
``torchrun -m meshtrain.train CONFIG`` directly resolve the same way for their ``WORLD_SIZE``
(:meth:`ResolvedRun.resolve`). Torch-free.

The file::

    {"format": "meshtrain-resolved-run", "version": 1, "layout": "config" | "auto",
     "world_size": 4, "degrees": {"dp": 2, "tp": 2, "pp": 1, "sp": 1}, "global_batch_size": 24,
     "config": {"model": {...}, "data": {...}, "parallel": {...}, ...}}

``config`` holds every key of every section (parallel.dp resolved); ``degrees`` and ``global_batch_size`` are
what the ranks use, written out so a reader need not derive them (:meth:`ResolvedRun.read` checks they agree).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtrain import axes
from meshtrain.batch_math import global_batch_size
from meshtrain.config.checks import diloco_workers, resolve_world, validate
from meshtrain.config.load import set_key
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError

FORMAT = "meshtrain-resolved-run"
VERSION = 1
FILE_NAME = "resolved.json"
LAYOUT_SOURCES = ("config", "auto")


@dataclass(frozen=True)
class ResolvedRun:
    """A validated config whose layout is fixed for ``world_size`` ranks.

    - ``config``: every key, with ``parallel.dp`` resolved (never -1; with ``sync_mode = "async"``, the workers);
    - ``world_size``: ranks of the run (``pp * dp * sp * tp``, plus the parameter servers of an async run);
    - ``layout``: where the layout came from, "config" or "auto" (``--layout auto``'s planner choice).
    """

    config: Config
    world_size: int
    layout: str = "config"

    @classmethod
    def resolve(cls, cfg: Config, world_size: int | None, layout: str = "config") -> ResolvedRun:
        """``cfg`` fixed for ``world_size`` ranks (None: the world its own degrees give), ``cfg`` untouched.

        Raises:
            ConfigError: the ranks do not suit the config (:func:`meshtrain.config.checks.resolve_world`).
        """
        world, dp = resolve_world(cfg, world_size)
        config = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=dp))
        return cls(config, world, layout)

    def for_world(self, world_size: int) -> ResolvedRun:
        """This run on the ``world_size`` ranks a rank finds itself among: itself when they are the ones it
        was resolved for; else resolved again, which refuses a world its pinned ``dp`` does not fill
        (an elastic restart with fewer nodes).

        Raises:
            ConfigError: ``world_size`` does not suit the config.
        """
        return self if world_size == self.world_size else ResolvedRun.resolve(self.config, world_size, self.layout)

    @property
    def dp(self) -> int:
        """Data-parallel degree (parameter server: workers)."""
        return self.config.parallel.dp

    @property
    def workers(self) -> int:
        """DiLoCo's workers in this job (``sync_mode = "diloco"``: ``world_size / diloco.group``; 1 for an
        elastic worker, whose peers are other jobs), else 1."""
        cfg = self.config
        return diloco_workers(cfg, self.world_size) if cfg.parallel.sync_mode == "diloco" and not cfg.elastic else 1

    @property
    def degrees(self) -> dict[str, int]:
        """``{"dp": 2, "tp": 2, "pp": 1, "sp": 1}``: one degree per axis of :data:`meshtrain.axes.AXIS_TABLE`."""
        return axes.as_dict(self.config.parallel)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, ``micro_batch_size * gradient_accumulation_steps * dp``
        (:func:`meshtrain.batch_math.global_batch_size`; an async run's step is one worker's batch; an elastic
        DiLoCo worker's run counts every worker's, ``dp * diloco.workers``)."""
        b, p = self.config.batch, self.config.parallel
        shares = self.config.diloco.workers if self.config.elastic else 1
        return global_batch_size(b.micro_batch_size, b.gradient_accumulation_steps,
                                 1 if p.sync_mode == "async" else self.dp * shares)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "layout": self.layout, "world_size": self.world_size,
                "degrees": self.degrees, "global_batch_size": self.global_batch_size, "config": self.config.to_dict()}

    def write(self, path: str | Path) -> Path:
        """Write the run as JSON to ``path`` (a file; written whole under a fresh temporary name, then renamed)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> ResolvedRun:
        """The run :meth:`write` wrote: each config key typed and checked as a TOML file's
        (:func:`meshtrain.config.load.set_key`, :func:`meshtrain.config.checks.validate`).

        Raises:
            ConfigError: no such file, not JSON, another format or version, a key that is not valid, or
                ``degrees`` / ``global_batch_size`` that disagree with the config.
        """
        from meshtrain.fileio import read_text_checked

        path = Path(path)
        text = read_text_checked(path, "resolved run", "start the run with meshtrain train")  # a file, bounded, first
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"resolved run '{path}' cannot be read ({e}): start the run with meshtrain train") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ConfigError(f"'{path}' is not a meshtrain resolved run of version {VERSION}: start the run with "
                              f"meshtrain train")
        cfg = Config()
        for section, table in data["config"].items():
            for key, value in table.items():
                set_key(cfg, f"{section}.{key}", value, from_text=False)
        validate(cfg)
        layout = data.get("layout")
        if layout not in LAYOUT_SOURCES:
            raise ConfigError(f"'{path}': layout = {layout!r} is not one of {', '.join(LAYOUT_SOURCES)}")
        run = cls(cfg, int(data["world_size"]), layout)
        if run.degrees != data["degrees"] or run.global_batch_size != data["global_batch_size"]:
            raise ConfigError(f"'{path}': degrees {data['degrees']} and global batch {data['global_batch_size']} "
                              f"disagree with its config ({run.degrees}, {run.global_batch_size})")
        return run


def config_of(run: ResolvedRun | Config) -> Config:
    """The config of a resolved run, or a bare config (ranks started without the launcher, tests) as it is."""
    return run.config if isinstance(run, ResolvedRun) else run


def for_world(run: ResolvedRun | Config, world_size: int) -> ResolvedRun:
    """``run`` on the ``world_size`` ranks a rank finds itself among (:meth:`ResolvedRun.for_world`); a bare config is
    resolved for them.

    Raises:
        ConfigError: ``world_size`` does not suit the config.
    """
    return run.for_world(world_size) if isinstance(run, ResolvedRun) else ResolvedRun.resolve(run, world_size)
