"""Monitor lifecycle and what a training loop sees through the real exporter and event log."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import MonitorFactory
from helpers import (
    LoopClock,
    events,
    interruptible_sleep,
    scrape,
    tiny_model,
    train_step,
    value,
    wait_until,
)
from torch.nn.utils import get_total_norm

import stabmon
import stabmon.pipeline.measurements


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01)


# --- lifecycle ------------------------------------------------------------------------------


def test_detach_leaves_model_and_optimizer_hooks_as_before(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    before = (
        dict(model._forward_pre_hooks),
        dict(model._forward_hooks),
        dict(optimizer._optimizer_step_pre_hooks),
        dict(optimizer._optimizer_step_post_hooks),
    )
    monitor = attach(model, optimizer)
    assert len(model._forward_pre_hooks) == len(before[0]) + 1
    train_step(model, optimizer, monitor)
    monitor.detach()
    after = (
        dict(model._forward_pre_hooks),
        dict(model._forward_hooks),
        dict(optimizer._optimizer_step_pre_hooks),
        dict(optimizer._optimizer_step_post_hooks),
    )
    assert after == before
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks


def test_attach_twice_to_the_same_optimizer_raises_a_clear_error(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    attach(model, optimizer)
    with pytest.raises(stabmon.AlreadyAttachedError, match="already attached to this model"):
        attach(model, _sgd(model))
    with pytest.raises(stabmon.AlreadyAttachedError, match="already attached to this optimizer"):
        attach(tiny_model(1), optimizer)


def test_attach_after_detach_works_again(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    attach(model, optimizer).detach()
    monitor = attach(model, optimizer)
    train_step(model, optimizer, monitor)
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 1


def test_monitor_is_a_context_manager_that_detaches(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    with stabmon.attach(model, optimizer, port=0, run_dir=str(tmp_path)) as monitor:
        train_step(model, optimizer, monitor)
        url = monitor.metrics_url
        assert value(scrape(url), "stabmon_steps_total") == 1
    assert monitor.metrics_url is None
    with pytest.raises(OSError):
        scrape(url)
    assert not model._forward_pre_hooks


def test_detach_stops_every_thread_without_waiting_out_their_intervals(
    attach: MonitorFactory,
) -> None:
    import threading

    monitor = attach(tiny_model(), _sgd(tiny_model()), sample_seconds=3600)
    monitor.detach()  # a detach that waited out the sampler's hour would hang here
    names = {thread.name for thread in threading.enumerate()}
    assert not {"stabmon-watchdog", "stabmon-sampler"} & names


def test_bad_config_raises_config_error_before_any_hook(tmp_path: Path) -> None:
    model = tiny_model()
    with pytest.raises(stabmon.ConfigError, match="stall_seconds"):
        stabmon.attach(model, _sgd(model), stall_seconds=-5, run_dir=str(tmp_path))
    assert not model._forward_pre_hooks


# --- gradients, NaN, loss -------------------------------------------------------------------


def test_grad_norm_metric_equals_get_total_norm(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    expected = float(get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    optimizer.step()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_grad_norm") == pytest.approx(expected, rel=1e-5)
    module_norms = [v for (name, _), v in samples.items() if name == "stabmon_module_grad_norm"]
    assert sum(n**2 for n in module_norms) ** 0.5 == pytest.approx(expected, rel=1e-5)


def test_nan_at_step_k_is_logged_at_step_k_and_counted_within_one_step_at_judge_seconds_0(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: a NaN never reaches weights
    monitor = attach(model, optimizer, judge_seconds=0)
    for step in range(8):
        train_step(model, optimizer, monitor, nan_grad=step == 5)
        counted = value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total")
        assert counted == (1 if step >= 5 else 0), f"after step {step}"
    anomalies = [e for e in events(monitor.event_log_path) if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"]) for e in anomalies] == [("nonfinite_grad", 5)]
    assert anomalies[0]["parameters"] == ["0.weight"]
    assert value(scrape(monitor.metrics_url), "stabmon_anomalies_total", kind="nonfinite_grad") == 1


def test_results_wait_up_to_judge_seconds_and_an_epoch_end_judges_them(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=3600)
    train_step(model, optimizer, monitor)
    assert value(scrape(monitor.metrics_url), "stabmon_grad_norm") is not None  # first: at once
    for step in range(1, 6):
        train_step(model, optimizer, monitor, nan_grad=step == 3)
    assert value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total") == 0  # waiting

    monitor.epoch_end()

    assert value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total") == 1
    anomalies = [e for e in events(monitor.event_log_path) if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"]) for e in anomalies] == [("nonfinite_grad", 3)]


def test_results_are_judged_at_the_first_step_end_judge_seconds_after_the_last(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=1.0, window_steps=10**6)  # no epoch ends
    train_step(model, optimizer, monitor)  # judged at once, the first
    judged_first = time.perf_counter()
    train_step(model, optimizer, monitor, nan_grad=True)
    counted = value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total")
    while not counted:  # a running loop: its step ends judge, the judge thread never needs to
        time.sleep(0.01)  # 100 steps a second: fewer than MAX_WAITING_RESULTS wait
        train_step(model, optimizer, monitor)
        counted = value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total")
        assert time.perf_counter() - judged_first < 60, "never judged"

    assert counted == 1
    assert time.perf_counter() - judged_first >= 1.0
    anomalies = [e for e in events(monitor.event_log_path) if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"]) for e in anomalies] == [("nonfinite_grad", 1)]


def test_results_waiting_in_a_quiet_loop_are_judged_by_the_judge_thread(
    attach: MonitorFactory,
) -> None:
    """A NaN followed by a hang (a collective that never returns): no step end judges it."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    # judge_seconds leaves a loaded machine time to scrape before the judge thread acts.
    monitor = attach(model, optimizer, judge_seconds=2.0)
    train_step(model, optimizer, monitor)  # judged at once, the first
    train_step(model, optimizer, monitor, nan_grad=True)
    quiet_since = time.perf_counter()
    assert value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total") == 0

    def anomalies() -> list[tuple[str, int]]:
        records = events(monitor.event_log_path)
        return [(e["kind"], e["step"]) for e in records if e["event"] == "anomaly"]

    while not anomalies():
        assert time.perf_counter() - quiet_since < 60, "the quiet loop's results were not judged"
        time.sleep(0.02)

    assert time.perf_counter() - quiet_since >= 2.0  # judge_seconds of quiet first
    assert anomalies() == [("nonfinite_grad", 1)]
    assert value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total") == 1


