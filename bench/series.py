"""How many series stabmon adds to Prometheus, and what one scrape costs.

Measures, on this machine, with real exporters scraped over loopback HTTP:

- series per training rank at default config, for a model with 8 top-level
  modules and for one that fills ``max_modules`` (32), after some steps and two
  epochs (every labelled child that will ever exist is there by then);
- series of the node daemon for 8 GPUs and 8 ranks (a fake NVML, since the
  count does not depend on the driver, and 8 registered live processes);
- the time of one scrape of a rank, of 8 ranks one after the other (a node's
  worth, as Prometheus scrapes them), and of the daemon.

Usage::

    python bench/series.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn

import stabmon
from stabmon.config import load_config
from stabmon.daemon.app import DaemonApp
from stabmon.export.exporter import MAX_CONNECTIONS, MIN_REQUEST_SECONDS
from stabmon.hardware.nvml import GpuProcess
from stabmon.shared.rundir import ProcessRecord, boot_id, write_atomic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "daemon"))
from fake_nvml import FakeGpu, FakeNvml  # noqa: E402 - the tests' programmable NVML

SCRAPES = 50
#: Rounds start no closer together than this: each exporter serves at most MAX_CONNECTIONS
#: requests per MIN_REQUEST_SECONDS (its flood limit), and a faster loop would time the
#: wait for a free connection slot, not the scrape. One slot is left spare for a round that
#: runs late. Prometheus scrapes a target every few seconds, far below the limit.
ROUND_SECONDS = MIN_REQUEST_SECONDS / (MAX_CONNECTIONS - 1)


def _model(modules: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(modules)))


def _series(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def _scrape_seconds(urls: list[str], rounds: int = SCRAPES) -> float:
    """Median wall time of scraping every URL in ``urls`` once, in turn, paced as above."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for url in urls:
            with urllib.request.urlopen(url, timeout=5) as response:
                response.read()
        times.append(time.perf_counter() - started)
        time.sleep(max(0.0, ROUND_SECONDS - times[-1]))
    return statistics.median(times)


def _train(monitor: stabmon.Monitor, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for _epoch in range(2):
        for _ in range(20):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
        monitor.epoch_end()


def measure(run_dir: Path) -> dict[str, Any]:
    monitors = []
    per_rank: dict[str, int] = {}
    for name, modules in (("8 modules", 8), ("32 modules (max_modules)", 32)):
        model = _model(modules)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1",
                                 run_dir=str(run_dir), run_id=f"bench-{modules}")  # fmt: skip
        _train(monitor, model, optimizer)
        assert monitor.metrics_url is not None
        per_rank[name] = _series(monitor.metrics_url)
        monitors.append(monitor)
    for rank in range(6):  # 8 ranks' worth of exporters on this "node"
        model = _model(8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1",
                                 run_dir=str(run_dir), run_id=f"bench-rank{rank}")  # fmt: skip
        _train(monitor, model, optimizer)
        monitors.append(monitor)
    urls = [m.metrics_url for m in monitors if m.metrics_url]

    daemon_dir = run_dir / "daemon"
    me = psutil.Process()
    for rank in range(8):
        (daemon_dir / "job").mkdir(parents=True, exist_ok=True)
        record = ProcessRecord(pid=os.getpid(), create_time=me.create_time(), run="job",
                               rank=rank, local_rank=rank, boot_id=boot_id(),
                               metrics_url=f"http://127.0.0.1:{9400 + rank}/metrics",
                               attached_unix=time.time(), last_step_unix=time.time(),
                               updated_unix=time.time())  # fmt: skip
        write_atomic(daemon_dir / "job" / f"rank-{rank}.json", record.to_json())
    gpus = [
        FakeGpu(
            uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
            utilization_percent=90,
            processes=[GpuProcess(os.getpid(), 2**30)],
        )  # fmt: skip
        for index in range(8)
    ]
    config = load_config({"run_dir": str(daemon_dir),
                          "daemon": {"port": 0, "address": "127.0.0.1", "interval": 1.0}},
                         env={})  # fmt: skip
    daemon = DaemonApp(config, reader=FakeNvml(gpus))
    assert daemon.start() and daemon.url
    time.sleep(0.5)
    try:
        result = {
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "stabmon": stabmon.__version__,
            "series_per_rank": per_rank,
            "series_daemon_8_gpus_8_ranks": _series(daemon.url),
            "scrape_rounds": SCRAPES,
            "scrape_ms_one_rank": 1000 * _scrape_seconds(urls[:1]),
            "scrape_ms_8_ranks": 1000 * _scrape_seconds(urls[:8]),
            "scrape_ms_daemon": 1000 * _scrape_seconds([daemon.url]),
        }
    finally:
        daemon.stop()
        for monitor in monitors:
            monitor.detach()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(Path(tmp))
    print(f"# {time.strftime('%Y-%m-%d')} on {result['machine']}; host {socket.gethostname()}")
    print(f"# Python {result['python']}, torch {result['torch']}, stabmon {result['stabmon']}")
    for name, count in result["series_per_rank"].items():
        print(f"series per rank, {name}: {count}")
    print(f"series of the daemon, 8 GPUs and 8 ranks: {result['series_daemon_8_gpus_8_ranks']}")
    rounds = result["scrape_rounds"]
    print(f"one scrape of a rank: {result['scrape_ms_one_rank']:.2f} ms (median of {rounds})")
    print(f"scrapes of 8 ranks in turn: {result['scrape_ms_8_ranks']:.2f} ms")
    print(f"one scrape of the daemon: {result['scrape_ms_daemon']:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
