"""A fake CUDA runtime and a sync audit, for proving stabmon's CUDA path on a machine without a GPU.

This is a test double, not a simulator: **no number computed here is real.**

- Tensors on ``cuda`` are :class:`~torch._subclasses.fake_tensor.FakeTensor`\\ s: every
  operator runs on shapes, dtypes and devices only (PyTorch's own meta kernels), so a
  forward, the optimizer's foreach kernels, ``clip_grad_norm_`` and GradScaler's AMP
  kernels all run on ``cuda`` tensors on a CPU-only build.
- :class:`SyncAudit` is that FakeTensorMode with one more duty: before any operator runs,
  it fails the ones that make the host wait for the device, when stabmon's code is on the
  Python stack: ``.item()``, ``bool()``/``if tensor`` and ``.tolist()`` (all reach
  ``aten._local_scalar_dense`` or a blocking copy), blocking device-to-host copies
  (``.cpu()``, ``.to("cpu")``, ``copy_`` into pageable memory, non_blocking or not: CUDA
  stages those through the host synchronously), and operators whose output size depends
  on device data (``nonzero``, boolean indexing, ``unique``, ``equal``). ``torch.cuda``
  functions that wait (``synchronize``, ``Event.synchronize``, ``Stream.synchronize``) are
  stood in for below and fail the same way. FakeTensors route every operator through
  their mode, on whatever thread, so the exporter's and the judge thread's work is
  audited too. Syncs of the user's own making (GradScaler.step's ``found_inf.item()``)
  are allowed: the audit is of stabmon.
- The CUDA runtime pieces stabmon touches are small fakes (:class:`FakeCuda`): events
  (``query()`` completes once :meth:`FakeDevice.catch_up` says the device got past them,
  and copies to the host land only then),
  the current stream, pinned host buffers (``torch.empty(pin_memory=True)`` gives a real
  host tensor, remembered as pinned), allocator statistics and ``is_available()``.
- A fake device has no data, so values it "copies back" into pinned buffers are scripted:
  :attr:`FakeDevice.result` fills each copy (NaN for a non-finite step, a halved value
  for the loss scale of a step GradScaler skips), and :attr:`FakeDevice.found_inf` answers
  GradScaler's own ``found_inf.item()``. Host-side reads of fake host scalars (the
  optimizer's step count) read as 1.
- On a CPU-only build PyTorch has no device guard for CUDA, which autograd asks for the
  moment a CUDA parameter takes part in a graph; :func:`noop_cuda_guard` registers the
  CPU's no-op guard in its place for the duration (and removes it after). The backward
  itself cannot run there: the autograd engine asks the accelerator runtime for the
  current stream, which a CPU build does not have. The audit's loop sets each gradient to
  a fresh CUDA tensor instead; stabmon installs no backward hooks, it reads ``.grad`` at
  the optimizer step, so none of its code is skipped.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

import stabmon

#: Where stabmon's code lives: a sync with one of these files on the stack is stabmon's.
STABMON_DIR = str(Path(stabmon.__file__).resolve().parent) + os.sep

#: Frames left out of a violation's stack: PyTorch's and this module's.
_NOT_SHOWN = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve()))
aten = torch.ops.aten
#: Operators whose only purpose is to hand a device value to the host.
_SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
#: Operators whose output size depends on device data: the host waits to learn it.
_DATA_DEPENDENT = {
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
}  # fmt: skip
#: In-place random fills: a fake tensor has no values to draw (parameter initialisation).
_RANDOM_FILLS = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float}


#: The mark of a host buffer handed out as pinned memory.
_PINNED = "_fake_cuda_pinned"


class SyncViolation(AssertionError):
    """stabmon made the host wait for the device."""


@dataclass
class Violation:
    """One synchronisation inside stabmon: what it was and where."""

    what: str
    thread: str
    stack: list[str]

    def __str__(self) -> str:
        return f"{self.what} on thread {self.thread}, at:\n" + "".join(self.stack)


def _stabmon_stack() -> list[str] | None:
    """The Python stack without torch's and this module's frames, if a frame of stabmon's
    code is on it; None otherwise."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(STABMON_DIR):
            frames = traceback.extract_stack(sys._getframe(2))
            shown = [f for f in frames if not f.filename.startswith(_NOT_SHOWN)]
            return traceback.format_list(shown[-8:])
        frame = frame.f_back  # type: ignore[assignment]
    return None


