"""stabmon.wiring.step_hooks through its own interface: a :class:`StepHooks` over parts that
an ``Assembly`` (stabmon.wiring.assembly) made from a real tiny CPU model, installed on a real
:class:`~stabmon.wiring.hooks.HookSet`, driven by real training steps, and read back through a
real HTTP scrape. No Monitor; the loop clock is a :class:`~tests.helpers.LoopClock`."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stabmon.config import Config, load_config
from stabmon.errors import StabmonError
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.wiring.assembly import Assembly
from stabmon.wiring.hooks import HookSet
from stabmon.wiring.resources import Resources
from stabmon.wiring.step_hooks import StepHooks, judge_at_exit, owns_param
from tests.helpers import LoopClock, scrape, tiny_model, value


class FailingClock(LoopClock):
    """A loop clock that raises once ``broken`` is set (after attach read it)."""

    broken = False

    def __call__(self) -> float:
        if self.broken:
            raise RuntimeError("clock broke")
        return self.now


class Rig:
    """StepHooks over assembled parts, installed on a tiny model, its registry served."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        model: torch.nn.Module | None = None,
        scaler: object | None = None,
        measure_every: int = 1,
        window_steps: int = 1000,
        **overrides: Any,
    ) -> None:
        settings: dict[str, Any] = {"port": 0, "address": "127.0.0.1", "run_dir": str(tmp_path),
                                    "run_id": "r", "scrape_cache_seconds": 0,
                                    "judge_seconds": 0}  # fmt: skip
        settings.update(overrides)
        config: Config = load_config({}, overrides=settings, env={})
        self.model = model if model is not None else tiny_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        limiter = LogLimiter()
        guard = Guard(limiter)
        self.clock = FailingClock()
        self.resources = Resources(hooks=HookSet(self.model, self.optimizer, scaler))
        self.parts = parts = Assembly(
            config, self.model, self.optimizer, run_id="r", rank=0, plugins=(), guard=guard,
            limiter=limiter, resources=self.resources, clock=self.clock,
        )  # fmt: skip
        parts.serve(local_rank=0, local_world_size=1)
        self.hooks = StepHooks(parts, model=self.model, scaler=scaler, guard=guard,
                               measure_every=measure_every, window_steps=window_steps)  # fmt: skip

    def install(self) -> Rig:
        assert self.resources.hooks is not None
        self.hooks.install(self.resources.hooks)
        return self

    def backward(self) -> float:
        """Forward and backward (hooks fire); returns the gradients' total norm."""
        self.optimizer.zero_grad()
        self.model(torch.randn(4, 8)).pow(2).mean().backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads))

    def step(self, seconds: float = 0.5) -> float:
        """One training step that takes ``seconds`` on the loop clock; its gradient norm."""
        norm = self.backward()
        self.clock.advance(seconds)
        self.optimizer.step()
        return norm

    def metric(self, name: str, **labels: str) -> float | None:
        assert self.resources.exporter is not None
        return value(scrape(self.resources.exporter.url), name, **labels)


RigFactory = Callable[..., Rig]


def _poison(model: torch.nn.Module) -> None:
    """An inf in the first gradient: the GradScaler skips the step."""
    grad = next(model.parameters()).grad
    assert grad is not None
    grad.view(-1)[0] = float("inf")


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[RigFactory]:
    made: list[Rig] = []

    def make(**options: Any) -> Rig:
        made.append(Rig(tmp_path, **options))
        return made[-1]

    yield make
    for one in made:
        one.resources.close()


def test_step_hooks_count_each_optimizer_step_and_publish_its_grad_norm(rig: RigFactory) -> None:
    one = rig().install()
    one.step()
    last = one.step()
    assert one.metric("stabmon_steps_total") == 2
    assert one.metric("stabmon_grad_norm") == pytest.approx(last, rel=1e-5)


