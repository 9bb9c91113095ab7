"""What ``stabmon compare`` needs from one run, read in bounded memory.

The logs are read by :func:`stabmon.report.events.read_run`, a line at a time, never
following a symlink (the run directory is on a shared node). Step samples, the bulk of a
long run's log, are folded into a few numbers each as they are read; past
``MAX_SAMPLES`` per rank every other one is dropped, so a month-long run keeps an even
sample of its steps. Other records are kept with only the fields compare reads
(``_FIELDS``), each mapping of figures (phase seconds, memory by device) cut to
``MAX_ENTRIES`` finite numbers, no text longer than ``MAX_TEXT``; at most ``MAX_RECORDS``
per rank and ``MAX_KEPT_BYTES`` of them (estimated). The first attach record of each rank
is kept whole (its environment, one line); later ones keep their time and throughput
config. A record whose step is negative is dropped (steps count from 0). Every record
is untrusted: a field of the wrong type reads as absent.

Needs no torch; reuses :mod:`stabmon.report.goodput` for throughput and goodput.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stabmon.report.events import RankLog, Run, count, number, read_run
from stabmon.report.goodput import RankGoodput, rank_goodput

__all__ = ["Block", "RankDigest", "RunDigest", "Sample", "read_digest"]

#: Step samples kept per rank; past it, every other one is dropped (an even thinning).
MAX_SAMPLES = 20_000
#: Records other than step samples kept per rank (a throughput record a minute: 70 days).
MAX_RECORDS = 100_000
#: Entries kept of each mapping of figures in a kept record (devices, phases).
MAX_ENTRIES = 64
#: A name or text in a kept record longer than this reads as absent (no stabmon name is).
MAX_TEXT = 128
#: What one rank's kept records may take, estimated as ``_VALUE_BYTES`` a value plus its text:
#: a real record costs about 1.5 KB, so ``MAX_RECORDS`` of them fit.
MAX_KEPT_BYTES = 160 * 2**20
_VALUE_BYTES = 80
_COMMON = ("event", "time", "step", "run", "rank")
#: The fields compare reads, by event; other events keep only the common fields.
_FIELDS: dict[str, tuple[str, ...]] = {
    "throughput": ("steps", "samples", "tokens", "uptime_seconds", "mfu", "flops_per_step"),
    "epoch": (),
    "anomaly": ("kind", "device", "phase", "silent_seconds"),
    "stall_end": ("stalled_seconds", "completed"),
    "flops": ("flops_per_step",),
}
#: Mappings of figures (name to number or flag), cut to ``MAX_ENTRIES``.
_FIGURES = ("phase_seconds", "memory", "peak", "leak_suspected")
#: Variables that name one launch or one process, not the environment: they differ every run.
LAUNCH_VARIABLES = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "NODE_RANK",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
    }
)


@dataclass(frozen=True)
class Sample:
    """One ``step_sample``: its step and the figures compare reads (None where absent)."""

    step: int
    step_seconds: float | None
    data_wait_seconds: float | None
    loss_scale: float | None
    host_rss_bytes: float | None


@dataclass(frozen=True)
class Block:
    """Steps ``first_step``..``last_step`` of one process between two throughput records,
    and the seconds each phase took per step over them."""

    first_step: int
    last_step: int
    per_step: dict[str, float]
    #: Samples and tokens counted over the block's steps (None where not counted).
    samples: int | None = None
    tokens: int | None = None
    #: When the block ended (its record's time) and when it began (the previous record's,
    #: or the process's attach), Unix seconds; None where a record had no time.
    end_time: float | None = None
    start_time: float | None = None

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1

    @property
    def step_seconds(self) -> float:
        """The four built-in phases: a step's time, end to end (named phases are not steps)."""
        return sum(
            self.per_step.get(p, 0.0) for p in ("data_wait", "forward", "backward", "optimizer")
        )


