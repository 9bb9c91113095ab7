"""Helpers the tests import: tiny models, a training step, real scrapes, event-log reads,
and processes that announce their URL."""

from __future__ import annotations

import ctypes
import importlib
import json
import subprocess
import threading
import time
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import stabmon


def import_on_framework(framework: str, module: str) -> ModuleType:
    """``module``, a test helper that imports ``framework`` at its top, imported now; the test
    is skipped where ``framework`` is not installed.

    For a fixture: importing a framework at a test module's top costs every xdist worker
    seconds at collection. The import runs under the suite's own filter (every warning an
    error), not the calling module's, so one that warns fails as it would have failed
    collection.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pytest.importorskip(framework)
        return importlib.import_module(module)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
        torch.nn.Linear(16, 1),
    )  # fmt: skip


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    monitor: stabmon.Monitor | None = None,
    *,
    nan_grad: bool = False,
    batch: int = 4,
) -> torch.Tensor:
    """One plain step: forward, backward, optional NaN gradient, step, zero_grad, observe.

    A NaN step leaves the weights as they were, so later steps are clean again.
    """
    inputs = torch.randn(batch, 8)
    loss = model(inputs).pow(2).mean()
    loss.backward()
    saved = [p.detach().clone() for p in model.parameters()] if nan_grad else []
    if nan_grad:
        first = next(p for p in model.parameters() if p.grad is not None)
        assert first.grad is not None
        first.grad.view(-1)[0] = float("nan")
    optimizer.step()
    with torch.no_grad():  # undo the poisoned update, as a skipping GradScaler would
        for param, copy in zip(model.parameters(), saved, strict=False):
            param.copy_(copy)
    optimizer.zero_grad()
    if monitor is not None:
        monitor.observe(loss=loss)
    return loss


def scrape(url: str | None) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """GET ``url`` and parse it with prometheus-client's parser: {(sample name, labels): value}."""
    assert url is not None, "the monitor has no exporter"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    """The one sample called ``name`` whose labels include ``labels``; None when absent."""
    matches = _matching(samples, name, labels)
    assert len(matches) <= 1, f"{name}{labels} matches {len(matches)} samples"
    return matches[0] if matches else None


def unique_value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    """As :func:`value`, but None rather than an error when several samples match (a rank
    restarted: its dead and its new process both report for a while)."""
    matches = _matching(samples, name, labels)
    return matches[0] if len(matches) == 1 else None


def _matching(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, labels: dict[str, str]
) -> list[float]:
    return [v for (n, lbl), v in samples.items() if n == name and set(labels.items()) <= lbl]


def scrape_until(
    url: str,
    predicate: Callable[[dict[tuple[str, frozenset[tuple[str, str]]], float]], bool],
    timeout: float = 15.0,
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Scrape ``url`` every 0.2 s until ``predicate`` holds; the last scrape in the error."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s; last scrape: {samples}")
        time.sleep(0.2)


def start_announcing(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    """Start a process that prints one line announcing its URL; return it and the URL.

    It runs in a session of its own: the ``processes`` fixture kills the whole group,
    data loader workers included.
    """
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line, f"{args[1:3]} exited before announcing itself (code {process.poll()})"
    return process, line.rsplit(" ", 1)[1]


def events(path: Path | None) -> list[dict[str, Any]]:
    """Every record of an event log (each line must be strict JSON)."""
    assert path is not None, "the monitor has no event log"
    return [json.loads(line, parse_constant=_reject) for line in path.read_text().splitlines()]


def _reject(constant: str) -> Any:
    raise AssertionError(f"event log holds a non-JSON constant {constant}")


def has_nvidia_driver() -> bool:
    """Whether NVML's library loads here (a GPU machine); tests of the driverless path skip then."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


class LoopClock:
    """A loop clock the test moves, injected with ``attach(..., clock=clock)``.

    The loop timer, the heartbeat and the stall watchdog all read it, so a stall happens
    when the test advances it past the limit, never because the machine is slow.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``check`` until it holds (a background thread's work); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        time.sleep(0.02)


def interruptible_sleep(until: threading.Event, timeout: float = 30.0) -> None:
    """Block the calling (main) thread until ``until`` is set, as a stalled loop blocks."""
    until.wait(timeout)
