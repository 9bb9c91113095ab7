"""A deterministic training process that checkpoints every epoch, can SIGKILL itself, and resumes.

    python resume_trainee.py --run-dir D --run-id R --checkpoint C --summary S
        [--steps 40] [--epoch-steps 8] [--kill-at-step K] [--spike-at-step N]

Epochs are ``--epoch-steps`` optimizer steps, closed by ``mon.epoch_end()``;
after each one ``{model, optimizer, monitor: mon.state_dict(), step}`` is saved
to ``--checkpoint``. A process started while that file exists resumes from it.
Batches are a function of the global step and one thread does the arithmetic,
so an interrupted and an uninterrupted run compute the same numbers.

At step ``--spike-at-step`` the loss is multiplied by ``--spike-factor`` (a
mis-scaled loss term), so the loss and the gradient norm spike there. At step
``--kill-at-step`` the process writes its summary and sends itself SIGKILL, as
the OOM killer would. Otherwise it writes the summary at the end: the final
``mon.state_dict()``, the state it resumed from, its event log path, and its
own exporter's samples right after attach (and resume) and at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

import stabmon


def _samples(url: str | None) -> list[dict[str, Any]]:
    """The exporter's samples as JSON-able records (name, labels, value)."""
    assert url is not None, "the monitor has no exporter"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return [
        {"name": sample.name, "labels": dict(sample.labels), "value": sample.value}
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def _write_atomic(path: Path, data: bytes) -> None:
    # rename(2) is atomic: the test never reads half a summary.
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    # Killed mid-save, the process leaves the previous checkpoint intact.
    temporary = path.with_name(f".{path.name}.tmp")
    torch.save(state, temporary)
    os.replace(temporary, path)


def _batch(step: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(32, 16, generator=generator)
    noise = 0.1 * torch.randn(32, 1, generator=generator)
    return inputs, inputs @ weights + noise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--summary", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--epoch-steps", type=int, default=8)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--spike-at-step", type=int, default=-1)
    parser.add_argument("--spike-factor", type=float, default=100.0)
    parser.add_argument("--spike-warmup-steps", type=int, default=10)
    args = parser.parse_args()
    started_unix = time.time()
    torch.set_num_threads(1)  # same arithmetic, in the same order, in every process

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )  # fmt: skip
    weights = torch.randn(16, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # its state must resume too
    monitor = stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=args.run_dir, run_id=args.run_id,
        spike_warmup_steps=args.spike_warmup_steps, leak_warmup_epochs=1, leak_window_epochs=2,
        scrape_cache_seconds=0,  # scraped twice within a second: each scrape must be fresh
    )  # fmt: skip
    start_step = 0
    resumed_from: dict[str, Any] | None = None
    if args.checkpoint.exists():
        checkpoint = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        monitor.load_state_dict(checkpoint["monitor"])
        start_step = checkpoint["step"]
        resumed_from = checkpoint["monitor"]
    summary: dict[str, Any] = {
        "pid": os.getpid(),
        "started_unix": started_unix,
        "start_step": start_step,
        "resumed_from": resumed_from,
        "event_log": str(monitor.event_log_path),
        "metrics_at_start": _samples(monitor.metrics_url),
    }

    def finish(step: int, *, killed: bool) -> None:
        summary.update(
            killed=killed,
            steps=step,
            steps_in_process=step - start_step,
            state=monitor.state_dict(),
            metrics=_samples(monitor.metrics_url),
        )
        _write_atomic(args.summary, json.dumps(summary).encode())

    for step in range(start_step, args.steps):
        if step == args.kill_at_step:
            finish(step, killed=True)
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = _batch(step, weights)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        if step == args.spike_at_step:
            loss = loss * args.spike_factor
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        monitor.observe(loss=loss)
        if (step + 1) % args.epoch_steps == 0:
            monitor.epoch_end()
            with monitor.phase("checkpoint"):
                _save_checkpoint(
                    args.checkpoint,
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "monitor": monitor.state_dict(),
                        "step": step + 1,
                    },
                )
    finish(args.steps, killed=False)
    monitor.detach()


if __name__ == "__main__":
    main()
