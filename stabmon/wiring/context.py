"""The Context a Monitor hands its plug-ins: the narrow door of :mod:`stabmon.extension`.

Plug-ins see only what :class:`~stabmon.extension.Context` declares; the recorder, the
judging engine and the event log stay behind it, so a plug-in cannot reach past the
layers. Built once at attach; it refers to no Monitor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from stabmon.config import Config
from stabmon.pipeline.judging import Judging
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.probes.memory import MemorySampler
from stabmon.shared.heartbeat import Heartbeat
from stabmon.wiring.hooks import HookSet, watch_gradient

__all__ = ["PluginContext"]


class PluginContext:
    """One Monitor's :class:`~stabmon.extension.Context` (see there for each member)."""

    def __init__(
        self,
        config: Config,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        readings: Readings,
        memory: MemorySampler,
        heartbeat: Heartbeat,
        run_directory: Path,
        rank: int,
        recorder: Recorder,
        engine: Judging[Any],
        hooks: HookSet | None = None,
        gradient_norms: Callable[[], torch.Tensor | list[float] | None] | None = None,
    ) -> None:
        self.config, self.model, self.optimizer = config, model, optimizer
        self.readings, self.memory, self.heartbeat = readings, memory, heartbeat
        self.run_directory, self.rank = run_directory, rank
        self._recorder, self._engine, self._hooks = recorder, engine, hooks
        self._norms = gradient_norms

    @property
    def global_step(self) -> int:
        return self._recorder.global_step

    @property
    def last_step(self) -> int | None:
        return self._recorder.last_step

    def anomaly(self, kind: str, step: int | None, message: str, **details: Any) -> None:
        self._recorder.anomaly(kind, step, message, **details)

    def event(self, name: str, **fields: Any) -> None:
        self._recorder.write(name, **fields)

    def log(self, key: str, level: int, message: str, *args: object) -> None:
        self._recorder.log(key, level, message, *args)

    def gradient_norms(self) -> torch.Tensor | list[float] | None:
        if self._norms is None:  # built without measurements (a unit test's rig)
            return None
        return self._norms()

    def watch_modules(
        self, hook: Callable[[str, Any, Any], None], names: Collection[str] | None = None
    ) -> Callable[[], None]:
        if self._hooks is None:  # built without hooks (a unit test's rig): nothing to watch
            return _nothing
        return self._hooks.watch_modules(hook, names)

    #: No instance state to read: one Python call less a tensor, on an armed step.
    watch_gradient = staticmethod(watch_gradient)

    def judging(self) -> threading.RLock:
        # Read at each use: a forked child's engine gets a fresh lock.
        return self._engine.lock


def _nothing() -> None:
    pass
