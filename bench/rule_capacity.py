"""How many ranks one Prometheus evaluates stabmon's alert rules for: time per group per rank.

Synthetic, healthy history for N ranks (the series the rules read, from training targets and
node daemons: 8 ranks and 8 GPUs a node, 64 ranks a run) is written as OpenMetrics, turned into
TSDB blocks by ``promtool tsdb create-blocks-from openmetrics`` (offline backfill), and a real
``prometheus`` (Debian's, as ``make tools`` installs it) evaluates a rules file over it, with no
scrape target. The history ends as Prometheus starts, so instant selectors see it as live. The
series that the rules file records itself and reads back over an hour or more (the last scrape
times every 15 s, the leak floors every 5 minutes) are backfilled too, as hours of running
would have left them; the rest are recorded by the rules as they run.

Every group is evaluated every ``--eval`` seconds (15 s by default) whatever its shipped
interval, so a measurement takes a minute rather than the 5-minute group's first cycle. The
cost of one evaluation does not depend on the interval; the report divides it by the shipped
one. Read per group, the fastest of ``--evaluations`` evaluations of Prometheus' own
``prometheus_rule_group_last_duration_seconds``:

- *ms/eval*: one evaluation of the group, in milliseconds;
- *us/rank*: that over the number of ranks;
- *share*: the evaluation over its shipped interval (groups run concurrently, each group's
  rules in sequence, so a group whose share passes 1 skips evaluations);
- *ranks at half*: the ranks at which the group's evaluation takes half its shipped interval
  (the issue's goal), from the per-rank cost at that N, assuming it stays linear.

Usage::

    python bench/rule_capacity.py                       # shipped rules, 16 32 64 ranks
    python bench/rule_capacity.py --ranks 64 --rev 7c83bed --rev HEAD   # before and after
    # the README's table (about 20 minutes on 2 cores; 4518abd: groups by cadence):
    python bench/rule_capacity.py --ranks 64 --rev 7c83bed --rev 4518abd --rev worktree \
        --evaluations 7 --lead 150 --top 6
    python bench/rule_capacity.py --quick               # 8 ranks, 2 h: a smoke test

It needs ``prometheus`` and ``promtool`` on PATH, and writes its TSDBs under a temporary
directory (about 150 MB per 16 ranks at 18 hours of 15 s samples).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from stabmon.contract import PHASES, THROTTLE_REASONS  # the contract needs no third-party module

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "stabmon.rules.yml"
RULES_PATH = "deploy/prometheus/rules/stabmon.rules.yml"

RANKS_PER_NODE = 8
RANKS_PER_RUN = 64
LOOP_PHASES = ("startup", "data_wait", "forward", "backward", "optimizer", "eval")
KINDS = (
    "nonfinite_grad",
    "nonfinite_loss",
    "grad_spike",
    "loss_spike",
    "memory_leak",
    "stall",
    "dead_grad",
)


@dataclass(frozen=True)
class Series:
    """One series: its name, labels, and its value as a function of seconds since the start."""

    name: str
    labels: dict[str, str]
    slope: float = 0.0  # per second
    base: float = 0.0
    every: float = 0.0  # seconds between samples where not every scrape (recorded series)
    timestamp: bool = False  # the value is the sample's own Unix time


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def rank_series(rank: int, recorded: set[str]) -> Iterator[Series]:
    """What one training process and its share of the node daemon export, healthy."""
    node, local = divmod(rank, RANKS_PER_NODE)
    run = f"run{rank // RANKS_PER_RUN}"
    target = {
        "job": "stabmon-training",
        "instance": f"node{node}:{9400 + local}",
        "run": run,
        "rank": str(rank),
    }
    daemon = {
        "job": "stabmon-daemon",
        "instance": f"node{node}:9399",
        "run": run,
        "rank": str(rank),
    }
    yield Series("up", {"job": target["job"], "instance": target["instance"]}, base=1)
    yield Series("stabmon_build_info", {**target, "stabmon_version": "0.1.0"}, base=1)
    yield Series("stabmon_steps_total", target, slope=2.0)
    yield Series("stabmon_last_step_timestamp_seconds", target, timestamp=True)
    yield Series("stabmon_stalled", target)
    for name, per_step in (
        ("stabmon_step_duration_seconds", 0.5),
        ("stabmon_data_wait_seconds", 0.02),
    ):
        yield Series(f"{name}_sum", target, slope=2.0 * per_step)
        yield Series(f"{name}_count", target, slope=2.0)
    for phase in PHASES:
        yield Series("stabmon_phase_seconds_total", {**target, "phase": phase}, slope=0.24)
        yield Series("stabmon_slowdown_active", {**target, "phase": phase})
    yield Series("stabmon_device_phase_seconds_total", {**target, "phase": "forward"}, slope=0.3)
    for phase in LOOP_PHASES:
        yield Series(
            "stabmon_loop_phase", {**target, "phase": phase}, base=float(phase == "forward")
        )
    yield Series("stabmon_step_time_baseline_seconds", target, base=0.5)
    yield Series("stabmon_nonfinite_grad_steps_total", target)
    yield Series("stabmon_nonfinite_loss_total", target)
    for kind in KINDS:
        yield Series("stabmon_anomalies_total", {**target, "kind": kind})
    yield Series("stabmon_amp_loss_scale", target, base=65536)
    yield Series("stabmon_amp_skipped_steps_total", target)
    for device in ("cuda:0", "host"):
        yield Series("stabmon_memory_drift_ratio", {**target, "device": device}, base=0.001)
        yield Series("stabmon_memory_leak_suspected", {**target, "device": device})
    yield Series("stabmon_host_memory_rss_bytes", target, base=6e9)
    # The node daemon's view of the process.
    yield Series("stabmon_process_up", {**daemon, "pid": str(1000 + rank)}, base=1)
    yield Series("stabmon_heartbeat_age_seconds", daemon, base=0.5)
    yield Series("stabmon_process_stall_limit_seconds", daemon, base=1800)
    for scope, size in (("main", 6e9), ("workers", 3e9)):
        yield Series("stabmon_process_memory_bytes", {**daemon, "scope": scope}, base=size)
        yield Series("stabmon_process_cpu_seconds_total", {**daemon, "scope": scope}, slope=1.0)
    gpu = {
        "job": "stabmon-daemon",
        "instance": daemon["instance"],
        "gpu": str(local),
        "uuid": f"GPU-{node:05d}-{local}",
    }
    yield Series(
        "stabmon_process_gpu_memory_bytes",
        {**gpu, "rank": str(rank), "pid": str(1000 + rank)},
        base=6e10,
    )
    # The GPU this rank runs on (one rank a GPU).
    yield Series("stabmon_gpu_utilization_ratio", gpu, base=0.93)
    yield Series("stabmon_gpu_memory_used_bytes", gpu, base=6.2e10)
    yield Series("stabmon_gpu_memory_total_bytes", gpu, base=8.5e10)
    yield Series("stabmon_gpu_temperature_celsius", gpu, base=65)
    yield Series("stabmon_gpu_power_watts", gpu, base=550)
    yield Series("stabmon_gpu_sm_clock_hertz", gpu, base=1.98e9)
    for reason in THROTTLE_REASONS:
        yield Series("stabmon_gpu_throttle_active", {**gpu, "reason": reason})
    for kind in ("corrected", "uncorrected"):
        yield Series("stabmon_gpu_ecc_errors_total", {**gpu, "type": kind})
    if local == 0:  # the node daemon's own series, once a node
        node_target = {"job": "stabmon-daemon", "instance": daemon["instance"]}
        yield Series("up", node_target, base=1)
        yield Series("stabmon_daemon_nvml_up", node_target, base=1)
        yield Series(
            "stabmon_daemon_last_poll_timestamp_seconds",
            {**node_target, "poller": "processes"},
            timestamp=True,
        )
        yield Series("stabmon_host_memory_total_bytes", node_target, base=2e12)
    # What the rules file records and reads back over an hour or more, as running would have
    # left it: the liveness group's last scrape times, the memory group's floors (5 minutes).
    if "target:stabmon_build_info:timestamp" in recorded:
        yield Series("target:stabmon_build_info:timestamp", target, timestamp=True)
    if "run_rank:stabmon_memory_drift_ratio:min30m" in recorded:
        for device in ("cuda:0", "host"):
            yield Series(
                "run_rank:stabmon_memory_drift_ratio:min30m",
                {**target, "device": device},
                base=0.001,
                every=300,
            )
        yield Series("run_rank:stabmon_host_memory_rss_bytes:min30m", target, base=6e9, every=300)
        yield Series(
            "run_rank:stabmon_process_memory_bytes:min30m",
            {**daemon, "scope": "workers"},
            base=3e9,
            every=300,
        )


def write_openmetrics(
    out: TextIO, ranks: int, start: int, samples: int, scrape: int, recorded: set[str]
) -> int:
    """All series, family by family (OpenMetrics forbids interleaving them); returns samples."""
    families: dict[str, list[Series]] = {}
    for rank in range(ranks):
        for series in rank_series(rank, recorded):
            families.setdefault(series.name, []).append(series)
    written = 0
    for name, members in families.items():
        for series in members:
            head = f"{name}{{{_labels(series.labels)}}} "
            lines = []
            for i in range(0, samples, max(1, int(series.every // scrape))):
                t = start + i * scrape
                value = t if series.timestamp else series.base + series.slope * i * scrape
                lines.append(f"{head}{value:.17g} {t}\n")
            out.write("".join(lines))
            written += len(lines)
    out.write("# EOF\n")
    return written


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _group_durations(text: str) -> dict[str, float]:
    durations = {}
    for line in text.splitlines():
        if line.startswith("prometheus_rule_group_last_duration_seconds{"):
            labels, value = line.rsplit(" ", 1)
            group = labels.split('rule_group="', 1)[1].split('"', 1)[0].split(";", 1)[-1]
            durations[group] = float(value)
    return durations


def _rules_text(rev: str | None) -> str:
    if rev in (None, "worktree"):
        return RULES.read_text()
    return subprocess.run(
        ["git", "show", f"{rev}:{RULES_PATH}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def measure(
    rules_text: str,
    ranks: int,
    hours: float,
    scrape: int,
    every: int,
    evaluations: int,
    work: Path,
    lead: int,
    rule_costs: dict[str, float],
) -> tuple[dict[str, float], dict[str, float], int]:
    """Per group: the fastest evaluation in seconds and the shipped interval; and samples.

    The fastest, not the median: on a shared machine a neighbour's load only ever adds time.
    """
    document = yaml.safe_load(rules_text)
    shipped = {
        group["name"]: _seconds(group.get("interval", "15s")) for group in document["groups"]
    }
    for group in document["groups"]:
        group["interval"] = f"{every}s"
    recorded = {
        rule["record"]
        for group in document["groups"]
        for rule in group["rules"]
        if "record" in rule
    }
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    samples = int(hours * 3600 / scrape)
    # The history ends `lead` seconds from now, about when Prometheus is up: later samples are
    # invisible until their time comes, and the last one stays within the 5-minute lookback.
    start = int(time.time()) + lead - samples * scrape
    source = work / "history.om"
    with source.open("w") as out:
        written = write_openmetrics(out, ranks, start, samples, scrape, recorded)
    subprocess.run(
        [
            "promtool",
            "tsdb",
            "create-blocks-from",
            "openmetrics",
            "--quiet",
            str(source),
            str(data),
        ],
        check=True,
    )
    source.unlink()
    (work / "rules.yml").write_text(yaml.safe_dump(document))
    config = {
        "global": {"evaluation_interval": f"{every}s"},
        "rule_files": [str(work / "rules.yml")],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{_free_port()}"
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address={url.removeprefix('http://')}",
            "--log.level=error",
            "--storage.tsdb.retention.time=30d",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        seen: dict[str, list[float]] = {}
        deadline = time.monotonic() + every * (evaluations + 3) + 120
        last: dict[str, float] = {}
        while time.monotonic() < deadline:
            time.sleep(every / 3)
            try:
                durations = _group_durations(_metrics(url))
            except OSError:
                continue  # still starting (loading the blocks)
            for group, seconds in durations.items():
                if seconds > 0 and seconds != last.get(group):
                    seen.setdefault(group, []).append(seconds)
                    last[group] = seconds
            if seen and all(len(seen.get(g, [])) >= evaluations for g in shipped):
                break
        with urllib.request.urlopen(f"{url}/api/v1/rules", timeout=10) as response:
            for group in json.load(response)["data"]["groups"]:
                for rule in group["rules"]:
                    name = f"{group['name']} {rule['name']}"
                    rule_costs[name] = rule_costs.get(name, 0.0) + float(rule["evaluationTime"])
    finally:
        process.terminate()
        process.wait(timeout=30)
    fastest = {group: min(values) for group, values in seen.items()}
    return fastest, shipped, written


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(duration[:-1]) * units[duration[-1]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument(
        "--hours", type=float, default=18.0, help="history (the leak legs reach 18 h back)"
    )
    parser.add_argument("--scrape", type=int, default=15, help="seconds between samples")
    parser.add_argument("--eval", type=int, default=15, help="evaluation interval while measuring")
    parser.add_argument("--evaluations", type=int, default=5)
    parser.add_argument(
        "--lead",
        type=int,
        default=60,
        help="seconds from now to the end of the history (writing it takes that long)",
    )
    parser.add_argument(
        "--rev",
        action="append",
        default=None,
        help="the rules file at this git revision, or worktree (repeatable; default: worktree)",
    )
    parser.add_argument("--quick", action="store_true", help="8 ranks, 2 hours, 2 evaluations")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--top", type=int, default=0, help="also list the N dearest rules")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.hours, args.evaluations = [8], 2.0, 2
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            print(f"ERROR: {tool} is not on PATH (make tools installs it)", file=sys.stderr)
            return 2
    rows = []
    print(
        "| rules | ranks | samples | group | interval | ms/eval | us/rank | share | ranks at half |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="stabmon-rule-capacity-") as tmp:
        for rev in args.rev or [None]:
            text = _rules_text(rev)
            for ranks in args.ranks:
                medians, shipped, written = measure(
                    text,
                    ranks,
                    args.hours,
                    args.scrape,
                    args.eval,
                    args.evaluations,
                    Path(tmp),
                    args.lead,
                    rule_costs := {},
                )
                for group, interval in shipped.items():
                    seconds = medians.get(group, math.nan)
                    per_rank = seconds / ranks
                    row = {
                        "rules": rev or "working tree",
                        "ranks": ranks,
                        "samples": written,
                        "group": group,
                        "interval_s": interval,
                        "ms_per_eval": seconds * 1e3,
                        "us_per_rank": per_rank * 1e6,
                        "share": seconds / interval,
                        "ranks_at_half": int(0.5 * interval / per_rank) if per_rank else None,
                    }
                    rows.append(row)
                    print(
                        f"| {row['rules']} | {ranks} | {written:,} | {group} | {interval:g} s "
                        f"| {row['ms_per_eval']:.1f} | {row['us_per_rank']:.0f} "
                        f"| {row['share']:.3f} | {row['ranks_at_half'] or 0:,} |",
                        flush=True,
                    )
                if args.top:
                    print(
                        f"\nThe {args.top} dearest rules at their last evaluation "
                        f"({rev or 'working tree'}, {ranks} ranks):"
                    )
                    dearest = sorted(rule_costs.items(), key=lambda item: -item[1])[: args.top]
                    for name, seconds in dearest:
                        print(f"    {seconds * 1e3:8.1f} ms  {name}")
                    print()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
