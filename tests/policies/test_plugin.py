"""stabmon.policies.plugin: on_anomaly acting on real training steps on CPU.

Real parts only: a real model, real torch optimizers (fused and not), a real CPU GradScaler,
a real Monitor with its hooks; the faults are written into the gradients before
``optimizer.step()``. The multi-rank cases (real gloo ranks) are in
tests/integration/test_policies_ddp.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stabmon
from stabmon.policies.plugin import AnomalyPolicies

Fault = Callable[[nn.Module], None]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _nan(model: nn.Module) -> None:
    next(model.parameters()).grad[0, 0] = float("nan")  # type: ignore[index]


def _spike(model: nn.Module) -> None:
    for param in model.parameters():
        param.grad.mul_(10_000)  # type: ignore[union-attr]


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    return copy.deepcopy((model.state_dict(), optimizer.state_dict()["state"]))


def _identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _train(
    attach: Callable[..., stabmon.Monitor],
    steps: int,
    faults: dict[int, Fault],
    *,
    fused: bool = False,
    scaler: torch.amp.GradScaler | None = None,
    **overrides: Any,
) -> tuple[dict[int, bool], nn.Module, stabmon.Monitor]:
    """Train ``steps`` steps with ``faults`` written into the gradients; for each step,
    whether the model and optimizer state were left bit-identical by it."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    monitor = attach(model, optimizer, scaler=scaler, judge_seconds=0, **overrides)
    unchanged: dict[int, bool] = {}
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        inputs = torch.randn(4, 8, generator=generator)
        loss = model(inputs).pow(2).mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if step in faults:
            faults[step](model)
        before = _snapshot(model, optimizer)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        unchanged[step] = _identical(before, _snapshot(model, optimizer))
        optimizer.zero_grad(set_to_none=True)
        monitor.observe(loss=loss)
    return unchanged, model, monitor


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(param).all()) for param in model.parameters())


def _verdict(tmp_path: Path, rank: int = 0) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp_path / "test-run" / f"rank-{rank}.verdict.json")
                                      .read_text())  # fmt: skip
    return data


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_nan_gradient_at_step_20_with_skip_leaves_params_and_adamw_state_as_at_step_19(
    attach: Callable[..., stabmon.Monitor], tmp_path: Path, fused: bool
) -> None:
    unchanged, model, _ = _train(attach, 40, {20: _nan}, fused=fused,
                                 on_anomaly={"nonfinite_grad": "skip"})  # fmt: skip

    assert [step for step, same in unchanged.items() if same] == [20]
    assert _finite(model)  # and training went on, finite
    verdict = _verdict(tmp_path)
    assert (verdict["decision"], verdict["kind"], verdict["step"]) == (
        "continue", "nonfinite_grad", 20,
    )  # fmt: skip


def test_without_a_policy_the_same_nan_reaches_the_parameters(
    attach: Callable[..., stabmon.Monitor], tmp_path: Path
) -> None:
    unchanged, model, monitor = _train(attach, 25, {20: _nan})

    assert not unchanged[20] and not _finite(model)
    assert not [p for p in monitor._plugged.plugins if isinstance(p, AnomalyPolicies)]
    assert not (tmp_path / "test-run" / "rank-0.verdict.json").exists()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_10000x_gradient_at_step_300_with_grad_spike_skip_is_skipped_and_its_neighbours_not(
    attach: Callable[..., stabmon.Monitor], fused: bool
) -> None:
    unchanged, model, _ = _train(attach, 310, {300: _spike}, fused=fused,
                                 on_anomaly={"grad_spike": "skip"})  # fmt: skip

    assert [step for step, same in unchanged.items() if same] == [300]
    assert _finite(model)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_grad_spike_skip_under_gradscaler_leaves_the_scaler_as_after_a_clean_step(
    attach: Callable[..., stabmon.Monitor], fused: bool
) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    unchanged, model, _ = _train(attach, 310, {300: _spike}, fused=fused, scaler=scaler,
                                 on_anomaly={"grad_spike": "skip"})  # fmt: skip

    assert [step for step, same in unchanged.items() if same] == [300]
    # The skip was the policy's, not an overflow: the scale did not back off, and the growth
    # tracker counted every step (GradScaler's bookkeeping as after clean steps).
    assert scaler.get_scale() == 2.0**10
    assert scaler._get_growth_tracker() == 310
    assert _finite(model)


