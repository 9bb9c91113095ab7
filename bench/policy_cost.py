"""What an ``on_anomaly`` policy costs a clean step, on the corpus loops (bench/corpus.py).

    python bench/policy_cost.py [--loops gpt lstm cnn] [--steps 200]

Each loop runs clean (no fault) under stabmon with each policy mode; the gate's own time
(``AnomalyPolicies.gate_step``, the policies' whole per-step work on the training thread)
is timed call by call and its median set against the median step time of the same loop
without a policy. Timing the gate itself rather than comparing two runs' wall time keeps
the figure readable on a shared machine, where two runs of the same loop differ by more
than the gate costs. The modes (docs/policies.md):

- ``late``: ``loss_spike: stop``, ``replica_mismatch: stop`` (kinds judged late): a zero
  vector, the agreement, its copy queued to the host and read a step later;
- ``skip``: ``nonfinite_grad: skip``, ``grad_spike: skip`` with the loops' own (foreach)
  optimizers: the step's norm judged against the limit, the agreement, and the flags read
  on the host at the step (the one sync a step on a GPU);
- ``stop``: ``nonfinite_grad: stop``, ``grad_spike: stop``: the same work as ``skip``.

The agreement is one process's here (no all-reduce); on several ranks add one all-reduce
of a few float64 values a step. A policy that fires costs what its action does: a
skipped step saves the optimizer's work; lr_scale writes the LR twice a step for its
window; checkpoint is the loop's own save; stop ends the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402 - a sibling script

from stabmon.policies.plugin import AnomalyPolicies  # noqa: E402

MODES: dict[str, dict[str, str]] = {
    "late": {"loss_spike": "stop", "replica_mismatch": "stop"},
    "skip": {"nonfinite_grad": "skip", "grad_spike": "skip"},
    "stop": {"nonfinite_grad": "stop", "grad_spike": "stop"},
}


class _StepTimes:
    """Wall time between consecutive optimizer steps, from a step pre-hook of our own."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def _run(loop: str, policy: dict[str, str], steps: int) -> tuple[list[float], list[float]]:
    """The loop's step times and the gate's times, in seconds."""
    gate_times: list[float] = []
    original = AnomalyPolicies.gate_step

    def timed(self: AnomalyPolicies, step: int, optimizer: torch.optim.Optimizer) -> None:
        start = time.perf_counter()
        try:
            original(self, step, optimizer)
        finally:
            gate_times.append(time.perf_counter() - start)

    step_times = _StepTimes()
    original_init = torch.optim.Optimizer.__init__

    def hooked_init(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.register_step_pre_hook(step_times)

    AnomalyPolicies.gate_step = timed  # type: ignore[method-assign]
    torch.optim.Optimizer.__init__ = hooked_init  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            config: dict[str, Any] = {"serve_metrics": False, "run_dir": run_dir,
                                      "run_id": loop, "judge_seconds": 0.2,
                                      "stall_seconds": 120.0, "on_anomaly": policy}  # fmt: skip
            corpus.RUNNERS[loop](config, steps, corpus._Injector("clean", steps + 1))
    finally:
        AnomalyPolicies.gate_step = original  # type: ignore[method-assign]
        torch.optim.Optimizer.__init__ = original_init  # type: ignore[method-assign]
    return step_times.times, gate_times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", nargs="+", default=["gpt", "lstm", "cnn"],
                        choices=corpus.LOOPS)  # fmt: skip
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {args.steps} steps, 1 thread; the gate's median time "
          "a step, and its share of the loop's median step without a policy")  # fmt: skip
    print(f"{'loop':6} {'step':>10} " + " ".join(f"{mode:>18}" for mode in MODES))
    for loop in args.loops:
        _run(loop, {}, max(args.steps // 4, 10))  # warm-up: imports, allocator
        step = statistics.median(_run(loop, {}, args.steps)[0])
        cells = []
        for policy in MODES.values():
            gate = statistics.median(_run(loop, policy, args.steps)[1])
            cells.append(f"{gate * 1e6:7.0f} us {gate / step:6.1%}")
        print(f"{loop:6} {step * 1e3:7.2f} ms " + " ".join(f"{cell:>18}" for cell in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
