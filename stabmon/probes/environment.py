"""Who this process is (rank, run id) and what it runs on (versions)."""

from __future__ import annotations

import functools
import os
import platform
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ProcessIdentity", "build_info", "default_run_id", "process_identity"]


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


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
