"""What every adapter shares: phases held open across events, and monitor settings.

A trainer announces the start and the end of evaluation or checkpointing as two
separate events, so :class:`PhaseSwitch` keeps one ``Monitor.phase(...)`` block
open from one event to another. :func:`monitor_settings` gives each of several
monitors in one process (one per optimizer) its own run id, so their series,
event logs and run-directory records do not collide.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stabmon.config import Config, load_config
from stabmon.errors import StabmonError
from stabmon.log import LOGGER
from stabmon.monitor import Monitor
from stabmon.probes.environment import default_run_id

__all__ = [
    "ConfigSource", "PhaseSwitch", "load_state", "monitor_settings", "restore", "save_state",
]  # fmt: skip

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | Config | None

_RUN_ID_LENGTH = 128  # Config.run_id's limit


class PhaseSwitch:
    """At most one named phase of one Monitor open at a time, entered and left by events."""

    def __init__(self, monitor: Monitor) -> None:
        self._monitor = monitor
        self._open: contextlib.AbstractContextManager[None] | None = None
        self.name: str | None = None

    def enter(self, name: str) -> None:
        """Leave the open phase, if any, and enter ``name`` (staying in it is a no-op)."""
        if self.name == name:
            return
        self.close()
        block = self._monitor.phase(name)
        block.__enter__()
        self._open, self.name = block, name

    def close(self) -> None:
        """Leave the open phase, if any."""
        block, self._open, self.name = self._open, None, None
        if block is not None:
            block.__exit__(None, None, None)


def monitor_settings(
    config: ConfigSource, overrides: Mapping[str, Any], index: int, count: int
) -> dict[str, Any]:
    """Keyword arguments for monitor ``index`` of ``count`` attached in one process.

    One monitor keeps the configured run id. Several (one per optimizer) get
    ``<run id>-opt<index>``: each has its own series (label ``run``), event log
    and run-directory record, and the exporter's port fallback gives each its own
    port. Raises :class:`~stabmon.ConfigError` for a bad config, as ``attach`` does.
    """
    settings = dict(overrides)
    if count > 1:
        run_id = load_config(config, overrides).run_id or default_run_id(os.environ)
        suffix = f"-opt{index}"
        settings["run_id"] = run_id[: _RUN_ID_LENGTH - len(suffix)] + suffix
    return settings


def save_state(monitor: Monitor, path: Path) -> None:
    """Write ``monitor.state_dict()`` to ``path`` atomically; a failure is logged, not raised."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(monitor.state_dict(), partial)
        os.replace(partial, path)  # rename(2) is atomic: a crash leaves the old state or the new
    except OSError as error:
        LOGGER.warning("stabmon: could not save the monitor state to %s: %s", path, error)
        with contextlib.suppress(OSError):
            partial.unlink()


def load_state(monitor: Monitor, path: Path) -> bool:
    """Continue from a state saved by :func:`save_state`; False (and a warning) when unusable."""
    if not path.is_file():
        LOGGER.warning(
            "stabmon: resuming, but %s does not exist; step numbering and baselines start over",
            path,
        )
        return False
    try:
        monitor.load_state_dict(torch.load(path, weights_only=True))
    except (OSError, RuntimeError, StabmonError) as error:  # torch.load raises RuntimeError
        LOGGER.warning("stabmon: could not resume the monitor state from %s: %s", path, error)
        return False
    return True


def restore(monitor: Monitor, state: Mapping[str, Any], where: str) -> None:
    """``monitor.load_state_dict(state)``; a state it refuses is logged and the run goes on."""
    try:
        monitor.load_state_dict(state)
    except StabmonError as error:
        LOGGER.warning(
            "stabmon: %s holds an unusable monitor state (%s); starting over", where, error
        )
