"""Which physical GPUs a process uses: ``CUDA_VISIBLE_DEVICES`` resolved (torch's view of
them is :func:`stabmon.probes.identity.torch_device_uuids`; this module never imports torch).

A training process declares the physical GPUs it uses (``ProcessRecord.gpu_uuids``)
so the node daemon can tell when it holds memory on one it did not declare.
UUIDs are the common language: ``cuda:0`` names a different physical GPU in
every process, a UUID names the same one everywhere. Nothing here calls NVML.

``CUDA_VISIBLE_DEVICES`` as documented by NVIDIA (CUDA Programming Guide,
"CUDA Environment Variables", 5.2.1.1,
https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/environment-variables.html):

- unset: every GPU is visible; set to an empty string: none is;
- a comma-separated sequence of integer indices (``2,1``), GPU UUIDs as
  ``nvidia-smi -L`` prints them (``GPU-8932f937-d72c-4106-c12f-20bd9faed9f6``, or
  any prefix of one that is unique on the machine, ``GPU-8932f937``), or MIG
  instances (``MIG-<GPU-UUID>/<GPU instance ID>/<compute instance ID>``, and
  the ``MIG-<uuid>`` form of current drivers);
- devices are enumerated in the order of the sequence, and "if an invalid index
  is encountered, only devices with indices that appear before the invalid
  index in the list are visible": ``0,2,-1,1`` makes devices 0 and 2 visible.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the daemon parses CUDA_VISIBLE_DEVICES here and runs without torch
    pass

__all__ = ["UUID_PREFIXES", "PhysicalGpu", "parse_visible_devices", "resolve_visible"]

_INDEX = re.compile(r"[0-9]+")
#: How a UUID starts, in NVML's spelling (lower-cased).
UUID_PREFIXES = ("gpu-", "mig-")
_LEGACY_MIG_PREFIX = "mig-gpu-"


@dataclass(frozen=True)
class PhysicalGpu:
    """One physical GPU as NVML lists it: index, UUID and the UUIDs of its MIG instances."""

    index: int
    #: ``GPU-...``, as NVML and ``nvidia-smi -L`` spell it.
    uuid: str
    #: ``MIG-...`` UUIDs of the MIG instances on this GPU (empty without MIG).
    mig_uuids: tuple[str, ...] = ()


def parse_visible_devices(value: str | None) -> list[str] | None:
    """The identifiers in a ``CUDA_VISIBLE_DEVICES`` value, up to the first invalid one.

    >>> parse_visible_devices(None) is None  # unset: every device is visible
    True
    >>> parse_visible_devices("")
    []
    >>> parse_visible_devices(" 0, 2 ,-1,1")
    ['0', '2']

    A token is valid when it is a non-negative integer or starts with ``GPU-`` or
    ``MIG-`` (any case); CUDA ignores everything from the first invalid token on,
    and so does this function. Whether an index or UUID names a device on this
    machine is :func:`resolve_visible`'s question.
    """
    if value is None:
        return None
    if not value.strip():
        return []
    tokens: list[str] = []
    for raw in value.split(","):
        token = raw.strip()
        if not _is_identifier(token):
            break
        tokens.append(token)
    return tokens


def resolve_visible(value: str | None, physical: Sequence[PhysicalGpu]) -> list[str]:
    """The physical UUIDs a process with ``CUDA_VISIBLE_DEVICES=value`` sees, ``cuda:0`` first.

    >>> gpus = [PhysicalGpu(0, "GPU-aa11"), PhysicalGpu(1, "GPU-bb22")]
    >>> resolve_visible("1,GPU-AA", gpus)
    ['GPU-bb22', 'GPU-aa11']

    - an index names the GPU with that NVML index;
    - a UUID matches by unique prefix, case-insensitively, as CUDA allows; the
      result is NVML's spelling;
    - ``MIG-<uuid>`` resolves to the known MIG instance it prefixes, or stays as
      written when this node's list does not name it (it is already a UUID);
    - the legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` resolves to a MIG instance listed
      under exactly that name (drivers of that era), else to its parent GPU's
      UUID: a GPU instance and compute instance ID name no UUID, and placement
      counts a MIG instance as its parent GPU anyway;
    - an index or UUID that names no GPU here (or more than one) is invalid, and
      like CUDA the list stops there.

    Unset means every GPU, in index order.
    """
    ordered = sorted(physical, key=lambda gpu: gpu.index)
    tokens = parse_visible_devices(value)
    if tokens is None:
        return [gpu.uuid for gpu in ordered]
    resolved: list[str] = []
    for token in tokens:
        uuid = _resolve_token(token, ordered)
        if uuid is None:
            break
        resolved.append(uuid)
    return resolved


def _is_identifier(token: str) -> bool:
    if _INDEX.fullmatch(token):
        return True
    return token[:4].lower() in UUID_PREFIXES and len(token) > 4


def _resolve_token(token: str, physical: Sequence[PhysicalGpu]) -> str | None:
    if _INDEX.fullmatch(token):
        index = int(token)
        return next((gpu.uuid for gpu in physical if gpu.index == index), None)
    instances = [uuid for gpu in physical for uuid in gpu.mig_uuids]
    lowered = token.lower()
    if lowered.startswith(_LEGACY_MIG_PREFIX):
        exact = [uuid for uuid in instances if uuid.lower() == lowered]
        if exact:
            return exact[0]
        parent = lowered[len("mig-") :].split("/", 1)[0]
        return _unique_prefix(parent, [gpu.uuid for gpu in physical])
    if lowered.startswith("mig-"):
        return _unique_prefix(lowered, instances) or token
    return _unique_prefix(lowered, [gpu.uuid for gpu in physical])


def _unique_prefix(prefix: str, uuids: Sequence[str]) -> str | None:
    matches = [uuid for uuid in uuids if uuid.lower().startswith(prefix)]
    return matches[0] if len(matches) == 1 else None
