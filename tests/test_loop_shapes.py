"""Loops as real projects write them: get_batch(), hand updates, complex parts, loader proxies."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

import stabmon
from stabmon.detectors.stall import Heartbeat
from stabmon.pipeline.readings import Readings
from stabmon.probes.timing import LoopTimer
from tests.conftest import MonitorFactory
from tests.helpers import (
    LoopClock,
    events,
    interruptible_sleep,
    scrape,
    train_step,
    value,
    wait_until,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def test_attach_with_something_else_than_an_optimizer_says_what_to_do(tmp_path: object) -> None:
    with pytest.raises(stabmon.StabmonError, match=r"needs the torch.optim.Optimizer.*lr=0.0"):
        stabmon.attach(_model(), "adam")  # type: ignore[arg-type]


def test_attach_without_an_optimizer_that_never_comes_says_what_to_do(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    model = _model()
    monitor = attach(model, None, judge_seconds=0)
    for _ in range(2):  # a hand-written update, and no optimizer at all
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        monitor.observe(loss=loss)
    assert "attached without an optimizer" in caplog.text and "lr=0.0" in caplog.text
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 0


def test_a_hand_update_loop_is_monitored_through_a_zero_lr_optimizer(
    attach: MonitorFactory,
) -> None:
    model = _model()
    marker = torch.optim.SGD(model.parameters(), lr=0.0)  # the documented recipe
    monitor = attach(model, marker, judge_seconds=0)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.01 * param.grad  # type: ignore[operator]
        marker.step()
        model.zero_grad()
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 3


def test_complex_loss_is_skipped_and_counted_and_the_scrape_still_works(
    attach: MonitorFactory,
) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0)
    train_step(model, optimizer, monitor)
    monitor.observe(torch.tensor(1.0 + 2.0j))
    monitor.observe(1.0 + 2.0j)  # type: ignore[arg-type]
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_internal_errors_total", component="loss") == 2
    assert value(samples, "stabmon_steps_total") == 1


class _WithComplex(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.real = torch.nn.Linear(8, 1)
        self.phase = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotated = (x.to(torch.complex64) * self.phase).abs()
        return self.real(rotated)


def test_complex_parameter_is_skipped_with_one_log_line_and_the_rest_are_measured(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    model = _WithComplex()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        monitor = attach(model, optimizer, judge_seconds=0)
        for _ in range(2):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            real_norm = float(torch.nn.utils.get_total_norm([model.real.weight.grad,
                                                             model.real.bias.grad]))  # fmt: skip
            optimizer.step()
            optimizer.zero_grad()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_grad_norm") == pytest.approx(real_norm, rel=1e-5)
    assert value(samples, "stabmon_internal_errors_total", component="grads") == 0
    assert len([r for r in caplog.records if "complex-valued" in r.getMessage()]) == 1


def test_track_keeps_the_loaders_len_and_attributes(attach: MonitorFactory) -> None:
    model = _model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.01))
    dataset = torch.utils.data.TensorDataset(torch.randn(10, 8))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    tracked = monitor.track(loader)
    assert len(tracked) == 3
    assert tracked.dataset is dataset
    assert [len(batch[0]) for batch in tracked] == [4, 4, 2]
    assert [len(batch[0]) for batch in tracked] == [4, 4, 2]  # each pass is a new iteration


def test_track_close_ends_the_pass_left_early_as_a_generators_close_did(
    attach: MonitorFactory,
) -> None:
    model = _model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(10, 8)))
    tracked = monitor.track(loader)
    passes = iter(tracked)
    next(passes)
    tracked.close()  # track() returned a generator before; loops that close() it keep working
    with pytest.raises(StopIteration):
        next(passes)
    assert len(list(tracked)) == 10  # a new pass after close() starts from the beginning


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_fetch_between_forward_and_backward_is_data_wait_not_backward() -> None:
    clock = FakeClock()
    readings = Readings(labels={})
    timer = LoopTimer(readings, Heartbeat(clock), clock=clock)
    timer.forward_start()
    clock.now += 1.0
    timer.forward_end()  # backward starts
    clock.now += 5.0  # ...the loop fetches the next batch here, and waits 5 s for it
    timer.loader_wait(5.0)
    clock.now += 2.0  # the backward pass itself
    timer.optimizer_start()
    clock.now += 1.0
    timer.optimizer_end()
    assert readings.phase_seconds["backward"] == 2.0
    assert readings.phase_seconds["data_wait"] == 5.0
    assert readings.phase_seconds["forward"] == 1.0


def test_data_wait_context_times_a_get_batch_call(attach: MonitorFactory) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0)

    def get_batch() -> torch.Tensor:
        return torch.randn(4, 8)

    for _ in range(3):
        with monitor.data_wait():
            batch = get_batch()
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_data_wait_seconds_count") == 3


# --- where a hang is: input wait only while a batch is fetched; evaluation's own limit --------


class _Blocking(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """An mnist-sized data set whose item ``block_at`` hangs (a stuck read) until released."""

    def __init__(self, clock: LoopClock, block_at: int | None, release: threading.Event) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = (
            torch.randn(32, 8, generator=generator),
            torch.randn(32, 1, generator=generator),
        )
        self.clock, self.block_at, self.release = clock, block_at, release

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == self.block_at:
            self.clock.advance(100.0)
            interruptible_sleep(self.release)
        return self.x[index], self.y[index]


def _stall_while_blocked(monitor: stabmon.Monitor, release: threading.Event) -> threading.Thread:
    """Sets ``release`` once the stall is exported and its evidence (every thread's stack,
    taken while the loop is blocked) is in the event log: the loop stays blocked until then.
    On a busy machine the evidence lands well after the gauge."""

    def has_evidence() -> bool:
        try:
            return any(r.get("event") == "hang_evidence" for r in events(monitor.event_log_path))
        except ValueError:  # a line being written: look again
            return False

    def watch() -> None:
        try:
            wait_until(
                lambda: value(scrape(monitor.metrics_url), "stabmon_stalled") == 1, "stalled"
            )
            wait_until(has_evidence, "the hang evidence is written", timeout=60)
        finally:
            release.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return watcher


def _mnist_epoch(
    monitor: stabmon.Monitor,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: torch.utils.data.DataLoader[tuple[torch.Tensor, torch.Tensor]],
    after_step: Any = None,
) -> None:
    """pytorch/examples mnist's train(): batches through track(), a log line every few."""
    model.train()
    for batch_idx, (data, target) in enumerate(monitor.track(loader)):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(batch_idx)


