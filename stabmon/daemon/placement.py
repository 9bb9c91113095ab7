"""Wrong-GPU detection: a monitored process holding memory on a GPU it did not declare.

Each training process declares the physical GPUs it uses (``gpu_uuids`` in its
registration record, from :func:`stabmon.probes.devices.torch_device_uuids`).
NVML lists, per physical GPU, the processes holding memory there. A process on
a GPU outside its declaration usually means a stray ``torch.device("cuda")``
(``cuda:0`` of every rank) or a launcher that set ``CUDA_VISIBLE_DEVICES``
wrong: the ranks then share a GPU, run out of memory or slow each other down.

Design
------
:meth:`PlacementCollector.update` runs on the daemon's poll thread after the
NVML and process polls; it replaces the collector's values in single
assignments. :meth:`PlacementCollector.collect` runs in the exporter's thread
and reads only those values, never NVML or psutil.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stabmon.contract import ANOMALIES, DAEMON_METRICS, MetricDef
from stabmon.daemon.processes import ProcessSample
from stabmon.log import LogLimiter

__all__ = [
    "Mismatch",
    "PlacementChecker",
    "PlacementCollector",
    "find_mismatches",
    "process_gpu_memory",
]

#: The ``kind`` this module counts in ``stabmon_anomalies_total`` (one of ANOMALY_KINDS).
_DEVICE_MISMATCH = "device_mismatch"

#: NVML's view of one GPU's processes: (pid, used bytes or None where NVML cannot tell).
GpuProcesses = Mapping[int, Sequence[tuple[int, int | None]]]
MigParent = Callable[[str], str | None]


def _metric(name: str) -> MetricDef:
    return next(definition for definition in DAEMON_METRICS if definition.name == name)


_PROCESS_GPU_MEMORY = _metric("stabmon_process_gpu_memory_bytes")


def _no_parent(uuid: str) -> str | None:
    return None


@dataclass(frozen=True)
class Mismatch:
    """A monitored process found on a physical GPU it did not declare."""

    rank: int
    run: str
    pid: int
    gpu_index: int
    #: The undeclared GPU's UUID.
    uuid: str
    used_bytes: int | None
    declared: tuple[str, ...]


def find_mismatches(
    samples: Sequence[ProcessSample],
    gpu_processes: GpuProcesses,
    identities: Mapping[int, str],
    mig_parent: MigParent = _no_parent,
) -> list[Mismatch]:
    """Every (alive, declaring) monitored process on a GPU outside its declaration.

    ``gpu_processes`` maps a GPU index to NVML's processes on it, ``identities``
    a GPU index to its UUID, and ``mig_parent`` a MIG UUID to its parent GPU's
    UUID (None when it is not one). UUIDs compare case-insensitively, and a
    declared MIG instance counts as its parent GPU. CUDA reports a MIG
    instance's UUID as ``GPU-<uuid>`` where NVML says ``MIG-<uuid>``, so a
    declared ``GPU-`` UUID that is no GPU here is also tried as a MIG instance.

    Never flagged: processes that declared nothing (CPU-only, or unknown), and
    processes none of whose declared UUIDs names a GPU of this node (a spelling
    this check does not know is no evidence of a wrong GPU).
    """
    declaring = {s.record.pid: s for s in samples if s.alive and s.record.gpu_uuids}
    known = {uuid.lower() for uuid in identities.values()}
    mismatches: list[Mismatch] = []
    for index in sorted(gpu_processes):
        uuid = identities.get(index)
        if uuid is None:
            continue  # a GPU NVML could not name cannot be compared
        for pid, used in gpu_processes[index]:
            sample = declaring.get(pid)
            if sample is None:
                continue
            declared = _declared_gpus(sample.record.gpu_uuids, known, mig_parent)
            if declared and uuid.lower() not in declared:
                record = sample.record
                mismatches.append(
                    Mismatch(record.rank, record.run, pid, index, uuid, used, record.gpu_uuids)
                )
    return mismatches


def process_gpu_memory(
    samples: Sequence[ProcessSample], gpu_processes: GpuProcesses, identities: Mapping[int, str]
) -> list[tuple[dict[str, str], float]]:
    """``stabmon_process_gpu_memory_bytes`` samples: (labels, bytes) of alive monitored processes.

    A process NVML lists twice on one GPU (in its compute and its graphics list,
    each with the process's whole usage) counts once; one whose usage NVML
    cannot tell (None) is left out.
    """
    ranks = {s.record.pid: s.record.rank for s in samples if s.alive}
    totals: dict[tuple[int, int], float] = {}
    for index in sorted(gpu_processes):
        for pid, used in gpu_processes[index]:
            if pid in ranks and used is not None:
                totals[(index, pid)] = max(totals.get((index, pid), 0.0), float(used))
    return [
        (
            {
                "gpu": str(index),
                "uuid": identities.get(index, ""),
                "rank": str(ranks[pid]),
                "pid": str(pid),
            },
            used,
        )
        for (index, pid), used in totals.items()
    ]


class PlacementChecker:
    """Counts each new mismatch once (per pid, gpu) and logs it once.

    Exported as ``stabmon_anomalies_total{kind="device_mismatch"}`` on the daemon.

    >>> checker = PlacementChecker(limiter=LogLimiter())
    >>> checker.check([])
    >>> checker.count
    0
    """

    def __init__(self, *, limiter: LogLimiter) -> None:
        self._limiter = limiter
        self._seen: set[tuple[int, int]] = set()
        self._count = 0

    @property
    def count(self) -> int:
        """Mismatches counted so far."""
        return self._count

    def check(
        self, mismatches: Sequence[Mismatch], *, alive_pids: Collection[int] | None = None
    ) -> None:
        """Count and log the mismatches not seen before.

        With ``alive_pids``, pairs whose process is no longer alive are
        forgotten, which bounds the memory and lets a reused pid count anew.
        """
        if alive_pids is not None:
            self._seen = {key for key in self._seen if key[0] in alive_pids}
        for mismatch in mismatches:
            key = (mismatch.pid, mismatch.gpu_index)
            if key in self._seen:
                continue
            self._seen.add(key)
            self._count += 1
            self._limiter.limited(
                _DEVICE_MISMATCH,
                logging.WARNING,
                "stabmon daemon: rank %d of run %s (pid %d) holds %s on GPU %d (%s), "
                "which it did not declare (declared: %s); check its torch.device and "
                "CUDA_VISIBLE_DEVICES",
                mismatch.rank,
                mismatch.run,
                mismatch.pid,
                "memory" if mismatch.used_bytes is None else f"{mismatch.used_bytes} bytes",
                mismatch.gpu_index,
                mismatch.uuid,
                ", ".join(mismatch.declared),
            )


class PlacementCollector(Collector):
    """``stabmon_process_gpu_memory_bytes`` and the daemon's device-mismatch count.

    The daemon's poll loop calls :meth:`update`; a scrape reads the last update
    only. The mismatch counter is exported as 0 from the start.
    """

    def __init__(self, *, limiter: LogLimiter) -> None:
        self._checker = PlacementChecker(limiter=limiter)
        self._memory: tuple[tuple[dict[str, str], float], ...] = ()
        self._mismatches: tuple[Mismatch, ...] = ()

    @property
    def mismatches(self) -> list[Mismatch]:
        """The mismatches found by the last update."""
        return list(self._mismatches)

    def update(
        self,
        samples: Sequence[ProcessSample],
        gpu_processes: GpuProcesses,
        identities: Mapping[int, str],
        mig_parent: MigParent = _no_parent,
    ) -> None:
        """Join the last process poll with NVML's process lists (see :func:`find_mismatches`)."""
        mismatches = tuple(find_mismatches(samples, gpu_processes, identities, mig_parent))
        self._checker.check(mismatches, alive_pids={s.record.pid for s in samples if s.alive})
        self._mismatches = mismatches
        self._memory = tuple(process_gpu_memory(samples, gpu_processes, identities))

    def collect(self) -> Iterator[Metric]:
        memory = GaugeMetricFamily(
            _PROCESS_GPU_MEMORY.name, _PROCESS_GPU_MEMORY.help, labels=_PROCESS_GPU_MEMORY.labels
        )
        for labels, used in self._memory:
            memory.add_metric([labels[name] for name in _PROCESS_GPU_MEMORY.labels], used)
        yield memory
        anomalies = CounterMetricFamily(ANOMALIES.name, ANOMALIES.help, labels=ANOMALIES.labels)
        anomalies.add_metric([_DEVICE_MISMATCH], float(self._checker.count))
        yield anomalies


def _declared_gpus(
    declared: Sequence[str], known: Collection[str], mig_parent: MigParent
) -> set[str]:
    """The lower-cased UUIDs of this node's GPUs that ``declared`` names."""
    gpus: set[str] = set()
    for uuid in declared:
        candidates = [uuid]
        if uuid[:4].lower() == "gpu-" and uuid.lower() not in known:
            candidates.append(f"MIG-{uuid[4:]}")  # CUDA's spelling of a MIG instance
        for candidate in candidates:
            parent = mig_parent(candidate)
            for name in (candidate, parent):
                if name is not None and name.lower() in known:
                    gpus.add(name.lower())
    return gpus