@dataclass
class RankDigest:
    """One rank: its kept records (``log``), its step samples, and figures read from them."""

    log: RankLog
    samples: list[Sample] = field(default_factory=list)
    goodput: RankGoodput | None = None

    @property
    def rank(self) -> int:
        return self.log.rank

    def blocks(self) -> list[Block]:
        """Every interval between two throughput records of one process (the first from attach)."""
        blocks: list[Block] = []
        before = _Totals({}, 0, None, None)
        since: float | None = None
        for record in self.log.records:
            event = record.get("event")
            if event == "attach":
                before, since = _Totals({}, 0, None, None), number(record.get("time"))
            if event != "throughput" or not isinstance(record.get("step"), int):
                continue
            time = number(record.get("time"))
            now = _Totals.of(record)
            done = now.steps - before.steps
            first = record["step"] - done + 1
            if done > 0 and first >= 0:
                per_step = {
                    phase: max(0.0, seconds - before.phases.get(phase, 0.0)) / done
                    for phase, seconds in now.phases.items()
                }
                samples, tokens = now.done(before)
                blocks.append(Block(first, record["step"], per_step, samples, tokens, time, since))
            before = now if now.steps >= before.steps else before
            since = time
        return blocks

    def environment(self) -> dict[str, str]:
        """The first attach record's environment as flat facts, launch variables left out."""
        environment = _mapping(self.log.attach.get("environment"))
        if not environment:
            return {}
        facts = {str(k): str(v) for k, v in _mapping(environment.get("versions")).items()}
        for key in (
            "driver_version",
            "hostname",
            "platform",
            "python_executable",
            "cpu_count",
            "torch_threads",
        ):
            facts[key] = _text(environment.get(key))
        available = environment.get("cuda_available") is True
        facts["cuda_devices"] = _text(environment.get("cuda_device_count")) if available else "none"
        facts["CUDA_VISIBLE_DEVICES"] = _text(environment.get("cuda_visible_devices"), "unset")
        gpus = [gpu for gpu in _list(environment.get("gpus")) if isinstance(gpu, Mapping)]
        if gpus:
            facts["gpu_models"] = ", ".join(_text(gpu.get("name")) for gpu in gpus)
            facts["gpu_uuids"] = ", ".join(_text(gpu.get("uuid")) for gpu in gpus)
        for name, value in _mapping(environment.get("variables")).items():
            if str(name) not in LAUNCH_VARIABLES:
                facts[str(name)] = _text(value)
        return facts

    def variable(self, name: str) -> str | None:
        variables = _mapping(_mapping(self.log.attach.get("environment")).get("variables"))
        value = variables.get(name)
        return value if isinstance(value, str) else None

    def flops_per_step(self) -> float | None:
        if self.goodput is not None and self.goodput.flops_per_step is not None:
            return self.goodput.flops_per_step
        counted = [number(r.get("flops_per_step")) for r in self.log.of("flops")]
        return next((value for value in reversed(counted) if value is not None), None)

    def memory(self) -> dict[str, list[tuple[int, float]]]:
        """(step, bytes) per device label: epoch-end samples; for ``host``, the step samples'
        RSS when there are more of them."""
        series: dict[str, list[tuple[int, float]]] = {}
        for record in self.log.of("epoch"):
            step = record.get("step")
            for device, raw in _mapping(record.get("memory")).items():
                value = number(raw)
                if isinstance(step, int) and value is not None and math.isfinite(value):
                    series.setdefault(str(device), []).append((step, value))
        rss = [(s.step, s.host_rss_bytes) for s in self.samples if s.host_rss_bytes is not None]
        if len(rss) > len(series.get("host", [])):  # the same RSS, sampled more often
            series["host"] = [(step, value) for step, value in rss if value is not None]
        return series

    def peaks(self) -> dict[str, float]:
        """The highest memory seen per device: allocator peaks at epoch ends, and the series."""
        found: dict[str, float] = {}
        for record in self.log.of("epoch"):
            for device, raw in _mapping(record.get("peak")).items():
                value = number(raw)
                if value is not None and math.isfinite(value):
                    found[str(device)] = max(value, found.get(str(device), 0.0))
        for device, points in self.memory().items():
            found[device] = max([found.get(device, 0.0), *(value for _, value in points)])
        return found

    def leaks(self) -> set[str]:
        """Devices a leak was suspected on: a memory_leak anomaly, or the last epoch's flag."""
        found = {
            str(r.get("device"))
            for r in self.log.of("anomaly")
            if r.get("kind") == "memory_leak" and isinstance(r.get("device"), str)
        }
        epochs = self.log.of("epoch")
        if epochs:
            suspected = _mapping(epochs[-1].get("leak_suspected"))
            found |= {str(device) for device, flag in suspected.items() if flag is True}
        return found

    def anomalies(self) -> list[tuple[str, int | None]]:
        """(kind, step) of each anomaly, in log order."""
        return [
            (r["kind"], r["step"] if isinstance(r.get("step"), int) else None)
            for r in self.log.of("anomaly")
            if isinstance(r.get("kind"), str) and r["kind"]  # no kind: not a stabmon anomaly
        ]


