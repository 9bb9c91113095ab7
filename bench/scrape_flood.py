"""Scrape flood: what 50 concurrent scrapers on loopback cost a training loop (issues 21, 40).

Anyone who can reach a rank's exporter can scrape it as fast as they like. This
benchmark trains a CPU MLP with stabmon attached, pinned to one core, while a
separate process (pinned to another core, so its own CPU is not what is
measured) runs 50 threads that scrape ``/metrics`` back to back for the whole
window. Quiet and flooded windows alternate, ``--rounds`` of each, and the cost
is one minus the ratio of the median flooded to the median quiet step rate,
in steps per CPU second of the training process (see ``_train_window``; the
wall-clock rate is reported too). The target is under 5%.

The headline figure is the share of the training process's CPU time that its
threads other than the training thread take under the flood, less their share
when quiet: with the process pinned to one core, that is CPU the training loop
did not get. Wall-clock step rates are reported too, but on a small shared VM
they move with other programs' load and with what runs on the sibling
hyperthread (flooded windows came out faster than quiet ones there, with one
client as with fifty), so they are not the measure.

    python bench/scrape_flood.py                     # 3 rounds of 10 s + 10 s
    python bench/scrape_flood.py --cache-seconds 0   # no scrape cache: the cost of the rest
    python bench/scrape_flood.py --attack idle       # 132 idle connections, held (issue 40)
    python bench/scrape_flood.py --json out.json

Throughout each attacked window a *real scraper* (Prometheus, as far as the exporter can
tell) scrapes ``/metrics`` once a second with a 2 s timeout from 127.0.0.1, while the
attackers connect from 127.0.0.2 (another host, to the exporter; on one address without
basic auth the two cannot be told apart): its scrapes served and failed are the figure
of issue 40 ("real scrapes served").

Needs two CPUs (``os.sched_setaffinity``); on one it says so and measures
anyway (the flood's own CPU then counts against training).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_FLOOD = r"""
import os, socket, sys, threading, time
host, port, seconds, clients = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
attack, source = sys.argv[5], sys.argv[6]
if len(sys.argv) > 7:
    os.sched_setaffinity(0, {int(sys.argv[7])})
request = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
done = [0] * clients
failed = [0] * clients
real = [0, 0]
end = time.monotonic() + seconds
def connect(address, timeout):
    connection = socket.socket()
    connection.settimeout(timeout)
    connection.bind((address, 0))
    connection.connect((host, port))
    return connection
def scrape(connection):
    connection.sendall(request)
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    return answer.startswith(b"HTTP/1.0 200") or answer.startswith(b"HTTP/1.1 200")
def flood(index):
    while time.monotonic() < end:
        try:
            with connect(source, 2) as connection:
                ok = scrape(connection)
            done[index] += ok
            failed[index] += not ok
        except OSError:
            failed[index] += 1
def idle(index):  # holds a connection that never sends; opens another when it is closed
    while time.monotonic() < end:
        try:
            with connect(source, max(end - time.monotonic(), 0.01)) as connection:
                done[index] += 1
                connection.recv(1)
        except OSError:
            failed[index] += 1
            time.sleep(0.05)
def prometheus():
    while time.monotonic() < end - 1:
        started = time.monotonic()
        try:
            with connect("127.0.0.1", 2) as connection:
                real[0 if scrape(connection) else 1] += 1
        except OSError:
            real[1] += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
