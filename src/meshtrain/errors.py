"""The user-mistake error every torch-free check raises (config, model families, pre-launch checks)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake in the configuration; the message is one actionable line."""


class DataError(ConfigError):
    """Damaged data found by the rank that read it (only the data shows it: nothing before launch could); the
    message is one line that names the file or split and how to make it again."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)
