"""The NVML seam: the only module in stabmon that imports ``pynvml``.

Everything the daemon knows about GPUs comes through :class:`NvmlReader`, in
SI units and plain Python types: NVML's percent, milliwatts, megahertz and
clock-event bitmasks stop here, converted by the pure helpers below
(:func:`to_ratio`, :func:`mw_to_watts`, :func:`mhz_to_hertz`,
:func:`throttle_reason_names`) that the test double in
``tests/daemon/fake_nvml.py`` uses too.

Errors: each field of a reading fails on its own. A field the GPU does not
support is ``None``; a field whose call fails otherwise (no permission, not
found, unknown) is ``None`` too and its :class:`NvmlError` is listed in
:attr:`GpuReading.errors`. Only a GPU that is gone (:attr:`NvmlError.gpu_lost`)
or whose handle cannot be had makes :meth:`NvmlReader.reading` raise. A node
without a driver raises :class:`NvmlUnavailable` from :meth:`NvmlReader.init`.

Design
------
:class:`PynvmlReader` keeps no device handles: it asks NVML for the handle by
index on every call (NVML caches them), so a re-init never leaves a stale one.
Its only state is the XID event set, which the XID thread waits on while the
poll thread may shut NVML down. A lock keeps ``shutdown`` from freeing the set
under a wait; ``shutdown`` waits for it at most ``lock_timeout`` seconds, then
leaves the set alone (the XID thread resets it after its wait fails) and shuts
NVML down regardless, because NVML's init is reference-counted and a skipped
``nvmlShutdown`` would leak a reference into every later re-init.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import pynvml

from stabmon.contract import THROTTLE_REASONS
from stabmon.hardware.gpu_readings import (
    GpuIdentity,
    GpuProcess,
    GpuReading,
    NvmlReader,
    mhz_to_hertz,
    mw_to_watts,
    to_ratio,
)
from stabmon.hardware.nvml_constants import constants_of
from stabmon.shared.log import LogLimiter

__all__ = [
    "GpuIdentity",
    "GpuProcess",
    "GpuReading",
    "NvmlError",
    "NvmlReader",
    "NvmlUnavailable",
    "PynvmlReader",
    "THROTTLE_REASON_BITS",
    "mhz_to_hertz",
    "mw_to_watts",
    "nvml_session",
    "throttle_reason_names",
    "to_ratio",
]

#: NVML's constants as this node's nvidia-ml-py spells them, nvml.h's value for any it lacks.
_NVML = constants_of(pynvml)
_GPU_IS_LOST: int = _NVML.error_gpu_is_lost


class NvmlError(Exception):
    """An NVML call failed; ``call`` names it and ``code`` is NVML's error code when known."""

    def __init__(self, call: str, reason: str, *, code: int | None = None) -> None:
        self.call = call
        self.reason = reason
        self.code = code
        super().__init__(f"{call} failed: {reason}")

    @property
    def gpu_lost(self) -> bool:
        """Whether NVML says the GPU itself is gone (``NVML_ERROR_GPU_IS_LOST``)."""
        return self.code == _GPU_IS_LOST


class NvmlUnavailable(NvmlError):
    """No NVIDIA driver / library: the daemon runs without GPU telemetry."""


# --- clock event reasons ---------------------------------------------------------------------

#: NVML's clock event reason bits, by contract reason name.
THROTTLE_REASON_BITS: Mapping[str, int] = MappingProxyType(dict(_NVML.reasons))
if set(THROTTLE_REASON_BITS) != set(THROTTLE_REASONS):  # not assert: it must survive python -O
    raise RuntimeError("THROTTLE_REASON_BITS and contract.THROTTLE_REASONS disagree")


def throttle_reason_names(bitmask: int) -> frozenset[str]:
    """Contract names of the reasons set in an NVML clock event bitmask; unknown bits ignored."""
    return frozenset(name for name, bit in THROTTLE_REASON_BITS.items() if bitmask & bit)


# --- the real reader ------------------------------------------------------------------------

# A driver too old for a call reports FUNCTION_NOT_FOUND: to us, that field is unsupported too.
_UNSUPPORTED = frozenset({_NVML.error_not_supported, _NVML.error_function_not_found})
_NO_DRIVER = frozenset({_NVML.error_library_not_found, _NVML.error_driver_not_loaded})
_MAX_EVENTS_PER_WAIT = 64


def _call(function: Callable[..., Any], *args: Any) -> Any:
    """Call a pynvml function, turning its errors into :class:`NvmlError` named after the call."""
    try:
        return function(*args)
    except pynvml.NVMLError as error:
        raise NvmlError(function.__name__, str(error), code=error.value) from error
    except pynvml.NVMLLibraryMismatchError as error:  # an unversioned call the driver lacks
        code = _NVML.error_function_not_found
        raise NvmlError(function.__name__, str(error), code=code) from error


