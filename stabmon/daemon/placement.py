"""Wrong-GPU detection: a monitored process holding memory on a GPU it did not declare.

Each training process declares the physical GPUs it uses (``gpu_uuids`` in its
registration record, from :func:`stabmon.probes.identity.torch_device_uuids`);
a record without ``gpu_uuids`` but with ``cuda_visible_devices`` declares the
GPUs that value makes visible (:func:`stabmon.hardware.devices.resolve_visible`,
indices taken as NVML's: they agree with CUDA's under
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on nodes of identical GPUs).

NVML lists, per physical GPU, the processes holding memory there. A process on
a GPU outside its declaration usually means a stray ``torch.device("cuda")``
(``cuda:0`` of every rank) or a launcher that set ``CUDA_VISIBLE_DEVICES``
wrong: the ranks then share a GPU, run out of memory or slow each other down.
A DataLoader worker that touches CUDA (the classic stray context on
``cuda:0``) is judged against its training process's declaration: the process
table lists each process's workers (``ProcessSample.worker_pids``).

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

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stabmon.contract import ANOMALIES, ANOMALY_KINDS, PROCESS_GPU_MEMORY
from stabmon.daemon.processes import ProcessSample
from stabmon.export.families import family
from stabmon.hardware.devices import PhysicalGpu, resolve_visible
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import ProcessRecord

__all__ = [
    "Mismatch",
    "PlacementChecker",
    "PlacementCollector",
    "find_mismatches",
    "process_gpu_memory",
]

#: The ``kind`` this module counts in ``stabmon_anomalies_total``; import fails if the contract
#: drops it.
_DEVICE_MISMATCH = ANOMALY_KINDS[ANOMALY_KINDS.index("device_mismatch")]

#: NVML's view of one GPU's processes: (pid, used bytes or None where NVML cannot tell).
GpuProcesses = Mapping[int, Sequence[tuple[int, int | None]]]
MigParent = Callable[[str], str | None]


def _no_parent(uuid: str) -> str | None:
    return None


@dataclass(frozen=True)
class Mismatch:
    """A monitored process (or one of its workers) found on a physical GPU it did not declare."""

    rank: int
    run: str
    #: The process on the GPU: the training process, or one of its workers.
    pid: int
    gpu_index: int
    #: The undeclared GPU's UUID.
    uuid: str
    used_bytes: int | None
    #: The declared UUIDs (resolved from ``cuda_visible_devices`` where no UUIDs were declared).
    declared: tuple[str, ...]
    #: The training process's pid when ``pid`` is one of its workers; None when it is the process.
    worker_of: int | None = None


def find_mismatches(
    samples: Sequence[ProcessSample],
    gpu_processes: GpuProcesses,
    identities: Mapping[int, str],
    mig_parent: MigParent = _no_parent,
) -> list[Mismatch]:
    """Every (alive, declaring) monitored process or worker on a GPU outside its declaration.

    A worker (a pid in ``ProcessSample.worker_pids``) is held to its training
    process's declaration. A process that declared no ``gpu_uuids`` but set
    ``cuda_visible_devices`` declares the GPUs that value resolves to among
    ``identities``. ``gpu_processes`` maps a GPU index to NVML's processes on it, ``identities``
    a GPU index to its UUID, and ``mig_parent`` a MIG UUID to its parent GPU's
    UUID (None when it is not one). UUIDs compare case-insensitively, and a
    declared MIG instance counts as its parent GPU. CUDA reports a MIG
    instance's UUID as ``GPU-<uuid>`` where NVML says ``MIG-<uuid>``, so a
    declared ``GPU-`` UUID that is no GPU here is also tried as a MIG instance.

    Never flagged: processes that declared nothing (CPU-only, or unknown), and
    processes none of whose declared UUIDs names a GPU of this node (a spelling
    this check does not know is no evidence of a wrong GPU).
    """
    owners = _owners(samples)
    physical = [PhysicalGpu(index, uuid) for index, uuid in identities.items()]
    known = {uuid.lower() for uuid in identities.values()}
    mismatches: list[Mismatch] = []
    for index in sorted(gpu_processes):
        uuid = identities.get(index)
        if uuid is None:
            continue  # a GPU NVML could not name cannot be compared
        for pid, used in gpu_processes[index]:
            sample = owners.get(pid)
            if sample is None:
                continue
            record = sample.record
            uuids = _declaration(record, physical)
            declared = _declared_gpus(uuids, known, mig_parent)
            if declared and uuid.lower() not in declared:
                worker_of = None if pid == record.pid else record.pid
                mismatches.append(
                    Mismatch(record.rank, record.run, pid, index, uuid, used, uuids, worker_of)
                )
    return mismatches


def process_gpu_memory(
    samples: Sequence[ProcessSample], gpu_processes: GpuProcesses, identities: Mapping[int, str]
) -> list[tuple[dict[str, str], float]]:
    """``stabmon_process_gpu_memory_bytes`` samples: (labels, bytes) of alive monitored processes.

    A process NVML lists twice on one GPU (in its compute and its graphics list,
    each with the process's whole usage) counts once; one whose usage NVML
    cannot tell (None) is left out. A worker's memory is exported under its own
    pid with its training process's rank.
    """
    ranks = {pid: sample.record.rank for pid, sample in _owners(samples).items()}
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
                "stabmon daemon: rank %d of run %s (%s) holds %s on GPU %d (%s), "
                "which it did not declare (declared: %s); check its torch.device and "
                "CUDA_VISIBLE_DEVICES",
                mismatch.rank,
                mismatch.run,
                f"pid {mismatch.pid}"
                if mismatch.worker_of is None
                else f"pid {mismatch.pid}, a worker of pid {mismatch.worker_of}",
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
        """Join the last process poll with NVML's process lists (see :func:`find_mismatches`).

        ``identities`` maps each GPU index to its UUID; it also resolves the
        records that declare only ``cuda_visible_devices``.
        """
        mismatches = tuple(find_mismatches(samples, gpu_processes, identities, mig_parent))
        # Workers too: a worker's mismatch is forgotten only once the worker is gone.
        self._checker.check(mismatches, alive_pids=set(_owners(samples)))
        self._mismatches = mismatches
        self._memory = tuple(process_gpu_memory(samples, gpu_processes, identities))

    def collect(self) -> Iterator[Metric]:
        memory = family(PROCESS_GPU_MEMORY)
        for labels, used in self._memory:
            memory.add_metric([labels[name] for name in PROCESS_GPU_MEMORY.labels], used)
        yield memory
        anomalies = family(ANOMALIES)
        anomalies.add_metric([_DEVICE_MISMATCH], float(self._checker.count))
        yield anomalies


def _owners(samples: Sequence[ProcessSample]) -> dict[int, ProcessSample]:
    """Each pid of an alive monitored process or of one of its workers, to that process."""
    owners = {pid: s for s in samples if s.alive for pid in s.worker_pids}
    # A monitored process that is also another's child answers for itself.
    owners.update({s.record.pid: s for s in samples if s.alive})
    return owners


def _declaration(record: ProcessRecord, physical: Sequence[PhysicalGpu]) -> tuple[str, ...]:
    """The UUIDs ``record`` declares: ``gpu_uuids``, else those ``cuda_visible_devices`` names."""
    if record.gpu_uuids:
        return record.gpu_uuids
    if record.cuda_visible_devices is None:
        return ()  # unset means every GPU: no declaration to hold it to
    return tuple(resolve_visible(record.cuda_visible_devices, physical))


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