def test_step_hooks_time_a_step_on_the_injected_loop_clock(rig: RigFactory) -> None:
    one = rig().install()
    one.step(seconds=1.0)
    one.step(seconds=2.5)
    one.step(seconds=4.0)
    # Each step lasts from the end of the one before to its own end on the loop clock.
    assert one.metric("stabmon_step_duration_seconds_count") == 2
    assert one.metric("stabmon_step_duration_seconds_sum") == pytest.approx(6.5)


def test_step_hooks_measure_gradients_only_every_measure_every_steps(rig: RigFactory) -> None:
    one = rig(measure_every=3).install()
    measured = one.step()
    one.step()
    one.step()
    assert one.metric("stabmon_grad_norm") == pytest.approx(measured, rel=1e-5)
    again = one.step()
    assert one.metric("stabmon_grad_norm") == pytest.approx(again, rel=1e-5)


def test_step_hooks_see_a_clip_grad_norm_and_publish_the_pre_clip_norm(rig: RigFactory) -> None:
    one = rig().install()
    before = one.backward()
    torch.nn.utils.clip_grad_norm_(one.model.parameters(), before / 10)
    one.optimizer.step()
    assert one.metric("stabmon_grad_norm") == pytest.approx(before, rel=1e-5)
    assert one.metric("stabmon_grad_clip_coefficient") == pytest.approx(0.1, rel=1e-4)


def test_step_hooks_forget_a_clips_measurement_when_a_new_forward_starts(rig: RigFactory) -> None:
    one = rig().install()
    stale = one.backward()
    torch.nn.utils.clip_grad_norm_(one.model.parameters(), stale / 10)
    fresh = one.backward()  # gradient accumulation restarted: the clip is stale
    one.optimizer.step()
    assert fresh != pytest.approx(stale, rel=1e-5)
    assert one.metric("stabmon_grad_norm") == pytest.approx(fresh, rel=1e-5)


def test_step_hooks_close_an_epoch_every_window_steps_when_nothing_marks_epochs(
    rig: RigFactory,
) -> None:
    one = rig(window_steps=3).install()
    for _ in range(2):
        one.step()
    assert one.metric("stabmon_epoch") == 0
    one.step()
    assert one.metric("stabmon_epoch") == 1


def test_step_hooks_timed_pass_counts_each_batch_wait_and_closes_an_epoch_at_its_end(
    rig: RigFactory,
) -> None:
    one = rig(window_steps=2).install()
    one.parts.timer.track_loader()  # what Monitor.track() does before the first pass
    one.hooks.epochs.by_loader = True
    batches = [torch.randn(4, 8) for _ in range(3)]
    for batch in one.hooks.timed_pass(batches):
        one.optimizer.zero_grad()
        one.model(batch).pow(2).mean().backward()
        one.optimizer.step()
    assert one.metric("stabmon_data_wait_seconds_count") == 3
    # The pass, not the window of 2 steps, marks epochs once a tracked loader is seen.
    assert one.metric("stabmon_epoch") == 1


def test_step_hooks_count_an_iteration_the_grad_scaler_skipped(rig: RigFactory) -> None:
    model = tiny_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    one = rig(model=model, scaler=scaler).install()
    for poisoned in (False, True):
        one.optimizer.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        scaler.scale(loss).backward()
        if poisoned:
            _poison(model)
        scaler.step(one.optimizer)
        scaler.update()
    assert one.metric("stabmon_steps_total") == 1
    assert one.metric("stabmon_amp_skipped_steps_total") == 1
    assert one.metric("stabmon_amp_loss_scale") == 512.0  # halved by the skipped iteration


def test_step_hooks_contain_a_failing_hook_count_it_and_let_training_go_on(
    rig: RigFactory,
) -> None:
    one = rig().install()
    one.clock.broken = True
    before = [p.detach().clone() for p in one.model.parameters()]
    one.step()  # every timer read in the hooks raises
    assert any(not torch.equal(a, b) for a, b in zip(before, one.model.parameters(), strict=True))
    errors = one.metric("stabmon_internal_errors_total", component="hooks")
    assert errors is not None and errors >= 1