target = flood if attack == "flood" else idle
threads = [threading.Thread(target=target, args=(i,)) for i in range(clients)]
threads.append(threading.Thread(target=prometheus))
for thread in threads: thread.start()
for thread in threads: thread.join()
print(sum(done), sum(failed), real[0], real[1], flush=True)
"""


def _train_window(step, seconds: float) -> tuple[float, float, float]:
    """Steps per wall second, steps per process CPU second, and the share of the process's
    CPU time spent outside the training thread (exporter, stabmon's own threads)."""
    steps = 0
    process = time.process_time()
    thread = time.thread_time()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        step()
        steps += 1
    process = time.process_time() - process
    thread = time.thread_time() - thread
    return steps / seconds, steps / process, (process - thread) / process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each window")
    parser.add_argument("--rounds", type=int, default=3, help="quiet + flooded windows")
    parser.add_argument("--clients", type=int, default=None, help="50 (flood), 132 (idle)")
    parser.add_argument(
        "--attack", choices=("flood", "idle"), default="flood",
        help="flood: scrape back to back; idle: hold connections that never send a request",
    )  # fmt: skip
    parser.add_argument(
        "--source", default="127.0.0.2", help="the attackers' address (127.0.0.1: Prometheus')"
    )
    parser.add_argument("--cache-seconds", type=float, default=1.0, help="scrape_cache_seconds")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    if args.clients is None:
        args.clients = 50 if args.attack == "flood" else 132

    import torch

    import stabmon

    cpus = sorted(os.sched_getaffinity(0))
    pinned = len(cpus) >= 2
    if pinned:
        os.sched_setaffinity(0, {cpus[0]})
    else:
        print("only one CPU: the flood's own CPU counts against training", file=sys.stderr)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(64, 256), torch.randint(0, 10, (64,))
    run_dir = tempfile.mkdtemp(prefix="stabmon-flood-")
    monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1", run_dir=run_dir,
                             run_id="flood", scrape_cache_seconds=args.cache_seconds)  # fmt: skip
    url = monitor.metrics_url
    assert url is not None
    port = int(url.rsplit(":", 1)[1].split("/")[0])

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)

    _train_window(step, 2.0)  # warm up
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:  # Prometheus, before any attack
        response.read()
    quiet: list[tuple[float, float, float]] = []
    flooded: list[tuple[float, float, float]] = []
    scrapes: list[tuple[int, int]] = []
    real: list[tuple[int, int]] = []
    for _ in range(args.rounds):
        quiet.append(_train_window(step, args.seconds))
        flood_args = [sys.executable, "-c", _FLOOD, "127.0.0.1", str(port), str(args.seconds + 1),
                      str(args.clients), args.attack, args.source]  # fmt: skip
        flood_args += [str(cpus[1])] if pinned else []
        flood = subprocess.Popen(flood_args, stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the clients are connecting
        flooded.append(_train_window(step, args.seconds))
        out, _ = flood.communicate()
        served, failed, real_served, real_failed = (int(word) for word in out.split())
        scrapes.append((served, failed))
        real.append((real_served, real_failed))
    monitor.detach()
    wall_cost = 1.0 - statistics.median(f[0] for f in flooded) / statistics.median(
        q[0] for q in quiet
    )
    per_cpu_cost = 1.0 - statistics.median(f[1] for f in flooded) / statistics.median(
        q[1] for q in quiet
    )
    cost = statistics.median(f[2] for f in flooded) - statistics.median(q[2] for q in quiet)
    result = {
        "attack": args.attack,
        "clients": args.clients,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "scrape_cache_seconds": args.cache_seconds,
        "pinned": pinned,
        "cpu": _cpu_name(),
        "quiet_steps_per_second": [q[0] for q in quiet],
        "flooded_steps_per_second": [f[0] for f in flooded],
        "quiet_steps_per_cpu_second": [q[1] for q in quiet],
        "flooded_steps_per_cpu_second": [f[1] for f in flooded],
        "scrapes_served_failed": scrapes,
        "real_scrapes_served_failed": real,
        "quiet_other_threads_cpu_share": [q[2] for q in quiet],
        "flooded_other_threads_cpu_share": [f[2] for f in flooded],
        "throughput_cost": cost,
        "throughput_cost_per_cpu_second": per_cpu_cost,
        "throughput_cost_wall": wall_cost,
    }
    print(json.dumps(result, indent=2))
    print(
        f"scrape flood ({args.clients} clients, {args.seconds:g} s x {args.rounds}): the "
        f"training process's CPU outside its training thread "
        f"{statistics.median(q[2] for q in quiet):.2%} quiet -> "
        f"{statistics.median(f[2] for f in flooded):.2%} flooded: cost {cost:+.2%} of training "
        f"(target < 5%); steps per process CPU second {per_cpu_cost:+.1%}, per wall second "
        f"{wall_cost:+.1%} (noisy on a shared machine); attackers' "
        f"{'scrapes served' if args.attack == 'flood' else 'connections opened'} per window: "
        f"{', '.join(str(s) for s, _ in scrapes)}; real scrapes (1/s) served/failed: "
        f"{', '.join(f'{s}/{f}' for s, f in real)}; steps/s quiet "
        f"{statistics.median(q[0] for q in quiet):.1f} -> attacked "
        f"{statistics.median(f[0] for f in flooded):.1f}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
