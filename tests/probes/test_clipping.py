"""Gradient norms are measured before clipping, whatever way the loop clips."""

from __future__ import annotations

import gc
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from process_groups import run_group

from stabmon.monitor import Monitor
from stabmon.probes.clipping import clipping_wrapped
from tests.conftest import MonitorFactory
from tests.helpers import scrape, value

ROOT = Path(__file__).resolve().parents[2]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _attached(attach: MonitorFactory) -> tuple[torch.nn.Module, torch.optim.Optimizer, Monitor]:
    """The tiny model, plain SGD and a Monitor that judges every result at once."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    return model, optimizer, attach(model, optimizer, judge_seconds=0)


def _backward(model: torch.nn.Module, scale: float = 100.0, micro_batches: int = 1) -> None:
    for _ in range(micro_batches):  # gradient accumulation: several backward passes, one step
        loss = model(torch.randn(4, 8)).pow(2).mean() * scale / micro_batches
        loss.backward()


def _unclipped_norm(model: torch.nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads))


def test_grad_norm_is_the_pre_clip_norm_when_the_loop_uses_clip_grad_norm(
    attach: MonitorFactory,
) -> None:
    model, optimizer, monitor = _attached(attach)
    for _ in range(3):
        _backward(model, micro_batches=4)
        true_norm = _unclipped_norm(model)
        returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    samples = scrape(monitor.metrics_url)
    assert true_norm > 10  # the clip bit: the post-clip norm would read 1.0
    assert float(returned) == pytest.approx(true_norm, rel=1e-5)
    assert value(samples, "stabmon_grad_norm") == pytest.approx(true_norm, rel=1e-5)
    assert value(samples, "stabmon_grad_clipped_steps_total") == 3
    assert value(samples, "stabmon_grad_clip_coefficient") == pytest.approx(
        1.0 / true_norm, rel=1e-4
    )


def test_module_grad_norms_are_pre_clip_norms(attach: MonitorFactory) -> None:
    model, optimizer, monitor = _attached(attach)
    _backward(model)
    first_layer = math.hypot(*(float(p.grad.norm()) for p in model[0].parameters()))  # type: ignore[union-attr]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    optimizer.step()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_module_grad_norm", module="0") == pytest.approx(
        first_layer, rel=1e-5
    )


def test_grad_norm_is_the_pre_clip_norm_with_get_total_norm_and_clip_grads_with_norm(
    attach: MonitorFactory,
) -> None:
    model, optimizer, monitor = _attached(attach)
    _backward(model)
    params = list(model.parameters())
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, 0.5, total)
    optimizer.step()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_grad_norm") == pytest.approx(float(total), rel=1e-5)
    assert value(samples, "stabmon_grad_clipped_steps_total") == 1


def test_clip_coefficient_is_one_when_the_clip_does_not_bite(attach: MonitorFactory) -> None:
    model, optimizer, monitor = _attached(attach)
    _backward(model, scale=1e-3)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
    optimizer.step()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_grad_clip_coefficient") == 1.0
    assert value(samples, "stabmon_grad_clipped_steps_total") == 0


def test_loop_without_clipping_reports_coefficient_one_and_no_clipped_steps(
    attach: MonitorFactory,
) -> None:
    model, optimizer, monitor = _attached(attach)
    _backward(model)
    true_norm = _unclipped_norm(model)
    optimizer.step()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_grad_norm") == pytest.approx(true_norm, rel=1e-5)
    assert value(samples, "stabmon_grad_clip_coefficient") == 1.0
    assert value(samples, "stabmon_grad_clipped_steps_total") == 0


def _collect_dropped_monitors() -> None:
    """Finalize Monitors an earlier test in this worker dropped without detaching, in a
    reference cycle (an adapter's, when AnomalyStop ended its trainer's train()): they hold
    the clip wrappers until a full collection, which these tests of the wrappers' own
    state must not wait for."""
    gc.collect()
    assert not clipping_wrapped(), "a Monitor of an earlier test is still attached"


def test_detach_restores_torch_clipping_functions(attach: MonitorFactory) -> None:
    from torch.nn.utils import clip_grad

    _collect_dropped_monitors()
    public = torch.nn.utils.clip_grads_with_norm_
    internal = clip_grad._clip_grads_with_norm_
    monitor = attach(_model(), torch.optim.SGD(_model(1).parameters(), lr=0.1))
    assert clipping_wrapped()
    assert clip_grad._clip_grads_with_norm_ is not internal
    monitor.detach()
    assert not clipping_wrapped()
    assert clip_grad._clip_grads_with_norm_ is internal
    assert torch.nn.utils.clip_grads_with_norm_ is public


def test_two_monitors_each_see_only_their_own_clipping(attach: MonitorFactory) -> None:
    _collect_dropped_monitors()
    first, second = _model(0), _model(1)
    first_opt = torch.optim.SGD(first.parameters(), lr=1e-4)
    second_opt = torch.optim.SGD(second.parameters(), lr=1e-4)
    first_mon = attach(first, first_opt, judge_seconds=0, run_id="first")
    second_mon = attach(second, second_opt, judge_seconds=0, run_id="second")
    _backward(first)
    _backward(second, scale=1e-3)
    first_norm, second_norm = _unclipped_norm(first), _unclipped_norm(second)
    torch.nn.utils.clip_grad_norm_(first.parameters(), 1.0)  # only the first loop clips
    first_opt.step()
    second_opt.step()
    first_samples, second_samples = scrape(first_mon.metrics_url), scrape(second_mon.metrics_url)
    assert value(first_samples, "stabmon_grad_norm") == pytest.approx(first_norm, rel=1e-5)
    assert value(first_samples, "stabmon_grad_clipped_steps_total") == 1
    assert value(second_samples, "stabmon_grad_norm") == pytest.approx(second_norm, rel=1e-5)
    assert value(second_samples, "stabmon_grad_clipped_steps_total") == 0
    first_mon.detach()
    assert clipping_wrapped()  # the second Monitor still watches
    second_mon.detach()
    assert not clipping_wrapped()


def test_a_clip_whose_step_is_skipped_is_not_used_for_the_next_step(
    attach: MonitorFactory,
) -> None:
    model, optimizer, monitor = _attached(attach)
    _backward(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.zero_grad()  # the loop gave up on this step (say, a skipped batch)
    _backward(model, scale=1e-3)
    fresh_norm = _unclipped_norm(model)
    optimizer.step()  # no clip this time
    samples = scrape(monitor.metrics_url)
    # The stale pre-clip measurement of the abandoned iteration is not this step's norm.
    assert value(samples, "stabmon_grad_norm") == pytest.approx(fresh_norm, rel=1e-5)


_FSDP_SCRIPT = """
import os, socket, sys, tempfile, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
import stabmon
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
model = FSDP(inner, device_id=torch.device("cpu"))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with tempfile.TemporaryDirectory() as run_dir:
    monitor = stabmon.attach(model, optimizer, serve_metrics=False, run_dir=run_dir,
                             judge_seconds=0)
    (model(torch.randn(4, 8)) * 100).pow(2).mean().backward()
    total = model.clip_grad_norm_(1.0)  # FSDP's own clipping: it computes its own total
    optimizer.step()
    monitor.state_dict()
    text = generate_latest(monitor.registry).decode()
    monitor.detach()
