"""The plan: what each anomaly kind does, read once from ``on_anomaly`` at attach.

Kinds come in two sorts, which decides when an action can happen:

- checked before the step (:data:`BEFORE_STEP`: ``nonfinite_grad``, ``grad_spike``): the
  gate judges the step's own gradients on the device in the optimizer's pre-hook, so an
  action lands before the step is applied;
- judged late (every other kind): a detector records it a step or more after the fact, on
  the host; the action lands at the first optimizer step after the ranks agreed on it.

Where the host must know the agreed flags at the very step (a ``stop``, ``checkpoint`` or
``lr_scale`` on a kind checked before the step, or a ``skip`` for an optimizer that takes
no device flag), the gate reads them then: one host-device sync per step, only while such
a policy is configured. Otherwise the flags are read a step later, without a sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["BEFORE_STEP", "OUTCOMES", "Outcome", "Plan"]

#: Kinds judged on the step's own gradients, on the device, before the step is applied.
BEFORE_STEP: tuple[str, ...] = ("nonfinite_grad", "grad_spike")


class Outcome(NamedTuple):
    """How a kind reads in a verdict, in the vocabulary of the resiliency tools."""

    #: "workload" (the model, the data, the hyper-parameters), "infrastructure" or "unknown".
    failure_domain: str
    #: What a stop means for the job: "stop" (a restart as is repeats it) or "restart".
    on_stop: str
    #: What to do next, said to a person or a launcher.
    advice: str


_RESUME = "resume from the last good checkpoint"
#: Per kind; a kind not listed (a plug-in's) reads as unknown.
OUTCOMES: dict[str, Outcome] = {
    "nonfinite_grad": Outcome(
        "workload",
        "stop",
        f"{_RESUME} and skip the batches in rank-{{rank}}.skip_batches.json, or lower the LR",
    ),
    "nonfinite_loss": Outcome(
        "workload",
        "stop",
        f"{_RESUME} and skip the batches in rank-{{rank}}.skip_batches.json, or lower the LR",
    ),
    "grad_spike": Outcome(
        "workload", "stop", f"{_RESUME} with a lower LR or a tighter gradient clip"
    ),
    "loss_spike": Outcome(
        "workload",
        "stop",
        f"{_RESUME}; look at the batches in rank-{{rank}}.skip_batches.json, lower the LR",
    ),
    "replica_mismatch": Outcome(
        "infrastructure",
        "restart",
        f"{_RESUME} without this node: a replica diverged (a faulty GPU, memory or link)",
    ),
    "stall": Outcome(
        "unknown", "restart", "restart the job; the hang evidence is in the event log"
    ),
    "slowdown": Outcome(
        "infrastructure",
        "restart",
        "restart on healthy nodes; `stabmon compare` says which phase slowed down",
    ),
    "memory_leak": Outcome(
        "workload",
        "restart",
        f"{_RESUME} (a new process frees the memory); find the leak with the allocator snapshot",
    ),
}
_UNKNOWN = Outcome("unknown", "stop", "look at the event log of this rank")


def outcome(kind: str) -> Outcome:
    """How ``kind`` reads in a verdict."""
    return OUTCOMES.get(kind, _UNKNOWN)


@dataclass(frozen=True)
class Plan:
    """The kinds that act (action not ``none``), in a fixed order every rank shares."""

    #: kind -> action, for the kinds whose action is not "none".
    actions: dict[str, str]
    #: The kinds in slot order: the agreed flag vector has one slot per kind.
    kinds: tuple[str, ...]
    lr_factor: float
    lr_steps: int

    @classmethod
    def from_config(cls, policies: Any) -> Plan | None:
        """The plan of an ``on_anomaly`` section; None when every kind's action is none."""
        fields = policies.to_dict()
        actions = {
            kind: action
            for kind, action in fields.items()
            if isinstance(action, str) and action != "none"
        }
        if not actions:
            return None
        return cls(
            actions=actions,
            kinds=tuple(sorted(actions)),
            lr_factor=float(policies.lr_scale_factor),
            lr_steps=int(policies.lr_scale_steps),
        )

    def slot(self, kind: str) -> int | None:
        return self.kinds.index(kind) if kind in self.actions else None

    @property
    def before_step(self) -> tuple[str, ...]:
        """The acting kinds judged on the step's gradients, in slot order."""
        return tuple(kind for kind in self.kinds if kind in BEFORE_STEP)

    @property
    def judged_late(self) -> tuple[str, ...]:
        return tuple(kind for kind in self.kinds if kind not in BEFORE_STEP)

    def reads_every_step(self, takes_device_flag: bool) -> bool:
        """Whether the host must read the agreed flags at the step itself (one sync a step):
        an action before the step other than a skip the optimizer can take as a device flag."""
        for kind in self.before_step:
            action = self.actions[kind]
            if action != "skip" or not takes_device_flag:
                return True
        return False
