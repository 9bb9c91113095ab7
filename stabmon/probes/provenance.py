"""NaN provenance: which module produced the first non-finite value, and which only passed
it on, in the forward or the backward pass.

After one step, every parameter upstream of a fault is non-finite too, so the gradient
norms alone cannot tell the producer from the propagators. Disarmed, this costs nothing:
no hook is registered and the step hooks do not call it (``measuring`` is False).
When a non-finite gradient or loss is judged at step K, it arms (at the next optimizer
step, or the end of an iteration GradScaler skipped: the training thread) a forward hook
on every module for ``provenance_steps`` training steps. Each hook sums, on the device and
without a sync, every floating tensor the module takes or returns that this step has not
summed yet: a NaN or an infinity reaches the sum (one fused reduction per tensor, no
boolean copy; half precision is summed in fp32, so a finite sum overflows only past about
1e38, where the tensor is about to overflow anyway). When the gradients are watched too
(after a non-finite gradient whose loss was finite, or always with ``provenance_always``;
a non-finite loss comes from the forward, which the forward watch names alone), each such
tensor that requires a gradient gets a gradient hook that sums its gradient when autograd
computes it, in autograd's order. The sums of a step go back stacked with the Monitor's
other results (the device-side port of :mod:`stabmon.extension`) and are judged a step
later:

- **forward producer**: the first module, in completion order, whose inputs are finite
  and whose output is not (a ``log`` of zero, an overflow); its **propagators** are the
  modules after it whose inputs were already non-finite. A non-finite model input is
  named as the batch itself (``<input>``); a module whose input comes out of the forward
  code of a module around it (functional code between its submodules), non-finite while
  every output before it was finite, gives that enclosing module.
- **backward producer**: the forward was finite, and the first non-finite gradient, in
  the order autograd computed them, lies inside the innermost module whose output's
  gradient (grad-output) was still finite: it is that module's grad-input, or the
  grad-output of one of its submodules (the NaN arose in the module's own backward code,
  between its submodules: a custom autograd ``Function``, a ``sqrt`` or ``log`` near
  zero). Its **propagators** are the modules whose grad-output was non-finite, in the
  order autograd reached them (the earlier layers). A gradient already non-finite where
  it enters the model gives ``<loss>``: the loss or the code after the model's forward.
  A gradient is the total over a tensor's uses, so when several modules share one input
  (query, key and value projections) the producer is the module around them.
- **backward, by the parameters**: every watched gradient was finite yet a parameter's
  was not: the NaN arose in a weight gradient; named by the module whose parameters are
  the last, in model order, with non-finite gradients.
- **not reproduced**: every watched step was finite: a transient (that batch, the
  hardware); the event says which step to look at.

A model of more than :data:`TWO_STAGES_ABOVE` modules is watched in two stages: a hook on
every small layer of a big model would cost more than the step's own work. The first
stage watches the top of the module tree, down to the depth that keeps both stages small
(a transformer's blocks, stem and head); once it names a module, the second watches the
modules inside it, and the first stage's still, for another ``provenance_steps`` steps,
and the verdict names the inner producer, then the blocks that passed it on (or, where
the fault moved meanwhile, where it arose then). If the fault does not recur meanwhile,
the first stage's module is the verdict, and the message says so.

The verdict is one ``provenance`` event and one log line. ``provenance_always`` watches
from the first step, for a debugging session. A compiled forward is not watched (its
module hooks are no-ops in traced code), nor an evaluation under ``no_grad``; checkpointed
blocks are (reentrant ones run under ``no_grad`` inside the training forward), judged in
the forward's order, not as the backward re-runs them. What an
armed step costs on CPU: ``bench/provenance_cost.py`` (docs/loops.md).
"""

from __future__ import annotations

import logging
import math
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from stabmon.probes.unwrap import unwrap_model

if TYPE_CHECKING:
    from stabmon.extension import Context, GradSummary

__all__ = [
    "MAX_WATCHED_CALLS",
    "TWO_STAGES_ABOVE",
    "NanProvenance",
    "backward_producer",
    "forward_producer",
]

