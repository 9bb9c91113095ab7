"""torch.compile: stabmon causes no graph break; a compiled model's metrics equal an eager one's.

A graph break is detected two ways. ``fullgraph=True`` makes dynamo raise on any
break, so a compiled loop that trains at all has none. Without it, dynamo's own
``counters["graph_break"]`` records every break by reason;
``test_graph_break_checks_see_a_break_inside_a_forward_hook`` shows that both
checks catch a break inside a forward hook, so a quiet check here means
something. (``torch._dynamo.explain`` is asserted too, but in torch 2.13 it does
not count a break inside a module hook, so it cannot stand alone.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import MonitorFactory
from helpers import events, scrape, value
from torch._dynamo.utils import counters
from torch.nn.utils import get_total_norm

import stabmon

Forward = Callable[[torch.Tensor], torch.Tensor]

MODES = ("attach-then-compile", "compile-then-attach", "compile-in-place", "in-place-then-attach")
# Importing inductor defines TorchScript classes, which warn in torch 2.13; not stabmon's warning.
INDUCTOR_IMPORT_WARNING = "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"


@pytest.fixture
def attach(attach: MonitorFactory) -> MonitorFactory:
    """Tests here compare what is exported after each step: each result judged at once."""
    return functools.partial(attach, judge_seconds=0)


class Net(torch.nn.Module):
    """A user's module (not a torch.nn container), with a branch that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1)
        self.spare = torch.nn.Linear(16, 1)  # unused in forward: its 2 parameters stay None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(inputs)))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and reads only its own graph-break counts."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _graph_breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


def _compiled(
    mode: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    attach: MonitorFactory, backend: str,
) -> tuple[stabmon.Monitor, Forward]:  # fmt: skip
    """Attach and compile in the order ``mode`` names; return the monitor and what to call."""
    if mode == "attach-then-compile":
        monitor = attach(model, optimizer)
        return monitor, torch.compile(model, fullgraph=True, backend=backend)
    if mode == "compile-then-attach":  # hooks go on the OptimizedModule wrapper
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        return attach(compiled, optimizer), compiled
    if mode == "compile-in-place":
        monitor = attach(model, optimizer)
        model.compile(fullgraph=True, backend=backend)
        return monitor, model
    assert mode == "in-place-then-attach"
    model.compile(fullgraph=True, backend=backend)
    return attach(model, optimizer), model


