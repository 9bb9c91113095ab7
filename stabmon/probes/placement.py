"""Where tensors live: the model's parameters, buffers and optimizer state, and each input.

Two checks, both on tensor metadata only (``tensor.device`` is a field, never a
synchronisation):

- At attach, :func:`audit` finds parameters split over devices, buffers away
  from the parameters, and optimizer state on another device than its
  parameter: the classic after ``optimizer.load_state_dict`` of a checkpoint
  saved on another device, which fails only at the first ``step()``, or never
  and runs slowly on the CPU.
- At each training forward, :class:`InputCheck` walks the arguments (tuples,
  lists, dicts, dataclasses, bounded in depth and count) and names each tensor
  on another device than the model's parameters, with its path
  (``args[0]['image']``), before PyTorch fails deep inside the first layer with a
  message that names neither.

CPU scalars (0-dim tensors) mix with CUDA tensors legitimately and are never
reported. Inputs are not checked for a model whose parameters are all on the
``meta`` device (deferred initialisation) or split over devices (pipeline
parallelism; set ``device_check: off`` when that is on purpose).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stabmon.errors import DeviceMismatchError

__all__ = ["InputCheck", "Misplaced", "PlacementWatch", "audit", "model_device"]

#: How deep an input walk goes, and how many tensors it looks at: a forward stays cheap.
MAX_DEPTH = 4
MAX_TENSORS = 64
#: How many names a finding lists before "and N more".
MAX_NAMES = 5


@dataclass(frozen=True)
class Misplaced:
    """One finding: what is where, and where it should be."""

    what: str
    device: str
    expected: str
    names: tuple[str, ...] = ()

    def message(self) -> str:
        listed = ", ".join(self.names[:MAX_NAMES])
        more = len(self.names) - MAX_NAMES
        if more > 0:
            listed += f" and {more} more"
        return f"{self.what} on {self.device}, expected {self.expected}" + (
            f": {listed}" if listed else ""
        )


def model_device(named_params: Sequence[tuple[str, torch.Tensor]]) -> torch.device | None:
    """The one device of the parameters; None when split over devices, on meta, or none."""
    devices = {param.device for _, param in named_params}
    if len(devices) != 1:
        return None
    (device,) = devices
    return None if device.type == "meta" else device


def audit(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Misplaced]:
    """Parameters split over devices, stray buffers and optimizer state on the wrong device."""
    named = list(model.named_parameters())
    names_of = {id(param): name for name, param in named}
    findings: list[Misplaced] = []
    by_device: dict[str, list[str]] = {}
    for name, param in named:
        by_device.setdefault(str(param.device), []).append(name)
    if len(by_device) > 1:
        majority = max(by_device, key=lambda device: len(by_device[device]))
        for device, names in by_device.items():
            if device != majority:
                findings.append(
                    Misplaced("parameters split over devices", device, majority, tuple(names))
                )
    expected = model_device(named)
    if expected is not None:
        stray = [name for name, buffer in model.named_buffers() if _misplaced(buffer, expected)]
        if stray:
            device = str(dict(model.named_buffers())[stray[0]].device)
            findings.append(Misplaced("buffers", device, str(expected), tuple(stray)))
    wrong_state: dict[tuple[str, str], list[str]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and _misplaced(value, param.device):
                    name = names_of.get(id(param), f"param@{id(param):x}")
                    where = (str(value.device), str(param.device))
                    wrong_state.setdefault(where, []).append(f"{name}[{key!r}]")
    for (device, expected_device), names in wrong_state.items():
        findings.append(
            Misplaced(
                "optimizer state", device, f"{expected_device} (its parameter's)", tuple(names)
            )  # fmt: skip
        )
    return findings


class InputCheck:
    """Finds forward arguments on another device than the model's parameters.

    The expected device is read from one parameter at each check, so a model moved
    after attach (``model.to("cuda")``) is followed; a model whose parameters were
    split over devices at attach is not checked.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        single = model_device(named_params) is not None
        self._anchor = named_params[0][1] if single and named_params else None

    def check(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[Misplaced]:
        """Every misplaced tensor among ``args`` and ``kwargs`` (metadata only, no sync)."""
        anchor = self._anchor
        if anchor is None or anchor.is_meta:  # a flag; `device.type` formats a string per read
            return []
        expected = anchor.device  # a new device object per read: read it once
        if not kwargs:
            # The usual call, tensors on the model's device: no tree to walk per step. A loop,
            # not all() over a generator: this runs at every forward.
            for value in args:
                if not (isinstance(value, torch.Tensor) and value.device == expected):
                    break
            else:
                return []
        found: list[Misplaced] = []
        for path, tensor in _tensors(args, kwargs):
            if _misplaced(tensor, expected):
                found.append(Misplaced(f"input {path}", str(tensor.device), str(expected)))
        return found


class PlacementWatch:
    """Runs the checks for one Monitor and reports each distinct finding once.

    ``mode`` is the config's ``device_check``: ``"warn"`` hands findings to
    ``report`` (which logs and counts them), ``"raise"`` raises
    :class:`~stabmon.errors.DeviceMismatchError` instead.
    """

    #: Distinct findings remembered (so one misplaced input is not reported every step).
    MAX_SEEN = 64

    def __init__(
        self,
        mode: str,
        named_params: Sequence[tuple[str, torch.Tensor]],
        report: Callable[[Misplaced], None],
    ) -> None:
        self.mode = mode
        #: ``misplaced_inputs(args, kwargs)``: the misplaced tensors among a forward's
        #: arguments, for :meth:`report_inputs`. The check itself rather than a method that
        #: calls it: it runs at every forward.
        self.misplaced_inputs = InputCheck(named_params).check
        self._report = report
        self._seen: set[tuple[str, str, str]] = set()

    def audit(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for finding in audit(model, optimizer):
            self._found(finding)

    def report_inputs(self, findings: Iterable[Misplaced]) -> None:
        """Report findings of :attr:`misplaced_inputs` (or raise, in raise mode)."""
        for finding in findings:
            self._found(finding)

    def _found(self, finding: Misplaced) -> None:
        if self.mode == "raise":
            raise DeviceMismatchError(f"{finding.message()}{_hint(finding)}")
        key = (finding.what, finding.device, finding.expected)
        if key in self._seen:
            return
        if len(self._seen) < self.MAX_SEEN:
            self._seen.add(key)
        self._report(finding)


def _hint(finding: Misplaced) -> str:
    if finding.what.startswith("input"):
        return f"; move it with .to({finding.expected!r}) before calling the model"
    if finding.what == "optimizer state":
        return (
            "; create the optimizer after moving the model, or load its state after the move "
            "(Optimizer.load_state_dict casts state to each parameter's device)"
        )
    return "; move the whole model with model.to(device), or set device_check: off on purpose"


def _misplaced(tensor: torch.Tensor, expected: torch.device) -> bool:
    device = tensor.device
    if device == expected:
        return False
    if device.type == "cpu" and tensor.dim() == 0:
        return False  # CPU scalars combine with tensors on any device
    if device.type == expected.type and (device.index is None or expected.index is None):
        return False  # "cuda" and "cuda:0" name the same device under set_device
    return True


def _tensors(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    budget = [MAX_TENSORS]
    for index, value in enumerate(args):
        yield from _walk(value, f"args[{index}]", MAX_DEPTH, budget)
    for key, value in kwargs.items():
        yield from _walk(value, str(key), MAX_DEPTH, budget)


def _walk(
    value: Any, path: str, depth: int, budget: list[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    if budget[0] <= 0:
        return
    if isinstance(value, torch.Tensor):
        budget[0] -= 1
        yield path, value
        return
    if depth == 0 or isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return
    if isinstance(value, Mapping):
        for key, item in list(value.items())[:MAX_TENSORS]:
            yield from _walk(item, f"{path}[{key!r}]", depth - 1, budget)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value[:MAX_TENSORS]):
            yield from _walk(item, f"{path}[{index}]", depth - 1, budget)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _walk(getattr(value, field.name), f"{path}.{field.name}", depth - 1, budget)