@dataclass
class FakeDevice:
    """What the fake device 'computes': scripted values and how far it has run."""

    #: Value of every element the device copies back to the host (NaN: a non-finite step).
    result: float = 1.0
    #: GradScaler's found_inf as the device would report it (1.0: this step is skipped).
    found_inf: float = 0.0
    #: Events recorded so far, and how many of them the device has passed.
    recorded: int = 0
    completed: int = 0
    copies: int = 0
    #: Allocator statistics, in bytes.
    allocated: int = 64 * 2**20
    reserved: int = 128 * 2**20
    peak: int = 96 * 2**20

    #: Copies issued and not yet done: (pinned buffer, the value it will hold).
    in_flight: list[tuple[torch.Tensor, float]] = field(default_factory=list)

    def catch_up(self) -> None:
        """The device finishes everything issued so far (it runs about a step behind).

        Copies land only now: until then their buffers hold NaN, so a host that read a
        buffer before its event completed would see a non-finite value it never sent.
        """
        self.completed = self.recorded
        with unset_fake_temporarily():
            for buffer, value in self.in_flight:
                buffer.fill_(value)
        self.in_flight.clear()


class SyncAudit(FakeTensorMode):
    """FakeTensorMode that fails, and records, any host-device synchronisation inside stabmon."""

    def __init__(self, device: FakeDevice) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.device = device
        self.violations: list[Violation] = []
        self.user_syncs = 0
        self._lock = threading.Lock()

    @property
    def avoid_device_init(self) -> bool:  # type: ignore[override]
        # Behave as on a machine without a device even while torch.cuda.is_available() is
        # faked to True: tensors never materialise on a device.
        return True

    def violation(self, what: str) -> None:
        """Record and raise a sync made with stabmon's code on the stack; else count the user's."""
        stack = _stabmon_stack()
        if stack is None:
            self.user_syncs += 1
            return
        found = Violation(what, threading.current_thread().name, stack)
        with self._lock:
            self.violations.append(found)
        raise SyncViolation(str(found))

    @staticmethod
    def is_pinned(tensor: torch.Tensor) -> bool:
        return getattr(tensor, _PINNED, False) is True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS and isinstance(args[0], FakeTensor):
            return args[0]
        if func in (aten.empty.memory_format, aten.empty_strided.default) and kwargs.get(
            "pin_memory"
        ):
            return self._pinned_buffer(func, args, kwargs)
        if func in _SCALAR_READS and _on_cuda(args):
            self.violation(f"{func} (.item(), bool() or a comparison) on a CUDA tensor")
            return self.device.found_inf  # the user's own read: GradScaler.step's found_inf
        if func is aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return 1  # a host scalar of a fake tensor has no value (the optimizer's step count)
        if func in _DATA_DEPENDENT and _on_cuda(args):
            self.violation(f"{func}: its output size waits for device data")
        if func is aten._to_copy.default and _on_cuda(args) and _to_host(kwargs.get("device")):
            if not kwargs.get("non_blocking"):
                self.violation("a blocking device-to-host copy (.cpu(), .to('cpu'), .tolist())")
        if func is aten.copy_.default:
            destination, source = args[0], args[1]
            if _is_cuda(source) and destination.device.type == "cpu":
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                return self._copy_to_host(destination, bool(non_blocking))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pinned_buffer(self, func: Any, args: Any, kwargs: Any) -> torch.Tensor:
        """A real host tensor standing in for pinned memory (a CPU-only build has none)."""
        kwargs = {**kwargs, "pin_memory": False}
        with unset_fake_temporarily():
            buffer: torch.Tensor = func(*args, **kwargs)
        setattr(buffer, _PINNED, True)  # noqa: B010 - a mark on this one tensor object
        return buffer

    def _copy_to_host(self, destination: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        if not non_blocking:
            self.violation("a blocking device-to-host copy_")
        elif not self.is_pinned(destination):
            self.violation("a device-to-host copy_ into pageable memory (CUDA makes it blocking)")
        if isinstance(destination, FakeTensor):
            return destination
        self.device.copies += 1
        with unset_fake_temporarily():
            destination.fill_(math.nan)  # lands at the device's next catch_up()
        self.device.in_flight.append((destination, self.device.result))  # scripted value
        return destination


def _is_cuda(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _on_cuda(args: Any) -> bool:
    return any(_is_cuda(arg) for arg in args)


def _to_host(device: object) -> bool:
    return device is not None and torch.device(device).type == "cpu"  # type: ignore[arg-type]


class FakeEvent:
    """``torch.cuda.Event``: complete once the fake device has passed it."""

    def __init__(self, audit: SyncAudit, enable_timing: bool = False, **_: Any) -> None:
        self._audit = audit
        self._recorded_at: int | None = None

    def record(self, stream: object = None) -> None:
        device = self._audit.device
        device.recorded += 1
        self._recorded_at = device.recorded

    def query(self) -> bool:
        return self._recorded_at is not None and self._recorded_at <= self._audit.device.completed

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time of an event the device has not reached")
        return 0.5 * ((end._recorded_at or 0) - (self._recorded_at or 0))  # scripted ms

    def synchronize(self) -> None:
        self._audit.violation("torch.cuda.Event.synchronize()")

    def wait(self, stream: object = None) -> None:
        """A device-side wait: the host does not wait."""


class FakeStream:
    """``torch.cuda.current_stream()``."""

    def __init__(self, audit: SyncAudit) -> None:
        self._audit = audit

    def synchronize(self) -> None:
        self._audit.violation("torch.cuda.Stream.synchronize()")

    def query(self) -> bool:
        return True

    def wait_event(self, event: object) -> None:
        """A device-side wait: the host does not wait."""


def _no_nvml(device: object = None) -> int:
    raise RuntimeError("the fake CUDA runtime has no NVML (utilization is the daemon's job)")


def _no_properties(device: object = None) -> Any:
    raise RuntimeError("the fake CUDA runtime has no device properties")


#: c10::impl::device_guard_impl_registry and c10::impl::registerDeviceGuard(DeviceType, impl).
_REGISTRY_SYMBOL = "_ZN3c104impl26device_guard_impl_registryE"
_REGISTER_SYMBOL = (
    "_ZN3c104impl19registerDeviceGuardENS_10DeviceTypeEPKNS0_24DeviceGuardImplInterfaceE"
)


@contextlib.contextmanager
def noop_cuda_guard() -> Iterator[None]:
    """On a CPU-only build, register the CPU's no-op device guard for CUDA while inside.

    Autograd asks the device guard of a parameter's device for its stream when the
    parameter first takes part in a graph; a CPU-only build has none for CUDA, and the
    C++ error it raises there ends the process. c10 exports the registry and its setter;
    where it does not (another PyTorch), the test skips with the reason. A CUDA build has
    its own guard, left alone.
    """
    library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    try:
        registry = (ctypes.c_void_p * 2).in_dll(library, _REGISTRY_SYMBOL)
        register = getattr(library, _REGISTER_SYMBOL)
    except (AttributeError, ValueError) as error:
        pytest.skip(f"Requires: c10's device guard registry, to stand in for CUDA's ({error})")
    if registry[1]:  # a CUDA build: the real guard is there
        yield
        return
    register.argtypes, register.restype = [ctypes.c_int8, ctypes.c_void_p], None
    register(1, registry[0])  # DeviceType::CUDA gets DeviceType::CPU's no-op guard
    try:
        yield
    finally:
        register(1, None)


@dataclass
class FakeCuda:
    """The installed fake runtime: the audit (a FakeTensorMode) and the device behind it."""

    audit: SyncAudit
    device: FakeDevice = field(init=False)

    def __post_init__(self) -> None:
        self.device = self.audit.device

    def assert_clean(self) -> None:
        """Fail with every synchronisation stabmon made, each with its stack."""
        if self.audit.violations:
            listed = "\n\n".join(str(v) for v in self.audit.violations)
            raise SyncViolation(
                f"stabmon made the host wait for the device {len(self.audit.violations)} "
                f"time(s):\n\n{listed}"
            )

    def stand_in_backward(self, parameters: Any) -> None:
        """Give every trainable parameter a fresh CUDA gradient (see the module docstring)."""
        for param in parameters:
            if param.requires_grad:
                param.grad = torch.empty_like(param)


@contextlib.contextmanager
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """Install the fake CUDA runtime and enter the audit; everything is undone on exit."""
    audit = SyncAudit(FakeDevice())
    device = audit.device

    def synchronize(device_: object = None) -> None:
        audit.violation("torch.cuda.synchronize()")

    def reset_peak(device_: object = None) -> None:
        device.peak = device.allocated

    if torch.version.cuda is not None and torch.cuda.is_available():
        # A CUDA build on a GPU machine: its lazy initialisations (CUDA's and cuDNN's, which
        # ask for the device's properties) run now, on the real runtime, not against the fakes.
        torch.cuda.init()
        torch.backends.cudnn.version()  # type: ignore[no-untyped-call]  # unannotated in torch
    stream = FakeStream(audit)
    replacements: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "Event": lambda enable_timing=False, **kw: FakeEvent(audit, enable_timing, **kw),
        "current_stream": lambda device_=None: stream,
        "synchronize": synchronize,
        "memory_allocated": lambda device_=None: device.allocated,
        "memory_reserved": lambda device_=None: device.reserved,
        "max_memory_allocated": lambda device_=None: device.peak,
        "reset_peak_memory_stats": reset_peak,
        "utilization": _no_nvml,
        "get_device_properties": _no_properties,
    }
    for name, replacement in replacements.items():
        monkeypatch.setattr(torch.cuda, name, replacement)
    with noop_cuda_guard(), audit:
        yield FakeCuda(audit)