def _optional(function: Callable[..., Any], *args: Any) -> Any:
    """Like :func:`_call`, but None when the GPU does not support the call."""
    try:
        return _call(function, *args)
    except NvmlError as error:
        if error.code in _UNSUPPORTED:
            return None
        raise


class _Fields:
    """Reads one GPU's fields independently, collecting the errors of those that fail."""

    def __init__(self) -> None:
        self.errors: list[NvmlError] = []

    def read(self, function: Callable[..., Any], *args: Any) -> Any:
        """The call's result, or None when unsupported or failed; raises when the GPU is lost."""
        try:
            return _optional(function, *args)
        except NvmlError as error:
            if error.gpu_lost:
                raise
            self.errors.append(error)
            return None


def _text(value: object) -> str:
    """Older pynvml releases return bytes where newer ones return str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _map(value: Any, convert: Callable[[Any], Any]) -> Any:
    return None if value is None else convert(value)


def _free_event_set(event_set: Any) -> None:
    if event_set is None:
        return
    try:
        _call(pynvml.nvmlEventSetFree, event_set)
    except NvmlError:
        pass  # NVML cannot free it (GPU lost, NVML gone): the set is unusable either way


class PynvmlReader:
    """:class:`NvmlReader` over the real NVML library.

    Example::

        reader = PynvmlReader()
        reader.init()  # NvmlUnavailable on a node without an NVIDIA driver
        for index in range(reader.device_count()):
            print(reader.identity(index).uuid, reader.reading(index).power_watts)
        reader.shutdown()

    ``limiter`` logs the reader's own problems once each (a GPU left out of XID
    registration, an event set left unfreed); ``lock_timeout`` bounds how long
    ``shutdown`` waits for an XID wait in flight.
    """

    def __init__(self, *, limiter: LogLimiter | None = None, lock_timeout: float = 0.5) -> None:
        self._limiter = limiter if limiter is not None else LogLimiter()
        self._lock_timeout = lock_timeout
        self._events_lock = threading.Lock()
        self._event_set: Any = None

    def init(self) -> None:
        try:
            _call(pynvml.nvmlInit)
        except NvmlError as error:
            if error.code in _NO_DRIVER:
                raise NvmlUnavailable(
                    error.call,
                    f"{error.reason} (no NVIDIA driver on this node: no GPU telemetry)",
                    code=error.code,
                ) from error
            raise

    def shutdown(self) -> None:
        try:
            if self._events_lock.acquire(timeout=self._lock_timeout):
                try:
                    event_set, self._event_set = self._event_set, None
                    _free_event_set(event_set)
                finally:
                    self._events_lock.release()
            else:
                self._limiter.once(
                    "nvml:shutdown:event-set",
                    logging.WARNING,
                    "stabmon daemon: NVML shut down without freeing the XID event set: an XID "
                    "wait still held it after %.1f s",
                    self._lock_timeout,
                )
        finally:
            _call(pynvml.nvmlShutdown)

    def driver_version(self) -> str:
        return _text(_call(pynvml.nvmlSystemGetDriverVersion))

    def device_count(self) -> int:
        return int(_call(pynvml.nvmlDeviceGetCount))

    def identity(self, index: int) -> GpuIdentity:
        handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
        return GpuIdentity(
            index=index,
            uuid=_text(_call(pynvml.nvmlDeviceGetUUID, handle)),
            name=_text(_call(pynvml.nvmlDeviceGetName, handle)),
            pci_bus_id=_text(_call(pynvml.nvmlDeviceGetPciInfo, handle).busId),
        )

    def reading(self, index: int) -> GpuReading:
        handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
        fields = _Fields()
        utilization = fields.read(pynvml.nvmlDeviceGetUtilizationRates, handle)
        memory = fields.read(pynvml.nvmlDeviceGetMemoryInfo, handle)
        temperature = fields.read(pynvml.nvmlDeviceGetTemperature, handle, _NVML.temperature_gpu)
        power = fields.read(pynvml.nvmlDeviceGetPowerUsage, handle)
        clock = fields.read(pynvml.nvmlDeviceGetClockInfo, handle, _NVML.clock_sm)
        reasons = fields.read(self._clock_event_reasons, handle)
        ecc = pynvml.nvmlDeviceGetTotalEccErrors
        lifetime = _NVML.aggregate_ecc  # volatile counts reset with the driver
        corrected = fields.read(ecc, handle, _NVML.memory_error_corrected, lifetime)
        uncorrected = fields.read(ecc, handle, _NVML.memory_error_uncorrected, lifetime)
        return GpuReading(
            utilization_ratio=_map(utilization, lambda u: to_ratio(u.gpu)),
            memory_used_bytes=_map(memory, lambda m: int(m.used)),
            memory_total_bytes=_map(memory, lambda m: int(m.total)),
            temperature_celsius=_map(temperature, float),
            power_watts=_map(power, mw_to_watts),
            sm_clock_hertz=_map(clock, mhz_to_hertz),
            throttle_reasons=_map(reasons, throttle_reason_names),
            ecc_corrected=_map(corrected, int),
            ecc_uncorrected=_map(uncorrected, int),
            errors=tuple(fields.errors),
        )

    def processes(self, index: int) -> list[GpuProcess]:
        handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
        used_by_pid: dict[int, int | None] = {}
        for query in (
            pynvml.nvmlDeviceGetComputeRunningProcesses,
            pynvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            for process in _optional(query, handle) or []:
                pid = int(process.pid)
                used = _map(process.usedGpuMemory, int)  # None where the OS hides it (WDDM)
                known = [b for b in (used_by_pid.get(pid), used) if b is not None]
                # One process in both lists: take the larger figure rather than count twice.
                used_by_pid[pid] = max(known) if known else None
        return [GpuProcess(pid, used) for pid, used in used_by_pid.items()]

    def start_xid_events(self) -> None:
        with self._events_lock:
            if self._event_set is not None:
                return
            event_set = _call(pynvml.nvmlEventSetCreate)
            try:
                self._register_xid(event_set)
            except BaseException:
                _free_event_set(event_set)
                raise
            self._event_set = event_set

    def reset_xid_events(self) -> None:
        with self._events_lock:
            event_set, self._event_set = self._event_set, None
            _free_event_set(event_set)

    def wait_xid(self, timeout_ms: int) -> list[tuple[int, int]]:
        events: list[tuple[int, int]] = []
        with self._events_lock:
            if self._event_set is None:
                raise NvmlError("nvmlEventSetWait", "no event set: call start_xid_events() first")
            while len(events) < _MAX_EVENTS_PER_WAIT:
                try:
                    data = _call(pynvml.nvmlEventSetWait_v2, self._event_set, timeout_ms)
                except NvmlError as error:
                    if error.code == _NVML.error_timeout:
                        return events
                    raise
                if data.eventType & _NVML.event_xid_critical:
                    events.append((self._event_index(data.device), int(data.eventData)))
                timeout_ms = 0  # drain what else is queued, without waiting again
        return events

    def mig_parent_uuid(self, uuid: str) -> str | None:
        if not uuid.startswith("MIG-"):
            return None
        if uuid.startswith("MIG-GPU-"):  # the pre-R470 form names its parent: MIG-GPU-<uuid>/gi/ci
            return uuid[len("MIG-") :].split("/", 1)[0]
        try:
            mig = _call(pynvml.nvmlDeviceGetHandleByUUID, uuid)
            parent = _call(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, mig)
            return _text(_call(pynvml.nvmlDeviceGetUUID, parent))
        except NvmlError:
            return None

    def _register_xid(self, event_set: Any) -> None:
        """Register every GPU that can be; one failing GPU does not cost the others their XIDs."""
        registered = 0
        first_failure: NvmlError | None = None
        for index in range(self.device_count()):
            try:
                handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
                xid = _NVML.event_xid_critical
                _call(pynvml.nvmlDeviceRegisterEvents, handle, xid, event_set)
            except NvmlError as error:
                if error.code in _UNSUPPORTED:
                    continue  # e.g. a GPU in a VM without event support: expected, not logged
                first_failure = first_failure or error
                self._limiter.once(
                    f"nvml:xid:{index}:{error.call}",
                    logging.WARNING,
                    "stabmon daemon: XID errors on GPU %d are not counted: %s",
                    index,
                    error,
                )
                continue
            registered += 1
        if registered == 0:
            raise first_failure or NvmlError(
                "nvmlDeviceRegisterEvents",
                "no GPU on this node supports XID events",
                code=_NVML.error_not_supported,
            )

    @staticmethod
    def _clock_event_reasons(handle: Any) -> Any:
        current = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = None if current is None else _optional(current, handle)
        if reasons is None:  # drivers (and nvidia-ml-py) before 535 know only the older name
            reasons = _optional(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        return reasons

    @staticmethod
    def _event_index(device: Any) -> int:
        try:
            return int(_call(pynvml.nvmlDeviceGetIndex, device))
        except NvmlError:
            return -1  # count the XID under an unknown GPU rather than lose it


@contextmanager
def nvml_session() -> Iterator[Any]:
    """The pynvml module, initialised for the block and shut down after; None without NVML.

    The library side (:mod:`stabmon.probes.identity`) asks NVML two things at attach,
    the driver version and each GPU's NVML index, and holds no NVML handle after.
    """
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml.NVMLError of any kind: no driver library, no GPU
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # shutting down a library that is going away: nothing to do
            pass