def test_a_nan_gradient_under_gradscaler_is_gradscalers_to_skip_and_not_an_anomaly_action(
    attach: Callable[..., stabmon.Monitor], tmp_path: Path
) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    unchanged, model, monitor = _train(attach, 25, {20: _nan}, fused=True, scaler=scaler,
                                       on_anomaly={"nonfinite_grad": "skip"})  # fmt: skip
    monitor.detach()  # the verdict at the end

    assert [step for step, same in unchanged.items() if same] == [20]
    assert scaler.get_scale() == 2.0**9  # GradScaler backed off, as it does for an overflow
    assert _verdict(tmp_path)["kind"] is None  # its own scale search, nothing to act on


def test_lr_scale_cuts_the_lr_for_n_steps_then_the_loops_own_lr_and_schedule_are_back(
    attach: Callable[..., stabmon.Monitor],
) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # bounded updates: no blow-up
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    monitor = attach(model, optimizer, judge_seconds=0, spike_warmup_steps=5,
                     on_anomaly={"grad_spike": "lr_scale", "lr_scale_factor": 0.25,
                                 "lr_scale_steps": 3})  # fmt: skip
    seen: list[float] = []
    # Registered after attach, so it runs after stabmon's pre-hook: the LR the step uses.
    handle = optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"])
    )
    for step in range(14):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if step == 9:
            _spike(model)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    handle.remove()
    monitor.detach()

    own = [0.1 * 0.9**step for step in range(14)]
    scaled = [0.25 if step in (9, 10, 11) else 1.0 for step in range(14)]
    assert seen == pytest.approx([lr * factor for lr, factor in zip(own, scaled, strict=True)])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**14)


def test_stop_raises_anomaly_stop_before_the_step_and_the_verdict_says_stop(
    attach: Callable[..., stabmon.Monitor], tmp_path: Path
) -> None:
    with pytest.raises(stabmon.AnomalyStop) as raised:
        _train(attach, 30, {12: _nan}, on_anomaly={"nonfinite_grad": "stop"})

    stop = raised.value
    assert (stop.kind, stop.step, stop.anomaly_step, stop.rank) == ("nonfinite_grad", 12, 12, 0)
    verdict = _verdict(tmp_path)
    assert verdict["decision"] == "stop" and verdict["failure_domain"] == "workload"
    assert "skip_batches" in verdict["recommended_action"]


def test_a_late_kind_is_agreed_at_the_next_step_and_acted_on_a_step_later(
    attach: Callable[..., stabmon.Monitor],
) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, judge_seconds=0, on_anomaly={"loss_spike": "stop"})
    policies = next(p for p in monitor._plugged.plugins if isinstance(p, AnomalyPolicies))
    stopped = None
    for step in range(6):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if step == 3:
            policies.anomaly_recorded("loss_spike", 2)  # as the loss judge records it, late
        try:
            optimizer.step()
        except stabmon.AnomalyStop as stop:
            stopped = (step, stop.step, stop.anomaly_step)
            break
        optimizer.zero_grad()

    # Agreed at step 3 (the next step after it was recorded), read on the host a step later
    # without a sync: every rank raises at step 4.
    assert stopped == (4, 4, 2)


def test_checkpoint_calls_the_loops_save_once_before_the_damage(
    attach: Callable[..., stabmon.Monitor],
) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = attach(model, optimizer, judge_seconds=0,
                     on_anomaly={"nonfinite_grad": "checkpoint"})  # fmt: skip
    saved: list[tuple[int, bool]] = []
    monitor.on_checkpoint_action(lambda step: saved.append((step, _finite(model))))
    for step in range(30):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if step in (10, 20):
            _nan(model)
        optimizer.step()
        optimizer.zero_grad()

    assert saved == [(10, True)]  # once, while the parameters were still finite


