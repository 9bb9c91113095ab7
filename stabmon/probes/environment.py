"""Who this process is (rank, run id) and what it runs on (versions)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stabmon.probes.identity import identify_gpus
from stabmon.shared.guard import Guard

__all__ = [
    "ProcessIdentity",
    "build_info",
    "default_run_id",
    "describe_environment",
    "environment_record",
    "format_environment",
    "process_identity",
    "relevant_variables",
    "set_in_process",
]

#: How long a rank waits at attach for rank 0's run id in the process group's store.
_STORE_WAIT_SECONDS = 10.0
#: Environment variables that change how a run behaves (threads, NCCL, allocator, launch).
_PREFIXES = ("TORCH", "PYTORCH_", "NCCL_", "CUDA_", "CUBLAS_", "CUDNN_", "NVIDIA_", "OMP_", "MKL_")
_NAMES = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
     "GROUP_RANK", "ROLE_RANK", "NODE_RANK"}
)  # fmt: skip
#: The environment when this module was imported (at the first stabmon.attach): what the user
#: and the launcher set. A relevant variable that appears or changes later was set inside the
#: process (torch sets TORCHINDUCTOR_CACHE_DIR to its default the first time inductor looks
#: for its cache, which counting a compiled step's FLOPs does), and the report says so.
_AT_IMPORT: dict[str, str] = dict(os.environ)
#: Names that may hold a credential: their values are never recorded.
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|_)KEY($|_)", re.IGNORECASE)


@dataclass(frozen=True)
class ProcessIdentity:
    """Position of this process in a (possibly distributed) job."""

    rank: int
    local_rank: int
    local_world_size: int


def process_identity(env: Mapping[str, str]) -> ProcessIdentity:
    """Rank from torch.distributed when initialised, else from torchrun's variables, else 0."""
    rank = _int(env.get("RANK"), 0)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    return ProcessIdentity(
        rank=rank,
        local_rank=_int(env.get("LOCAL_RANK"), 0),
        local_world_size=max(1, _int(env.get("LOCAL_WORLD_SIZE"), 1)),
    )


def default_run_id(env: Mapping[str, str]) -> str:
    """A run id shared by every rank of a distributed job, else one stable for this process.

    In order: torchrun's rendezvous id (``TORCHELASTIC_RUN_ID``, which is ``none``
    under a static ``--master-addr/--master-port`` rendezvous); an id that rank 0
    puts in the process group's store, once, at attach (never per step); a hash of
    the job's rendezvous address and size, which every rank computes alike; and
    last, for a single process, host, start time and pid.
    """
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        return elastic
    return _shared_run_id(_job_key(env)) or _process_run_id()


