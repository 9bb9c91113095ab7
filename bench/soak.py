"""Compressed soak: a tiny model for a million steps with faults on a schedule, scraped throughout.

About as many optimizer steps as 72 hours of a fast model, in minutes: epochs of
``--epoch-steps`` steps closed by ``epoch_end()``; NaN gradients, loss spikes
and stalls injected in turn every ``--fault-every`` steps (with the demo's own
fault injection, :func:`stabmon.demo.nan_step`), and one host-memory leak
episode, freed again before the end; the rank's exporter scraped every second
by a concurrent thread; the node daemon running as a subprocess. It reports:

- wall time and steps per second;
- the process's RSS once the run is in its steady state and at the end (flat within
  1 MiB). The steady state starts at the first epoch after every kind of fault has
  happened once and the leak episode is over: a first stall, say, starts a thread
  whose malloc arena stays (a one-off of about 0.5 MiB, not growth), and the freed
  leak leaves its own churn;
- the number of series at the first and the last scrape (equal);
- scrape latency p50/p99 and the number of scrapes;
- every injected fault, and whether the event log holds it exactly once at the
  right step (a leak: once, in an epoch of its episode); anything else found.

Exit code 0 when every check holds, 1 otherwise.

Usage::

    python bench/soak.py [--steps 1000000] [--epoch-steps 1000] [--json out.json]
    python bench/soak.py --clean   # a clean million steps: any anomaly is a false positive
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from prometheus_client.parser import text_string_to_metric_families

import stabmon
from stabmon.demo import nan_step, read_anomalies

#: Gauges absent until their detector has a value (the slowdown rule's baseline: after its
#: warm-up and first normal blocks), then one series for good: not counted as cardinality.
APPEAR_WHEN_JUDGED = frozenset({"stabmon_step_time_baseline_seconds"})
RSS_TOLERANCE_BYTES = 2**20
STALL_LIMIT_SECONDS = 3.0  # generous: a shared machine can hold one step up for a second
SPIKE_FACTOR = 300.0
LEAK_BYTES_PER_EPOCH = 32 * 2**20


@dataclass(frozen=True)
class Fault:
    kind: str  # "nan", "spike" or "stall"
    step: int

    @property
    def expected(self) -> tuple[str, ...]:
        """The anomaly kinds that must be logged at this step, each exactly once."""
        return {
            "nan": ("nonfinite_grad",),
            "spike": ("loss_spike", "grad_spike"),
            "stall": ("stall",),
        }[self.kind]

    @property
    def logged_step(self) -> int:
        """The step its records carry: a stall's is the step that did not complete in time."""
        return self.step + 1 if self.kind == "stall" else self.step


