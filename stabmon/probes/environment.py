"""Who this process is (rank, run id) and what it runs on (versions)."""

from __future__ import annotations

import functools
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

__all__ = [
    "ProcessIdentity",
    "build_info",
    "default_run_id",
    "environment_record",
    "format_environment",
    "process_identity",
    "relevant_variables",
]

#: Environment variables that change how a run behaves (threads, NCCL, allocator, launch).
_PREFIXES = ("TORCH", "PYTORCH_", "NCCL_", "CUDA_", "CUBLAS_", "CUDNN_", "NVIDIA_", "OMP_", "MKL_")
_NAMES = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
     "GROUP_RANK", "ROLE_RANK", "NODE_RANK"}
)  # fmt: skip
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
    """A run id shared by every rank of a torchrun job, else one stable for this process."""
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        return elastic
    return _process_run_id()


@functools.cache
def _process_run_id() -> str:
    # Cached: two monitors in one process are one run, and the id must not change mid-run.
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{socket.gethostname()}-{stamp}-{os.getpid()}"


def build_info(stabmon_version: str) -> dict[str, str]:
    """Label values of ``stabmon_build_info``; empty where not applicable."""
    cudnn_backend: Any = torch.backends.cudnn  # unannotated in torch
    cudnn = cudnn_backend.version() if cudnn_backend.is_available() else None
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


def environment_record(
    versions: Mapping[str, str],
    gpus: Sequence[Mapping[str, str]],
    driver: str,
    env: Mapping[str, str],
) -> dict[str, Any]:
    """Everything two runs need to be compared: the event log's first line, ``stabmon env``."""
    return {
        "versions": dict(versions),
        "driver_version": driver,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python_executable": sys.executable,
        "cpu_count": os.cpu_count() or 0,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "gpus": [dict(gpu) for gpu in gpus],
        "variables": relevant_variables(env),
    }


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
    lines += [f"  {name}={value}" for name, value in variables.items()] or ["  (none set)"]
    return "\n".join(lines)


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