#: Module calls watched per step at most (a model of thousands of modules, or a loop that
#: never steps): the flags of the first ones are kept.
MAX_WATCHED_CALLS = 4096
#: Tensors (forward) and gradients (backward) summed per step at most.
MAX_WATCHED_TENSORS = 2 * MAX_WATCHED_CALLS
#: Module calls under no_grad recorded per step at most (an evaluation of a submodule left
#: in an armed step: the training forward keeps the rest of the bound).
MAX_NO_GRAD_CALLS = MAX_WATCHED_CALLS // 4
#: Propagators a verdict names at most.
MAX_PROPAGATORS = 5
#: A model of more modules is watched in two stages after a non-finite value: the top of its
#: module tree first (down to the level that keeps both stages small: the blocks, stem and
#: head of a transformer), then the inside of the module that stage named. A hook per module
#: on every small layer of a big model costs more than the step's own work; a small model is
#: watched whole at once.
TWO_STAGES_ABOVE = 48
#: The producer's name when the model's own input was already non-finite.
INPUT = "<input>"
#: The producer's name when the gradient was already non-finite where it entered the model.
LOSS = "<loss>"
#: How the root module (name "") is shown.
ROOT = "(root)"

#: One module call: (name, its inputs' slots, its outputs' slots). A slot is a tensor's
#: index in the step's sums.
Call = tuple[str, tuple[int, ...], tuple[int, ...]]


class _Step:
    """One watched step's record: the tensors summed, the calls, the gradients in order.

    Gradient hooks hold this (not the plug-in); a hook that fires after the step was
    measured (a graph kept with ``retain_graph``) writes into a record no one reads.
    """

    __slots__ = (
        "calls", "error", "grad_slots", "grads", "mark", "no_grad", "recomputed", "seen", "sums"
    )  # fmt: skip

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.sums: list[torch.Tensor] = []  # by slot: each tensor's fp32 sum, on its device
        # This step's tensors already summed (a module's input is the output before it):
        # id -> (the tensor, weakly, its slot).
        self.seen: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.grads: list[torch.Tensor] = []  # gradient sums, in the order autograd made them
        self.grad_slots: list[int] = []  # the slot of each
        self.error: Exception | None = None  # a failure inside a hook, raised at measure()
        # Calls (by index) made under no_grad, and made inside a backward pass (activation
        # checkpointing re-running a forward): see _forward_calls.
        self.no_grad: set[int] = set()
        self.recomputed: set[int] = set()
        self.mark = (0, 0)  # the calls and sums as the last call with a gradient completed


class _GradientSum:
    """A gradient hook: sums the gradient of one slot's tensor into its step's record."""

    __slots__ = ("_slot", "_step")

    def __init__(self, step: _Step, slot: int) -> None:
        self._step, self._slot = step, slot

    def __call__(self, grad: torch.Tensor) -> None:
        step = self._step
        try:
            if len(step.grads) < MAX_WATCHED_TENSORS:
                # Detached: under backward(create_graph=True) the gradient has a graph
                # reaching the step's whole forward, which the sum would keep until judged.
                step.grads.append(grad.detach().sum(dtype=torch.float32))
                step.grad_slots.append(self._slot)
        except Exception as error:  # never break the backward; raised at measure()
            step.error = step.error or error


