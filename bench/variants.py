"""The step variants the overhead benchmark compares: stabmon, the floor, and the peers.

Every variant is a context manager taking a :class:`~workloads.Workload` and a
:class:`Context` and yielding a step function; leaving it removes whatever it
attached. The peers (Lightning's ``grad_norm``, ``wandb.watch``) come from the
optional ``bench`` extra (``pip install .[bench]``) and are left out, with the
reason printed, when it is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from workloads import Batch, Workload

import stabmon
from stabmon.export.families import registry_sum

StepFn = Callable[[Batch], None]
GradCheck = Callable[[], object]
Variant = Callable[[Workload, "Context"], contextlib.AbstractContextManager[StepFn]]


@dataclass
class Context:
    """What variants share within one benchmark run: a scratch directory, one wandb run."""

    run_dir: Path
    _wandb_run: Any = field(default=None, repr=False)

    def wandb_run(self) -> Any:
        """One offline wandb run for the whole benchmark (its start takes seconds)."""
        if self._wandb_run is None:
            wandb_dir = self.run_dir / "wandb"
            wandb_dir.mkdir(exist_ok=True)
            os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true")
            import wandb

            # No system-metrics sampler: its process would load this 2-core machine during every
            # variant's rounds, not only wandb's; gradient logging, which is measured, is unchanged.
            settings = wandb.Settings(x_disable_stats=True, x_disable_machine_info=True)
            self._wandb_run = wandb.init(
                project="stabmon-bench", dir=str(wandb_dir), mode="offline", settings=settings
            )
        return self._wandb_run

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def step_fn(
    workload: Workload,
    *,
    before_step: GradCheck | None = None,
    after_step: Callable[[torch.Tensor], None] | None = None,
) -> StepFn:
    model, optimizer, loss_fn = workload.model, workload.optimizer, workload.loss_fn
    device_type, dtype = workload.device.type, workload.autocast

    def step(batch: Batch) -> None:
        inputs, targets = batch
        if dtype is None:
            loss = loss_fn(model(inputs), targets)
        else:
            with torch.autocast(device_type, dtype=dtype):
                loss = loss_fn(model(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        if before_step is not None:
            before_step()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(loss)

    return step


@contextlib.contextmanager
def plain(workload: Workload, context: Context) -> Iterator[StepFn]:
    """Forward, backward, optimizer.step(), zero_grad()."""
    yield step_fn(workload)


@contextlib.contextmanager
def floor(workload: Workload, context: Context) -> Iterator[StepFn]:
    """Plain + one fused on-device read of every gradient: the cost floor."""
    parameters = list(workload.model.parameters())

    def fused_read() -> torch.Tensor:
        grads = [p.grad for p in parameters if p.grad is not None]
        norms = torch._foreach_norm(grads, 2.0)
        total = torch.linalg.vector_norm(torch.stack(norms))
        return torch.isfinite(total)  # stays on device: no .item()

    yield step_fn(workload, before_step=fused_read)


def internal_errors(monitor: stabmon.Monitor) -> int:
    """stabmon_internal_errors_total over components, read from the Monitor's registry."""
    return int(registry_sum(monitor.registry, "stabmon_internal_errors_total"))


def _stabmon(
    workload: Workload, context: Context, *, observe: bool = True, **overrides: Any
) -> Iterator[StepFn]:
    monitor = stabmon.attach(
        workload.model,
        workload.optimizer,
        port=0,
        run_dir=str(context.run_dir),
        event_log=False,
        **overrides,
    )
    try:
        after_step = (lambda loss: monitor.observe(loss=loss)) if observe else None
        yield step_fn(workload, after_step=after_step)
        # A sync under set_sync_debug_mode("error"), or any other failure inside stabmon, is
        # contained and counted rather than raised: a benchmark of a broken monitor is void.
        errors = internal_errors(monitor)
        if errors:
            raise RuntimeError(f"stabmon contained {errors} internal error(s) during the segment")
    finally:
        monitor.detach()


@contextlib.contextmanager
def stabmon_default(workload: Workload, context: Context) -> Iterator[StepFn]:
    """stabmon.attach with default config; observe(loss=loss) every step."""
    yield from _stabmon(workload, context)


@contextlib.contextmanager
def stabmon_every10(workload: Workload, context: Context) -> Iterator[StepFn]:
    """As stabmon, with measure_every=10."""
    yield from _stabmon(workload, context, measure_every=10)


@contextlib.contextmanager
def stabmon_judge_each(workload: Workload, context: Context) -> Iterator[StepFn]:
    """As stabmon, judging each result as soon as it is on the host (judge_seconds=0), rather
    than in batches: what the batching saves."""
    yield from _stabmon(workload, context, judge_seconds=0)


# --- the breakdown of stabmon's cost (--breakdown) --------------------------------------------


#: A measure_every no run reaches: step 0 is measured, then none.
NEVER_AGAIN = 2**62


def _no_op(*args: Any) -> None:
    return None