def test_a_hang_in_the_loops_own_code_between_steps_is_not_called_input_wait(
    attach: MonitorFactory,
) -> None:
    model, clock, release = _model(), LoopClock(), threading.Event()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, stall_seconds=10, clock=clock)
    loader = torch.utils.data.DataLoader(_Blocking(clock, None, release), batch_size=4)

    def log_line(batch_idx: int) -> None:  # the loop's own logging, stuck after step 2
        if batch_idx == 2:
            clock.advance(100.0)
            watcher = _stall_while_blocked(monitor, release)
            interruptible_sleep(release)
            watcher.join(timeout=30)

    _mnist_epoch(monitor, model, optimizer, loader, log_line)
    records = events(monitor.event_log_path)
    stall = next(r for r in records if r.get("kind") == "stall")
    assert (stall["phase"], stall["step"]) == ("between_steps", 3)
    evidence = next(r for r in records if r["event"] == "hang_evidence")
    assert evidence["state"] == "lock_wait"  # interruptible_sleep waits on an Event


def test_a_hang_while_the_loader_fetches_a_batch_is_input_wait(attach: MonitorFactory) -> None:
    model, clock, release = _model(), LoopClock(), threading.Event()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, stall_seconds=10, clock=clock)
    loader = torch.utils.data.DataLoader(_Blocking(clock, 13, release), batch_size=4)
    watcher = _stall_while_blocked(monitor, release)  # item 13: batch 3, after step 2
    _mnist_epoch(monitor, model, optimizer, loader)
    watcher.join(timeout=30)
    records = events(monitor.event_log_path)
    stall = next(r for r in records if r.get("kind") == "stall")
    assert (stall["phase"], stall["step"]) == ("data_wait", 3)
    evidence = next(r for r in records if r["event"] == "hang_evidence")
    assert evidence["state"] == "data_wait"


@contextlib.contextmanager
def _stall_flag(monitor: stabmon.Monitor, stalled: threading.Event) -> Iterator[None]:
    """Sets ``stalled`` if the exporter ever says stalled while the block runs; the watching
    thread ends with the block."""
    url, done = monitor.metrics_url, threading.Event()

    def watch() -> None:
        while not done.is_set():
            if value(scrape(url), "stabmon_stalled") == 1:
                stalled.set()
                return
            done.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=30)


