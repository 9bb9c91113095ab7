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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stabmon.probes.devices import torch_device_uuids

__all__ = ["DeviceIdentity", "cuda_identities", "driver_version", "local_rank_problem"]


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
    nvml = _nvml() if nvml is None else nvml
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
    nvml = _nvml() if nvml is None else nvml
    if nvml is None:
        return ""
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


def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # not installed, no driver library, no GPU
        return None
    return pynvml


def _nvml_index(nvml: Any, uuid: str) -> str:
    if nvml is None or not uuid:
        return ""
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())  # bytes: older bindings want them
        return str(int(nvml.nvmlDeviceGetIndex(handle)))
    except Exception:  # a MIG instance, or NVML failing: the index stays unknown
        return ""
