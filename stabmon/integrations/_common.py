"""What every adapter shares: phases held open across events, monitor settings, batch sizes.

A trainer announces the start and the end of evaluation or checkpointing as two
separate events, so :class:`PhaseSwitch` keeps one ``Monitor.phase(...)`` block
open from one event to another. :func:`monitor_settings` gives each of several
monitors in one process (one per optimizer) its own run id, so their series,
event logs and run-directory records do not collide. Trainers whose callbacks never
see a batch (Hugging Face, Ultralytics) count samples with :class:`EpochBatches`, from
the loader's batch size and length: no batch is read.
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
from stabmon.monitor import Monitor
from stabmon.probes.environment import default_run_id
from stabmon.shared.log import LOGGER

__all__ = [
    "ConfigSource", "EpochBatches", "PhaseSwitch", "load_state", "monitor_settings", "restore",
    "save_state",
]  # fmt: skip

ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | Config | None

_RUN_ID_LENGTH = 128  # Config.run_id's limit


class PhaseSwitch:
    """At most one named phase of one Monitor open at a time, entered and left by events."""

    def __init__(self, monitor: Monitor) -> None:
        self._monitor = monitor
        self._open: contextlib.AbstractContextManager[Any] | None = None
        self._block: Any = None
        self.name: str | None = None

    def enter(self, name: str) -> None:
        """Leave the open phase, if any, and enter ``name`` (staying in it is a no-op)."""
        if self.name == name:
            return
        self.close()
        block = self._monitor.phase(name)
        self._block = block.__enter__()
        self._open, self.name = block, name

    def close(self, *, path: str | os.PathLike[str] | None = None) -> None:
        """Leave the open phase, if any; ``path``: where a ``checkpoint`` phase saved."""
        block, self._open, self.name = self._open, None, None
        if path is not None and self._block is not None:
            self._block.path = path
        self._block = None
        if block is not None:
            block.__exit__(None, None, None)


class EpochBatches:
    """Samples in each batch of an epoch, from a loader's batch size, length and sampler.

    Every batch holds ``batch_size`` samples except the epoch's last, which holds what
    is left of the sampler's samples (unless the loader drops it); a loader whose
    length or sampler is unknown (an iterable dataset) counts full batches.
    """

    def __init__(self, batch_size: int, batches: int | None, last: int | None) -> None:
        self.batch_size = batch_size
        #: Batches per epoch, or None when the loader has no length.
        self.batches = batches
        self._last = last

    @classmethod
    def of(cls, loader: object) -> EpochBatches | None:
        """From a ``torch.utils.data.DataLoader`` (or a wrapper with the same attributes)."""
        # A loader built with batch_size= batches its own sampler; one given a batch_sampler=
        # (Accelerate's) has batch_size None, and the batch sampler holds both.
        batcher = loader
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is None:
            batcher = getattr(loader, "batch_sampler", None)
            batch_size = getattr(batcher, "batch_size", None)
        if not isinstance(batch_size, int) or batch_size <= 0:
            return None
        batches = last = None
        with contextlib.suppress(TypeError, AttributeError, NotImplementedError):
            batches = len(loader)  # type: ignore[arg-type]  # a loader without len raises
            drop_last = getattr(batcher, "drop_last", True)
            samples = len(getattr(batcher, "sampler"))  # noqa: B009 - AttributeError: none
            # Only when the sampler is this loader's own (a sharded loader's is not).
            if not drop_last and batches == -(-samples // batch_size):
                last = samples - (batches - 1) * batch_size
        return cls(batch_size, batches, last)

    def samples(self, first: int, count: int) -> int:
        """Samples in batches ``first`` .. ``first + count - 1`` of an epoch (0-based)."""
        total = count * self.batch_size
        if self.batches is not None and self._last and first <= self.batches - 1 < first + count:
            total -= self.batch_size - self._last  # the short last batch
        return total


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
    except Exception as error:  # torch.save raises RuntimeError on a full disk, not OSError
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
    # The trainer's resume callback calls this outside any guard, and a damaged file makes
    # torch.load raise almost anything (RuntimeError for a broken zip archive, EOFError when
    # empty, UnpicklingError when not a torch file, UnicodeDecodeError, KeyError, struct.error
    # for flipped bits): whatever it is, the run goes on without the old numbering.
    except Exception as error:
        LOGGER.warning(
            "stabmon: could not resume the monitor state from %s (%s: %s); step numbering and "
            "baselines start over",
            path,
            type(error).__name__,
            error,
        )
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