class _SlowEvaluation(torch.nn.Module):
    """A model whose evaluation forward takes 30 s on the loop clock (a 1,000-image batch)."""

    def __init__(self, clock: LoopClock, stalled: threading.Event) -> None:
        super().__init__()
        self.net, self.clock, self.stalled = _model(), clock, stalled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.clock.advance(30.0)
            interruptible_sleep(self.stalled, timeout=1.5)  # the watchdog polls meanwhile
        return self.net(x)  # type: ignore[no-any-return]


def test_an_unwrapped_evaluation_longer_than_stall_seconds_gets_the_phase_limit(
    attach: MonitorFactory,
) -> None:
    """mnist's test(): model.eval() and no_grad(), no mon.phase; its one batch takes 30 s."""
    clock, stalled = LoopClock(), threading.Event()
    model = _SlowEvaluation(clock, stalled)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, stall_seconds=10, phase_stall_seconds=600, clock=clock)
    loader = torch.utils.data.DataLoader(_Blocking(clock, None, threading.Event()), batch_size=4)
    _mnist_epoch(monitor, model, optimizer, loader)
    model.eval()
    with _stall_flag(monitor, stalled), torch.no_grad():
        for data, _ in torch.utils.data.DataLoader(loader.dataset, batch_size=32):
            model(data)
    assert not stalled.is_set()
    assert [r for r in events(monitor.event_log_path) if r.get("kind") == "stall"] == []


# --- LBFGS: step(closure) runs forward and backward many times inside one step ----------------


class _Sequence(torch.nn.Module):
    """pytorch/examples time_sequence_prediction's model: two LSTM cells and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm1, self.lstm2 = torch.nn.LSTMCell(1, 8), torch.nn.LSTMCell(8, 8)
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, inputs: torch.Tensor, future: int = 0) -> torch.Tensor:
        h1 = c1 = h2 = c2 = torch.zeros(inputs.size(0), 8)
        outputs = []
        output = torch.zeros(inputs.size(0), 1)
        for value_t in [*inputs.split(1, dim=1), *([None] * future)]:
            h1, c1 = self.lstm1(output if value_t is None else value_t, (h1, c1))
            h2, c2 = self.lstm2(h1, (h2, c2))
            output = self.linear(h2)
            outputs.append(output)
        return torch.cat(outputs, dim=1)


class _GradNorms:
    """A plug-in keeping each measured step's gradient norm, as the Monitor judged it."""

    component = "test_grad_norms"

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def grads_judged(self, step: int, summary: Any) -> None:
        self.norms[step] = summary.total_norm


def test_lbfgs_closure_passes_are_progress_and_each_step_records_its_own_gradient(
    attach: MonitorFactory,
) -> None:
    """Each closure pass takes 4 s on the loop clock, a step up to 25 of them (100 s), with
    stall_seconds 10: no stall. A step's gradient record is its closure's last gradient."""
    clock, stalled, norms = LoopClock(), threading.Event(), _GradNorms()
    seq = _Sequence()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)
    monitor = attach(seq, optimizer, stall_seconds=10, clock=clock, plugins=[lambda _: norms])
    wave = torch.sin(torch.arange(24.0).view(1, 24) / 4 + torch.arange(4.0).view(4, 1))
    inputs, target = wave[:, :-1], wave[:, 1:]

    last_norm: dict[int, float] = {}
    watching = _stall_flag(monitor, stalled)
    watching.__enter__()
    for i in range(3):
        passes = 0

        def closure(i: int = i) -> torch.Tensor:
            nonlocal passes
            optimizer.zero_grad()
            clock.advance(4.0)
            loss = torch.nn.functional.mse_loss(seq(inputs), target)
            loss.backward()
            last_norm[i] = float(torch.nn.utils.get_total_norm([p.grad for p in seq.parameters()]))
            passes += 1
            if i == 1 and passes == 4:  # 16 s into the step: the watchdog polls meanwhile
                interruptible_sleep(stalled, timeout=1.5)
            return loss

        loss = optimizer.step(closure)
        monitor.observe(loss=loss)
        with torch.no_grad():  # the example predicts after each step
            seq(inputs[:, :4], future=8)
    watching.__exit__(None, None, None)
    monitor.detach()
    assert not stalled.is_set()
    assert [r for r in events(monitor.event_log_path) if r.get("kind") == "stall"] == []
    assert sorted(norms.norms) == [0, 1, 2]
    for step in range(3):
        assert norms.norms[step] == pytest.approx(last_norm[step], rel=1e-5)