class NanProvenance:
    """Plug-in: arms module hooks after a non-finite value and names the producer."""

    component = "grads"
    measure_at = "before_step"

    def __init__(self, context: Context) -> None:
        config = context.config
        self._context = context
        self._watch_gradient = context.watch_gradient
        self._steps: int = config.provenance_steps
        self._always: bool = config.provenance_always
        self._trigger: int | None = None  # the step whose non-finite value armed the watch
        self._unwatch: Any = None
        self._left = 0  # watched steps still to measure
        self._step = _Step()
        # Measured steps' calls, their forward sums' count, gradients' slots, the weights'
        # owners and the forward's own calls (None: all of them), by step.
        # A list per step: the steps GradScaler skips are measured under one step number.
        self._waiting: dict[int, list[_Waiting]] = {}
        self._verdicts: list[_Verdict] = []
        self._measured = 0  # watched steps measured for the trigger under way
        self._backward: str | None = None  # where the parameters' gradients went non-finite
        self._arm_pending = self._always  # set under the judging lock, read by measure()
        # Explained: no new watch until the loss and the gradients are finite again (one
        # verdict per episode).
        self._explained = False
        self._loss_finite = self._grads_finite = True
        # Whether the watch registers gradient hooks: always on in provenance_always, else
        # only after a non-finite gradient whose loss was finite (the costlier half).
        self._gradients = self._always
        # The weights as the watch began (once per watch): each parameter's norm on the
        # device, sent with the first watched step; the modules whose own weights were
        # non-finite then (an update applied the non-finite gradient before the watch).
        self._weights: tuple[list[str], torch.Tensor] | None = None
        self._bad_weights: list[str] = []
        # Two stages (a model of over TWO_STAGES_ABOVE modules, not provenance_always): every
        # module's name as the watch began, the first stage's verdict while the inside of its
        # producer is watched, and that producer (set under the judging lock, read by
        # measure()). Each watch is a generation: a step measured by an earlier one is not
        # judged.
        self._names: list[str] = []
        self._first: frozenset[str] | None = None  # the first stage's modules (None: all)
        self._coarse: _Verdict | None = None
        self._before: list[int] = []  # the first stage's steps before the one it named
        self._refine: str | None = None
        self._generation = 0

    @property
    def measuring(self) -> bool:
        """Whether :meth:`measure` has work at a step: a watch asked for or under way. Read by
        the Monitor after each judged value and measurement; disarmed, no call a step."""
        return self._arm_pending or self._unwatch is not None or self._refine is not None

    # --- judged values (under the judging lock) -----------------------------------------

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        self._grads_finite = not summary.nonfinite
        if self._grads_finite:
            self._settle()
            return
        if step in self._waiting:  # a watched step: its flags come next
            self._backward = self._backward or _last_nonfinite_module(summary)
        if self._arm(step):
            # The loss judged last was finite: the NaN may arise in the backward pass, so
            # the gradients are watched too (unless this step's loss turns out non-finite).
            self._gradients = self._always or self._loss_finite

    def loss_judged(self, step: int, value: float) -> None:
        self._loss_finite = math.isfinite(value)
        if self._loss_finite:
            self._settle()
        elif self._arm(step) or step == self._trigger:
            # A non-finite loss comes from the forward pass (or the batch): the forward
            # watch names it, and the gradients, non-finite after it anyway, are left alone.
            self._gradients = self._always

    def _settle(self) -> None:
        """The episode is over once the loss and the gradients are both finite again (a NaN
        arising in the backward leaves the loss finite all along)."""
        if self._loss_finite and self._grads_finite:
            self._explained = False

    def _arm(self, step: int) -> bool:
        """Arm for the non-finite value judged at ``step``; whether this armed the watch."""
        if self._trigger is not None or self._explained or not (self._steps or self._always):
            return False
        self._trigger = step
        if not self._always:
            self._measured = 0
            self._arm_pending = True  # the next measure() arms it, on the training thread
        return True

    # --- the training thread ------------------------------------------------------------

    def _start_watching(self) -> None:
        self._arm_pending = False
        if self._unwatch is None:
            first = None
            if not self._always:
                model = unwrap_model(self._context.model)  # as the module watch names them
                self._names = [name for name, _ in model.named_modules()]
                self._first = first = _first_stage(self._names)
            self._watch(first)
            self._left = self._steps if not self._always else sys.maxsize
            if not self._always:
                self._weights = _weight_norms(self._context.model)

    def _watch(self, names: frozenset[str] | None) -> None:
        self._generation += 1
        self._unwatch = self._context.watch_modules(self._forward, names)

    def _start_refining(self, producer: str) -> None:
        """The second stage: the inside of the module the first named, and the first stage's
        modules still (so a value already non-finite where it enters that module, or a
        fault that moved, is named where it arose, not inside). Under the judging lock: the
        judge thread reads what changes here."""
        first = self._first or frozenset()
        names = frozenset(n for n in self._names if n in first or _contains(producer, n))
        with self._context.judging():
            self.detach()
            self._watch(names)  # a new generation first: the old watch's steps are not judged
            self._refine = None
            self._left, self._measured = self._steps, 0

    def _forward(self, name: str, inputs: Any, output: Any) -> None:
        step = self._step
        if len(step.calls) >= MAX_WATCHED_CALLS:
            return  # past the bound, the first calls decide
        try:
            # Tagged for the verdict: a call under no_grad is the training forward's only
            # inside one that has a gradient (reentrant checkpointing), not an evaluation;
            # one inside a backward re-runs a forward (checkpointing), out of its order.
            if not torch.is_grad_enabled():
                if name == "":  # the model's own forward under no_grad: an evaluation
                    _drop_since_mark(step)
                    return
                if len(step.no_grad) >= MAX_NO_GRAD_CALLS:
                    return  # an evaluation of a submodule: it takes a bounded share
                step.no_grad.add(len(step.calls))
            if torch._C._current_graph_task_id() != -1:
                step.recomputed.add(len(step.calls))
            index = len(step.calls)
            if isinstance(output, torch.Tensor):  # the common case, without a tuple walk
                slot = self._slot(output, step)
                outputs: tuple[int, ...] = (slot,) if slot >= 0 else ()
            else:
                outputs = self._slots(output, step)
            if not outputs:
                step.no_grad.discard(index)
                step.recomputed.discard(index)
                return
            if len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
                slot = self._slot(inputs[0], step)
                step.calls.append((name, (slot,) if slot >= 0 else (), outputs))
            else:
                step.calls.append((name, self._slots(inputs, step), outputs))
            if index not in step.no_grad:
                step.mark = (len(step.calls), len(step.sums))
        except Exception as error:  # never break the forward; raised at measure()
            step.error = step.error or error

    def _slot(self, tensor: torch.Tensor, step: _Step) -> int:
        """``tensor``'s slot, summed once a step (-1: not a floating tensor, or past the
        bound); one that requires a gradient gets a gradient hook the first time."""
        known = step.seen.get(id(tensor))
        if known is not None and known[0]() is tensor:
            return known[1]
        slot = len(step.sums)
        if not tensor.is_floating_point() or not tensor.numel() or slot >= MAX_WATCHED_TENSORS:
            return -1
        step.sums.append(tensor.detach().sum(dtype=torch.float32))
        step.seen[id(tensor)] = (weakref.ref(tensor), slot)
        # Not under no_grad: an evaluation's slots are dropped and taken again, and a hook
        # on a tensor it was given would fire into another tensor's slot.
        if self._gradients and tensor.requires_grad and torch.is_grad_enabled():
            self._watch_gradient(tensor, _GradientSum(step, slot))
        return slot

    def _slots(self, value: Any, step: _Step, depth: int = 0) -> tuple[int, ...]:
        """The slots of the floating tensors in ``value`` (a tensor, or a tuple, list or
        mapping of them, two levels deep)."""
        if isinstance(value, torch.Tensor):
            slot = self._slot(value, step)
            return (slot,) if slot >= 0 else ()
        if depth >= 2:
            return ()
        if isinstance(value, Mapping):
            value = tuple(value.values())
        elif not isinstance(value, (tuple, list)):
            return ()
        slots: tuple[int, ...] = ()
        for item in value:
            slots += self._slots(item, step, depth + 1)
        return slots

    def measure(self, step: int) -> torch.Tensor | None:
        watched, self._step = self._step, _Step()
        if self._arm_pending:
            self._start_watching()  # from the next iteration's forward on
            return None
        refine = self._refine
        if refine is not None:  # this step's first-stage record has nothing to add
            self._start_refining(refine)
            return None
        if watched.error is not None:
            self.detach()  # a hook failed: stop watching (the guard counts and logs it)
            raise watched.error
        if not watched.calls:
            # A step without a watched call (a compiled forward) counts too: the watch ends.
            self._left -= 1
            if self._left <= 0:
                self.detach()
                if self._coarse is not None and not self._measured:  # e.g. compiled meanwhile
                    with self._context.judging():  # the first stage's verdict is all there is
                        self._report()
                elif not self._measured and not self._always:
                    # Nothing was watched: no verdict (none could be right); the episode
                    # is over once the values are finite again, as after a verdict.
                    self._explained, self._trigger = True, None
            return None
        sums = watched.sums + watched.grads
        device = sums[0].device
        packed = torch.stack(
            [s if s.device == device else s.to(device, non_blocking=True) for s in sums]
        )
        owners: list[str] = []
        if self._weights is not None:  # the first watched step: the weights go with it
            (owners, norms), self._weights = self._weights, None
            packed = torch.cat([packed, norms.to(device, non_blocking=True)])
        tags = (
            (watched.no_grad, watched.recomputed) if watched.no_grad or watched.recomputed else None
        )
        self._waiting.setdefault(step, []).append(
            _Waiting(
                watched.calls, len(watched.sums), watched.grad_slots, owners, tags, self._generation
            )
        )
        self._measured += 1
        self._left -= 1
        if self._left <= 0:
            self.detach()
        return packed

    def detach(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    # --- the verdict (under the judging lock) -------------------------------------------

    def judge(self, step: int, values: list[float]) -> None:
        queue = self._waiting.get(step)
        waiting = queue.pop(0) if queue else None
        if queue is not None and not queue:
            del self._waiting[step]
        # Results come oldest first: a watched step still waiting from before this one was
        # dropped by the read-back (bounded), and counts as measured no longer.
        for lost in [earlier for earlier in self._waiting if earlier < step]:
            for entry in self._waiting.pop(lost):
                if entry.generation == self._generation:
                    self._measured -= 1
        if waiting is None or waiting.generation != self._generation or self._refine is not None:
            return  # measured by a watch since replaced: the verdict it gave is being refined
        calls, count, grad_slots, owners, tags, _ = waiting
        finite = [math.isfinite(v) for v in values]
        if owners:
            weights, finite = finite[len(finite) - len(owners) :], finite[: -len(owners)]
            bad = [owner for owner, ok in zip(owners, weights, strict=True) if not ok]
            self._bad_weights = list(dict.fromkeys(bad))
        forward = forward_producer(_forward_calls(calls, *tags) if tags else calls, finite[:count])
        backward = backward_producer(calls, grad_slots, finite[count:])
        verdict = _Verdict(step, forward, backward, bool(grad_slots))
        if self._always:  # every step watched: a verdict for each episode's first producer
            if verdict.found and not self._explained:
                self._verdicts = [verdict]
                self._report()
            return
        if self._trigger is None:
            return
        inside = self._refinable(verdict)
        if inside is not None:  # the first stage named a module: now watch inside it
            self._coarse, self._refine = verdict, inside
            self._before, self._verdicts = [v.step for v in self._verdicts], []
            return
        self._verdicts.append(verdict)
        # Once the watch has ended, the steps it measured are all there will be (some of
        # its steps may have had no watched call).
        needed = self._measured if self._unwatch is None else max(self._measured, self._steps)
        if verdict.found or len(self._verdicts) >= needed:
            self._report()

    def _refinable(self, verdict: _Verdict) -> str | None:
        """The module a first-stage verdict names, when it has modules inside that the first
        stage did not watch (None: one stage, a verdict already refined, or nothing to
        look inside: the batch, the loss, a leaf)."""
        if self._coarse is not None or self._always or self._bad_weights or not verdict.found:
            return None
        shown = verdict.producer
        if shown in (INPUT, LOSS, ROOT, None):
            return None
        first = self._first
        if first is None or not any(
            name not in first and _contains(shown, name) for name in self._names
        ):
            return None
        return shown

    def finish(self) -> None:
        """The run ends while the inside of a first-stage producer is watched: its verdict
        is what there is."""
        if self._coarse is not None:
            self._report()

    def _report(self) -> None:
        verdicts, self._verdicts = self._verdicts, []
        found = next((v for v in verdicts if v.found), None)
        inside_unseen: list[int] | None = None  # the second stage's steps, if it found nothing
        coarse, self._coarse = self._coarse, None
        if coarse is not None:
            if found is None:
                found, inside_unseen = coarse, [v.step for v in verdicts]
            elif _refines(found, coarse):
                found = _refined(found, coarse)
            # else: the second stage, seeing the first's modules too, named another (the
            # fault moved, or came from outside): what it saw stands.
            verdicts = [coarse, *verdicts]
        trigger = self._trigger if self._trigger is not None else verdicts[0].step
        watched = sorted({*self._before, *(v.step for v in verdicts)})
        context = self._context
        producer: str | None = None
        propagators: list[str] = []
        direction: str | None = None
        first: str | None = None
        if self._bad_weights:  # the NaN is in the weights already: no producer can be told
            step, direction = verdicts[0].step, "weights"
            producer, propagators = _shown(self._bad_weights[0]), []
            message = _weights_message(trigger, step, [_shown(m) for m in self._bad_weights])
        elif found is not None and found.forward[0] is not None:
            step, producer, propagators = found.step, found.forward[0], found.forward[1]
            direction = "forward"
            message = _forward_message(
                trigger, step, found.forward[0], propagators, _inside(producer, inside_unseen)
            )
        elif found is not None and found.backward[0] is not None:
            step, producer, propagators = found.step, found.backward[0], found.backward[1]
            direction, first = "backward", found.backward[2]
            message = _backward_message(
                trigger, step, producer, propagators, first, _inside(producer, inside_unseen)
            )
        elif self._backward is not None:
            step, producer, direction = verdicts[-1].step, self._backward, "backward"
            message = _parameters_message(trigger, self._backward)
        else:
            step = trigger
            message = _not_reproduced(trigger, watched, any(v.gradients for v in verdicts))
        context.event(
            "provenance", step=trigger, observed_step=step, producer=producer,
            direction=direction, propagators=propagators, watched_steps=watched,
            rank=context.rank, reproduced=producer is not None, first_nonfinite=first,
        )  # fmt: skip
        context.log("provenance", logging.WARNING, "stabmon: rank %d: %s", context.rank, message)
        self._trigger, self._backward, self._explained = None, None, True
        self._weights, self._bad_weights, self._refine, self._before = None, [], None, []
        if not self._always:
            self._waiting.clear()  # steps still in flight for this trigger: explained already


class _Waiting(NamedTuple):
    """A measured step's record, until its sums are read back and judged."""

    calls: list[Call]
    forward_sums: int  # how many of the sums are the forward's (the gradients' follow)
    grad_slots: list[int]
    owners: list[str]  # the weights' owners (the first step of a watch), else empty
    tags: tuple[set[int], set[int]] | None  # the calls under no_grad and recomputed
    generation: int  # the watch that measured it


class _Verdict:
    """One watched step's findings."""

    __slots__ = ("backward", "forward", "gradients", "step")

    def __init__(
        self,
        step: int,
        forward: tuple[str | None, list[str]],
        backward: tuple[str | None, list[str], str | None],
        gradients: bool,
    ) -> None:
        self.step, self.forward, self.backward = step, forward, backward
        self.gradients = gradients  # whether any gradient was watched

    @property
    def found(self) -> bool:
        return self.producer is not None

    @property
    def producer(self) -> str | None:
        """The forward producer, else the backward one (None: every value was finite)."""
        return self.forward[0] if self.forward[0] is not None else self.backward[0]


def forward_producer(calls: Sequence[Call], finite: Sequence[bool]) -> tuple[str | None, list[str]]:
    """The first module (completion order) whose inputs are finite and output is not, and the
    modules after it whose inputs were already non-finite; ``(None, [])`` when every output
    was finite. ``finite`` says, by slot, whether each tensor was finite. A module without a
    floating input (an embedding of token ids) counts its inputs as finite."""
    roots = {slot for name, inputs, _ in calls if name == "" for slot in inputs}
    root_seen = any(name == "" for name, _, _ in calls)
    producer: str | None = None
    propagators: list[str] = []
    for index, (name, inputs, outputs) in enumerate(calls):
        finite_in = all(finite[slot] for slot in inputs)
        if producer is None:
            if all(finite[slot] for slot in outputs):
                continue
            if finite_in:
                producer = _shown(name)
            elif root_seen and not any(not finite[slot] and slot in roots for slot in inputs):
                # Not the batch: made by functional code between modules, in one around it.
                producer = _enclosing(name, calls[index + 1 :])
            else:
                producer = INPUT
            continue
        if not finite_in and not _contains(name, producer) and _shown(name) not in propagators:
            propagators.append(_shown(name))
    return producer, propagators[:MAX_PROPAGATORS]


def backward_producer(
    calls: Sequence[Call], slots: Sequence[int], finite: Sequence[bool]
) -> tuple[str | None, list[str], str | None]:
    """The backward producer, its propagators and where the first non-finite gradient was
    (``"m's output"`` / ``"m's input"``); ``(None, [], None)`` when every gradient was finite.

    ``slots`` are the tensors whose gradients autograd computed, in its order, and
    ``finite`` whether each gradient was finite.
    """
    grads: dict[int, bool] = {}
    order: dict[int, int] = {}
    for index, (slot, ok) in enumerate(zip(slots, finite, strict=False)):
        grads[slot] = grads.get(slot, True) and ok
        order.setdefault(slot, index)
    bad = [slot for slot, ok in grads.items() if not ok]
    if not bad:
        return None, [], None
    first = min(bad, key=order.__getitem__)
    makers = [name for name, _, outputs in calls if first in outputs]
    users = [name for name, inputs, _ in calls if first in inputs]
    candidates: list[tuple[int, str]] = []  # (depth, name)
    for name, inputs, outputs in calls:
        fired = [grads[slot] for slot in outputs if slot in grads]
        if not fired or not all(fired):
            continue  # its grad-output was not (all) finite, or never came
        if first in inputs or any(_contains(name, inner) and inner != name for inner in makers):
            candidates.append((name.count(".") + 1 if name else 0, name))
    producer = _deepest(candidates)
    where = (
        f"{_shown(makers[-1])}'s output" if makers
        else f"{_shown(users[0])}'s input" if users else None
    )  # fmt: skip
    if producer is None:
        producer = LOSS
    ranked: list[tuple[int, str]] = []
    for name, _, outputs in calls:
        reached = [order[slot] for slot in outputs if slot in grads and not grads[slot]]
        if reached and (producer == LOSS or not _contains(name, producer)):
            ranked.append((min(reached), _shown(name)))
    propagators: list[str] = []
    for _, name in sorted(ranked):
        if name != producer and name not in propagators:
            propagators.append(name)
    return producer, propagators[:MAX_PROPAGATORS], where


def _first_stage(names: Sequence[str]) -> frozenset[str] | None:
    """The modules the first of two stages watches: every module down to the depth of the
    module tree that keeps the larger of the two stages smallest (its own modules, or the
    most modules inside one of them, which the second watches); None for a model of at most
    TWO_STAGES_ABOVE modules, or one whose tree no depth splits into two smaller stages."""
    if len(names) <= TWO_STAGES_ABOVE:
        return None
    depths = [name.count(".") + 1 if name else 0 for name in names]
    best: tuple[int, int] | None = None  # (the larger stage, depth)
    for depth in range(1, max(depths)):
        top = [name for name, d in zip(names, depths, strict=True) if d == depth]
        inside: dict[str, int] = dict.fromkeys(top, 0)
        for name, d in zip(names, depths, strict=True):
            if d > depth:
                above = ".".join(name.split(".")[:depth])
                inside[above] = inside.get(above, 0) + 1
        stages = (sum(1 for d in depths if d <= depth), max(inside.values(), default=0) + 2)
        if best is None or max(stages) < best[0]:
            best = (max(stages), depth)
    if best is None or best[0] * 2 > len(names):
        return None  # two stages would not halve what one watch costs
    return frozenset(name for name, d in zip(names, depths, strict=True) if d <= best[1])


def _refines(inner: _Verdict, outer: _Verdict) -> bool:
    """Whether a second-stage verdict names a module inside (or) the first stage's producer."""
    outer_producer, inner_producer = outer.producer, inner.producer
    if outer_producer is None or inner_producer in (None, INPUT, LOSS, ROOT):
        return False
    return _contains(outer_producer, inner_producer)


def _refined(inner: _Verdict, outer: _Verdict) -> _Verdict:
    """The second stage's producer, its propagators inside the first stage's producer, then
    the first stage's propagators (the modules around it, each a block)."""

    def joined(inside: list[str], around: list[str]) -> list[str]:
        kept = inside[: MAX_PROPAGATORS - min(2, len(around))]  # room for the next blocks
        return list(dict.fromkeys([*kept, *around]))[:MAX_PROPAGATORS]

    forward = (inner.forward[0], joined(inner.forward[1], outer.forward[1]))
    backward = (inner.backward[0], joined(inner.backward[1], outer.backward[1]), inner.backward[2])
    return _Verdict(inner.step, forward, backward, inner.gradients or outer.gradients)


def _drop_since_mark(step: _Step) -> None:
    """Forget the calls and sums since the last call with a gradient: they were an
    evaluation's (the model's forward under no_grad), and would take the step's bounds."""
    calls, sums = step.mark
    if len(step.calls) == calls and len(step.sums) == sums:
        return
    del step.calls[calls:], step.sums[sums:]
    step.no_grad = {index for index in step.no_grad if index < calls}
    step.seen = {key: seen for key, seen in step.seen.items() if seen[1] < sums}


def _forward_calls(calls: Sequence[Call], no_grad: set[int], recomputed: set[int]) -> list[Call]:
    """The calls of the training forward, in its order: without the forwards re-run inside
    a backward (activation checkpointing: out of order, duplicates), and without calls
    under no_grad unless the next call of a module around them had a gradient (reentrant
    checkpointing runs its blocks under no_grad inside the training forward; an evaluation
    under no_grad is left out whole)."""
    kept = [True] * len(calls)
    for index in range(len(calls) - 1, -1, -1):
        if index in recomputed:
            kept[index] = False
        elif index in no_grad:
            around = _around(calls, index, recomputed)
            kept[index] = around is not None and kept[around]
    return [call for call, keep in zip(calls, kept, strict=True) if keep]


def _around(calls: Sequence[Call], index: int, recomputed: set[int]) -> int | None:
    """The call of a module around call ``index`` (the next to complete that contains it),
    or None when the same module runs again first: then ``index`` ran on its own (a
    submodule evaluated under no_grad before the training forward calls it again)."""
    name = calls[index][0]
    for later in range(index + 1, len(calls)):
        if later in recomputed:
            continue
        other = calls[later][0]
        if other == name:
            return None
        if _contains(other, name):
            return later
    return None


def _deepest(candidates: list[tuple[int, str]]) -> str | None:
    """The innermost candidate module; among several as deep, the innermost candidate
    around them all (one input shared by several modules)."""
    if not candidates:
        return None
    depth = max(d for d, _ in candidates)
    tied = sorted({name for d, name in candidates if d == depth})
    if len(tied) > 1:
        around = [name for _, name in candidates if all(_contains(name, t) for t in tied)]
        return _shown(max(around, key=len)) if around else _shown(tied[0])
    return _shown(tied[0])


def _enclosing(name: str, later: Sequence[Call]) -> str:
    """The innermost module around ``name`` among the calls completed after it."""
    around = [other for other, _, _ in later if other != name and _contains(other, name)]
    return _shown(max(around, key=len)) if around else INPUT


def _shown(name: str) -> str:
    return name or ROOT


def _contains(name: str, inner: str) -> bool:
    """Whether module ``name`` contains module ``inner`` (the root, "", contains all)."""
    return name in ("", ROOT, inner) or inner.startswith(name + ".")


def _weight_norms(model: torch.nn.Module) -> tuple[list[str], torch.Tensor] | None:
    """Each floating parameter's norm (on the device, no sync) and the name of the module
    that owns it, as the module watch names modules; None for a model without any. Taken
    once per watch, when it begins."""
    model = unwrap_model(model)  # as the module watch names modules
    owners: list[str] = []
    norms: list[torch.Tensor] = []
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.numel() and len(norms) < MAX_WATCHED_TENSORS:
                # This rank's shard of a DTensor (FSDP2, tensor parallelism): its norm would
                # be a DTensor, which the step's sums cannot be stacked with, and may redistribute
                # (a collective) on the one rank that armed.
                local = param.to_local() if hasattr(param, "to_local") else param
                owners.append(name)
                norms.append(torch.linalg.vector_norm(local.detach(), dtype=torch.float32))
    if not norms:
        return None
    device = norms[0].device
    return owners, torch.stack([n if n.device == device else n.to(device) for n in norms])


def _weights_message(trigger: int, step: int, modules: list[str]) -> str:
    shown = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
    return (
        f"the non-finite value of step {trigger} had reached the weights before the watch "
        f"began (step {step}): non-finite parameters in {shown}, so every forward is "
        f"non-finite from them on and no producer can be told; step {trigger}'s "
        "nonfinite_grad or nonfinite_loss anomaly names where it arose. Resume from a "
        f"checkpoint before step {trigger}; on_anomaly.nonfinite_grad: skip holds such steps "
        "back"
    )


def _last_nonfinite_module(summary: GradSummary) -> str | None:
    """The module of the parameter with a non-finite gradient that comes last in model order."""
    offenders = summary.layout.nonfinite_offenders(summary, limit=sys.maxsize)
    return offenders[-1].rpartition(".")[0] or ROOT if offenders else None


def _forward_message(
    trigger: int, step: int, producer: str, propagators: list[str], inside: str = ""
) -> str:
    passed = f"; passed on by {', '.join(propagators)}" if propagators else ""
    if producer == INPUT:
        return (
            f"the non-finite value first seen at step {trigger} comes with the batch: the "
            f"model's input at step {step} was already non-finite{passed}; look at that "
            "batch's samples and the data pipeline"
        )
    return (
        f"the non-finite value first seen at step {trigger} is produced in the forward pass by "
        f"module {producer} (watched at step {step}: its inputs were finite, its output was "
        f"not){passed}{inside}; look at that module's inputs, weights and numerics (a log or "
        "division of zero, an overflow in half precision)"
    )


def _backward_message(
    trigger: int,
    step: int,
    producer: str,
    propagators: list[str],
    first: str | None,
    inside: str = "",
) -> str:
    passed = f"; passed on by {', '.join(propagators)}" if propagators else ""
    at = f", the first non-finite one was the gradient of {first}" if first else ""
    if producer == LOSS:
        return (
            f"the non-finite gradient first seen at step {trigger} comes from the loss: at "
            f"step {step} every forward output was finite and the gradient was already "
            f"non-finite where it entered the model{at}{passed}; look at the loss function "
            "and the code after the model's forward (a log, sqrt or division near zero)"
        )
    return (
        f"the non-finite gradient first seen at step {trigger} is produced in the backward pass "
        f"by module {producer} (watched at step {step}: every forward output was finite; the "
        f"gradient at {producer}'s output was finite{at}){passed}{inside}; look in "
        f"{producer}'s own forward code for a custom autograd Function or an unstable gradient "
        "(sqrt or log near zero, an overflow in half precision)"
    )


def _parameters_message(trigger: int, module: str) -> str:
    return (
        f"the non-finite gradient first seen at step {trigger} arises in the backward pass: "
        f"every forward output and every watched activation gradient was finite; it is a "
        f"weight gradient, at or just after module {module} (the last, in model order, whose "
        "gradients are non-finite): look for a custom autograd Function or an overflow in "
        "that module's weight gradient"
    )


def _inside(producer: str, steps: list[int] | None) -> str:
    """What a message says when the inside of the module a first stage named was watched and
    the fault did not recur there, or the run ended first."""
    if steps is None:
        return ""
    if not steps:
        return f"; the run ended before the modules inside {producer} were watched"
    return (
        f"; the modules inside {producer} were watched next, at steps "
        f"{', '.join(map(str, steps))}, and it did not recur there, so which of them made it "
        "is not known"
    )


def _not_reproduced(trigger: int, watched: list[int], gradients: bool) -> str:
    passes = "forward and backward" if gradients else "forward"
    return (
        f"the non-finite value at step {trigger} was not reproduced: every module's {passes} "
        f"was finite in steps {', '.join(map(str, watched))}: a transient, so look at step "
        f"{trigger}'s batch (its samples) and at the hardware"
    )
