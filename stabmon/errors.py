"""Exceptions that stabmon raises to its caller.

Only user errors escape, and only at set-up time (``attach``, ``load_config``);
nothing raised inside a hook or a background thread reaches the training loop
(see :mod:`stabmon.shared.guard`).

    StabmonError                  base of everything stabmon raises on purpose
     ├── ConfigError              a config key, type or value is not allowed
     ├── AlreadyAttachedError     the model or optimizer already has a Monitor
     ├── DeviceMismatchError      a tensor is on the wrong device (only with
     │                            ``device_check: raise``, which asks for it)
     ├── TrainingStalled          no step completed within the stall limit (only
     │                            with ``stall_action: raise``, which asks for it)
     └── AnomalyStop              an anomaly whose ``on_anomaly`` action is ``stop``,
                                  raised by ``optimizer.step()`` on every rank at once
"""

from __future__ import annotations

__all__ = [
    "AlreadyAttachedError",
    "AnomalyStop",
    "ConfigError",
    "DeviceMismatchError",
    "StabmonError",
    "TrainingStalled",
]


class StabmonError(Exception):
    """Base class of the errors stabmon raises on purpose."""


class ConfigError(StabmonError, ValueError):
    """A config value is unknown, of the wrong type or out of range.

    The message reads ``<key> in <source>: <problem>``; the same facts are on
    the attributes so tools can act on them.
    """

    def __init__(self, problem: str, *, key: str | None, source: str, allowed: str = "") -> None:
        self.key = key
        self.source = source
        self.allowed = allowed
        self.problem = problem
        where = f"{key} in {source}" if key else source
        super().__init__(f"{where}: {problem}")


class AlreadyAttachedError(StabmonError):
    """A second Monitor was attached to a model or optimizer that has one."""


class DeviceMismatchError(StabmonError, RuntimeError):
    """A parameter, buffer, optimizer state or forward input is on another device.

    Raised only with ``device_check: raise``, from ``attach`` or from the forward
    pre-hook, before PyTorch's own, less specific error.
    """


class TrainingStalled(StabmonError, RuntimeError):
    """No optimizer step completed within the stall limit, and ``stall_action: raise`` asked
    for this exception in the training thread (see docs/runbooks.md#stabmontrainingstalled).

    Raised asynchronously at the training thread's next Python instruction: a thread blocked
    inside a C call (a collective, a lock) sees it only when the call returns, which is why
    ``stall_action: exit`` exists. The evidence (stacks, phase, step, collectives issued, the
    verdict) is in the event log before it is raised.
    """

    def __init__(
        self,
        message: str = (
            "stabmon: no training step completed within the stall limit (stall_action: raise); "
            "the evidence is in the run's event log"
        ),
    ) -> None:
        super().__init__(message)


class AnomalyStop(StabmonError, RuntimeError):
    """An anomaly whose ``on_anomaly`` action is ``stop`` (docs/policies.md).

    Raised by ``optimizer.step()`` (from its pre-hook, so that step is not applied) in the
    training thread of every rank, at the same step: the ranks agree on it with one small
    all-reduce. Catch it to save what you need and exit; the rank's ``verdict.json`` names
    the decision, the last good checkpoint and what to do next.
    """

    def __init__(self, kind: str, step: int, rank: int, *, anomaly_step: int | None = None) -> None:
        #: The anomaly kind (``nonfinite_grad``, ``loss_spike``, ...).
        self.kind = kind
        #: The optimizer step that was not applied (0-based, across resumes).
        self.step = step
        #: This process's rank.
        self.rank = rank
        #: The step the anomaly was recorded at (on whichever rank saw it first).
        self.anomaly_step = step if anomaly_step is None else anomaly_step
        super().__init__(
            f"stabmon: {kind} at step {self.anomaly_step} (on_anomaly.{kind}: stop); rank {rank} "
            f"stopped before applying step {step}. The rank's verdict.json in the run directory "
            "names the last good checkpoint to resume from"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled across processes (multiprocessing, Ray) with its keyword argument intact.
        return (_anomaly_stop, (self.kind, self.step, self.rank, self.anomaly_step))


def _anomaly_stop(kind: str, step: int, rank: int, anomaly_step: int) -> AnomalyStop:
    return AnomalyStop(kind, step, rank, anomaly_step=anomaly_step)