def test_the_last_good_checkpoint_is_the_one_before_the_anomaly(
    attach: Callable[..., stabmon.Monitor], tmp_path: Path
) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = attach(model, optimizer, judge_seconds=0, on_anomaly={"grad_spike": "skip"})
    for step in range(31):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if step == 20:
            _nan(model)  # no nonfinite_grad policy: it reaches the parameters
        optimizer.step()
        optimizer.zero_grad()
        if step in (10, 30):
            path = tmp_path / f"ckpt-{step}.pt"
            with monitor.phase("checkpoint", path=path):
                torch.save(model.state_dict(), path)
    monitor.detach()

    good = _verdict(tmp_path)["last_good_checkpoint"]
    assert (good["step"], good["path"], good["good"]) == (10, str(tmp_path / "ckpt-10.pt"), True)
    assert good["size"] == (tmp_path / "ckpt-10.pt").stat().st_size
    events = [json.loads(line) for line in
              (tmp_path / "test-run" / "rank-0.events.jsonl").read_text().splitlines()]  # fmt: skip
    later = [e for e in events if e["event"] == "checkpoint" and e["step"] == 30]
    assert later and later[0]["good"] is False and "nonfinite" in later[0]["why_not_good"]


def test_a_save_that_raises_is_not_good(
    attach: Callable[..., stabmon.Monitor], tmp_path: Path
) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, on_anomaly={"loss_spike": "stop"})
    with pytest.raises(OSError), monitor.phase("checkpoint", path=tmp_path / "x.pt"):
        raise OSError("disk full")
    monitor.detach()

    assert _verdict(tmp_path)["last_good_checkpoint"] is None