@contextlib.contextmanager
def torch_hooks(workload: Workload, context: Context) -> Iterator[StepFn]:
    """Plain with four no-op hooks where stabmon puts its own: PyTorch's hook dispatch alone."""
    model, optimizer = workload.model, workload.optimizer
    handles = [
        model.register_forward_pre_hook(_no_op, with_kwargs=True),
        model.register_forward_hook(_no_op),
        optimizer.register_step_pre_hook(_no_op),
        optimizer.register_step_post_hook(_no_op),
    ]
    try:
        yield step_fn(workload)
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def stabmon_hooks_only(workload: Workload, context: Context) -> Iterator[StepFn]:
    """stabmon with no gradient measurement after the first step and no observe(): what its
    hooks cost by themselves (phase timing, the input device check, the heartbeat)."""
    yield from _stabmon(workload, context, observe=False, measure_every=NEVER_AGAIN)


@contextlib.contextmanager
def stabmon_no_observe(workload: Workload, context: Context) -> Iterator[StepFn]:
    """stabmon with default config but no observe(loss): the loss's share by difference."""
    yield from _stabmon(workload, context, observe=False)


@contextlib.contextmanager
def manual(workload: Workload, context: Context) -> Iterator[StepFn]:
    """The usual hand-written monitor: norm().item() and isnan().any().item() per parameter."""
    parameters = list(workload.model.parameters())

    def per_parameter_read() -> list[tuple[float, bool]]:
        return [
            (p.grad.norm().item(), bool(torch.isnan(p.grad).any().item()))
            for p in parameters
            if p.grad is not None
        ]

    yield step_fn(workload, before_step=per_parameter_read)


def _lightning_grad_norm() -> Callable[..., dict[str, torch.Tensor]]:
    try:
        from lightning.pytorch.utilities import grad_norm
    except ImportError:
        from pytorch_lightning.utilities import grad_norm
    return grad_norm  # type: ignore[no-any-return]  # Lightning's own annotation


@contextlib.contextmanager
def lightning_grad_norm(workload: Workload, context: Context) -> Iterator[StepFn]:
    """Lightning's grad_norm(model, norm_type=2) before every step (on_before_optimizer_step)."""
    grad_norm, model = _lightning_grad_norm(), workload.model
    yield step_fn(workload, before_step=lambda: grad_norm(model, norm_type=2))


def _wandb_watch(workload: Workload, context: Context, log_freq: int) -> Iterator[StepFn]:
    run = context.wandb_run()
    run.watch(workload.model, log="gradients", log_freq=log_freq)
    try:
        yield step_fn(workload)
    finally:
        run.unwatch(workload.model)


@contextlib.contextmanager
def wandb_watch_1(workload: Workload, context: Context) -> Iterator[StepFn]:
    """wandb.watch(model, log="gradients", log_freq=1), offline."""
    yield from _wandb_watch(workload, context, 1)


@contextlib.contextmanager
def wandb_watch_1000(workload: Workload, context: Context) -> Iterator[StepFn]:
    """wandb.watch(model, log="gradients") at its default log_freq=1000, offline."""
    yield from _wandb_watch(workload, context, 1000)


CORE: dict[str, Variant] = {
    "plain": plain,
    "floor": floor,
    "stabmon": stabmon_default,
    "stabmon_every10": stabmon_every10,
    "manual": manual,
}
PEERS: dict[str, Variant] = {
    "lightning_grad_norm": lightning_grad_norm,
    "wandb_watch_1": wandb_watch_1,
    "wandb_watch_1000": wandb_watch_1000,
}
#: Where stabmon's cost goes, by difference (overhead.py --breakdown).
BREAKDOWN: dict[str, Variant] = {
    "torch_hooks": torch_hooks,
    "stabmon_hooks_only": stabmon_hooks_only,
    "stabmon_no_observe": stabmon_no_observe,
}
#: Variants that must never synchronise with a CUDA device (checked in --device cuda runs).
SYNC_FREE = frozenset({"plain", "floor", "stabmon", "stabmon_every10", *BREAKDOWN})


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def peer_problems() -> dict[str, str]:
    """Peers that cannot run here, each with the reason."""
    problems = {}
    if not (_installed("lightning") or _installed("pytorch_lightning")):
        problems["lightning_grad_norm"] = "needs lightning or pytorch_lightning"
    if not _installed("wandb"):
        problems["wandb_watch_1"] = problems["wandb_watch_1000"] = "needs wandb"
    return {name: f"{why} (pip install .[bench])" for name, why in problems.items()}


def select(*, peers: bool, breakdown: bool = False) -> tuple[dict[str, Variant], dict[str, str]]:
    """The variants to run and those left out, with the reason."""
    extra = dict(BREAKDOWN) if breakdown else {}
    if not peers:
        return {**CORE, **extra}, dict.fromkeys(PEERS, "left out (--no-peers)")
    problems = peer_problems()
    chosen = {**CORE, **{name: v for name, v in PEERS.items() if name not in problems}, **extra}
    return chosen, problems
