"""The sync audit: on CUDA tensors, stabmon never makes the host wait for the device.

No GPU is needed: the training loop runs on fake CUDA tensors (FakeTensorMode) under an
audit that fails every host-device synchronisation made while stabmon's code is on the
stack, on any thread; the CUDA runtime pieces stabmon uses are small fakes. What is
real and what is stood in for is listed in ``tests/fake_cuda.py``. The loop goes through
steady-state steps, the step that rebuilds the gradient layout (a new param group), a
non-finite step, a step GradScaler skips, an epoch end and a real HTTP scrape, with
forward, clipping, optimizer and GradScaler steps, every probe on, and a plug-in measuring
on the device through the extension point's device-side port. On a GPU,
``tests/test_gpu.py`` runs real steps under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda, SyncViolation, fake_cuda
from helpers import scrape, value
from torch import nn

import stabmon
from stabmon.pipeline.readback import Readback

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(32, 64, device="cuda"), nn.ReLU(), nn.Linear(64, 64, device="cuda"), nn.ReLU()
        )  # fmt: skip
        self.head = nn.Linear(64, 8, device="cuda")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.head(self.body(inputs))
        return output


def _step(cuda: FakeCuda, model: _Net, optimizer: torch.optim.Optimizer,
          scaler: torch.amp.GradScaler, monitor: stabmon.Monitor) -> None:  # fmt: skip
    """One AMP iteration as a user writes it; the device runs a step behind the host."""
    cuda.device.catch_up()
    inputs = torch.randn(16, 32, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(inputs).float().pow(2).mean()
    scaler.scale(loss)  # what backward starts from; backward itself is stood in for
    cuda.stand_in_backward(model.parameters())
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    monitor.observe(loss=loss)


class _ParameterNorm:
    """A device-side plug-in (stabmon.extension): the parameters' norm after each step,
    measured on the device and read back with the Monitor's other results."""

    component = "grads"
    measure_at = "after_step"
    judged: list[int] = []

    def __init__(self, context: Any) -> None:
        self._params = list(context.model.parameters())
        _ParameterNorm.judged = []

    def measure(self, step: int) -> torch.Tensor:
        norms = torch._foreach_norm([p.detach() for p in self._params])
        return torch.linalg.vector_norm(torch.stack(norms)).reshape(1)

    def judge(self, step: int, values: list[float]) -> None:
        _ParameterNorm.judged.append(step)


