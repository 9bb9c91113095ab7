"""Runs for ``stabmon compare``'s tests: real short trainings of the same tiny CPU loop, varied
one way at a time, and event logs written by hand for the unit tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from helpers import LoopClock, tiny_model

import stabmon

STEPS = 120
#: Throughput records (written at slowdown block ends) every 2 ms: a short run has many blocks,
#: at least the 4 per rank compare needs even where 110 fast steps take 10 ms.
RECORD_SECONDS = 0.002
WARMUP_STEPS = 10


def train(
    run_dir: Path,
    run_id: str,
    *,
    steps: int = STEPS,
    batch: int = 4,
    fetch_sleep: float = 0.0,
    nan_step: int | None = None,
    dataset: int | None = None,
    record_seconds: float = RECORD_SECONDS,
) -> Path:
    """``steps`` steps of a tiny model fed through ``mon.track``; returns the run's directory.

    The loop's clock moves as a real step's would, whatever the machine's load: 1 ms in
    each batch fetch, 4 ms in the forward, 4 ms in the backward and 1 ms in the optimizer
    step (a step of ``STEADY``'s shape), so identical runs time alike and a variant moves
    only what it changes. ``fetch_sleep`` is added to each batch fetch (a slow input
    pipeline); ``nan_step`` puts a
    NaN in one gradient of that step (its update undone, so later steps are clean);
    ``dataset`` samples make an epoch, its last batch short when ``batch`` does not divide
    it; ``record_seconds`` is throughput.record_seconds (60 s is the default: one block).
    """
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clock = LoopClock()
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(run_dir), run_id=run_id,
        sample_every=5, throughput={"record_seconds": record_seconds,
                                    "slowdown_block_seconds": record_seconds,
                                    "slowdown_warmup_steps": WARMUP_STEPS},
        clock=clock,
    ) as monitor:  # fmt: skip
        # Registered after stabmon's hooks, so inside the phases they time.
        model.register_forward_pre_hook(lambda module, args: clock.advance(0.004))
        optimizer.register_step_pre_hook(lambda *_: clock.advance(0.001))
        batches = _batches(steps, batch, fetch_sleep, dataset, clock)
        for step, inputs in enumerate(monitor.track(batches)):
            loss = model(inputs).pow(2).mean()
            loss.register_hook(lambda grad: clock.advance(0.004))  # in the backward
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            saved = [p.detach().clone() for p in model.parameters()] if step == nan_step else []
            if saved:
                first = next(p for p in model.parameters() if p.grad is not None)
                assert first.grad is not None
                first.grad.view(-1)[0] = float("nan")
            optimizer.step()
            with torch.no_grad():  # undo the poisoned update, as a skipping GradScaler would
                for param, copy in zip(model.parameters(), saved, strict=False):
                    param.copy_(copy)
            optimizer.zero_grad()
            monitor.observe(loss=loss)
    return run_dir / run_id


def _batches(
    steps: int, batch: int, fetch_sleep: float, dataset: int | None, clock: LoopClock
) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        clock.advance(0.001 + fetch_sleep)
        per_epoch = -(-dataset // batch) if dataset else 1
        size = min(batch, dataset - step % per_epoch * batch) if dataset else batch
        yield torch.randn(size, 8, generator=generator)


# ------------------------------------------------- event logs written by hand, for unit tests


def write_run(directory: Path, ranks: dict[int, list[dict[str, Any]]]) -> Path:
    """``directory`` holding one event log per rank, with these records (one line each)."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank, records in ranks.items():
        lines = [json.dumps({"run": directory.name, "rank": rank, **r}) + "\n" for r in records]
        (directory / f"rank-{rank}.events.jsonl").write_text("".join(lines))
    return directory


def attach_record(time: float = 1000.0, **variables: str) -> dict[str, Any]:
    """An attach record of a CPU process with these environment variables."""
    environment = {
        "versions": {"torch_version": "2.13.0+cpu", "python_version": "3.11.7"},
        "hostname": "node-1", "cpu_count": 2, "torch_threads": 2, "cuda_available": False,
        "cuda_visible_devices": None, "gpus": [], "variables": dict(variables),
    }  # fmt: skip
    return {"time": time, "event": "attach", "environment": environment, "parameters": 6,
            "config": {"throughput": {"slowdown_warmup_steps": 0}}}  # fmt: skip


def throughput_records(
    step_seconds: list[dict[str, float]], *, steps_per_block: int = 10, start: float = 1000.0
) -> list[dict[str, Any]]:
    """One throughput record per block, each block ``steps_per_block`` steps taking these
    seconds per step and phase (running totals, as a process writes them)."""
    records = []
    totals: dict[str, float] = {}
    for index, per_step in enumerate(step_seconds, start=1):
        for phase, seconds in per_step.items():
            totals[phase] = totals.get(phase, 0.0) + seconds * steps_per_block
        steps = index * steps_per_block
        records.append({
            "time": start + sum(totals.values()), "event": "throughput", "step": steps - 1,
            "steps": steps, "uptime_seconds": sum(totals.values()) + 0.5,
            "phase_seconds": dict(totals), "samples": steps * 4, "tokens": 0,
        })  # fmt: skip
    return records