# --- an optimizer built once training starts (karpathy/minGPT's Trainer) ---------------------


class _GPT(torch.nn.Module):
    """minGPT's model surface: forward(idx, targets) -> (logits, loss), configure_optimizers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        self.lm_head = torch.nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logits = self.lm_head(self.blocks(self.wte(idx)))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 16), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, lr: float) -> torch.optim.Optimizer:
        decay = [p for n, p in self.named_parameters() if n.endswith("weight") and p.dim() == 2]
        ids = {id(p) for p in decay}
        no_decay = [p for p in self.parameters() if id(p) not in ids]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


class _MinGPTTrainer:
    """mingpt/trainer.py's Trainer, trimmed: the optimizer is built inside run(), and the
    only callback point is 'on_batch_end', after the first optimizer step."""

    def __init__(self, model: _GPT, data: torch.utils.data.Dataset[Any], max_iters: int) -> None:
        self.model, self.data, self.max_iters = model, data, max_iters
        self.callbacks: dict[str, list[Any]] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.iter_num, self.loss = 0, torch.tensor(0.0)

    def add_callback(self, onevent: str, callback: Any) -> None:
        self.callbacks.setdefault(onevent, []).append(callback)

    def run(self) -> None:
        model = self.model
        self.optimizer = model.configure_optimizers(lr=5e-4)
        loader = torch.utils.data.DataLoader(self.data, batch_size=4, shuffle=True)
        model.train()
        data_iter = iter(loader)
        while True:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(loader)
                batch = next(data_iter)
            x, y = batch
            _, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            self.optimizer.step()
            for callback in self.callbacks.get("on_batch_end", []):
                callback(self)
            self.iter_num += 1
            if self.iter_num >= self.max_iters:
                break


def test_a_trainer_that_builds_its_optimizer_in_run_is_watched_from_iteration_0(
    attach: MonitorFactory,
) -> None:
    model, norms = _GPT(), _GradNorms()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (32, 6), generator=generator)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    monitor = attach(model, None, judge_seconds=0, plugins=[lambda _: norms])  # optimizer later
    trainer = _MinGPTTrainer(model, data, max_iters=5)
    trainer.add_callback("on_batch_end", lambda t: monitor.observe(loss=t.loss))
    trainer.run()
    monitor.bind_optimizer(trainer.optimizer)  # type: ignore[arg-type]  # bound: a no-op
    samples = scrape(monitor.metrics_url)
    monitor.detach()
    assert value(samples, "stabmon_steps_total") == 5
    assert sorted(norms.norms) == [0, 1, 2, 3, 4]  # iteration 0 measured, as its own step
    assert min(norms.norms.values()) > 1e-3  # before the clip to 1e-3
    assert value(samples, "stabmon_grad_clipped_steps_total") == 5
    records = events(monitor.event_log_path)
    bound = [r for r in records if r["event"] == "optimizer_bound"]
    assert [(r["optimizer"], r["step"]) for r in bound] == [("AdamW", None)]
    assert [r["step"] for r in records if r["event"] == "detach"] == [4]
    assert not trainer.optimizer._optimizer_step_pre_hooks  # type: ignore[union-attr]
    assert not _global_optimizer_pre_hooks


def test_bind_optimizer_before_the_first_step_and_the_optimizer_of_another_model_is_left(
    attach: MonitorFactory,
) -> None:
    """A GAN's two halves: the discriminator's optimizer steps first and binds nothing."""
    generator, discriminator = _model(), _model()
    monitor = attach(generator, None, judge_seconds=0)
    d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.01)
    discriminator(torch.randn(4, 8)).mean().backward()
    d_optimizer.step()
    g_optimizer = torch.optim.SGD(generator.parameters(), lr=0.01)
    monitor.bind_optimizer(g_optimizer)
    assert not _global_optimizer_pre_hooks  # the watch is gone
    train_step(generator, g_optimizer, monitor)
    with pytest.raises(stabmon.StabmonError, match="already watches a SGD"):
        monitor.bind_optimizer(d_optimizer)
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 1