def test_a_named_phase_judges_the_results_waiting_before_it(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=3600)
    for step in range(4):
        train_step(model, optimizer, monitor, nan_grad=step == 2)
    assert value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total") == 0

    with monitor.phase("eval"):
        assert value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total") == 1


def test_load_state_dict_judges_the_waiting_results_before_the_resumed_state(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    first = attach(model, optimizer)
    train_step(model, optimizer, first)
    state = first.state_dict()
    first.detach()
    monitor = attach(model, optimizer, judge_seconds=3600)
    for step in range(3):
        train_step(model, optimizer, monitor, nan_grad=step == 1)

    monitor.load_state_dict(state)

    assert value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total") == 1
    anomalies = [e for e in events(monitor.event_log_path) if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"]) for e in anomalies] == [("nonfinite_grad", 1)]


def test_results_waiting_at_a_new_param_group_are_read_with_their_own_layout(
    attach: MonitorFactory,
) -> None:
    """add_param_group rebuilds the probe; the NaN measured before it is still judged."""
    backbone, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    model = torch.nn.Sequential(backbone, head)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=3600)
    for step in range(3):
        model(torch.randn(2, 8)).pow(2).mean().backward()
        if step == 1:
            head.weight.grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            head.weight.nan_to_num_(0.0)  # lr 0 times NaN: undo the poisoned update
    optimizer.add_param_group({"params": backbone.parameters(), "lr": 0.0})  # unfreeze
    model(torch.randn(2, 8)).pow(2).mean().backward()
    optimizer.step()

    monitor.epoch_end()

    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_nonfinite_grad_steps_total") == 1
    assert value(samples, "stabmon_module_grad_norm", module="0") > 0  # the new layout's
    anomalies = [e for e in events(monitor.event_log_path) if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"], e["parameters"]) for e in anomalies] == [
        ("nonfinite_grad", 1, ["1.weight"])
    ]


def test_results_waiting_when_the_model_is_cast_keep_their_parameter_names(
    attach: MonitorFactory,
) -> None:
    """A cast rebuilds the probe in place, reordering its norms; waiting results keep theirs."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].bias.data = model[0].bias.data.double()  # two dtypes: norms in bucket order
    model[1].bias.data = model[1].bias.data.double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=3600)

    def step(nan: bool = False) -> None:
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        if nan:
            model[1].weight.grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
        optimizer.step()
        with torch.no_grad():
            for param in model.parameters():
                param.nan_to_num_(0.0)  # lr 0 times NaN: undo the poisoned update

    step()
    step(nan=True)
    model.double()  # one dtype now: the probe rebuilds with the norms in model order
    step()

    monitor.epoch_end()

    anomalies = [e for e in events(monitor.event_log_path) if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"], e["parameters"]) for e in anomalies] == [
        ("nonfinite_grad", 1, ["1.weight"])
    ]


def test_at_most_max_waiting_results_wait_however_short_the_steps(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stabmon.pipeline.measurements, "MAX_WAITING_RESULTS", 6)
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=3600)
    counted = []
    for step in range(12):
        train_step(model, optimizer, monitor, nan_grad=step == 1)
        counted.append(value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total"))
    # Two results a step (gradients, loss): six wait by the end of step 3, and are judged.
    assert counted == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]


def test_interpreter_exit_judges_the_results_still_waiting(tmp_path: Path) -> None:
    """A run that dies on its own NaN check: the NaN that explains the crash is in the log."""
    script = f"""
import torch, stabmon
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
monitor = stabmon.attach(model, optimizer, port=0, run_dir={str(tmp_path)!r}, run_id="crash",
                         judge_seconds=3600, sample_every=2)
for step in range(5):
    loss = model(torch.randn(2, 4)).pow(2).mean() * (float("nan") if step == 4 else 1.0)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if not torch.isfinite(loss):
        raise RuntimeError("loss diverged")
    monitor.observe(loss=loss)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "loss diverged" in result.stderr
    log = next(tmp_path.glob("crash/**/*.jsonl"))
    records = events(log)
    anomalies = [e for e in records if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"]) for e in anomalies] == [("nonfinite_grad", 4)]
    # Step 4's sample, waiting for a loss that never came, is written too; all of it before
    # the run-dir record says how the process ended.
    assert [e["step"] for e in records if e["event"] == "step_sample"] == [0, 2, 4]
    (record,) = [json.loads(path.read_text()) for path in tmp_path.rglob("rank-?.json")]
    assert record["exit_status"] == "exception"
    assert max(e["time"] for e in records) <= record["exited_unix"]


def test_a_forked_child_that_exits_leaves_the_parents_results_and_record_alone(
    tmp_path: Path,
) -> None:
    """A helper process forked from the training process exits normally: its atexit hooks
    must neither judge the parent's waiting results into the shared log nor end its record."""
    script = f"""
import os, torch, stabmon
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
monitor = stabmon.attach(model, optimizer, port=0, run_dir={str(tmp_path)!r}, run_id="fork",
                         judge_seconds=3600, serve_metrics=False)
for step in range(3):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    monitor.observe(loss=float("nan") if step == 2 else loss)
child = os.fork()
if child == 0:
    raise SystemExit(0)  # a normal exit: atexit hooks run in the child
os.waitpid(child, 0)
import pathlib
print(next(pathlib.Path({str(tmp_path)!r}).rglob("rank-?.json")).read_text())
monitor.detach()
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["exit_status"] is None  # the parent still runs
    log = next(tmp_path.glob("fork/**/*.jsonl"))
    anomalies = [e for e in events(log) if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"]) for e in anomalies] == [("nonfinite_loss", 2)]


def test_a_handler_that_calls_back_into_the_monitor_while_it_judges_does_not_hang(
    tmp_path: Path,
) -> None:
    """Lightning's SLURM requeue handler saves a checkpoint (state_dict, phase) from inside a
    signal handler, which may run while stabmon judges; a logging handler on stabmon's own
    warnings runs while it judges. Either must neither hang the loop nor judge out of order."""
    script = f"""
import json, logging, signal, torch, stabmon
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
monitor = stabmon.attach(model, optimizer, port=0, run_dir={str(tmp_path)!r}, run_id="reenter",
                         judge_seconds=0)
saved = []

def checkpoint(*_):
    with monitor.phase("checkpoint"):
        saved.append(monitor.state_dict()["step"])
    monitor.epoch_end()

class CheckpointOnWarning(logging.Handler):
    def emit(self, record):
        checkpoint()

logging.getLogger("stabmon").addHandler(CheckpointOnWarning(logging.WARNING))
for step in range(300):
    if step == 150:  # from here on also a signal every 2 ms, landing anywhere
        signal.signal(signal.SIGALRM, checkpoint)
        signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    loss = model(torch.ones(2, 4)).pow(2).mean()  # the same loss every step: no spikes
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    monitor.observe(loss=float("nan") if step in (100, 200) else loss)
signal.setitimer(signal.ITIMER_REAL, 0, 0)
families = text_string_to_metric_families(generate_latest(monitor.registry).decode())
errors = sum(s.value for f in families for s in f.samples
             if s.name == "stabmon_internal_errors_total")
monitor.detach()
print(json.dumps({{"checkpoints": len(saved), "internal_errors": errors}}))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["checkpoints"] > 2  # the warnings' checkpoints at least, and some signals'
    assert outcome["internal_errors"] == 0  # no RecursionError from handlers stacked on a lock
    log = next(tmp_path.glob("reenter/**/*.jsonl"))
    anomalies = [e for e in events(log) if e["event"] == "anomaly"]
    assert [(e["kind"], e["step"]) for e in anomalies] == [
        ("nonfinite_loss", 100),
        ("nonfinite_loss", 200),
    ]


def test_non_finite_loss_is_counted_and_exported(attach: MonitorFactory) -> None:
    model = tiny_model()
    monitor = attach(model, _sgd(model), judge_seconds=0)
    monitor.observe(loss=1.5)
    monitor.observe(loss=torch.tensor(float("inf")))
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_nonfinite_loss_total") == 1
    assert value(samples, "stabmon_loss") == float("inf")
    assert value(samples, "stabmon_anomalies_total", kind="nonfinite_loss") == 1


def test_loss_spike_is_detected_after_warmup(attach: MonitorFactory) -> None:
    model = tiny_model()
    monitor = attach(model, _sgd(model), spike_warmup_steps=20, judge_seconds=0)
    for step in range(60):
        monitor.observe(loss=1.0 + 0.01 * (step % 3))
    monitor.observe(loss=25.0)
    assert value(scrape(monitor.metrics_url), "stabmon_anomalies_total", kind="loss_spike") == 1
    kinds = [e["kind"] for e in events(monitor.event_log_path) if e["event"] == "anomaly"]
    assert kinds == ["loss_spike"]


def test_grad_spike_is_detected(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, spike_warmup_steps=20, judge_seconds=0)
    torch.manual_seed(0)
    for step in range(40):
        loss = model(torch.randn(16, 8)).pow(2).mean() * (1000.0 if step == 35 else 1.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    spikes = [
        e
        for e in events(monitor.event_log_path)
        if e.get("event") == "anomaly" and e.get("kind") == "grad_spike"
    ]
    assert [e["step"] for e in spikes] == [35]


def test_zero_grad_params_counts_parameters_without_gradient(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    model(torch.randn(2, 8)).sum().backward()
    model[4].bias.grad = None  # a branch that received no gradient
    model[2].weight.grad.zero_()  # and one whose gradient is exactly zero
    optimizer.step()
    assert value(scrape(monitor.metrics_url), "stabmon_zero_grad_params") == 2


def test_measure_every_measures_only_every_nth_step(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, measure_every=3, judge_seconds=0)
    for step in range(7):
        train_step(model, optimizer, monitor, nan_grad=step in (1, 2, 3, 6))  # 3 and 6 measured
    assert value(scrape(monitor.metrics_url), "stabmon_nonfinite_grad_steps_total") == 2
    nan_steps = [
        e["step"]
        for e in events(monitor.event_log_path)
        if e.get("event") == "anomaly" and e.get("kind") == "nonfinite_grad"
    ]
    assert nan_steps == [3]  # measured steps 3 and 6 are one episode, recorded at its start


# --- timing, phases, epochs -----------------------------------------------------------------


def test_steps_durations_and_phases_are_exported(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    started = time.time()
    for _ in range(5):
        time.sleep(0.02)  # input wait
        train_step(model, optimizer, monitor)
    ended = time.time()
    with monitor.phase("eval"):
        time.sleep(0.05)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 5
    assert value(samples, "stabmon_step_duration_seconds_count") == 4
    assert value(samples, "stabmon_data_wait_seconds_count") == 4
    assert value(samples, "stabmon_data_wait_seconds_sum") >= 4 * 0.02
    assert value(samples, "stabmon_phase_seconds_total", phase="eval") >= 0.05
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        assert value(samples, "stabmon_phase_seconds_total", phase=phase) > 0
    last = value(samples, "stabmon_last_step_timestamp_seconds")
    assert last is not None and started <= last <= ended


def test_track_times_the_loader_and_marks_epochs(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    loader = [torch.randn(4, 8) for _ in range(3)]
    for _epoch in range(2):
        for batch in monitor.track(loader):
            model(batch).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_epoch") == 2
    assert value(samples, "stabmon_data_wait_seconds_count") == 6
    epochs = [e for e in events(monitor.event_log_path) if e["event"] == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    assert "host" in epochs[0]["memory"]


def test_epochs_fall_back_to_windows_of_steps(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer, window_steps=4)
    for _ in range(9):
        train_step(model, optimizer, monitor)
    assert value(scrape(monitor.metrics_url), "stabmon_epoch") == 2


def test_invalid_phase_names_are_counted_as_other(attach: MonitorFactory) -> None:
    monitor = attach(tiny_model(), _sgd(tiny_model()))
    with monitor.phase("not a label {}"):
        time.sleep(0.01)
    assert value(scrape(monitor.metrics_url), "stabmon_phase_seconds_total", phase="other") > 0


# --- memory ---------------------------------------------------------------------------------


def _epochs(
    monitor: stabmon.Monitor, model: torch.nn.Module, count: int, leak: list[torch.Tensor] | None
) -> None:
    optimizer_steps = torch.optim.SGD(model.parameters(), lr=0.0)
    del optimizer_steps  # steps are not needed: epoch ends sample memory
    # Live host tensors per epoch: 16 MiB, or 3% of this process's RSS if that is more (a
    # pytest worker's RSS is whatever the tests before it left; the threshold is relative).
    resident = psutil.Process().memory_info().rss
    chunk = max(16 * 2**20, int(resident * 0.03))
    for _ in range(count):
        if leak is not None:
            leak.append(torch.ones(chunk // 4))
            leak[-1].add_(1)  # touch every page so RSS sees it
        monitor.epoch_end()


def test_host_memory_leak_is_flagged(attach: MonitorFactory) -> None:
    model = tiny_model()
    monitor = attach(model, _sgd(model), leak_window_epochs=1, leak_windows=3, leak_warmup_epochs=1,
                     leak_threshold=0.01)  # fmt: skip
    leaked: list[torch.Tensor] = []
    _epochs(monitor, model, 8, leaked)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_memory_leak_suspected", device="host") == 1
    assert value(samples, "stabmon_anomalies_total", kind="memory_leak") == 1
    assert value(samples, "stabmon_memory_drift_ratio", device="host") > 0.05
    leaks = [e for e in events(monitor.event_log_path) if e.get("kind") == "memory_leak"]
    assert len(leaks) == 1 and leaks[0]["device"] == "host"


def test_clean_loop_of_equal_length_is_not_flagged(attach: MonitorFactory) -> None:
    model = tiny_model()
    monitor = attach(model, _sgd(model), leak_window_epochs=1, leak_windows=3, leak_warmup_epochs=1,
                     leak_threshold=0.01)  # fmt: skip
    _epochs(monitor, model, 8, None)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_memory_leak_suspected", device="host") == 0
    assert value(samples, "stabmon_anomalies_total", kind="memory_leak") == 0
    assert abs(value(samples, "stabmon_memory_drift_ratio", device="host")) < 0.01


def test_host_rss_is_sampled_from_attach(attach: MonitorFactory) -> None:
    monitor = attach(tiny_model(), _sgd(tiny_model()))
    assert value(scrape(monitor.metrics_url), "stabmon_host_memory_rss_bytes") > 10 * 2**20


# --- stall ----------------------------------------------------------------------------------


def test_stall_is_flagged_while_the_loop_sleeps_and_cleared_after(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    clock = LoopClock()
    monitor = attach(model, optimizer, stall_seconds=0.4, clock=clock)
    train_step(model, optimizer, monitor)
    assert value(scrape(monitor.metrics_url), "stabmon_stalled") == 0
    flagged = threading.Event()

    def watch() -> None:  # scrapes from another thread: the main one stays blocked
        wait_until(lambda: value(scrape(monitor.metrics_url), "stabmon_stalled") == 1, "stalled")
        flagged.set()

    watcher = threading.Thread(target=watch, daemon=True)
    clock.advance(1.0)  # the loop is past its limit
    watcher.start()
    interruptible_sleep(flagged)  # the main thread is blocked: only the watchdog can notice
    watcher.join(timeout=30)
    assert value(scrape(monitor.metrics_url), "stabmon_stalled") == 1
    train_step(model, optimizer, monitor)
    wait_until(lambda: value(scrape(monitor.metrics_url), "stabmon_stalled") == 0, "recovered")
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_stalled") == 0
    assert value(samples, "stabmon_anomalies_total", kind="stall") == 1
    stall = next(e for e in events(monitor.event_log_path) if e.get("kind") == "stall")
    assert stall["phase"] == "between_steps"  # the loop sleeps in its own code
    assert any(
        "time.sleep" in line or "sleep(" in line
        for stack in stall["stacks"].values()
        for line in stack
    )
    assert any(e["event"] == "stall_end" for e in events(monitor.event_log_path))


def test_a_stall_is_judged_on_the_injected_loop_clock_not_the_machine_clock(
    attach: MonitorFactory,
) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    clock = LoopClock()
    monitor = attach(model, optimizer, stall_seconds=0.2, clock=clock)
    train_step(model, optimizer, monitor)
    time.sleep(0.6)  # a slow machine: real time passes, the loop clock does not
    assert value(scrape(monitor.metrics_url), "stabmon_stalled") == 0
    clock.advance(0.3)
    wait_until(lambda: value(scrape(monitor.metrics_url), "stabmon_stalled") == 1, "stalled")


def test_a_stall_whose_record_write_hangs_still_sets_the_stalled_gauge(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run directory on a dead NFS mount: the stall's record never gets written, and the
    alert (on the gauge) must fire all the same."""
    from stabmon.export.event_log import EventLog

    model = tiny_model()
    optimizer = _sgd(model)
    clock = LoopClock()
    monitor = attach(model, optimizer, stall_seconds=0.2, clock=clock)
    train_step(model, optimizer, monitor)
    mount_back = threading.Event()
    write = EventLog.write

    def hung_mount(log: EventLog, event: str, **fields: object) -> None:
        if event == "anomaly":
            mount_back.wait(60)
        write(log, event, **fields)

    monkeypatch.setattr(EventLog, "write", hung_mount)
    try:
        clock.advance(0.3)
        wait_until(lambda: value(scrape(monitor.metrics_url), "stabmon_stalled") == 1, "stalled")
        assert not mount_back.is_set()  # the record is still being written
    finally:
        mount_back.set()


def test_named_phase_uses_the_longer_stall_limit(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    clock = LoopClock()
    monitor = attach(model, optimizer, stall_seconds=0.3, phase_stall_seconds=60, clock=clock)
    train_step(model, optimizer, monitor)
    with monitor.phase("eval"):
        clock.advance(0.8)
        time.sleep(0.3)  # a few watchdog looks (it looks every 0.075 s)
        assert value(scrape(monitor.metrics_url), "stabmon_stalled") == 0


# --- never break training -------------------------------------------------------------------


def test_a_probe_that_raises_is_contained_and_counted(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stabmon.probes.grads import GradProbe

    def broken(self: GradProbe) -> None:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(GradProbe, "measure", broken)
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        train_step(model, optimizer, monitor)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_internal_errors_total", component="grads") == 3
    assert value(samples, "stabmon_steps_total") == 3


def test_training_goes_on_when_the_run_dir_is_not_writable(tmp_path: Path) -> None:
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    model = tiny_model()
    optimizer = _sgd(model)
    with stabmon.attach(model, optimizer, port=0, run_dir=str(blocked)) as monitor:
        train_step(model, optimizer, monitor)
        samples = scrape(monitor.metrics_url)
    assert monitor.event_log_path is None
    assert value(samples, "stabmon_internal_errors_total", component="event_log") == 1
    assert value(samples, "stabmon_internal_errors_total", component="rundir") == 1


# --- models and optimizers of every shape ----------------------------------------------------


def test_several_param_groups_frozen_and_unused_parameters(attach: MonitorFactory) -> None:
    model = tiny_model()
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(
        [
            {"params": model[2].parameters(), "lr": 1e-3},
            {"params": model[4].parameters(), "lr": 1e-4},
        ]
    )
    monitor = attach(model, optimizer)
    for _ in range(3):
        train_step(model, optimizer, monitor)
    samples = scrape(monitor.metrics_url)
    modules = {dict(lbl)["module"] for (name, lbl) in samples if name == "stabmon_module_grad_norm"}
    assert modules == {"2", "4"}


def test_model_without_parameters_and_a_standalone_parameter(attach: MonitorFactory) -> None:
    model = torch.nn.ReLU()
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    monitor = attach(model, optimizer)
    model(weight * 2).sum().backward()
    optimizer.step()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_grad_norm") == pytest.approx(2 * 3**0.5)
    assert value(samples, "stabmon_module_grad_norm", module="group0") == pytest.approx(2 * 3**0.5)


def test_sparse_embedding_gradients_work(attach: MonitorFactory) -> None:
    embedding = torch.nn.Embedding(50, 4, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    monitor = attach(embedding, optimizer)
    for _ in range(2):
        embedding(torch.tensor([1, 1, 7])).sum().backward()
        expected = float(embedding.weight.grad.to_dense().norm())
        optimizer.step()
        optimizer.zero_grad()
    assert value(scrape(monitor.metrics_url), "stabmon_grad_norm") == pytest.approx(
        expected, rel=1e-5
    )


def test_gradient_accumulation_counts_optimizer_steps(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    for _ in range(3):
        for _micro in range(4):
            (model(torch.randn(2, 8)).pow(2).mean() / 4).backward()
        optimizer.step()
        optimizer.zero_grad()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 3
    assert value(samples, "stabmon_data_wait_seconds_count") == 2


def test_grad_scaler_scale_and_skipped_steps(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = attach(model, optimizer, scaler=scaler, judge_seconds=0)
    for step in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        scaler.scale(loss).backward()
        if step == 1:
            model[0].weight.grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    model(torch.randn(1, 8))  # the next forward reads the scale back
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_amp_skipped_steps_total") == 1
    assert value(samples, "stabmon_amp_loss_scale") == 512.0
    assert value(samples, "stabmon_steps_total") == 3  # the skipped step never ran


# --- resume ---------------------------------------------------------------------------------


def test_resume_continues_numbering_and_baselines_while_counters_restart(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    first = attach(model, optimizer, leak_warmup_epochs=0)
    for step in range(6):
        train_step(model, optimizer, first, nan_grad=step == 2)
    first.epoch_end()
    state = first.state_dict()
    first.detach()
    assert state["leaks"]["host"]["baseline"] is not None
    torch.save(state, tmp_path / "ckpt.pt")

    resumed = attach(model, optimizer, leak_warmup_epochs=0)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    train_step(model, optimizer, resumed, nan_grad=True)
    samples = scrape(resumed.metrics_url)
    # Counters count this process (a restart is a counter reset to Prometheus) ...
    assert value(samples, "stabmon_steps_total") == 1
    assert value(samples, "stabmon_nonfinite_grad_steps_total") == 1
    # ... while numbering, epochs and baselines continue.
    assert value(samples, "stabmon_epoch") == 1
    nan_events = [
        e
        for e in events(resumed.event_log_path)
        if e.get("event") == "anomaly" and e.get("kind") == "nonfinite_grad"
    ]
    assert [e["step"] for e in nan_events] == [2, 6]
    assert resumed.state_dict()["leaks"] == state["leaks"]
    assert resumed.state_dict()["step"] == 7


def test_load_state_dict_rejects_foreign_state_and_changes_nothing(attach: MonitorFactory) -> None:
    monitor = attach(tiny_model(), _sgd(tiny_model()))
    before = monitor.state_dict()
    with pytest.raises(stabmon.StabmonError, match="not a stabmon Monitor state"):
        monitor.load_state_dict({"epoch": 3})
    with pytest.raises(stabmon.StabmonError, match="missing key.*loss_spikes"):
        monitor.load_state_dict(
            {"version": 2, "step": 1, "epoch": 1, "grad_spikes": {}, "leaks": {}}
        )
    bad = dict(before, step=9, epoch=4, loss_spikes={"count": -1, "mean": 0.0, "var": 0.0})
    with pytest.raises(stabmon.StabmonError, match="malformed.*count"):
        monitor.load_state_dict(bad)
    assert monitor.state_dict() == before


def test_resumed_run_gets_the_start_up_grace_again(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    first = attach(model, optimizer)
    train_step(model, optimizer, first)
    state = first.state_dict()
    first.detach()
    clock = LoopClock()
    resumed = attach(model, optimizer, stall_seconds=0.3, phase_stall_seconds=60, clock=clock)
    resumed.load_state_dict(state)
    clock.advance(0.8)  # loading data, compiling: no step yet in this process
    time.sleep(0.3)  # a few watchdog looks
    assert value(scrape(resumed.metrics_url), "stabmon_stalled") == 0


# --- what training code does to a model with hooks ------------------------------------------


def test_model_can_be_deep_copied_averaged_and_saved_while_attached(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    import copy

    model = tiny_model()
    optimizer = _sgd(model)
    scaler = torch.amp.GradScaler("cpu")
    monitor = attach(model, optimizer, scaler=scaler)
    ema = torch.optim.swa_utils.AveragedModel(model)  # deep-copies the model
    clone = copy.deepcopy(model)
    torch.save(model, tmp_path / "model.pt")
    copied_scaler = copy.deepcopy(scaler)
    assert copied_scaler.update.__self__ is copied_scaler  # the plain method, on the copy
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    for copied in (ema.module, clone, loaded):  # the copies carry none of stabmon's hooks
        assert not copied._forward_pre_hooks and not copied._forward_hooks
    for other in (ema, clone, loaded):
        other(torch.randn(2, 8)).sum().backward()  # the copies' hooks are inert
    train_step(model, optimizer, monitor)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 1
    assert value(samples, "stabmon_internal_errors_total", component="hooks") == 0


def test_compiled_model_trains_without_graph_breaks_from_stabmon(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    model.compile(backend="eager", fullgraph=True)  # compiles _call_impl: the hooks are traced
    for _ in range(3):
        train_step(model, optimizer, monitor)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_steps_total") == 3
    assert value(samples, "stabmon_grad_norm") > 0
    torch._dynamo.reset()


def test_attach_that_fails_halfway_leaves_nothing_behind(tmp_path: Path) -> None:
    import threading
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated
        scripted = torch.jit.script(torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(scripted.parameters(), lr=0.1)
    with pytest.raises(stabmon.StabmonError, match="cannot install hooks on RecursiveScriptModule"):
        stabmon.attach(scripted, optimizer, port=0, run_dir=str(tmp_path))
    assert not {"stabmon-watchdog", "stabmon-sampler"} & {t.name for t in threading.enumerate()}
    model = torch.nn.Linear(2, 2)
    with stabmon.attach(
        model, torch.optim.SGD(model.parameters(), lr=0.1), port=0, run_dir=str(tmp_path)
    ):
        pass


def test_a_monitor_dropped_without_detach_is_collected(tmp_path: Path) -> None:
    import gc
    import threading
    import weakref

    model = tiny_model()
    optimizer = _sgd(model)
    monitor = stabmon.attach(model, optimizer, port=0, run_dir=str(tmp_path))
    train_step(model, optimizer, monitor)
    gone = weakref.ref(monitor)
    del monitor
    gc.collect()
    assert gone() is None
    time.sleep(0.3)
    assert not {"stabmon-watchdog", "stabmon-sampler"} & {t.name for t in threading.enumerate()}
    assert not model._forward_pre_hooks and not optimizer._optimizer_step_pre_hooks
    stabmon.attach(model, optimizer, port=0, run_dir=str(tmp_path)).detach()  # free again


# --- loops that are not plain ---------------------------------------------------------------


def test_track_plus_epoch_end_counts_each_epoch_once(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    loader = [torch.randn(4, 8) for _ in range(2)]
    for _epoch in range(3):
        for batch in monitor.track(loader):
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        monitor.epoch_end()
    assert value(scrape(monitor.metrics_url), "stabmon_epoch") == 3


def test_a_tracked_validation_loader_marks_no_epoch(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer)
    train, val = [torch.randn(4, 8)] * 2, [torch.randn(4, 8)] * 3
    for _epoch in range(2):
        for batch in monitor.track(train):
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            for batch in monitor.track(val):
                model(batch)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_epoch") == 2
    assert value(samples, "stabmon_data_wait_seconds_count") == 4 + 6


def test_evaluation_forwards_and_losses_do_not_count_as_training(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    monitor = attach(model, optimizer, spike_warmup_steps=5)
    for _ in range(10):
        train_step(model, optimizer, monitor)
    with torch.no_grad():
        model(torch.randn(4, 8))  # evaluation outside a named phase
    with monitor.phase("eval"):
        monitor.observe(loss=1e6)  # an evaluation loss
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_anomalies_total", kind="loss_spike") == 0
    assert value(samples, "stabmon_loss") != 1e6


def test_no_false_stall_after_a_named_phase_longer_than_the_limit(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = _sgd(model)
    clock = LoopClock()
    monitor = attach(model, optimizer, stall_seconds=0.5, phase_stall_seconds=60, clock=clock)
    train_step(model, optimizer, monitor)
    with monitor.phase("eval"):
        clock.advance(1.0)
        time.sleep(0.3)  # a few watchdog looks inside the phase
    clock.advance(0.2)  # back in the loop, well within the limit
    time.sleep(0.3)
    assert value(scrape(monitor.metrics_url), "stabmon_stalled") == 0
    assert value(scrape(monitor.metrics_url), "stabmon_anomalies_total", kind="stall") == 0


def test_parameter_groups_added_mid_run_are_measured(attach: MonitorFactory) -> None:
    backbone, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    model = torch.nn.Sequential(backbone, head)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1)
    monitor = attach(model, optimizer, judge_seconds=0)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.add_param_group({"params": backbone.parameters(), "lr": 0.01})  # unfreeze
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_module_grad_norm", module="0") > 0


def test_long_gradient_accumulation_with_amp_loses_no_measurement(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = attach(model, optimizer, scaler=scaler)
    for step in range(3):
        for micro in range(100):
            loss = model(torch.randn(2, 8)).pow(2).mean() / 100
            scaler.scale(loss).backward()
            monitor.observe(loss=loss)
            if step == 1 and micro == 99:
                model[0].weight.grad.view(-1)[0] = float("nan")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    monitor.epoch_end()  # judges everything waiting
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_amp_skipped_steps_total") == 1
    assert value(samples, "stabmon_steps_total") == 2
    assert value(samples, "stabmon_amp_loss_scale") == 2.0**9


def test_a_monitor_held_only_by_the_pass_it_tracks_keeps_monitoring(tmp_path: Path) -> None:
    import gc
    import threading

    model = tiny_model()
    optimizer = _sgd(model)
    names: list[set[str]] = []
    monitor = stabmon.attach(model, optimizer, port=0, run_dir=str(tmp_path))
    batches = iter(monitor.track([torch.randn(4, 8)] * 3))
    del monitor  # the loop holds the pass only, as `for x in attach(...).track(...)` does
    for batch in batches:
        gc.collect()
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        names.append({thread.name for thread in threading.enumerate()})
    assert all("stabmon-watchdog" in each for each in names)
    del batches
    gc.collect()
