"""Which physical GPU each CUDA device of this process is, and the driver it runs on.

``cuda:1`` names a device among those ``CUDA_VISIBLE_DEVICES`` leaves visible, in
CUDA's order, which need not be ``nvidia-smi``'s. What a person needs on a
dashboard is the physical GPU: its UUID, its NVML index (``nvidia-smi -i``) and
its PCI bus id. CUDA reports the UUID and the PCI location of each device it
sees, after the remapping; NVML, when the driver library is there, turns the
UUID into the NVML index and says the driver version. Everything here runs once,
at attach, and answers with empty strings rather than raise.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from stabmon.hardware.devices import UUID_PREFIXES

__all__ = [
    "DeviceIdentity",
    "cuda_identities",
    "driver_version",
    "identify_gpus",
    "local_rank_problem",
    "torch_device_uuids",
]


@dataclass(frozen=True)
class DeviceIdentity:
    """One CUDA device of this process, as a physical GPU."""

    device: str
    uuid: str
    name: str
    pci_bus_id: str
    #: NVML's index (what ``nvidia-smi -i`` takes); empty without NVML.
    gpu: str

    def labels(self) -> dict[str, str]:
        return {
            "device": self.device,
            "uuid": self.uuid.lower(),
            "gpu": self.gpu,
            "pci_bus_id": self.pci_bus_id,
            "name": self.name,
        }


def cuda_identities(devices: Iterable[torch.device], nvml: Any = None) -> list[DeviceIdentity]:
    """The physical identity of each CUDA device among ``devices`` (none without CUDA).

    ``nvml`` is the ``pynvml`` module, or None to import it here (absent: no NVML index).
    """
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    if not cuda or not torch.cuda.is_available():
        return []
    if nvml is None:
        with _nvml_session() as session:
            return _identities(cuda, session)
    return _identities(cuda, nvml)


def _identities(cuda: list[int], nvml: Any) -> list[DeviceIdentity]:
    identities = []
    for index in cuda:
        try:
            properties = torch.cuda.get_device_properties(index)
        except (AssertionError, RuntimeError):
            continue
        uuids = torch_device_uuids([torch.device("cuda", index)])
        uuid = uuids[0] if uuids else ""
        identities.append(
            DeviceIdentity(
                device=f"cuda:{index}",
                uuid=uuid,
                name=str(getattr(properties, "name", "")),
                pci_bus_id=pci_bus_id(properties),
                gpu=_nvml_index(nvml, uuid),
            )
        )
    return identities


def torch_device_uuids(devices: Iterable[torch.device]) -> list[str]:
    """UUIDs (``GPU-<uuid>``) of the CUDA devices among ``devices``, as CUDA reports them.

    This is what the library declares in its registration record: it asks the
    CUDA runtime through torch (``torch.cuda.get_device_properties(i).uuid``),
    needs no NVML and already accounts for ``CUDA_VISIBLE_DEVICES``. Non-CUDA
    devices are skipped; without CUDA the answer is ``[]``. It never raises: a
    device whose properties cannot be read is left out. On a MIG instance CUDA
    reports the instance's UUID, which NVML spells ``MIG-<uuid>``; the daemon's
    placement check knows this.

    >>> import torch
    >>> torch_device_uuids([torch.device("cpu")])
    []
    """
    cuda = [device for device in devices if device.type == "cuda"]
    if not cuda or not torch.cuda.is_available():
        return []
    uuids: list[str] = []
    for device in cuda:
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            raw = str(torch.cuda.get_device_properties(index).uuid)
        # AssertionError: torch built without CUDA; RuntimeError: driver error or bad ordinal.
        except (AssertionError, RuntimeError, ValueError, AttributeError):
            continue
        uuid = raw if raw[:4].lower() in UUID_PREFIXES else f"GPU-{raw}"
        if uuid not in uuids:
            uuids.append(uuid)
    return uuids


def identify_gpus(devices: Iterable[torch.device]) -> tuple[str, list[DeviceIdentity]]:
    """The driver version and the identity of each CUDA device, over one NVML session.

    NVML is initialised once and shut down after (the library holds no NVML handle
    while training runs).
    """
    with _nvml_session() as nvml:
        driver = driver_version(nvml) if nvml is not None else ""
        cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        if not cuda or not torch.cuda.is_available():
            return driver, []
        return driver, _identities(cuda, nvml)


def pci_bus_id(properties: Any) -> str:
    """NVML's spelling of a device's PCI location (``00000000:18:00.0``) from CUDA's fields."""
    try:
        domain = int(properties.pci_domain_id)
        bus = int(properties.pci_bus_id)
        device = int(properties.pci_device_id)
    except (AttributeError, TypeError, ValueError):
        return ""
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def driver_version(nvml: Any = None) -> str:
    """The NVIDIA driver's version from NVML; empty without a driver."""
    if nvml is None:
        with _nvml_session() as session:
            return driver_version(session) if session is not None else ""
    try:
        value = nvml.nvmlSystemGetDriverVersion()
    except Exception:  # NVMLError of any kind: no driver, no permission
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def local_rank_problem(env: Mapping[str, str], device_count: int) -> str | None:
    """Why ``cuda:LOCAL_RANK`` cannot exist here, in words a person can act on; else None.

    The classic: torchrun starts 8 ranks on a node where ``CUDA_VISIBLE_DEVICES``
    leaves 4 GPUs visible, and ``torch.cuda.set_device(local_rank)`` fails deep in
    PyTorch with "invalid device ordinal".
    """
    raw = env.get("LOCAL_RANK")
    if raw is None or not raw.isdigit() or device_count <= 0:
        return None
    local_rank = int(raw)
    if local_rank < device_count:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    shown = (
        f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    )
    return (
        f"LOCAL_RANK={local_rank} but this process sees {device_count} CUDA device(s), "
        f"cuda:0 to cuda:{device_count - 1} ({shown}): cuda:{local_rank} does not exist. "
        "Start fewer ranks per node, or make more GPUs visible to each"
    )


@contextmanager
def _nvml_session() -> Iterator[Any]:
    """pynvml, initialised for the block and shut down after; None where NVML cannot start.

    :mod:`stabmon.hardware.nvml` is the one module that imports pynvml; without the
    package installed there is no NVML index and no driver version, nothing worse.
    """
    try:
        from stabmon.hardware.nvml import nvml_session
    except ImportError:  # pynvml not installed
        yield None
        return
    with nvml_session() as nvml:
        yield nvml


def _nvml_index(nvml: Any, uuid: str) -> str:
    if nvml is None or not uuid:
        return ""
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())  # bytes: older bindings want them
        return str(int(nvml.nvmlDeviceGetIndex(handle)))
    except Exception:  # a MIG instance, or NVML failing: the index stays unknown
        return ""