def _job_key(env: Mapping[str, str]) -> str | None:
    parts = [env.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")]
    return ":".join(parts) if all(parts) else None


@functools.cache
def _shared_run_id(job: str | None) -> str | None:
    """The run id every rank agrees on (cached: one per process, as the job is)."""
    from_store = _run_id_from_store(job)
    if from_store:
        return from_store
    if job is None:
        return None
    return _job_run_id(job)


def _run_id_from_store(job: str | None) -> str | None:
    """The run id agreed in the default process group's store, if there is one."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return None
    try:
        store: Any = distributed.distributed_c10d._get_default_store()
        return agree_run_id(store, rank=distributed.get_rank(), job=job)
    except Exception:  # a store without check() or compare_set(), or one that failed
        return None


def agree_run_id(
    store: Any, *, rank: int, job: str | None, wait_seconds: float = _STORE_WAIT_SECONDS
) -> str:
    """One run id for every rank, whoever writes it first (``store``: a c10d ``Store``).

    Rank 0 proposes a fresh id. The other ranks wait up to ``wait_seconds`` for it
    and then propose the job hash. ``compare_set`` lets only the first proposal in,
    and every rank takes what is stored: a rank 0 that attaches late still joins the
    others' run instead of splitting the ``run`` label.
    """
    key = "stabmon/run_id"
    if rank == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        digest = hashlib.sha1((job or socket.gethostname()).encode()).hexdigest()[:8]
        proposal = f"job-{digest}-{stamp}"
    else:
        deadline = time.monotonic() + wait_seconds
        while not store.check([key]):  # non-blocking: never wait out the store's own timeout
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        proposal = _job_run_id(job or socket.gethostname())
    return bytes(store.compare_set(key, "", proposal)).decode()


def _job_run_id(job: str) -> str:
    return "job-" + hashlib.sha1(job.encode()).hexdigest()[:12]


@functools.cache
def _process_run_id() -> str:
    # Cached: two monitors in one process are one run, and the id must not change mid-run.
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{socket.gethostname()}-{stamp}-{os.getpid()}"


def build_info(stabmon_version: str) -> dict[str, str]:
    """Label values of ``stabmon_build_info``; empty where not applicable."""
    cudnn_backend: Any = torch.backends.cudnn  # unannotated in torch
    try:  # cuDNN's first use initialises it on every device: a broken device must not stop attach
        cudnn = cudnn_backend.version() if cudnn_backend.is_available() else None
    except RuntimeError:
        cudnn = None
    nccl = ""
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl_module: Any = torch.cuda.nccl  # unannotated in torch
            version = nccl_module.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (RuntimeError, AttributeError):  # built without NCCL
            nccl = ""
    return {
        "stabmon_version": stabmon_version,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda or "",
        "cudnn_version": str(cudnn) if cudnn else "",
        "nccl_version": nccl,
        "python_version": platform.python_version(),
    }


def relevant_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that matter for stability, sorted; credentials' values redacted."""
    chosen = {
        name: ("<redacted>" if _SECRET.search(name) else value)
        for name, value in env.items()
        if name.startswith(_PREFIXES) or name in _NAMES
    }
    return dict(sorted(chosen.items()))


def set_in_process(env: Mapping[str, str], at_start: Mapping[str, str]) -> list[str]:
    """The relevant variables of ``env`` that were not so in ``at_start``: set (or changed) by
    torch or stabmon inside this process, not by the user or the launcher."""
    return [name for name in relevant_variables(env) if at_start.get(name) != env.get(name)]


def _platform() -> str:
    """``platform.platform()``'s words (``Linux-6.8.0-x86_64-with-glibc2.35``), without its fork.

    ``platform.platform()`` asks for the processor, which runs ``uname -p`` in a subprocess,
    here in the training process's main thread at attach. That fork is not stabmon's to make:
    beside it, under load, a SIGTERM sent just after attach was seen (with the kernel's signal
    tracepoints) going to another thread, so that the user's own handler waited until the
    main thread's sleep ended by itself. ``uname(2)`` and ``confstr`` give the same words.
    """
    uname = platform.uname()  # system, release, machine: no processor, so no subprocess
    libc, version = platform.libc_ver()
    words = [uname.system, uname.release, uname.machine]
    if libc:
        words.append(f"with-{libc}{version}")
    return "-".join(word for word in words if word)


def environment_record(
    versions: Mapping[str, str],
    gpus: Sequence[Mapping[str, str]],
    driver: str,
    env: Mapping[str, str],
    at_start: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Everything two runs need to be compared: the event log's first line, ``stabmon env``.

    ``at_start`` is the environment before the process changed it (by default, as it was
    when stabmon was imported, where ``env`` is this process's own).
    """
    if at_start is None:
        at_start = _AT_IMPORT if env is os.environ else env
    return {
        "versions": dict(versions),
        "driver_version": driver,
        "hostname": socket.gethostname(),
        "platform": _platform(),
        "python_executable": sys.executable,
        "cpu_count": os.cpu_count() or 0,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "gpus": [dict(gpu) for gpu in gpus],
        "variables": relevant_variables(env),
        "set_in_process": set_in_process(env, at_start),
    }


def describe_environment(
    build: Mapping[str, str], devices: Sequence[torch.device], guard: Guard
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The attach record's environment, and the labels of the physical GPUs in use.

    Identifying the GPUs may fail (a driver that answers nothing); that failure is
    contained and the record is written without them.
    """
    gpus: list[dict[str, str]] = []
    driver = ""
    with guard.contain("hooks"):
        if devices:
            driver, identities = identify_gpus(devices)
            gpus = [{**identity.labels(), "driver_version": driver} for identity in identities]
    return environment_record(build, gpus, driver, os.environ), gpus


def format_environment(record: Mapping[str, Any]) -> str:
    """``stabmon env``'s table: the environment record, for a person."""
    lines = ["Versions"]
    lines += [f"  {name:<16} {value or '-'}" for name, value in record["versions"].items()]
    lines.append(f"  {'driver_version':<16} {record['driver_version'] or '- (no NVML driver)'}")
    lines += [
        "Host",
        f"  {'hostname':<16} {record['hostname']}",
        f"  {'platform':<16} {record['platform']}",
        f"  {'python':<16} {record['python_executable']}",
        f"  {'cpus':<16} {record['cpu_count']} (torch threads {record['torch_threads']})",
        "CUDA",
    ]
    visible = record["cuda_visible_devices"]
    shown = "unset" if visible is None else repr(visible)
    if record["cuda_available"]:
        lines.append(f"  {record['cuda_device_count']} device(s); CUDA_VISIBLE_DEVICES {shown}")
    else:
        lines.append(f"  not available; CUDA_VISIBLE_DEVICES {shown}")
    if record["gpus"]:
        columns = ("device", "gpu", "uuid", "pci_bus_id", "name")
        rows = [columns, *[tuple(gpu.get(c, "") or "-" for c in columns) for gpu in record["gpus"]]]
        widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                  for row in rows]  # fmt: skip
    lines.append("Variables")
    variables = record["variables"]
    inside = set(record.get("set_in_process") or ())
    lines += [
        f"  {name}={value}" + ("  (set inside the process, by torch or stabmon)" * (name in inside))
        for name, value in variables.items()
    ] or ["  (none set)"]
    return "\n".join(lines)


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