@dataclass
class RunDigest:
    """A run as compare reads it: its directory, its ranks (lowest first) and notes."""

    run: Run
    ranks: list[RankDigest]

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def notes(self) -> list[str]:
        return [*self.run.notes, *(note for log in self.run.ranks for note in log.notes)]

    @property
    def steps(self) -> int:
        return max((rank.log.steps for rank in self.ranks), default=0)

    def world_size(self) -> int:
        """``WORLD_SIZE`` as the launcher set it, else the number of ranks that wrote a log."""
        for rank in self.ranks:
            value = rank.variable("WORLD_SIZE")
            if value is not None and value.isdigit():
                return int(value)
        return len(self.ranks)

    def ranks_per_node(self) -> int:
        """``LOCAL_WORLD_SIZE`` as the launcher set it, else the most ranks on one host."""
        for rank in self.ranks:
            value = rank.variable("LOCAL_WORLD_SIZE")
            if value is not None and value.isdigit():
                return int(value)
        hosts: dict[str, int] = {}
        for rank in self.ranks:
            host = rank.environment().get("hostname", "")
            hosts[host] = hosts.get(host, 0) + 1
        return max(hosts.values(), default=0)


@dataclass(frozen=True)
class _Totals:
    """A throughput record's running totals: seconds per phase, steps, samples, tokens."""

    phases: dict[str, float]
    steps: int
    samples: int | None
    tokens: int | None

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> _Totals:
        phases = {
            str(name): seconds
            for name, value in _mapping(record.get("phase_seconds")).items()
            if (seconds := number(value)) is not None and math.isfinite(seconds)
        }
        return cls(
            phases,
            count(record.get("steps")) or 0,
            count(record.get("samples")),
            count(record.get("tokens")),
        )

    def done(self, before: _Totals) -> tuple[int | None, int | None]:
        """(samples, tokens) counted since ``before``; None where either did not count them."""
        return (
            _since(self.samples, before.samples if before.steps else 0),
            _since(self.tokens, before.tokens if before.steps else 0),
        )


def _since(now: int | None, before: int | None) -> int | None:
    if not now or before is None or now < before:
        return None
    return now - before