dist.destroy_process_group()
found = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}
print(float(total), found["stabmon_grad_norm"], found["stabmon_grad_clipped_steps"])
"""


@pytest.mark.slow
def test_grad_norm_is_the_pre_clip_norm_with_fsdp_clip_grad_norm(tmp_path: Path) -> None:
    done = run_group([sys.executable, "-c", _FSDP_SCRIPT], timeout=300,
                     env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    total, exported, clipped = (float(v) for v in done.stdout.split()[-3:])
    assert total > 1.0  # the clip bit
    assert exported == pytest.approx(total, rel=1e-5)
    assert clipped == 1


def _clipped_run(attach: MonitorFactory, blown: set[int], clip: bool) -> list[tuple[str, int]]:
    from tests.helpers import events

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay as they are
    monitor = attach(model, optimizer, judge_seconds=0, spike_warmup_steps=20)
    for step in range(60):
        _backward(model, scale=1.0)
        if step in blown:
            for param in model.parameters():
                param.grad.mul_(1000.0)  # type: ignore[union-attr]
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        optimizer.step()
        optimizer.zero_grad()
    path = monitor.event_log_path
    monitor.detach()
    return [(e["kind"], e["step"]) for e in events(path) if e["event"] == "anomaly"]


def test_a_single_spike_that_the_clip_absorbed_is_no_anomaly(attach: MonitorFactory) -> None:
    assert _clipped_run(attach, {40}, clip=True) == []


def test_a_clipped_spike_of_two_steps_is_no_anomaly(attach: MonitorFactory) -> None:
    assert _clipped_run(attach, {40, 41}, clip=True) == []


def test_a_clipped_spike_that_persists_is_a_grad_spike_at_its_first_step(
    attach: MonitorFactory,
) -> None:
    assert _clipped_run(attach, {40, 41, 42}, clip=True) == [("grad_spike", 40)]


def test_an_unclipped_spike_is_a_grad_spike_at_once(attach: MonitorFactory) -> None:
    assert _clipped_run(attach, {40}, clip=False) == [("grad_spike", 40)]


def test_a_clip_is_measured_once_after_a_reattach_under_somebody_elses_wrapper() -> None:
    from torch.nn.utils import clip_grad

    from stabmon.probes.clipping import watch_clipping

    internal, public = clip_grad._clip_grads_with_norm_, torch.nn.utils.clip_grads_with_norm_
    model = _model()
    _backward(model)
    seen: list[float] = []
    first = watch_clipping(lambda p: True, lambda params, max_norm: seen.append(max_norm))
    ours = clip_grad._clip_grads_with_norm_

    def theirs(*args: object, **kwargs: object) -> None:  # a library wraps the clip after us
        ours(*args, **kwargs)

    clip_grad._clip_grads_with_norm_ = theirs  # type: ignore[assignment]
    try:
        first.remove()  # ours stays inside their chain: it cannot be unwrapped under theirs
        second = watch_clipping(lambda p: True, lambda params, max_norm: seen.append(max_norm))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a new wrapper over theirs
        second.remove()
    finally:
        clip_grad._clip_grads_with_norm_ = internal  # type: ignore[assignment]
        torch.nn.utils.clip_grads_with_norm_ = public
    assert seen == [1.0]