@dataclass(frozen=True)
class Schedule:
    steps: int
    epoch_steps: int
    faults: tuple[Fault, ...]
    leak_epochs: range  # host memory grows in these epochs; freed at the end of the last

    @property
    def steady_epoch(self) -> int:
        """The epoch whose end starts the RSS comparison (see the module docstring)."""
        firsts: dict[str, int] = {}
        for fault in self.faults:
            firsts.setdefault(fault.kind, fault.step)
        after_faults = max(firsts.values(), default=0) // self.epoch_steps + 1
        return max(1, after_faults, self.leak_epochs.stop)

    @classmethod
    def build(cls, steps: int, epoch_steps: int, fault_every: int) -> Schedule:
        kinds = ("nan", "spike", "stall")
        # Off the epoch boundaries, and after the spike detector's warm-up.
        starts = range(fault_every, steps - epoch_steps // 2, fault_every)
        faults = tuple(
            Fault(kinds[index % len(kinds)], start + epoch_steps // 3 + index)
            for index, start in enumerate(starts)
        )
        epochs = steps // epoch_steps
        first_leak = max(4, epochs // 3)
        leak_epochs = range(first_leak, min(first_leak + 12, epochs - 2))
        return cls(steps, epoch_steps, faults, leak_epochs)


@dataclass
class Scraper:
    """GETs ``url`` every ``interval`` seconds in a thread; keeps latencies and series counts."""

    url: str
    interval: float = 1.0
    latencies: list[float] = field(default_factory=list)
    series: list[int] = field(default_factory=list)
    failures: int = 0
    last_names: set[str] = field(default_factory=set)  # the series of the latest scrape
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soak-scraper", daemon=True)
        self._thread.start()

    def scrape_once(self) -> int:
        started = time.perf_counter()
        with urllib.request.urlopen(self.url, timeout=10) as response:
            text = response.read().decode()
        self.latencies.append(time.perf_counter() - started)
        names = {
            sample.name + json.dumps(sample.labels, sort_keys=True)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        self.last_names = names
        # A gauge that appears once its rule first judges is one series, not growing cardinality.
        counted = {name for name in names if name.split("{", 1)[0] not in APPEAR_WHEN_JUDGED}
        self.series.append(len(counted))
        return len(counted)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.scrape_once()
            except OSError:
                self.failures += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)


def _percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _start_daemon(run_dir: Path) -> tuple[subprocess.Popen[str], str]:
    args = [sys.executable, "-m", "stabmon", "daemon", "--port", "0", "--address", "127.0.0.1",
            "--run-dir", str(run_dir), "--interval", "1"]  # fmt: skip
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"the daemon exited before announcing itself ({process.poll()})")
    return process, line.rsplit(" ", 1)[1]


def _daemon_sees(url: str, pid: int) -> float | None:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "stabmon_process_up" and sample.labels.get("pid") == str(pid):
                return sample.value
    return None


def run_soak(
    schedule: Schedule,
    *,
    run_dir: Path,
    scrape_interval: float = 1.0,
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Train through ``schedule``; return the figures and the per-fault verdicts."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    teacher = torch.nn.Linear(8, 1)
    generator = torch.Generator().manual_seed(1)
    # A pool of batches with label noise: the loss settles to a stationary level, not to 0.
    pool_inputs = torch.randn(256, 16, 8, generator=generator)
    with torch.no_grad():
        pool_targets = teacher(pool_inputs) + 0.3 * torch.randn(256, 16, 1, generator=generator)
    faults = {fault.step: fault for fault in schedule.faults}
    daemon, daemon_url = _start_daemon(run_dir)
    process = psutil.Process()
    leaked: list[torch.Tensor] = []
    monitor = stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(run_dir), run_id="soak",
        stall_seconds=STALL_LIMIT_SECONDS, spike_warmup_steps=200, sample_seconds=1.0,
        leak_warmup_epochs=1, leak_window_epochs=2, leak_windows=3, leak_threshold=0.03,
    )  # fmt: skip
    assert monitor.metrics_url is not None, "the soak needs the exporter"
    scraper = Scraper(monitor.metrics_url, scrape_interval)
    rss_start = series_start = None
    names_start: set[str] = set()
    started = time.perf_counter()
    try:
        scraper.start()
        for step in range(schedule.steps):
            index = step % pool_inputs.shape[0]
            loss = torch.nn.functional.mse_loss(model(pool_inputs[index]), pool_targets[index])
            fault = faults.get(step)
            if fault is not None and fault.kind == "spike":
                loss = loss * SPIKE_FACTOR  # a mis-scaled loss term: loss and gradients spike
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            if fault is not None and fault.kind == "spike":
                _step_and_undo(model, optimizer)  # measured, then undone: the run goes on clean
            elif fault is not None and fault.kind == "nan":
                nan_step(model, optimizer)
            else:
                optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
            if fault is not None and fault.kind == "stall":
                time.sleep(STALL_LIMIT_SECONDS * 2)  # a hung collective
            if (step + 1) % schedule.epoch_steps == 0:
                epoch = step // schedule.epoch_steps
                if epoch in schedule.leak_epochs:
                    leaked.append(torch.ones(LEAK_BYTES_PER_EPOCH // 4))
                if epoch == schedule.leak_epochs.stop - 1:
                    leaked.clear()  # the leak is fixed: memory back where it was
                monitor.epoch_end()
                if epoch == schedule.steady_epoch:
                    gc.collect()
                    rss_start = process.memory_info().rss
                    series_start = scraper.scrape_once()
                    names_start = scraper.last_names
                if epoch % 100 == 0:
                    elapsed = time.perf_counter() - started
                    progress(f"epoch {epoch}, {step + 1} steps, {elapsed:.0f} s")
        wall = time.perf_counter() - started
        gc.collect()
        rss_end = process.memory_info().rss
        series_end = scraper.scrape_once()
        series_changed = sorted(scraper.last_names ^ names_start)
        daemon_up = _daemon_sees(daemon_url, os.getpid())
    finally:
        scraper.stop()
        events_path = monitor.event_log_path
        monitor.detach()
        daemon.terminate()
        daemon.wait(10)
        if daemon.stdout is not None:
            daemon.stdout.close()
    detected = read_anomalies(events_path)
    report = _report(
        schedule, detected, wall=wall, rss=(rss_start, rss_end), series=(series_start, series_end),
        scraper=scraper, daemon_up=daemon_up, events_path=events_path,
    )  # fmt: skip
    report["series_changed"] = series_changed  # which series came or went, when the count moved
    return report


def _step_and_undo(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` measured by the hooks, then undone (the run is not derailed)."""
    saved = [param.detach().clone() for param in model.parameters()]
    state = [
        {key: value.clone() for key, value in optimizer.state[param].items()}
        for param in model.parameters()
    ]
    optimizer.step()
    with torch.no_grad():
        for param, copy, kept in zip(model.parameters(), saved, state, strict=True):
            param.copy_(copy)
            optimizer.state[param] = kept


def _report(
    schedule: Schedule,
    detected: dict[str, list[dict[str, Any]]],
    *,
    wall: float,
    rss: tuple[int | None, int],
    series: tuple[int | None, int],
    scraper: Scraper,
    daemon_up: float | None,
    events_path: Path | None,
) -> dict[str, Any]:
    verdicts = []
    claimed: set[tuple[str, int]] = set()
    for fault in schedule.faults:
        for kind in fault.expected:
            at = fault.logged_step
            steps = [r["step"] for r in detected.get(kind, []) if r["step"] == at]
            verdicts.append({"fault": fault.kind, "kind": kind, "step": at,
                             "found": len(steps), "ok": len(steps) == 1})  # fmt: skip
            claimed.add((kind, at))
    leaks = detected.get("memory_leak", [])
    epochs = schedule.leak_epochs
    if epochs:  # one leak episode: found once, in an epoch of it
        leak_ok = len(leaks) == 1 and epochs.start <= leaks[0]["epoch"] <= epochs.stop
    else:  # no leak injected (--clean): any memory_leak is a false positive
        leak_ok = not leaks
    unexpected = [
        {"kind": kind, "step": record["step"], "epoch": record["epoch"]}
        for kind, records in detected.items()
        if kind != "memory_leak"
        for record in records
        if (kind, record["step"]) not in claimed
    ]
    rss_start, rss_end = rss
    series_start, series_end = series
    rss_ok = rss_start is not None and abs(rss_end - rss_start) <= RSS_TOLERANCE_BYTES
    latencies_ms = [seconds * 1000 for seconds in scraper.latencies]
    checks = {
        "faults_detected_once_at_their_step": all(v["ok"] for v in verdicts),
        "leak_detected_once_in_its_episode": leak_ok,
        "nothing_unexpected": not unexpected,
        "rss_flat_within_1_mib": rss_ok,
        "series_count_unchanged": series_start == series_end,
        "daemon_reports_the_process_up": daemon_up == 1,
        "every_scrape_answered": scraper.failures == 0,
    }
    return {
        "steps": schedule.steps,
        "epoch_steps": schedule.epoch_steps,
        "wall_seconds": round(wall, 1),
        "steps_per_second": round(schedule.steps / wall, 1),
        "rss_steady_from_epoch": schedule.steady_epoch,
        "rss_start_bytes": rss_start,
        "rss_end_bytes": rss_end,
        "rss_change_bytes": None if rss_start is None else rss_end - rss_start,
        "series_start": series_start,
        "series_end": series_end,
        "scrapes": len(latencies_ms),
        "scrape_failures": scraper.failures,
        "scrape_p50_ms": _round(_percentile(latencies_ms, 0.50)),
        "scrape_p99_ms": _round(_percentile(latencies_ms, 0.99)),
        "faults": verdicts,
        "leak": {
            "epochs": [epochs.start, epochs.stop - 1],
            "detected": [(r["step"], r["epoch"]) for r in leaks],
        },  # fmt: skip
        "unexpected": unexpected,
        "event_log": str(events_path),
        "checks": checks,
        "ok": all(checks.values()),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--epoch-steps", type=int, default=1000)
    parser.add_argument(
        "--fault-every", type=int, default=None, help="steps between faults (default: steps / 12)"
    )
    parser.add_argument(
        "--clean", action="store_true",
        help="no faults and no leak: every anomaly is a false positive (must be none)",
    )  # fmt: skip
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the daemon subprocess and the exporter are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    fault_every = args.fault_every or max(args.steps // 12, 2000)
    schedule = Schedule.build(args.steps, args.epoch_steps, fault_every)
    if args.clean:
        schedule = Schedule(args.steps, args.epoch_steps, (), range(0))
    with tempfile.TemporaryDirectory(prefix="stabmon-soak-") as scratch:
        run_dir = args.run_dir or Path(scratch)
        report = run_soak(schedule, run_dir=run_dir, progress=lambda line: print(line, flush=True))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    failed = [name for name, ok in report["checks"].items() if not ok]
    print("soak: OK" if not failed else f"soak: FAILED {', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
