"""The Recorder and the built-in judges (stabmon.wiring.plugins.PLUGINS) on a real event log.

Host values go in as the readback would deliver them (a gradient summary, a loss, a clip's
``max_norm``, a GradScaler scale, epoch-end memory), through the same calls the Monitor's
pipeline makes; records are read back from the event log in tmp_path. No Monitor, no model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

from stabmon.config import load_config
from stabmon.export.event_log import EventLog
from stabmon.pipeline.judging import Judging
from stabmon.pipeline.readings import Readings
from stabmon.pipeline.recorder import Recorder
from stabmon.probes.grads import GradLayout, GradSummary
from stabmon.probes.memory import MemorySampler
from stabmon.shared.guard import Guard
from stabmon.shared.heartbeat import Heartbeat
from stabmon.shared.log import LogLimiter
from stabmon.wiring.context import PluginContext
from stabmon.wiring.plugins import Plugged

#: Two module groups of one parameter each.
LAYOUT = GradLayout(
    ("encoder", "head"),
    (0, 1),
    None,
    None,
    names=("encoder.weight", "head.weight"),
    model_order=(0, 1),
    empty_shards=(),
)


class Judges:
    """A Recorder and the built-in plug-ins, with small warm-ups by default."""

    def __init__(
        self, tmp_path: Path, *, memory: Any = None, heartbeat: Any = None, **overrides: Any
    ) -> None:
        settings: dict[str, Any] = {"spike_warmup_steps": 5, "spike_episode_gap": 3}
        settings.update(overrides)
        self.config = load_config({}, overrides=settings, env={})
        self.readings = Readings(labels={"rank": "0", "run": "r"})
        self.path = tmp_path / "rank-0.events.jsonl"
        guard = Guard(LogLimiter())
        events = EventLog(self.path, common={"run": "r", "rank": 0}, guard=guard)
        self.recorder = Recorder(self.config, self.readings, events=events, limiter=LogLimiter())
        self.plugged = Plugged(guard)
        engine: Judging[Any] = Judging(self._nothing, guard=guard, judge_seconds=0)
        #: What each plug-in is handed (stabmon.extension.Context).
        self.context = PluginContext(
            self.config, cast(Any, None), cast(Any, None), readings=self.readings,
            memory=memory or MemorySampler(self.readings, None, lambda: ()),
            heartbeat=heartbeat or Heartbeat(),
            run_directory=tmp_path, rank=0, recorder=self.recorder, engine=engine,
        )  # fmt: skip
        self.plugged.plug(self.context)

    def _nothing(self, results: list[tuple[Any, list[float]]]) -> None:
        pass

    # --- what the pipeline hands the judges ---------------------------------------------

    def grads(self, step: int, encoder: float, head: float = 1.0) -> None:
        total = (encoder**2 + head**2) ** 0.5
        summary = GradSummary(
            total, 0, total != total or total == float("inf"), [encoder, head], LAYOUT
        )
        self.recorder.grads(step, summary)
        self.plugged.grads_judged(step, summary)

    def loss(self, step: int, value: float) -> None:
        self.recorder.loss(step, value)
        self.plugged.loss_judged(step, value)

    def clip(self, step: int, max_norm: float) -> None:
        self.plugged.clip_judged(step, max_norm)

    def scale(self, step: int, scale: float) -> None:
        self.plugged.scale_judged(step, scale)

    def epoch(self, samples: dict[str, float], peaks: dict[str, float]) -> None:
        self.recorder.epoch(samples, peaks, self.plugged.epoch_memory(samples))

    def finish(self) -> None:
        self.recorder.flush_sample()
        self.plugged.finish()

    def state_dict(self) -> dict[str, Any]:
        return {**self.recorder.state_dict(), **self.plugged.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        self.recorder.load_state_dict(
            state, required=self.plugged.state_keys, restore=self.plugged.load_state_dict
        )

    # --- what came out ------------------------------------------------------------------------

    def records(self, event: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        found = [json.loads(line) for line in self.path.read_text().splitlines()]
        return [r for r in found if event is None or r["event"] == event]

    def anomalies(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records("anomaly") if r["kind"] == kind]