def _train(
    forward: Forward, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    monitor: stabmon.Monitor, steps: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Train ``steps`` steps; after each, what stabmon exports and what it should export."""
    records = []
    for step in range(steps):
        loss = forward(_batch(step)).pow(2).mean()
        loss.backward()
        reference = get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
        samples = scrape(monitor.metrics_url)
        records.append(
            {
                "steps": value(samples, "stabmon_steps_total"),
                "grad_norm": value(samples, "stabmon_grad_norm"),
                "reference_norm": float(reference),
                "loss": value(samples, "stabmon_loss"),
                "reference_loss": float(loss.detach()),
                "zero_grad_params": value(samples, "stabmon_zero_grad_params"),
                "internal_errors": sum(
                    v for (n, _), v in samples.items() if n == "stabmon_internal_errors_total"
                ),
                "unique_graphs": counters["stats"]["unique_graphs"],
            }
        )
    return records


def _eager_records(attach: MonitorFactory, steps: int) -> list[dict[str, Any]]:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return _train(model, model, optimizer, attach(model, optimizer), steps)


def _assert_matches_eager(compiled: list[dict[str, Any]], eager: list[dict[str, Any]]) -> None:
    assert len(compiled) == len(eager)
    for step, (got, want) in enumerate(zip(compiled, eager, strict=True)):
        assert got["steps"] == want["steps"] == step + 1
        assert got["grad_norm"] == pytest.approx(got["reference_norm"], rel=1e-5), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), step
        assert got["loss"] == pytest.approx(got["reference_loss"], rel=1e-6), step
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), step
        assert got["zero_grad_params"] == want["zero_grad_params"] == 2, step
        assert got["internal_errors"] == 0, step


@pytest.mark.parametrize("mode", MODES)
def test_compiled_model_metrics_match_an_uncompiled_run(attach: MonitorFactory, mode: str) -> None:
    eager = _eager_records(attach, 4)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor, forward = _compiled(mode, model, optimizer, attach, "aot_eager")
    compiled = _train(forward, model, optimizer, monitor, 4)  # fullgraph: a break would raise
    _assert_matches_eager(compiled, eager)
    assert _graph_breaks() == {}
    # The hooks read no state that changes per step: the graph compiled at step 1 is reused.
    assert compiled[0]["unique_graphs"] >= 1
    assert compiled[-1]["unique_graphs"] == compiled[0]["unique_graphs"]
    assert monitor.state_dict()["step"] == 4


@pytest.mark.slow
@pytest.mark.filterwarnings(INDUCTOR_IMPORT_WARNING)
@pytest.mark.parametrize("mode", ["attach-then-compile", "compile-in-place"])
def test_inductor_compiled_model_metrics_match_an_uncompiled_run(
    attach: MonitorFactory, mode: str
) -> None:
    eager = _eager_records(attach, 3)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor, forward = _compiled(mode, model, optimizer, attach, "inductor")  # the default
    compiled = _train(forward, model, optimizer, monitor, 3)
    _assert_matches_eager(compiled, eager)
    assert compiled[-1]["unique_graphs"] >= 1  # the loop really ran compiled code
    assert _graph_breaks() == {}


@pytest.mark.parametrize("container", ["sequential", "module"])
def test_stabmon_hooks_cause_no_graph_break_when_breaks_are_allowed(
    attach: MonitorFactory, container: str
) -> None:
    # Dynamo enters torch.nn containers and user modules by different paths (trace_rules).
    model = torch.nn.Sequential(torch.nn.Linear(8, 1)) if container == "sequential" else Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer)
    compiled = torch.compile(model, backend="eager")  # no fullgraph: breaks are only counted
    for step in range(2):
        compiled(_batch(step)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert _graph_breaks() == {}
    explained = torch._dynamo.explain(model)(_batch(0))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 2


def test_non_strict_export_of_an_attached_model_is_no_training_forward(
    attach: MonitorFactory,
) -> None:
    model = Net()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.export.export(model, (_batch(0),), strict=False)  # runs the hooks, eagerly, tracing
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_phase_seconds_total", phase="forward") == 0
    assert value(samples, "stabmon_internal_errors_total", component="hooks") == 0


def test_graph_break_checks_see_a_break_inside_a_forward_hook() -> None:
    def breaking_hook(module: torch.nn.Module, args: Any) -> None:
        torch._dynamo.graph_break()

    model = Net()
    model.register_forward_pre_hook(breaking_hook)
    torch.compile(model, backend="eager")(_batch(0))
    assert sum(_graph_breaks().values()) >= 1
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(model, backend="eager", fullgraph=True)(_batch(0))


@pytest.mark.parametrize("mode", MODES)
def test_track_epochs_and_named_phases_work_with_a_compiled_model(
    attach: MonitorFactory, mode: str
) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor, forward = _compiled(mode, model, optimizer, attach, "eager")
    loader = [_batch(step) for step in range(3)]
    for _epoch in range(2):
        for batch in monitor.track(loader):
            loss = forward(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
        with monitor.phase("eval"), torch.no_grad():
            monitor.observe(loss=forward(loader[0]).pow(2).mean() * 1e6)  # not a training loss
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 6
    assert value(samples, "stabmon_epoch") == 2
    assert value(samples, "stabmon_data_wait_seconds_count") == 6  # each next() of the loader
    assert value(samples, "stabmon_phase_seconds_total", phase="eval") > 0
    assert value(samples, "stabmon_loss") < 1e3
    assert value(samples, "stabmon_anomalies_total", kind="loss_spike") == 0
    internal = [v for (n, _), v in samples.items() if n == "stabmon_internal_errors_total"]
    assert internal and not any(internal)
    assert _graph_breaks() == {}
    if mode == "compile-then-attach":  # hooks on the wrapper run outside the compiled code
        assert value(samples, "stabmon_phase_seconds_total", phase="forward") > 0
        assert value(samples, "stabmon_phase_seconds_total", phase="backward") > 0


@pytest.mark.parametrize(
    ("compiled", "observe_before_step"),
    [
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    ],
    ids=["eager-observe-after-step", "eager-observe-before-step", "compiled-observe-after-step",
         "compiled-observe-before-step"],
)  # fmt: skip
def test_loss_spike_is_recorded_at_the_step_of_its_gradient_spike(
    attach: MonitorFactory, compiled: bool, observe_before_step: bool
) -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the spike leaves the weights alone
    monitor = attach(model, optimizer, spike_warmup_steps=5)
    forward = torch.compile(model, fullgraph=True, backend="eager") if compiled else model
    for step in range(12):
        loss = forward(_batch(step)).pow(2).mean() * (1000.0 if step == 9 else 1.0)
        loss.backward()
        if observe_before_step:
            monitor.observe(loss=loss)
        optimizer.step()
        optimizer.zero_grad()
        if not observe_before_step:
            monitor.observe(loss=loss)
    spikes = sorted(
        (record["kind"], record["step"])
        for record in events(monitor.event_log_path)
        if record["event"] == "anomaly"
    )
    assert spikes == [("grad_spike", 9), ("loss_spike", 9)]


def _heavy_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 1),
    )  # fmt: skip


@pytest.mark.parametrize(
    "compiled",
    [False, True],
    ids=["eager", "compiled"],
)
def test_forward_and_backward_time_is_not_counted_as_input_wait(
    attach: MonitorFactory, compiled: bool
) -> None:
    model = _heavy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    monitor = attach(model, optimizer)
    forward = torch.compile(model, fullgraph=True, backend="eager") if compiled else model
    batch = torch.randn(512, 256)  # already in memory: the loop never waits for input

    def phases() -> dict[str, float]:
        samples = scrape(monitor.metrics_url)
        return {
            phase: value(samples, "stabmon_phase_seconds_total", phase=phase) or 0.0
            for phase in ("data_wait", "forward", "backward", "optimizer")
        }

    for _ in range(2):  # compile outside the measured window
        forward(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    before = phases()
    for _ in range(10):
        forward(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    spent = {phase: seconds - before[phase] for phase, seconds in phases().items()}
    assert spent["data_wait"] < 0.5 * sum(spent.values()), spent


@pytest.mark.filterwarnings(INDUCTOR_IMPORT_WARNING)  # dynamo's optimizer support imports it
def test_steps_are_counted_when_the_optimizer_step_is_compiled(attach: MonitorFactory) -> None:
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer)

    @torch.compile(backend="eager")  # PyTorch's "compiling the optimizer" recipe
    def step() -> None:
        optimizer.step()

    for index in range(3):
        model(_batch(index)).pow(2).mean().backward()
        reference = float(
            get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        )
        step()
        optimizer.zero_grad()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 3
    assert value(samples, "stabmon_grad_norm") == pytest.approx(reference, rel=1e-5)