def test_step_hooks_install_refuses_a_scripted_model_saying_to_attach_before_scripting(
    rig: RigFactory,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated
        scripted = torch.jit.script(tiny_model())
    one = rig(model=scripted)
    with pytest.raises(StabmonError, match=r"attach to the Python nn.Module before scripting"):
        one.install()


def test_judge_at_exit_judges_the_results_still_waiting(rig: RigFactory) -> None:
    one = rig(judge_seconds=60).install()
    one.step()  # the first result is judged at once
    last = one.step()  # waits: judge_seconds have not passed on the loop clock
    assert one.metric("stabmon_grad_norm") != pytest.approx(last, rel=1e-5)
    judge_at_exit(weakref.ref(one.hooks))
    assert one.metric("stabmon_grad_norm") == pytest.approx(last, rel=1e-5)


def test_owns_param_is_true_only_for_the_measured_parameters_while_the_hooks_live(
    rig: RigFactory,
) -> None:
    one = rig()
    hooks = weakref.ref(one.hooks)
    param = next(one.model.parameters())
    assert owns_param(hooks, param)
    assert not owns_param(hooks, torch.nn.Parameter(torch.zeros(2)))
    one.resources.close()
    del one.hooks
    gc.collect()
    assert not owns_param(hooks, param)


def test_step_hooks_end_an_iteration_the_grad_scaler_skipped_so_the_wait_after_is_input_wait(
    rig: RigFactory,
) -> None:
    model = tiny_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    one = rig(model=model, scaler=scaler).install()
    one.optimizer.zero_grad()
    loss = model(torch.randn(4, 8)).pow(2).mean()
    scaler.scale(loss).backward()
    _poison(model)
    one.clock.advance(1.0)  # the backward's time
    scaler.step(one.optimizer)  # skipped: the optimizer's step hooks never run
    scaler.update()
    one.clock.advance(3.0)  # waiting for the next batch
    model(torch.randn(4, 8))
    assert one.metric("stabmon_phase_seconds_total", phase="backward") == pytest.approx(1.0)
    assert one.metric("stabmon_phase_seconds_total", phase="data_wait") == pytest.approx(3.0)


def test_step_hooks_book_an_evaluation_forward_to_the_eval_phase_not_the_training_step(
    rig: RigFactory,
) -> None:
    one = rig().install()
    one.step()
    one.clock.advance(2.0)  # waiting for input
    with torch.no_grad():
        one.model(torch.randn(4, 8))  # evaluation without mon.phase: not a training forward
    one.clock.advance(5.0)  # the evaluation runs
    one.step(seconds=0.0)
    assert one.metric("stabmon_phase_seconds_total", phase="eval") == pytest.approx(5.0)
    assert one.metric("stabmon_phase_seconds_total", phase="data_wait") == pytest.approx(2.0)
    assert one.metric("stabmon_steps_total") == 2


def test_step_hooks_timed_pass_times_each_batch_fetch_on_the_injected_loop_clock(
    rig: RigFactory,
) -> None:
    one = rig().install()
    one.parts.timer.track_loader()  # what Monitor.track() does before the first pass
    one.hooks.epochs.by_loader = True

    def slow_loader() -> Iterator[torch.Tensor]:
        for seconds in (1.0, 2.0, 4.0):
            one.clock.advance(seconds)  # the fetch takes this long on the loop clock
            yield torch.randn(4, 8)

    for batch in one.hooks.timed_pass(slow_loader()):
        one.optimizer.zero_grad()
        one.model(batch).pow(2).mean().backward()
        one.optimizer.step()
    assert one.metric("stabmon_data_wait_seconds_sum") == pytest.approx(7.0)
    assert one.metric("stabmon_phase_seconds_total", phase="data_wait") == pytest.approx(7.0)