def run_audited_loop(cuda: FakeCuda, run_dir: Path) -> Samples:
    """Every phase of a run, once, ending with a real scrape; returns the scraped samples."""
    model = _Net()
    optimizer = torch.optim.AdamW(model.body.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    monitor = stabmon.attach(
        model, optimizer, scaler=scaler, port=0, address="127.0.0.1", run_dir=str(run_dir),
        run_id="sync-audit", measure_every=1, sample_every=1, device_check="warn",
        plugins=[_ParameterNorm],
    )  # fmt: skip
    try:
        device = cuda.device
        for _ in range(6):  # steady state
            _step(cuda, model, optimizer, scaler, monitor)
        optimizer.add_param_group({"params": list(model.head.parameters())})  # layout rebuilt
        for _ in range(3):
            _step(cuda, model, optimizer, scaler, monitor)
        device.result = float("nan")  # a non-finite step: every value read back is NaN
        _step(cuda, model, optimizer, scaler, monitor)
        device.result = 1.0
        for _ in range(2):
            _step(cuda, model, optimizer, scaler, monitor)
        device.found_inf, device.result = 1.0, 0.5  # GradScaler skips; the scale halves
        _step(cuda, model, optimizer, scaler, monitor)
        device.found_inf, device.result = 0.0, 1.0
        for _ in range(3):
            _step(cuda, model, optimizer, scaler, monitor)
        device.catch_up()
        monitor.epoch_end()
        with monitor.phase("eval"), torch.no_grad():
            model(torch.randn(4, 32, device="cuda"))
        for _ in range(2):
            _step(cuda, model, optimizer, scaler, monitor)
        device.catch_up()
        monitor.epoch_end()
        return scrape(monitor.metrics_url)
    finally:
        cuda.device.catch_up()
        monitor.detach()


@pytest.fixture
def audited(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    with fake_cuda(monkeypatch) as cuda:
        yield cuda


def test_an_epoch_end_reads_the_device_time_of_the_steps_before_it(
    audited: FakeCuda, tmp_path: Path
) -> None:
    """A step's phase events pass on the device after the host's step end; the epoch end that
    follows (training thread) reads them, so one step and an epoch end show the step's device
    time and the device utilization (on an H200 one step showed neither: issue 38)."""
    model = _Net()
    optimizer = torch.optim.AdamW(model.body.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    monitor = stabmon.attach(
        model, optimizer, scaler=scaler, port=0, address="127.0.0.1", run_dir=str(tmp_path),
        run_id="one-step", device_check="warn", sample_seconds=3600,
    )  # fmt: skip
    try:
        _step(audited, model, optimizer, scaler, monitor)
        audited.device.catch_up()  # the device gets past the step's last event
        monitor.epoch_end()
        samples = scrape(monitor.metrics_url)
    finally:
        monitor.detach()

    audited.assert_clean()
    assert value(samples, "stabmon_device_phase_seconds_total", phase="forward") > 0
    assert 0 <= value(samples, "stabmon_device_utilization_ratio", device="cuda:0") <= 1


def test_monitored_cuda_loop_never_waits_for_the_device(audited: FakeCuda, tmp_path: Path) -> None:
    samples = run_audited_loop(audited, tmp_path)

    audited.assert_clean()
    errors = {dict(labels)["component"]: v for (name, labels), v in samples.items()
              if name == "stabmon_internal_errors_total"}  # fmt: skip
    assert errors and not any(errors.values()), errors
    # Each phase ran, as stabmon saw it: 18 iterations, one of them skipped by GradScaler.
    assert value(samples, "stabmon_steps_total") == 17
    assert value(samples, "stabmon_nonfinite_grad_steps_total") == 1
    assert value(samples, "stabmon_nonfinite_loss_total") == 1
    assert value(samples, "stabmon_amp_skipped_steps_total") == 1
    assert value(samples, "stabmon_module_grad_norm", module="head") is not None  # rebuilt
    assert value(samples, "stabmon_device_memory_allocated_bytes", device="cuda:0") == 64 * 2**20
    assert value(samples, "stabmon_epoch_memory_bytes", device="cuda:0") == 64 * 2**20
    assert value(samples, "stabmon_epoch") == 2
    assert value(samples, "stabmon_device_phase_seconds_total", phase="forward") > 0
    assert audited.device.copies > 0  # results came back through pinned buffers
    assert _ParameterNorm.judged[:3] == [0, 1, 2]  # the device-side port, read back in order


def _plant_in_submit(plant: Callable[[torch.Tensor], Any]) -> Callable[..., int]:
    original = Readback.submit

    def submit(self: Readback[Any], tag: Any, values: Any, fence: bool = True) -> int:
        if isinstance(values, torch.Tensor):
            plant(values)
        return original(self, tag, values, fence)

    return submit


@pytest.mark.parametrize(
    ("plant", "reported"),
    [
        (lambda values: values.sum().item(), "_local_scalar_dense"),
        (lambda values: bool(values.sum() > 0), "_local_scalar_dense"),
        (lambda values: values.tolist(), "blocking device-to-host copy"),
        (lambda values: values.cpu(), "blocking device-to-host copy"),
        (lambda values: values[values > 0], "nonzero"),
        (lambda values: torch.cuda.synchronize(), "torch.cuda.synchronize()"),
    ],
    ids=["item", "bool", "tolist", "cpu", "boolean-index", "synchronize"],
)
def test_sync_audit_fails_when_a_sync_is_planted_in_the_hot_path(
    audited: FakeCuda,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    plant: Callable[[torch.Tensor], Any],
    reported: str,
) -> None:
    monkeypatch.setattr(Readback, "submit", _plant_in_submit(plant))

    samples = run_audited_loop(audited, tmp_path)

    with pytest.raises(SyncViolation, match=reported) as failure:
        audited.assert_clean()
    assert "stabmon/monitor.py" in str(failure.value)  # the stack shows where
    # stabmon contained each planted sync (training went on) and counted it.
    assert value(samples, "stabmon_internal_errors_total", component="grads") > 0


def test_sync_audit_allows_the_users_own_syncs(audited: FakeCuda) -> None:
    """GradScaler.step reads found_inf with .item(): a sync, but the user's, not stabmon's."""
    found_inf = torch.zeros((), device="cuda")
    assert found_inf.item() == 0.0
    audited.assert_clean()
    assert audited.audit.user_syncs == 1


@pytest.mark.gpu
def test_monitored_cuda_loop_never_synchronises_a_real_device(tmp_path: Path) -> None:
    """The same phases on a real GPU, under torch.cuda.set_sync_debug_mode("error").

    AdamW is fused: GradScaler then hands found_inf to the optimizer instead of reading it
    with .item() (a sync of the user's making, which the debug mode would fail too), and a
    skipped step is skipped on the device. A sync inside stabmon raises inside a hook, where
    it is contained and counted: every component's count must stay 0.
    """
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.AdamW(model.body.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    monitor = stabmon.attach(
        model, optimizer, scaler=scaler, port=0, address="127.0.0.1", run_dir=str(tmp_path),
        run_id="sync-check", measure_every=1, sample_every=1, device_check="warn",
    )  # fmt: skip

    def step(poison: bool = False) -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(16, 32, device="cuda")).float().pow(2).mean()
        scaler.scale(loss).backward()
        if poison:  # an Inf gradient: non-finite, and GradScaler skips the step
            grad = model.body[0].weight.grad
            assert grad is not None
            # A slice's fill_: ``grad[0] = inf`` copies a host scalar in, a sync of its own.
            grad.view(-1)[:1].fill_(float("inf"))
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        monitor.observe(loss=loss)

    try:
        for _ in range(5):  # warm-up: first-use allocations and pinned buffers
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(50):
                step()
            optimizer.add_param_group({"params": list(model.head.parameters())})
            for _ in range(20):
                step()
            step(poison=True)
            for _ in range(20):
                step()
            monitor.epoch_end()
            samples = scrape(monitor.metrics_url)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        monitor.epoch_end()
        samples = scrape(monitor.metrics_url)
    finally:
        monitor.detach()
    errors = {dict(labels)["component"]: v for (name, labels), v in samples.items()
              if name == "stabmon_internal_errors_total"}  # fmt: skip
    assert errors and not any(errors.values()), errors
    assert value(samples, "stabmon_steps_total") == 96  # fused: the skipped step is a step
    assert value(samples, "stabmon_nonfinite_grad_steps_total") == 1
    assert value(samples, "stabmon_amp_skipped_steps_total") == 1
    assert value(samples, "stabmon_module_grad_norm", module="head") is not None


def test_sync_audit_catches_a_sync_on_the_exporters_thread(
    audited: FakeCuda, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FakeTensors route every operator through the audit, whatever thread runs it."""
    from stabmon.export.collector import ReadingsCollector

    device_value = torch.ones((), device="cuda")  # a result someone kept on the device
    original = ReadingsCollector.collect

    def collect(self: ReadingsCollector) -> Iterator[Any]:
        device_value.item()  # planted: a scrape that reads a device value
        yield from original(self)

    monkeypatch.setattr(ReadingsCollector, "collect", collect)
    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1",
                             run_dir=str(tmp_path), run_id="sync-audit")  # fmt: skip
    try:
        with contextlib.suppress(OSError):  # the failed scrape answers 500
            scrape(monitor.metrics_url)
    finally:
        monitor.detach()

    with pytest.raises(SyncViolation, match="on thread (?!MainThread)") as failure:
        audited.assert_clean()
    assert "stabmon/export/" in str(failure.value)


@pytest.mark.parametrize("amp", [False, True], ids=["fused", "fused+gradscaler"])
def test_the_skip_policy_with_a_fused_optimizer_never_waits_for_the_device(
    audited: FakeCuda, tmp_path: Path, amp: bool
) -> None:
    """on_anomaly ``skip`` with a fused AdamW: the step's norm is judged against the spike
    limit on the device, the flag is agreed and handed to the optimizer as ``found_inf``,
    and the flags come back through a pinned buffer read a step later (docs/policies.md).
    A late kind (loss_spike: lr_scale) rides on the same read."""
    model = _Net()
    optimizer = torch.optim.AdamW(model.body.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    monitor = stabmon.attach(
        model, optimizer, scaler=scaler, port=0, address="127.0.0.1", run_dir=str(tmp_path),
        run_id="sync-audit-skip", spike_warmup_steps=2,
        on_anomaly={"nonfinite_grad": "skip", "grad_spike": "skip", "loss_spike": "lr_scale"},
    )  # fmt: skip
    try:
        for index in range(8):
            audited.device.catch_up()
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = model(torch.randn(16, 32, device="cuda")).float().pow(2).mean()
            if scaler is not None:
                scaler.scale(loss)
            audited.stand_in_backward(model.parameters())
            audited.device.result = float("nan") if index == 5 else 1.0
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            monitor.observe(loss=loss)
        audited.device.catch_up()
        samples = scrape(monitor.metrics_url)
    finally:
        audited.device.catch_up()
        monitor.detach()

    audited.assert_clean()
    errors = {dict(labels)["component"]: v for (name, labels), v in samples.items()
              if name == "stabmon_internal_errors_total"}  # fmt: skip
    assert errors and not any(errors.values()), errors
    assert not hasattr(optimizer, "found_inf")  # handed for each step, taken back after it


def test_the_skip_policy_without_a_device_flag_reads_the_flags_each_step_as_documented(
    audited: FakeCuda, tmp_path: Path
) -> None:
    """A foreach AdamW takes no device flag: the gradients are held back on the host's word,
    so the gate reads the agreed flags at the step (docs/policies.md: one sync a step while
    such a policy is on). The audit sees that read, and only there."""
    model = _Net()
    optimizer = torch.optim.AdamW(model.body.parameters(), lr=1e-3)
    monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1",
                             run_dir=str(tmp_path), run_id="sync-audit-hold",
                             on_anomaly={"nonfinite_grad": "skip"})  # fmt: skip
    try:
        audited.device.catch_up()
        model(torch.randn(16, 32, device="cuda")).float().pow(2).mean()
        audited.stand_in_backward(model.parameters())
        optimizer.step()
    finally:
        audited.device.catch_up()
        monitor.detach()

    with pytest.raises(SyncViolation, match="1 time") as failure:
        audited.assert_clean()
    assert "flags.tolist(), step, optimizer, now=True)  # the one sync a step" in str(failure.value)


def test_the_skip_policy_never_waits_for_its_flags_while_the_device_lags(
    audited: FakeCuda, tmp_path: Path
) -> None:
    """Skip-only with a fused optimizer: the flags' copies are only told (the device made
    the skip), so they are read once their events passed; while the device lags behind the
    host (no catch-up for six steps) nothing waits for them."""
    model = _Net()
    optimizer = torch.optim.AdamW(model.body.parameters(), lr=1e-3, fused=True)
    skip = {"nonfinite_grad": "skip", "grad_spike": "skip"}
    monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1",
                             run_dir=str(tmp_path), run_id="sync-audit-lag",
                             on_anomaly=skip)  # fmt: skip
    try:
        for _ in range(6):
            model(torch.randn(16, 32, device="cuda")).float().pow(2).mean()
            audited.stand_in_backward(model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        audited.device.catch_up()
        monitor.detach()

    audited.assert_clean()


def test_the_replica_checks_fingerprint_and_vote_never_wait_for_the_device(
    audited: FakeCuda,
) -> None:
    # The device half of issue 36's check (the gather between them is a collective the
    # device waits for): fingerprints of every dtype and shape, then the vote with one
    # replica outvoted and one abstaining.
    from stabmon.probes.fingerprint import abstention, fingerprint, vote

    cuda = torch.empty(0, device="cuda").device  # cuda:0, as the parameters' device reads
    buckets = [
        [torch.randn(3 * 1024 + 5, device=cuda), torch.randn(7, 5, device=cuda).t()],
        [torch.randn(64, device=cuda).bfloat16(), torch.empty(0, device=cuda)],
        [torch.empty(0, device=cuda)],
    ]
    local = fingerprint(buckets, cuda)
    gathered = torch.stack([local, local, local + 1, abstention(3, cuda)])
    vote(gathered)
    audited.assert_clean()


def test_armed_nan_provenance_forward_and_backward_never_wait_for_the_device(
    audited: FakeCuda, tmp_path: Path
) -> None:
    """NaN provenance armed (always): every module's forward sums and the gradient hooks it
    registers, fired with CUDA gradients in the order autograd would fire them (the backward
    itself cannot run on fake CUDA: ``tests/fake_cuda.py``), then the stacked sums read back a
    step later; a scripted non-finite step gets its verdict through that readback."""
    from helpers import events

    from stabmon.probes.provenance import _GradientSum

    model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    outputs: list[torch.Tensor] = []
    for module in model.modules():  # the test's own hook: what autograd would reach
        module.register_forward_hook(lambda module, args, output: outputs.append(output))
    monitor = stabmon.attach(
        model, optimizer, serve_metrics=False, run_dir=str(tmp_path), run_id="provenance",
        device_check="warn", provenance_always=True, judge_seconds=0,
    )  # fmt: skip
    fired = []
    try:
        for step in range(6):
            audited.device.catch_up()
            audited.device.result = float("nan") if step == 3 else 1.0
            outputs.clear()
            loss = model(torch.randn(16, 32, device="cuda")).pow(2).mean()
            hooks = [(tensor, hook) for tensor in reversed(outputs)
                     for hook in (tensor._backward_hooks or {}).values()
                     if isinstance(hook, _GradientSum)]  # fmt: skip  # not other probes' own
            for tensor, hook in hooks:
                hook(torch.empty_like(tensor))  # the gradient hook, as autograd calls it
            fired.append(len(hooks))
            audited.stand_in_backward(model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            monitor.observe(loss=loss)
        audited.device.catch_up()
    finally:
        monitor.detach()

    audited.assert_clean()
    assert fired[0] == 0 and all(fired[1:])  # watched from the first step's end on
    records = [r for r in events(monitor.event_log_path) if r["event"] == "provenance"]
    assert [r["producer"] for r in records] == ["<input>"]  # every value read back NaN
