"""The ``on_anomaly`` plug-in: the plan, the agreement, the gate and the verdict, on the
extension ports (:mod:`stabmon.extension`).

At every optimizer step (``gate_step``, the step pre-hook, gradients in place) each rank:

1. in the deferred mode, reads the flags agreed at the step before (queued then, so no
   sync) and acts on them;
2. builds its own flags: the step's gradients judged on the device (``nonfinite_grad``:
   the global pre-clip norm is not finite; ``grad_spike``: it exceeds the limit the spike
   statistics of earlier steps give, known on the host before the step) and the late
   kinds recorded on this rank since the last step (``anomaly_recorded``);
3. agrees on them with every rank (one all-reduce MAX);
4. either passes the optimizer the skip flag on the device (deferred mode: fused
   optimizers, ``skip`` only) and queues the flags' copy to the host, or reads them now
   (one sync) and acts: holds the gradients back (skip), calls the save (checkpoint),
   scales the LR (lr_scale), raises :class:`~stabmon.errors.AnomalyStop` (stop).

The step post-hook (``step_applied``) undoes what was changed for the step. Every rank
acts on the agreed flags only, so all act alike at the same step.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from stabmon.detectors.spike import SpikeDetector
from stabmon.errors import AnomalyStop
from stabmon.extension import Context, GradSummary
from stabmon.policies.actions import BEFORE_STEP, Plan, outcome
from stabmon.policies.agreement import HostCopy, agree, all_attached, answer_roll_call
from stabmon.policies.gate import (
    StepChanges,
    computes_gradients_in_step,
    step_norm,
    takes_device_flag,
)
from stabmon.policies.verdict import Checkpoints, Verdict

__all__ = ["AnomalyPolicies", "anomaly_policies"]

#: Above any step + 1 a flag can carry (float64 holds integers exactly up to 2**53).
_MAX_STEP = 2.0**53
#: Kinds whose values, once they reach the parameters, damage them for every later save.
_DAMAGING = ("nonfinite_grad", "nonfinite_loss")


def anomaly_policies(context: Context) -> AnomalyPolicies | None:
    """The plug-in, or None when every ``on_anomaly`` action is ``none`` (the default)."""
    plan = Plan.from_config(context.config.on_anomaly)
    return None if plan is None else AnomalyPolicies(context, plan)


class AnomalyPolicies:
    """Acts on anomalies as ``on_anomaly`` says, the same way on every rank."""

    component = "hooks"
    state_key = "policies"

    def __init__(self, context: Context, plan: Plan) -> None:
        self._context = context
        self._plan = plan
        self._rank = context.rank
        config = context.config
        self._spikes = SpikeDetector(
            threshold=config.spike_threshold, warmup=config.spike_warmup_steps,
            alpha=config.spike_ema_alpha, log_scale=True, min_ratio=config.grad_spike_min_ratio,
        )  # fmt: skip
        #: The smallest pre-clip norm that is a spike, from earlier steps (None in warm-up).
        self.limit: float | None = None
        self._slots = {kind: plan.kinds.index(kind) for kind in plan.kinds}
        self._skips = [self._slots[k] for k in plan.before_step if plan.actions[k] == "skip"]
        self._checks = {kind: self._slots[kind] for kind in plan.before_step}
        # Late kinds recorded on this rank since the last step: kind -> its step (any thread).
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()
        # The last anomaly step acted on, per kind: one anomaly is acted on once.
        self._acted: dict[str, int] = {}
        self._copy = HostCopy()
        self._acts_late = bool(plan.judged_late)
        self._changes = StepChanges()
        self._lr_left = 0
        self._saved_by_policy = False
        #: Called with the step index by a ``checkpoint`` action (Monitor.on_checkpoint_action).
        self.save: Callable[[int], object] | None = None
        self._checkpoints = Checkpoints()
        # The verdict is decided and written from the training thread (actions, saves) and
        # from whichever thread records an anomaly (a stall's watchdog): one at a time.
        self._verdict_lock = threading.Lock()
        self._verdict = Verdict(
            context.run_directory / f"rank-{self._rank}.verdict.json", self._rank
        )
        self._reads_now: bool | None = None  # decided at the first step (the optimizer's kind)
        #: Skips of this step whose gradients are held back, recorded once the step has run:
        #: a closure passed to any optimizer's step may compute new ones that it applies.
        self._held_records: list[tuple[str, int, int, str]] = []
        #: Whether the step gated last had its gradients held back (read by adapters).
        self.held_back = False
        #: This rank counted among those with a policy (checked at the first step), and
        #: whether the policies turned themselves off (not every rank has them).
        self._roll_call = answer_roll_call()
        self._off = False
        held_back = plan.actions.get("nonfinite_grad") in ("skip", "stop")
        # A non-finite loss backpropagates non-finite gradients: held back too when those are.
        self._damaging = () if held_back else _DAMAGING

    # --- the training thread: the optimizer step ---------------------------------------------

    def gate_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self._off or (self._roll_call is not None and not self._everyone_here()):
            return
        if self._changes.pending:  # the last step raised inside optimizer.step()
            self._changes.undo()
            self._record_held(recomputed=False)
        self.held_back = False
        # Deferred mode: the flags agreed at the steps before. Late kinds are acted on at a
        # set step (the next), the same on every rank; a skip the device made is only told.
        for _, values in self._copy.take(wait=self._acts_late):
            self._act(values, step, optimizer, now=False)
        reads_now = self._reads_now
        if reads_now is None:
            reads_now = self._reads_now = self._plan.reads_every_step(takes_device_flag(optimizer))
            # Said up front where it is known from the optimizer's kind (LBFGS); each such
            # step's record says it was applied (_record_held: its closure made new gradients).
            if self._skips and computes_gradients_in_step(optimizer):
                self._context.log(
                    "policies:closure", logging.WARNING,
                    "stabmon: rank %d: on_anomaly skip cannot hold %s's steps back: it "
                    "computes the gradients it applies inside step(closure), after stabmon's "
                    "check; those steps are applied and recorded as such (use stop or "
                    "lr_scale with this optimizer)", self._rank, type(optimizer).__name__,
                )  # fmt: skip
        flags = agree(self._own_flags(step, optimizer))  # every rank, every step
        if reads_now:
            self._act(flags.tolist(), step, optimizer, now=True)  # the one sync a step
        else:
            if self._skips:
                skip = flags[self._skips[0]]
                for slot in self._skips[1:]:  # plain indexing: nothing uploaded
                    skip = torch.maximum(skip, flags[slot])
                self._changes.pass_flag(optimizer, (skip > 0).to(torch.float32))
            self._copy.start(flags, step)
        if self._lr_left > 0:
            self._lr_left -= 1
            self._changes.scale_lr(optimizer, self._plan.lr_factor)

    def _everyone_here(self) -> bool:
        """Once, at the first step: whether every rank has a policy, else off (said once)."""
        key, self._roll_call = self._roll_call, None
        if key is None or all_attached(key):
            return True
        self._off = True
        reason = (
            "stabmon with on_anomaly is attached on only some ranks of the job: an agreement "
            "would wait for ranks that never take part; attach it on every rank"
        )
        self._context.event("on_anomaly", state="off", reason=reason)
        self._context.log(
            "policies:off", logging.WARNING, "stabmon: rank %d: on_anomaly off: %s",
            self._rank, reason,
        )  # fmt: skip
        return False

    def step_applied(self) -> None:
        if self._changes.pending:
            self._record_held(self._changes.undo())

    def _record_held(self, recomputed: bool) -> None:
        """The skips of the step just run, as they turned out."""
        records, self._held_records = self._held_records, []
        for kind, at, step, optimizer in records:
            if not recomputed:
                self._record(kind, "skip", at, step, f"step {at} was not applied")
                continue
            self._damaging = _DAMAGING  # such steps are applied: NaNs reach the weights
            self._record(kind, "skip", at, step, f"step {at} was applied: {optimizer}.step was "
                         "given a closure that computed new gradients after the check, so a "
                         "skip cannot hold them back")  # fmt: skip

    def _own_flags(self, step: int, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """This rank's flags: one float64 slot per acting kind, the step it fired at + 1."""
        device = _device_of(optimizer)
        values = [0.0] * len(self._plan.kinds)
        on_device: list[tuple[int, torch.Tensor]] = []
        try:
            with self._lock:
                pending, self._pending = self._pending, {}
            for kind, at in pending.items():
                values[self._slots[kind]] = float(at + 1)
            if self._checks:
                on_device = self._check_gradients(values, step, optimizer)
        except Exception as error:  # the collective goes ahead all the same
            on_device = []
            self._context.log(
                "policies:flags", logging.WARNING,
                "stabmon: on_anomaly could not check step %d on rank %d (%s: %s); it takes "
                "part in the agreement with no flag of its own", step, self._rank,
                type(error).__name__, error,
            )  # fmt: skip
        if device.type == "cpu":  # host memory: built from the values, nothing to wait for
            flags = torch.tensor(values, dtype=torch.float64)
        else:  # filled on the device (a tensor built from a list would be a blocking copy)
            flags = torch.zeros(len(values), dtype=torch.float64, device=device)
            for slot, value in enumerate(values):
                if value:
                    flags[slot] = value
        for slot, fired in on_device:
            flags[slot] = fired
        return flags

    def _check_gradients(
        self, values: list[float], step: int, optimizer: torch.optim.Optimizer
    ) -> list[tuple[int, torch.Tensor]]:
        """The step's own gradients judged: into ``values`` where the norms are in host
        memory (a CPU model), else as device tensors by slot (no value leaves the device)."""
        norms = self._context.gradient_norms()
        if norms is None:
            return []
        at = float(step + 1)
        limit = self.limit
        nonfinite_slot = self._checks.get("nonfinite_grad")
        spike_slot = self._checks.get("grad_spike") if limit is not None else None
        scaler_flag = getattr(optimizer, "found_inf", None)
        if not isinstance(norms, torch.Tensor) or norms.device.type == "cpu":
            host = norms if isinstance(norms, list) else norms.tolist()
            total = math.sqrt(math.fsum(x * x for x in host))
            finite = math.isfinite(total)
            # GradScaler skips an overflow itself: not ours to act on.
            scaler_skips = isinstance(scaler_flag, torch.Tensor) and float(scaler_flag) != 0
            if nonfinite_slot is not None and not finite and not scaler_skips:
                values[nonfinite_slot] = at
            if spike_slot is not None and limit is not None and finite and total > limit:
                values[spike_slot] = at
            return []
        norm = step_norm(norms, norms.device)
        finite_now = torch.isfinite(norm)
        fired: list[tuple[int, torch.Tensor]] = []
        if nonfinite_slot is not None:
            nonfinite_now = ~finite_now
            if isinstance(scaler_flag, torch.Tensor):
                nonfinite_now &= scaler_flag.to(nonfinite_now.device) == 0
            fired.append((nonfinite_slot, nonfinite_now.to(torch.float64) * at))
        if spike_slot is not None and limit is not None:
            spiked = finite_now & (norm > limit)
            fired.append((spike_slot, spiked.to(torch.float64) * at))
        return fired

    # --- acting on agreed flags --------------------------------------------------------------

    def _act(self, values: list[float], step: int, optimizer: torch.optim.Optimizer,
             *, now: bool) -> None:  # fmt: skip
        """Act on the agreed ``values`` at ``step``; ``now``: they are this step's flags."""
        plan, stop = self._plan, None
        skipped = False
        for kind, value in zip(plan.kinds, values, strict=True):
            if not 0 < value < _MAX_STEP:  # 0: did not fire (NaN: not a value we wrote)
                continue
            at = int(value) - 1
            if at <= self._acted.get(kind, -1):
                continue  # acted on already (another rank recorded it later)
            self._acted[kind] = at
            action = plan.actions[kind]
            if action == "stop":
                stop = stop or (kind, at)
                continue
            if action == "skip":
                if now and not skipped:  # this step: hold its gradients back
                    self._changes.hold_gradients(optimizer)
                    skipped = self.held_back = True
                if self._changes.pending:  # said once the step has run (a closure may undo it)
                    self._held_records.append((kind, at, step, type(optimizer).__name__))
                else:
                    self._record(kind, action, at, step, f"step {at} was not applied")
            elif action == "lr_scale":
                self._lr_left = plan.lr_steps
                self._record(kind, action, at, step, f"the LR is x{plan.lr_factor:g} for "
                             f"{plan.lr_steps} steps from step {step}")  # fmt: skip
            elif action == "checkpoint":
                self._checkpoint(kind, at, step)
        if stop is not None:
            kind, at = stop
            self._record_held(recomputed=False)  # the step does not run
            self._record(kind, "stop", at, step, f"stopped before step {step}")
            raise AnomalyStop(kind, step, self._rank, anomaly_step=at)

    def _checkpoint(self, kind: str, at: int, step: int) -> None:
        if self._saved_by_policy:
            self._record(kind, "checkpoint", at, step, "already saved once by a policy")
            return
        save = self.save
        if save is None:
            self._record(kind, "checkpoint", at, step, "no save to call: pass one to "
                         "Monitor.on_checkpoint_action(save)")  # fmt: skip
            return
        self._saved_by_policy = True
        try:
            save(step)  # the loop's own save, before the step is applied
        except Exception as error:  # the loop's save failed: said, and training goes on
            what = f"the save raised {type(error).__name__}: {error}"
        else:
            what = f"saved before step {step}"
        self._record(kind, "checkpoint", at, step, what)

    def _record(self, kind: str, action: str, at: int, step: int, what: str) -> None:
        """An action's event, log line and verdict; a failure here is logged and changes
        nothing the ranks agreed on (the action itself was taken the same on every rank)."""
        try:
            self._tell(kind, action, at, step, what)
        except Exception as error:
            self._context.log(
                "policies:record", logging.WARNING,
                "stabmon: rank %d: on_anomaly.%s: %s at step %d was taken but not recorded "
                "(%s: %s)", self._rank, kind, action, step, type(error).__name__, error,
            )  # fmt: skip

    def _tell(self, kind: str, action: str, at: int, step: int, what: str) -> None:
        result = outcome(kind)
        decision = result.on_stop if action == "stop" else "continue"
        advice = result.advice.format(rank=self._rank)
        last = self._checkpoints.last_good
        if action == "stop" and last is not None:
            advice += f" (step {last['step']}: {last['path']})"
        elif action != "stop":
            advice = f"none now (on_anomaly.{kind}: {action}); if it recurs: {advice}"
        self._context.event("policy", kind=kind, action=action, anomaly_step=at, at_step=step,
                            decision=decision, detail=what)  # fmt: skip
        self._context.log(
            f"policy:{kind}", logging.WARNING,
            "stabmon: rank %d: %s at step %d (on this or another rank; every rank acts alike): "
            "on_anomaly.%s: %s, %s. %s", self._rank, kind, at, kind, action, what, advice,
        )  # fmt: skip
        with self._verdict_lock:
            self._verdict.decide(
                decision, failure_domain=result.failure_domain,
                reason=f"{kind} at step {at}: {what}", kind=kind, step=at,
                recommended_action=advice,
            )  # fmt: skip
            self._write()

    # --- what the judges recorded (any thread) -----------------------------------------------

    def anomaly_recorded(self, kind: str, step: int | None) -> None:
        if kind in self._damaging or kind == "replica_mismatch":
            where = "at an unknown step" if step is None else f"at step {step}"
            since = step
            if step is not None and kind == "replica_mismatch":  # parted since the last check
                since = step - max(self._context.config.replica_check_steps, 1) + 1
            # The saves are recorded by the training thread: one at a time with this one.
            with self._verdict_lock:
                before = self._checkpoints.last_good
                self._checkpoints.damaged(
                    f"{kind} {where} reached the parameters before this save", since
                )
                if self._checkpoints.last_good is not before:  # a save taken back: say so
                    self._verdict.checkpoint(self._checkpoints.last_good)
                    self._write()
        action = self._plan.actions.get(kind)
        if action is None or kind in BEFORE_STEP or self._off:
            return  # not acted on, judged on the device before its step, or policies off
        at = self._context.global_step if step is None else step
        with self._lock:
            self._pending[kind] = max(at, self._pending.get(kind, at))
        if action == "stop":  # the loop may never reach another step (a stall): say so now
            result = outcome(kind)
            with self._verdict_lock:
                self._verdict.decide(
                    result.on_stop, failure_domain=result.failure_domain,
                    reason=f"{kind} at step {at}: stopping at the next optimizer step",
                    kind=kind, step=at, recommended_action=result.advice.format(rank=self._rank),
                )  # fmt: skip
                self._write()

    def grads_judged(self, step: int, summary: GradSummary) -> None:
        if "grad_spike" in self._checks and not summary.nonfinite:
            self._spikes.update(summary.total_norm)
            self.limit = self._spikes.limit()

    # --- checkpoints and the end -------------------------------------------------------------

    def checkpoint_saved(self, step: int | None, path: str | None, completed: bool) -> None:
        with self._verdict_lock:  # damage is recorded from the judging thread
            entry = dict(self._checkpoints.saved(step, path, completed))
            self._verdict.checkpoint(self._checkpoints.last_good)
            self._write()
        self._context.event("checkpoint", **entry)

    def finish(self) -> None:
        """The last judgement: the flags still on their way, then the verdict at exit."""
        for step, values in self._copy.take(wait=True):
            for kind, value in zip(self._plan.kinds, values, strict=True):
                if 0 < value < _MAX_STEP and self._plan.actions[kind] == "skip":
                    at = int(value) - 1
                    if at > self._acted.get(kind, -1):
                        self._acted[kind] = at
                        self._record(kind, "skip", at, step, f"step {at} was not applied")
        with self._verdict_lock:
            self._write()

    def state_dict(self) -> dict[str, Any]:
        return {"grad_spikes": self._spikes.state_dict()}

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("grad_spikes"), dict):
            raise ValueError(f"policies state must be {{'grad_spikes': {{...}}}}, got {state!r}")
        self._spikes.load_state_dict(state["grad_spikes"])
        self.limit = self._spikes.limit()

    @property
    def verdict(self) -> dict[str, Any]:
        """The verdict as written (a copy)."""
        return self._verdict.state

    def _write(self) -> None:
        try:
            self._verdict.write()
        except OSError as error:
            self._context.log(
                "policies:verdict", logging.WARNING,
                "stabmon: cannot write %s (%s); the decisions are in the event log",
                self._verdict.path, error,
            )  # fmt: skip


def _device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    """Where the flags live: the first parameter's device (NCCL needs CUDA tensors)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device  # type: ignore[no-any-return]
    return torch.device("cpu")
