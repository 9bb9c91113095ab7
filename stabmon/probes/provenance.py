"""NaN provenance: which module produced the first non-finite value, and which only passed
it on.

After one step, every parameter upstream of a fault is non-finite too, so the gradient
norms alone cannot tell the producer from the propagators. Disarmed, this costs nothing:
the step hooks do not call it (``measuring`` is False).
When a non-finite gradient or loss is judged at step K, it arms (at the next optimizer
step, or the end of an iteration GradScaler skipped: the training thread) a forward hook
on every module for ``provenance_steps`` training steps. Each hook records on the device,
without a sync, whether the module's inputs and its output are all finite; the flags of a
step go back with the Monitor's other results (the device-side port of
:mod:`stabmon.extension`) and are judged a step later:

- **forward producer**: the first module, in completion order, whose inputs are finite
  and whose output is not (a ``log`` of zero, an overflow); its **propagators** are the
  modules after it whose inputs were already non-finite. A non-finite model input is
  named as the batch itself (``<input>``).
- **backward**: every forward was finite, yet the step's gradients are not: the NaN arose
  in the backward pass, at or just after the module whose parameters are the last, in
  model order, with non-finite gradients (gradients flow from the output back).
- **not reproduced**: every watched step was finite: a transient (that batch, the
  hardware); the event says which step to look at.

The verdict is one ``provenance`` event and one log line. ``provenance_always`` watches
from the first step, for a debugging session.
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from stabmon.extension import Context, GradSummary

__all__ = ["MAX_WATCHED_CALLS", "NanProvenance", "forward_producer"]

#: Module calls watched per step at most (a model of thousands of modules, or a loop that
#: never steps): the flags of the first ones are kept.
MAX_WATCHED_CALLS = 4096
#: Propagators a verdict names at most.
MAX_PROPAGATORS = 5
#: The producer's name when the model's own input was already non-finite.
INPUT = "<input>"


class NanProvenance:
    """Plug-in: arms module hooks after a non-finite value and names the producer."""

    component = "grads"
    measure_at = "before_step"

    def __init__(self, context: Context) -> None:
        config = context.config
        self._context = context
        self._steps: int = config.provenance_steps
        self._always: bool = config.provenance_always
        self._trigger: int | None = None  # the step whose non-finite value armed the watch
        self._unwatch: Any = None
        self._left = 0  # watched steps still to measure
        self._calls: list[str] = []
        self._flags: list[torch.Tensor] = []
        # This step's tensors already judged (a module's input is the output before it):
        # id -> (the tensor, weakly, its flag); cleared at each measure.
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._waiting: dict[int, list[str]] = {}  # measured steps' module names, by step
        self._verdicts: list[tuple[int, str | None, list[str]]] = []
        self._measured = 0  # watched steps measured for the trigger under way
        self._backward: str | None = None  # where the gradients went non-finite, if they did
        self._arm_pending = self._always  # set under the judging lock, read by measure()
        # Explained: no new watch until a finite value is judged (one verdict per episode).
        self._explained = False

    @property
    def measuring(self) -> bool:
        """Whether :meth:`measure` has work at a step: a watch asked for or under way. Read by
        the Monitor after each judged value and measurement; disarmed, no call a step."""
        return self._arm_pending or self._unwatch is not None

    # --- judged values (under the judging lock) -----------------------------------------

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        if not summary.nonfinite:
            self._explained = False
            return
        if step in self._waiting:  # a watched step: its forward flags come next
            self._backward = self._backward or _last_nonfinite_module(summary)
        self._arm(step)

    def loss_judged(self, step: int, value: float) -> None:
        if math.isfinite(value):
            self._explained = False
        else:
            self._arm(step)

    def _arm(self, step: int) -> None:
        if self._trigger is not None or self._explained or not (self._steps or self._always):
            return
        self._trigger = step
        if not self._always:
            self._measured = 0
            self._arm_pending = True  # the next measure() arms it, on the training thread

    # --- the training thread ------------------------------------------------------------

    def _start_watching(self) -> None:
        self._arm_pending = False
        if self._unwatch is None:
            self._unwatch = self._context.watch_modules(self._forward)
            self._left = self._steps if not self._always else sys.maxsize

    def _forward(self, name: str, inputs: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or len(self._calls) >= MAX_WATCHED_CALLS:
            return  # evaluation is no training step; past the bound, the first calls decide
        finite_out = _all_finite(output, self._seen)
        if finite_out is None:
            return
        finite_in = _all_finite(inputs, self._seen)  # mostly outputs judged already
        self._calls.append(name)
        self._flags += (finite_out if finite_in is None else finite_in, finite_out)

    def measure(self, step: int) -> torch.Tensor | None:
        if self._arm_pending:
            self._start_watching()  # from the next iteration's forward on
            self._calls, self._flags = [], []
            self._seen.clear()
            return None
        if not self._calls:
            return None
        device = self._flags[0].device
        packed = torch.stack([flag.to(device, non_blocking=True) for flag in self._flags])
        self._waiting[step] = self._calls
        self._calls, self._flags = [], []
        self._seen.clear()
        self._measured += 1
        self._left -= 1
        if self._left <= 0 and self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        return packed.to(torch.float32)

    def detach(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    # --- the verdict (under the judging lock) -------------------------------------------

    def judge(self, step: int, values: list[float]) -> None:
        names = self._waiting.pop(step, None)
        if names is None:
            return
        producer, propagators = forward_producer(names, values)
        if self._always:  # every step watched: a verdict for each episode's first producer
            if producer is not None and not self._explained:
                self._verdicts = [(step, producer, propagators)]
                self._report()
            return
        if self._trigger is None:
            return
        self._verdicts.append((step, producer, propagators))
        if producer is not None or len(self._verdicts) >= max(self._measured, self._steps):
            self._report()

    def _report(self) -> None:
        verdicts, self._verdicts = self._verdicts, []
        found = next(((st, p, props) for st, p, props in verdicts if p is not None), None)
        trigger = self._trigger if self._trigger is not None else verdicts[0][0]
        watched = [step for step, _, _ in verdicts]
        context = self._context
        producer: str | None
        if found is not None and found[1] is not None:
            step, producer, propagators = found[0], found[1], found[2]
            direction: str | None = "forward"
            message = _forward_message(trigger, step, found[1], propagators)
        elif self._backward is not None:
            step, producer, propagators = verdicts[-1][0], self._backward, []
            direction, message = "backward", _backward_message(trigger, self._backward)
        else:
            step, producer, propagators = trigger, None, []
            direction, message = None, _not_reproduced(trigger, watched)
        context.event(
            "provenance", step=trigger, observed_step=step, producer=producer,
            direction=direction, propagators=propagators, watched_steps=watched,
            rank=context.rank, reproduced=producer is not None,
        )  # fmt: skip
        context.log("provenance", logging.WARNING, "stabmon: rank %d: %s", context.rank, message)
        self._trigger, self._backward, self._explained = None, None, True
        if not self._always:
            self._waiting.clear()  # steps still in flight for this trigger: explained already


def forward_producer(names: Sequence[str], values: Sequence[float]) -> tuple[str | None, list[str]]:
    """The first module (completion order) whose inputs are finite and output is not, and the
    modules after it whose inputs were already non-finite; ``(None, [])`` when every output
    was finite. ``values`` are (inputs finite, output finite) pairs, 1.0 or 0.0."""
    producer: str | None = None
    propagators: list[str] = []
    for index, name in enumerate(names):
        finite_in, finite_out = values[2 * index] > 0.5, values[2 * index + 1] > 0.5
        if finite_out:
            continue
        if producer is None:
            producer = name if finite_in else INPUT
            continue
        if not finite_in and not _contains(name, producer) and name not in propagators:
            propagators.append(name)
    return producer, propagators[:MAX_PROPAGATORS]


def _contains(name: str, inner: str) -> bool:
    """Whether module ``name`` contains module ``inner`` (the root, "", contains all)."""
    return name == "" or inner.startswith(name + ".")


def _all_finite(
    value: Any, seen: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]], depth: int = 0
) -> torch.Tensor | None:
    """A device bool: whether every floating tensor in ``value`` is finite; None without one.

    A tensor is judged once a step (``seen``), by its minimum and maximum: one fused
    reduction that NaN and either infinity reach, and no boolean copy of the tensor.
    """
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.numel() == 0:
            return None
        known = seen.get(id(value))
        if known is not None and known[0]() is value:
            return known[1]
        low, high = torch.aminmax(value.detach())
        if value.element_size() < 4:  # half precision: add in fp32, so no finite sum overflows
            low, high = low.float(), high.float()
        flag = (low + high).isfinite()  # a NaN or an infinity at either end stays one
        seen[id(value)] = (weakref.ref(value), flag)
        return flag
    if depth >= 3:
        return None
    items: Any = value.values() if isinstance(value, Mapping) else value
    if not isinstance(items, (tuple, list)) and not isinstance(value, Mapping):
        return None
    found: list[torch.Tensor] = []
    for item in items:
        item_flag = _all_finite(item, seen, depth + 1)
        if item_flag is not None:
            found.append(item_flag)
    if not found:
        return None
    return found[0] if len(found) == 1 else torch.stack(found).all()


def _last_nonfinite_module(summary: GradSummary) -> str | None:
    """The module of the parameter with a non-finite gradient that comes last in model order."""
    offenders = summary.layout.nonfinite_offenders(summary, limit=sys.maxsize)
    return offenders[-1].rpartition(".")[0] or "(root)" if offenders else None


def _forward_message(trigger: int, step: int, producer: str, propagators: list[str]) -> str:
    passed = f"; passed on by {', '.join(propagators)}" if propagators else ""
    if producer == INPUT:
        return (
            f"the non-finite value first seen at step {trigger} comes with the batch: the "
            f"model's input at step {step} was already non-finite{passed}; look at that "
            "batch's samples and the data pipeline"
        )
    where = f"module {producer}"
    return (
        f"the non-finite value first seen at step {trigger} is produced in the forward pass by "
        f"{where} (watched at step {step}: its inputs were finite, its output was not){passed}; "
        "look at that module's inputs, weights and numerics (a log or division of zero, an "
        "overflow in half precision)"
    )


def _backward_message(trigger: int, module: str) -> str:
    return (
        f"the non-finite gradient first seen at step {trigger} arises in the backward pass: "
        f"every forward output was finite; it starts at or just after module {module} (the "
        "last, in model order, whose gradients are non-finite): look for a custom autograd "
        "Function or an unstable gradient (sqrt or log near zero) there"
    )


def _not_reproduced(trigger: int, watched: list[int]) -> str:
    return (
        f"the non-finite value at step {trigger} was not reproduced: every module's forward "
        f"was finite in steps {', '.join(map(str, watched))}: a transient, so look at step "
        f"{trigger}'s batch (its samples) and at the hardware"
    )