def test_skipping_costs_no_policy_plugin_when_none_is_configured(
    attach: Callable[..., stabmon.Monitor],
) -> None:
    model = _model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1))

    assert not monitor._plugged.gates


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [False, True], ids=["fused", "fused+gradscaler"])
def test_a_skip_with_fused_adamw_on_a_real_gpu_is_exact_and_never_syncs(
    attach: Callable[..., stabmon.Monitor], amp: bool
) -> None:
    """The device mode on CUDA, every step but the checks under sync-debug "error": a sync
    inside stabmon raises in a hook, is contained and counted (bench/policy_gpu.py measures
    the same path, and its cost)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    monitor = attach(model, optimizer, scaler=scaler, on_anomaly={"nonfinite_grad": "skip"})
    unchanged = None
    try:
        for step in range(30):
            torch.cuda.set_sync_debug_mode("error" if step >= 3 else "default")
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = model(torch.randn(32, 64, device="cuda")).float().pow(2).mean()
            (loss if scaler is None else scaler.scale(loss)).backward()
            if step == 20:
                torch.cuda.set_sync_debug_mode("default")
                model[0].weight.grad.view(-1)[:1].fill_(float("nan"))  # type: ignore[union-attr]
                before = _snapshot(model, optimizer)
                torch.cuda.set_sync_debug_mode("error")
            if scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)
                scaler.update()
            if step == 20:
                torch.cuda.set_sync_debug_mode("default")
                unchanged = _identical(before, _snapshot(model, optimizer))
            optimizer.zero_grad(set_to_none=True)
            monitor.observe(loss=loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    assert unchanged is True and _finite(model)
    assert not any(monitor._guard.counts.values())  # no sync was made (and contained)


def test_a_replica_mismatch_stops_every_rank_says_restart_at_once_and_spoils_later_saves(
    attach: Callable[..., stabmon.Monitor], tmp_path: Path
) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, judge_seconds=0, replica_check_steps=1,
                     on_anomaly={"replica_mismatch": "stop"})  # fmt: skip
    policies = next(p for p in monitor._plugged.plugins if isinstance(p, AnomalyPolicies))
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with monitor.phase("checkpoint", path=tmp_path / "before.pt"):
        torch.save(model.state_dict(), tmp_path / "before.pt")

    # As issue 36's check records it: the check after step 3 (every step) found them
    # parted, so the save of step 2 is still good (one of step 3 would not be).
    policies.anomaly_recorded("replica_mismatch", 3)
    verdict = _verdict(tmp_path)  # written at once: the loop may never step again
    with monitor.phase("checkpoint", path=tmp_path / "after.pt"):
        torch.save(model.state_dict(), tmp_path / "after.pt")
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()  # agreed here (one process: itself), read at the next step
    with pytest.raises(stabmon.AnomalyStop):
        optimizer.step()

    assert (verdict["decision"], verdict["failure_domain"]) == ("restart", "infrastructure")
    assert _verdict(tmp_path)["last_good_checkpoint"]["path"] == str(tmp_path / "before.pt")


def test_saves_the_damage_predates_are_not_good_though_it_is_recorded_after_them(
    attach: Callable[..., stabmon.Monitor], tmp_path: Path
) -> None:
    # Anomalies are recorded after the fact: a replica check every 10 steps that finds a
    # mismatch at step 59 says the replicas parted somewhere in steps 50..59, so saves of
    # steps 50..59 hold a corrupted replica; a NaN loss of step 30 read back later spoiled
    # the save of step 30 made before it was read. None of them may be the last good one.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, judge_seconds=0, replica_check_steps=10,
                     on_anomaly={"replica_mismatch": "stop"})  # fmt: skip
    policies = next(p for p in monitor._plugged.plugins if isinstance(p, AnomalyPolicies))
    for step in (20, 29, 30, 49, 55, 59):
        policies.checkpoint_saved(step, str(tmp_path / f"ckpt-{step}.pt"), True)

    policies.anomaly_recorded("replica_mismatch", 59)
    assert _verdict(tmp_path)["last_good_checkpoint"]["step"] == 49
    policies.anomaly_recorded("nonfinite_loss", 30)
    assert _verdict(tmp_path)["last_good_checkpoint"]["step"] == 29
    monitor.detach()
    assert _verdict(tmp_path)["last_good_checkpoint"]["step"] == 29


def test_skip_with_lbfgs_says_the_step_was_applied_instead_of_claiming_it_was_not(
    attach: Callable[..., stabmon.Monitor], caplog: pytest.LogCaptureFixture
) -> None:
    # LBFGS computes the gradients it applies inside step(closure), after the pre-hook
    # checked the ones before it: no skip can hold a NaN of its own closure back. The
    # policy must say so (once in the log, and in the record of each such step), and
    # count the NaN as damage, rather than record "step N was not applied".
    from helpers import events

    model = _model()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    monitor = attach(model, optimizer, judge_seconds=0, on_anomaly={"nonfinite_grad": "skip"})
    generator = torch.Generator().manual_seed(1)
    for step in range(8):
        inputs = torch.randn(4, 8, generator=generator)

        def closure(inputs: torch.Tensor = inputs, poisoned: bool = step >= 4) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(inputs).pow(2).mean()
            loss.backward()
            if poisoned:
                _nan(model)
            return loss

        optimizer.step(closure)
        monitor.observe(loss=closure().detach())
    monitor.detach()

    policies = [e for e in events(monitor.event_log_path) if e.get("event") == "policy"]
    assert policies and all("was applied" in e["detail"] for e in policies), policies
    assert "LBFGS" in policies[0]["detail"] and "not applied" not in str(policies)
    warnings = [r for r in caplog.records if "cannot hold LBFGS" in r.getMessage()]
    assert len(warnings) == 1
    assert not _finite(model)  # what happened: the NaN reached the weights


def test_skip_with_a_closure_given_to_sgd_says_the_step_was_applied(
    attach: Callable[..., stabmon.Monitor],
) -> None:
    # Any optimizer's step(closure) runs the closure after the pre-hook held the gradients
    # back; a closure that computes new ones (zero_grad, backward) has them applied. The
    # skip was recorded 'step N was not applied' while the NaN reached the weights.
    from helpers import events

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, judge_seconds=0, on_anomaly={"nonfinite_grad": "skip"})
    generator = torch.Generator().manual_seed(1)
    for step in range(8):
        inputs = torch.randn(4, 8, generator=generator)

        def closure(inputs: torch.Tensor = inputs, poisoned: bool = step >= 4) -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(inputs).pow(2).mean()
            loss.backward()
            if poisoned:
                _nan(model)
            return loss

        closure()  # the gradients the pre-hook checks
        optimizer.step(closure)
        monitor.observe(loss=closure().detach())
    monitor.detach()

    policies = [e for e in events(monitor.event_log_path) if e.get("event") == "policy"]
    assert policies and all("was applied" in e["detail"] for e in policies), policies
    assert "SGD.step was given a closure" in policies[0]["detail"]
    assert not _finite(model)  # what happened: the NaN reached the weights