class _Fold:
    """The ``select`` of :func:`read_run`: samples folded into :class:`Sample`, the rest slimmed."""

    def __init__(self) -> None:
        self.samples: dict[int, list[Sample]] = {}
        self._stride: dict[int, int] = {}
        self._seen: dict[int, int] = {}
        self._kept: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.dropped: dict[int, int] = {}
        self.negative: dict[int, int] = {}
        self._attached: set[int] = set()

    def __call__(self, rank: int, record: dict[str, Any]) -> dict[str, Any] | None:
        if record.get("event") == "step_sample":
            self._sample(rank, record)
            return None
        step = record.get("step")
        if isinstance(step, int) and step < 0:
            self.negative[rank] = self.negative.get(rank, 0) + 1
            return None
        if record.get("event") == "attach" and rank not in self._attached:
            self._attached.add(rank)  # the environment fingerprint: one line, kept whole
            return record
        slim = _slim(record)
        size = _size(slim)
        if (
            self._kept.get(rank, 0) >= MAX_RECORDS
            or self._bytes.get(rank, 0) + size > MAX_KEPT_BYTES
        ):
            self.dropped[rank] = self.dropped.get(rank, 0) + 1
            return None
        self._kept[rank] = self._kept.get(rank, 0) + 1
        self._bytes[rank] = self._bytes.get(rank, 0) + size
        return slim

    def _sample(self, rank: int, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        seen = self._seen[rank] = self._seen.get(rank, 0) + 1
        stride = self._stride.get(rank, 1)
        if not isinstance(step, int) or step < 0 or (seen - 1) % stride:
            return
        kept = self.samples.setdefault(rank, [])
        kept.append(
            Sample(
                step,
                _seconds(record.get("step_seconds")),
                _seconds(record.get("data_wait_seconds")),
                _seconds(record.get("amp_loss_scale")),
                _seconds(record.get("host_rss_bytes")),
            )
        )
        if len(kept) >= MAX_SAMPLES:  # keep every other one, and from now on every 2nd more
            kept[:] = kept[::2]
            self._stride[rank] = stride * 2


def read_digest(path: Path) -> RunDigest:
    """Read the run directory ``path`` for comparison (see the module's docstring)."""
    fold = _Fold()
    run = read_run(path, select=fold, follow_symlinks=False)
    for rank, dropped in sorted(fold.dropped.items()):
        run.notes.append(
            f"rank {rank}: {dropped} records not read, past the first {MAX_RECORDS:,} records "
            f"or {MAX_KEPT_BYTES >> 20} MiB kept"
        )
    for rank, negative in sorted(fold.negative.items()):
        run.notes.append(f"rank {rank}: {negative} records with a negative step not read")
    ranks = [
        RankDigest(log, fold.samples.get(log.rank, []), rank_goodput(log)) for log in run.ranks
    ]
    return RunDigest(run, ranks)


def _slim(record: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``record`` compare reads: plain values, and finite figures only (a
    hostile "steps": "nan" reads as absent)."""
    event = record.get("event")
    slim: dict[str, Any] = {}
    fields = _FIELDS.get(event, ()) if isinstance(event, str) else ()
    for key in (*_COMMON, *fields):
        value = record.get(key)
        text_ok = not isinstance(value, str) or len(value) <= MAX_TEXT
        if isinstance(value, (str, bool, int, float)) and text_ok and not _non_finite(value):
            slim[key] = value
    for key in _FIGURES:
        if isinstance(record.get(key), Mapping):
            slim[key] = _figures(record[key])
    if event == "attach":  # a later process's: what steptime reads of its config
        throughput = _mapping(_mapping(record.get("config")).get("throughput"))
        slim["config"] = {"throughput": _figures(throughput)}
    return slim


def _non_finite(value: object) -> bool:
    """NaN or Inf, as a float or as the strings the log writes for them."""
    found = number(value)
    return found is not None and not math.isfinite(found)


def _figures(value: Mapping[str, Any]) -> dict[str, Any]:
    """The first ``MAX_ENTRIES`` finite numbers and flags of a mapping of figures."""
    kept: dict[str, Any] = {}
    for key, item in value.items():
        if len(kept) >= MAX_ENTRIES:
            break
        if len(str(key)) > MAX_TEXT:
            continue
        if isinstance(item, bool) or ((found := number(item)) is not None and math.isfinite(found)):
            kept[str(key)] = item
    return kept


def _size(value: object) -> int:
    """What a slimmed record takes, estimated: ``_VALUE_BYTES`` a value, plus its text."""
    if isinstance(value, Mapping):
        return sum(len(str(key)) + _size(item) for key, item in value.items())
    return _VALUE_BYTES + (len(value) if isinstance(value, str) else 0)


def _seconds(value: object) -> float | None:
    """A finite number, else None (a NaN step time is no step time)."""
    found = number(value)
    return found if found is not None and math.isfinite(found) else None


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: object, empty: str = "-") -> str:
    return empty if value is None or value == "" else str(value)
