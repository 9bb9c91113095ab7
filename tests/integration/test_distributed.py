"""Every rank of a torchrun job monitored: real gloo DDP and FSDP2 ranks on CPU, scraped over HTTP.

The ranks attach with no distributed configuration: torchrun's environment gives
each its rank, local rank (so its port, 9400 + LOCAL_RANK by default; a free base
here) and run id. They are found the way a deployed Prometheus finds them,
through the node daemon's ``/targets``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from ddp_trainee import batch, make_model
from helpers import scrape, value
from realstack import Processes, announced, free_port, require, start_prometheus, until

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
TRAINEE = HERE / "ddp_trainee.py"
TRAINEE_SINGLE = HERE / "trainee.py"
RULES = HERE.parents[1] / "deploy" / "prometheus" / "rules" / "stabmon.rules.yml"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Node:
    """One machine's worth: a run directory, the daemon, and the ranks started on it."""

    def __init__(self, work: Path, processes: Processes) -> None:
        self.run_dir = work / "runs"
        self.processes = processes
        self.base_port = _free_port_block(8)
        # Each poll reads every rank's PSS (smaps_rollup), a few ms per torch process: every
        # 0.5 s, not faster, or the daemon takes a core's fifth from the ranks it watches.
        daemon = processes.start([sys.executable, "-m", "stabmon", "daemon", "--port", "0",
                                  "--address", "127.0.0.1", "--run-dir", str(self.run_dir),
                                  "--interval", "0.5"])  # fmt: skip
        self.daemon_url = announced(daemon)
        self.daemon_target = self.daemon_url.split("/")[2]

    def env(self) -> dict[str, str]:
        env = {**os.environ, "STABMON_DIR": str(self.run_dir), "STABMON_PORT": str(self.base_port)}
        env.pop("STABMON_RUN_ID", None)  # the run id must come from torchrun
        env["OMP_NUM_THREADS"] = "1"
        return env

    def torchrun(self, nproc: int, *args: str, static: bool = False) -> subprocess.Popen[str]:
        """torchrun with its elastic rendezvous, or (``static``) a fixed master address and port,
        as multi-node jobs and Kubeflow's PyTorchJob launch it (TORCHELASTIC_RUN_ID=none)."""
        rendezvous = (
            ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
            if static
            else ["--standalone"]
        )
        return self.processes.start(
            [sys.executable, "-m", "torch.distributed.run", *rendezvous,
             f"--nproc_per_node={nproc}", str(TRAINEE), *args],
            env=self.env(),
        )  # fmt: skip

    def ranks_without_agent(self, world: int, *args: str) -> list[subprocess.Popen[str]]:
        """The ranks of one job with torchrun's environment but no torchrun agent.

        torchrun's agent stops every rank when one dies; without it the survivors
        live on (as under a launcher that only reports failures), so a test can see
        them export while their peer is down.
        """
        common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                  "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                  "TORCHELASTIC_RUN_ID": "job-without-agent"}  # fmt: skip
        return [
            self.processes.start(
                [sys.executable, str(TRAINEE), *args],
                env={**self.env(), **common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            )
            for rank in range(world)
        ]

    def targets(self) -> list[dict[str, Any]]:
        """The daemon's HTTP service discovery answer, as Prometheus would get it."""
        url = self.daemon_url.replace("/metrics", "/targets")
        with urllib.request.urlopen(url, timeout=5) as response:
            groups: list[dict[str, Any]] = json.loads(response.read())
        return groups

    def ranks(self, count: int, timeout: float = 60) -> dict[int, str]:
        """Wait for ``count`` live ranks; their metrics URLs by rank."""
        until(f"{count} ranks listed by the daemon", lambda: len(self.targets()) == count, timeout)
        return {
            int(group["labels"]["__meta_stabmon_rank"]): f"http://{group['targets'][0]}/metrics"
            for group in self.targets()
        }


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    processes = Processes()
    try:
        yield Node(tmp_path, processes)
    finally:
        processes.close()


def _free_port_block(size: int) -> int:
    """A base port whose next ``size`` ports are free now (good enough for a test)."""
    for _ in range(50):
        base = free_port()
        if base + size < 65536 and all(_port_free(base + k) for k in range(size)):
            return base
    raise AssertionError("no free block of ports")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _scrape_when(url: str, steps: int, timeout: float = 60) -> Samples:
    """Scrape ``url`` once the rank has completed ``steps`` steps."""
    until(f"{steps} steps at {url}", lambda: value(scrape(url), "stabmon_steps_total") == steps,
          timeout)  # fmt: skip
    return scrape(url)


def _reference_norm(world: int, steps: int) -> float:
    """The last step's gradient norm of the same training on one unsharded model.

    DDP and FSDP average gradients over ranks; with equal batch sizes that is the
    gradient of the mean loss over every rank's batch together.
    """
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    norm = torch.zeros(())
    for step in range(steps):
        inputs, targets = zip(*(batch(step, rank) for rank in range(world)), strict=True)
        loss = torch.nn.functional.mse_loss(model(torch.cat(inputs)), torch.cat(targets))
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return float(norm)


@pytest.mark.parametrize(
    ("mode", "world", "static"),
    [
        # DDP with a fixed master address and port, as multi-node jobs and Kubeflow's
        # PyTorchJob launch it: torchrun says TORCHELASTIC_RUN_ID=none, and the ranks still
        # share a run. The sharded jobs take torchrun's own (--standalone) rendezvous.
        ("ddp", 4, True),
        ("fsdp", 2, False),
        ("fsdp", 4, False),
        ("hsdp", 4, False),
    ],
    ids=["ddp-4-static", "fsdp-2", "fsdp-4", "hsdp-4"],
)
def test_every_rank_exports_and_the_global_norm_is_reconstructed_from_the_ranks(
    node: Node, mode: str, world: int, static: bool
) -> None:
    steps = 5
    node.torchrun(world, "--mode", mode, "--steps", str(steps), static=static)
    urls = node.ranks(world)
    assert sorted(urls) == list(range(world))
    ports = sorted(int(url.rsplit(":", 1)[1].split("/")[0]) for url in urls.values())
    assert ports == [node.base_port + local_rank for local_rank in range(world)]

    scrapes = {rank: _scrape_when(url, steps) for rank, url in urls.items()}
    runs = set()
    for rank, samples in scrapes.items():
        labels = dict(next(lbl for (name, lbl) in samples if name == "stabmon_steps_total"))
        assert labels["rank"] == str(rank)
        runs.add(labels["run"])
    assert len(runs) == 1, "every rank of one torchrun job is one run"
    if static:  # no run id from torchrun: the ranks agree on one from the rendezvous
        (run,) = runs
        assert run.startswith("job-")

    def squared(samples: Samples, placement: str) -> float:
        found = value(samples, "stabmon_grad_norm_squared", placement=placement)
        assert found is not None
        return found

    # What the dashboard and the docs compute in PromQL: sum of the shards, one replica.
    sharded = sum(squared(s, "sharded") for s in scrapes.values())
    replicated = squared(scrapes[0], "replicated")
    reference = _reference_norm(world, steps)
    assert math.sqrt(sharded + replicated) == pytest.approx(reference, rel=1e-5)
    for samples in scrapes.values():
        if mode == "ddp":  # every rank holds every averaged gradient: its norm is the global one
            assert value(samples, "stabmon_grad_norm") == pytest.approx(reference, rel=1e-5)
            assert squared(samples, "sharded") == 0.0
        else:  # each rank holds its shards only
            assert squared(samples, "sharded") > 0.0
            assert squared(samples, "replicated") == 0.0
            norm = value(samples, "stabmon_grad_norm")
            assert norm is not None and norm < reference
        assert value(samples, "stabmon_nonfinite_grad_steps_total") == 0


def test_a_slowed_rank_is_the_straggler_and_a_killed_rank_is_down_while_the_rest_export(
    node: Node, tmp_path: Path
) -> None:
    require("prometheus")
    # Rank 2 waits for its input, rank 3 computes slowly (a throttled GPU); under DDP all four
    # step at the same pace, so only the rule's input-wait and forward legs tell them apart.
    world = 4
    slow = ("--slow-rank", "2", "--slow-forward-rank", "3", "--slow-seconds", "0.08",
            "--step-seconds", "0.02")  # fmt: skip
    node.ranks_without_agent(world, "--mode", "ddp", "--steps", "100000", *slow)
    urls = node.ranks(world)
    prometheus = start_prometheus(node.processes, tmp_path, node.daemon_target)
    wanted = {url.split("/")[2] for url in urls.values()} | {node.daemon_target}
    prometheus.until(
        "every rank and the daemon scraped", lambda: prometheus.scraped() == wanted, 60
    )

    # The shipped rule's expression, with its 10-minute windows shortened for the test.
    rule = next(
        rule
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if rule.get("alert") == "StabmonStragglerRank"
    )
    expr = rule["expr"].replace("[10m]", "[20s]")

    def straggler_ranks() -> set[str]:
        return {sample["metric"]["rank"] for sample in prometheus.query(expr)}

    until(
        "the slowed ranks flagged as stragglers", lambda: straggler_ranks() == {"2", "3"}, 90, 1.0
    )

    victim = next(
        group for group in node.targets() if group["labels"]["__meta_stabmon_rank"] == "1"
    )
    os.kill(int(victim["labels"]["__meta_stabmon_pid"]), signal.SIGKILL)

    def reported_down() -> bool:
        samples = scrape(node.daemon_url)
        return value(samples, "stabmon_process_up", rank="1") == 0

    until("the killed rank reported down by the daemon", reported_down, 30)
    for rank in (0, 2, 3):  # the survivors are stuck in the collective, but still export
        assert value(scrape(urls[rank]), "stabmon_steps_total") is not None
        assert value(scrape(node.daemon_url), "stabmon_process_up", rank=str(rank)) == 1


def test_a_crashed_rank_restarted_takes_its_port_back_and_is_discovered_again(
    node: Node,
) -> None:
    env = {**node.env(), "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    args = [sys.executable, str(TRAINEE_SINGLE), "--run-dir", str(node.run_dir), "--run-id",
            "job", "--rank", "1", "--port", str(node.base_port)]  # fmt: skip
    first = node.processes.start(args, env=env)
    first_url = announced(first)
    assert first_url.endswith(f":{node.base_port + 1}/metrics")
    first.send_signal(signal.SIGKILL)
    first.wait(10)

    second = node.processes.start(args, env=env)
    assert announced(second) == first_url  # the same port: the scrape config does not change

    def listed_once_with_the_new_pid() -> bool:
        pids = [group["labels"]["__meta_stabmon_pid"] for group in node.targets()]
        return pids == [str(second.pid)]

    until("the restarted rank discovered", listed_once_with_the_new_pid, 30)
