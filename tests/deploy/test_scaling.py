"""The path past one Prometheus (issue 39): an agent that remote-writes, and shards by run.

deploy/prometheus/agent.yml (agent mode, every sample remote-written to a long-term store)
and deploy/prometheus/shard.yml (one of N servers, each keeping the runs that hash to it)
are checked by what reads them: promtool and a real Prometheus in agent mode accept them, and,
with real Prometheus servers (Debian's), an agent's samples reach a remote-write receiver
where the shipped rules record from them, and two shards split a run's ranks and its daemon
series the way the files' comments say. The Kubernetes PrometheusAgent is checked with the
other custom resources in test_kubernetes.py.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import DEPLOY, PROMETHEUS_CONFIG, RULES_FILE, load_yaml, required_tool, run_tool

AGENT_CONFIG = DEPLOY / "prometheus" / "agent.yml"
SHARD_CONFIG = DEPLOY / "prometheus" / "shard.yml"
SHIPPED_SHARDS = 4
#: Four runs whose names hash to both of two shards (checked below, not assumed).
RUNS = ("run-a", "run-b", "run-c", "run-d")


def hashmod(value: str, modulus: int) -> int:
    """Prometheus' hashmod relabel action: the MD5's low 8 bytes, big-endian, modulo."""
    return int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % modulus


def _jobs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in config["scrape_configs"]}


def _shard_relabels(job: dict[str, Any]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = job.get("relabel_configs", []) + job.get(
        "metric_relabel_configs", []
    )
    return rules


def _as_shard(index: int, modulus: int, text: str | None = None) -> dict[str, Any]:
    """shard.yml as shard ``index`` of ``modulus``: the two edits its comment prescribes."""
    config: dict[str, Any] = yaml.safe_load(text or SHARD_CONFIG.read_text(encoding="utf-8"))
    for job in config["scrape_configs"]:
        for rule in _shard_relabels(job):
            if rule["action"] == "hashmod":
                rule["modulus"] = modulus
            elif rule.get("source_labels") == ["__tmp_shard"]:
                rule["regex"] = str(index)
    return config


# --- the files --------------------------------------------------------------------------------


def test_agent_scrapes_exactly_what_the_single_server_scrapes_and_evaluates_nothing() -> None:
    agent = load_yaml(AGENT_CONFIG)
    server = load_yaml(PROMETHEUS_CONFIG)
    assert agent["scrape_configs"] == server["scrape_configs"]
    assert agent["global"]["scrape_interval"] == server["global"]["scrape_interval"]
    # Agent mode refuses rules and Alertmanagers; the store evaluates the rules.
    assert not {"rule_files", "alerting", "evaluation_interval"} & {*agent, *agent["global"]}
    # No label that differs by agent: the rules join a rank's series across targets.
    assert "external_labels" not in agent["global"]
    (write,) = agent["remote_write"]
    assert write["url"].endswith("/api/v1/push")


def test_each_shard_keeps_its_runs_by_the_run_in_both_jobs() -> None:
    shard = load_yaml(SHARD_CONFIG)
    server = load_yaml(PROMETHEUS_CONFIG)
    assert shard["global"] == server["global"]
    assert shard["rule_files"] == server["rule_files"]
    jobs = _jobs(shard)
    assert set(jobs) == set(_jobs(server))
    # The training targets by the run the daemon lists them with, before the scrape; the
    # daemon's series by their run label, after it.
    training, daemon = jobs["stabmon-training"], jobs["stabmon-daemon"]
    assert [r["source_labels"] for r in training["relabel_configs"]] == [
        ["__meta_stabmon_run"],
        ["__tmp_shard"],
    ]
    assert [r["source_labels"] for r in daemon["metric_relabel_configs"]] == [
        ["run"],
        ["__tmp_shard"],
    ]
    for job in (training, daemon):
        hashing, keeping = _shard_relabels(job)
        assert hashing == {
            "source_labels": hashing["source_labels"],
            "modulus": SHIPPED_SHARDS,
            "target_label": "__tmp_shard",
            "action": "hashmod",
        }
        assert keeping == {"source_labels": ["__tmp_shard"], "regex": "0", "action": "keep"}
    # Only what the rules record, and the alerts, leave a shard.
    (write,) = shard["remote_write"]
    assert write["write_relabel_configs"] == [
        {"source_labels": ["__name__"], "regex": "[a-z_]+:.+|ALERTS", "action": "keep"}
    ]


def test_series_without_a_run_stay_on_the_shard_the_comment_names() -> None:
    text = SHARD_CONFIG.read_text(encoding="utf-8")
    assert "(shard 2 of 4, shard 0 of 2, shard 6 of 8;" in text
    assert [hashmod("", n) for n in (4, 2, 8)] == [2, 0, 6]


@pytest.mark.parametrize("path", [AGENT_CONFIG, SHARD_CONFIG], ids=lambda p: p.name)
def test_promtool_accepts_the_config(path: Path) -> None:
    result = run_tool(required_tool("promtool", "prometheus"), "check", "config", path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- real Prometheus servers ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class _Stub(BaseHTTPRequestHandler):
    """A node's daemon, as Prometheus sees it: /metrics, and /targets for its ranks."""

    metrics = ""
    rank_metrics = ""
    targets: list[dict[str, Any]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/targets":
            body, kind = json.dumps(self.targets).encode(), "application/json"
        else:
            text = self.rank_metrics if self.path == "/rank" else self.metrics
            body, kind = text.encode(), "text/plain; version=0.0.4"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def node() -> Iterator[str]:
    """A stub daemon on a free port: four runs' process series, a GPU, and two ranks a run."""
    lines = [f'stabmon_process_up{{run="{run}",rank="0",pid="1"}} 1' for run in RUNS]
    lines.append('stabmon_gpu_utilization_ratio{gpu="0",uuid="u0"} 0.5')
    rank_lines = [
        'stabmon_build_info{run="run-a",rank="0",stabmon_version="0"} 1',
        'stabmon_steps_total{run="run-a",rank="0"} 7',
    ]

    class Node(_Stub):
        metrics = "\n".join(lines) + "\n"
        rank_metrics = "\n".join(rank_lines) + "\n"

    server = ThreadingHTTPServer(("127.0.0.1", 0), Node)
    address = f"127.0.0.1:{server.server_address[1]}"
    # Ranks of each run at addresses nothing answers on: a target is listed, kept or dropped
    # by its run whether or not its scrape succeeds. The stub itself is run-a's rank 0.
    at_rank = {"__meta_stabmon_run": "run-a", "__metrics_path__": "/rank"}
    Node.targets = [{"targets": [address], "labels": at_rank}] + [
        {"targets": [f"127.0.0.1:{9 + 2 * i + rank}"], "labels": {"__meta_stabmon_run": run}}
        for i, run in enumerate(RUNS)
        for rank in range(2)
    ]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        server.shutdown()
        server.server_close()


class _Prometheus:
    def __init__(self, binary: str, config: dict[str, Any], work: Path, *flags: str) -> None:
        work.mkdir()
        (work / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={work / 'prometheus.yml'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
                *flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as response:
            return json.load(response)["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query=expr)["result"]
        return result

    def stop(self) -> str:
        self.process.terminate()
        try:
            _, errors = self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, errors = self.process.communicate()
        return errors


def _until(what: str, check: Callable[[], bool], timeout: float = 45.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _returns(get: Callable[[], list[str]], expected: list[str]) -> Callable[[], bool]:
    return lambda: get() == expected


def _point_at(config: dict[str, Any], node: str, *, sd: str | None = None) -> None:
    """Scrape the stub node every second, as the files scrape real nodes every 15 s."""
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    for job in config["scrape_configs"]:
        if "static_configs" in job:
            job["static_configs"] = [{"targets": [node]}]
        if "http_sd_configs" in job:
            job["http_sd_configs"] = [
                {"url": sd or f"http://{node}/targets", "refresh_interval": "1s"}
            ]


def test_agent_mode_refuses_a_config_with_rules_which_the_store_evaluates_instead(
    tmp_path: Path,
) -> None:
    prometheus = required_tool("prometheus", "prometheus")
    config = load_yaml(AGENT_CONFIG)
    config["rule_files"] = [str(RULES_FILE)]
    (tmp_path / "bad.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    command = [
        prometheus,
        "--enable-feature=agent",
        f"--config.file={tmp_path / 'bad.yml'}",
        f"--storage.agent.path={tmp_path / 'wal'}",
        f"--web.listen-address=127.0.0.1:{_free_port()}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode != 0
    assert "rule_files" in result.stderr


@pytest.mark.slow
def test_an_agent_remote_writes_to_a_store_where_the_shipped_rules_record(
    tmp_path: Path, node: str
) -> None:
    binary = required_tool("prometheus", "prometheus")
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / RULES_FILE.name).write_text(RULES_FILE.read_text(encoding="utf-8"), encoding="utf-8")
    # The store: a Prometheus that takes remote write and evaluates the shipped rules (as
    # Mimir's ruler does), every second here.
    store_config = {
        "global": {"evaluation_interval": "1s"},
        "rule_files": [str(rules / "*.rules.yml")],
    }
    receiver = "--web.enable-remote-write-receiver"
    tsdb = f"--storage.tsdb.path={tmp_path / 'store' / 'tsdb'}"
    store = _Prometheus(binary, store_config, tmp_path / "store", receiver, tsdb)
    agent_config = load_yaml(AGENT_CONFIG)
    _point_at(agent_config, node)
    (write,) = agent_config["remote_write"]
    write["url"] = f"{store.url}/api/v1/write"
    write["queue_config"]["batch_send_deadline"] = "1s"
    agent = _Prometheus(binary, agent_config, tmp_path / "agent", "--enable-feature=agent",
                        f"--storage.agent.path={tmp_path / 'agent' / 'wal'}")  # fmt: skip
    try:
        # Both jobs' samples arrive with their target labels, `up` included (the rules join on it).
        _until("the daemon's and the rank's series in the store", lambda: bool(
            store.query('stabmon_steps_total{job="stabmon-training",run="run-a"}')
            and store.query('stabmon_process_up{job="stabmon-daemon",run="run-d"}')
            and store.query('up{job="stabmon-training"} == 1')
        ))  # fmt: skip
        # The liveness group records each training target's last export from them.
        _until("a series the shipped rules record", lambda: bool(
            store.query('target:stabmon_build_info:timestamp{job="stabmon-training",run="run-a"}')
        ))  # fmt: skip
        # The agent answers no queries: it keeps nothing to query.
        with pytest.raises(urllib.error.HTTPError):
            agent.query("up")
    finally:
        errors = agent.stop() + store.stop()
    assert "error" not in errors.lower(), errors


@pytest.mark.slow
def test_two_shards_split_runs_and_keep_each_runs_daemon_series_with_its_ranks(
    tmp_path: Path, node: str
) -> None:
    binary = required_tool("prometheus", "prometheus")
    owner = {run: hashmod(run, 2) for run in RUNS}
    assert set(owner.values()) == {0, 1}, owner  # both shards hold runs
    shards = []
    for index in range(2):
        config = _as_shard(index, 2)
        _point_at(config, node)
        config.pop("remote_write")
        config.pop("alerting")
        config["rule_files"] = []
        work = tmp_path / f"shard{index}"
        shards.append(_Prometheus(binary, config, work, f"--storage.tsdb.path={work / 'tsdb'}"))
    try:
        for index, shard in enumerate(shards):
            mine = sorted(run for run, at in owner.items() if at == index)

            def training_runs(shard: _Prometheus = shard) -> list[str]:
                active = shard.get("/api/v1/targets", state="active")["activeTargets"]
                return sorted(
                    t["discoveredLabels"]["__meta_stabmon_run"]
                    for t in active
                    if t["labels"]["job"] == "stabmon-training"
                )

            def daemon_runs(shard: _Prometheus = shard) -> list[str]:
                found = shard.query('stabmon_process_up{job="stabmon-daemon"}')
                return sorted(sample["metric"]["run"] for sample in found)

            # Each run's ranks (two each; run-a's stub rank too) on its own shard only ...
            expected = sorted([*mine, *mine, *(["run-a"] if "run-a" in mine else [])])
            _until(f"shard {index}'s targets", _returns(training_runs, expected))
            # ... with the daemon's series about that run, and none of the other shard's.
            _until(f"shard {index}'s daemon series", _returns(daemon_runs, mine))
            # The series without a run: on shard 0 of 2 only, as shard.yml says.
            gpu = shard.query("stabmon_gpu_utilization_ratio")
            assert bool(gpu) == (index == hashmod("", 2))
            # Every shard scrapes the daemon, so each knows whether it is up.
            assert shard.query('up{job="stabmon-daemon"} == 1')
    finally:
        for shard in shards:
            shard.stop()
