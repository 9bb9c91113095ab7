"""deploy/compose's agent profile: Prometheus in agent mode remote-writing to Mimir (issue 39).

No Docker engine runs here, and no Mimir binary is packaged for Debian or PyPI. So the profile
is checked by parsing it (services, profiles, mounts of files that exist, named volumes), by
tying its pieces together (the agent's remote-write URL and tenant, Mimir's port, ruler
directory and Alertmanager, Grafana's data source), by validating mimir.yml against a schema
written from Mimir's configuration reference, and by running the agent service as compose
would start it with the real prometheus binary (Debian's; `make tools`): its own command line,
its own mounted config, its remote writes arriving where the profile points them.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
from deploy_helpers import DEPLOY, PROMETHEUS_CONFIG, RULES_FILE, load_yaml, required_tool
from test_compose import COMPOSE_DIR, _compose, _host_path, _mount, _mounts, _service

AGENT_CONFIG = DEPLOY / "prometheus" / "agent.yml"
MIMIR_CONFIG = COMPOSE_DIR / "mimir.yml"
MIMIR_DATASOURCE = DEPLOY / "grafana" / "provisioning" / "datasources" / "mimir.yml"
MIMIR_SCHEMA = Path(__file__).with_name("schemas") / "mimir.schema.json"
PROFILE = "agent"
PROFILE_SERVICES = {"prometheus-agent", "mimir"}


def _args(service: str) -> dict[str, str]:
    """A service's ``--name=value`` / ``-name=value`` arguments (``--flag`` alone: "")."""
    found = {}
    for arg in _service(service)["command"]:
        name, _, value = arg.lstrip("-").partition("=")
        found[name] = value
    return found


def _tenant() -> str:
    (write,) = load_yaml(AGENT_CONFIG)["remote_write"]
    tenant: str = write["headers"]["X-Scope-OrgID"]
    return tenant


def _mimir_port() -> int:
    port: int = load_yaml(MIMIR_CONFIG)["server"]["http_listen_port"]
    return port


# --- the profile, parsed ----------------------------------------------------------------------


def test_the_agent_profile_adds_the_agent_and_mimir_and_leaves_the_default_layout_alone() -> None:
    services = _compose()["services"]
    in_profile = {name for name, s in services.items() if PROFILE in s.get("profiles", [])}
    assert in_profile == PROFILE_SERVICES
    # `docker compose up` without --profile starts what it started before.
    assert {n for n, s in services.items() if "profiles" in s} == PROFILE_SERVICES
    assert {"prometheus", "alertmanager", "grafana", "daemon"} <= set(services)


def test_the_agent_runs_the_servers_prometheus_image_in_agent_mode_on_the_shipped_config() -> None:
    assert _service("prometheus-agent")["image"] == _service("prometheus")["image"]
    args = _args("prometheus-agent")
    assert args["enable-feature"] == "agent"
    config = _mount("prometheus-agent", args["config.file"])
    assert _host_path(config["source"]) == AGENT_CONFIG and config["read_only"] is True
    assert _mount("prometheus-agent", args["storage.agent.path"])["type"] == "volume"
    # It scrapes the daemon on the host, as the server does.
    assert _service("prometheus-agent")["extra_hosts"] == _service("prometheus")["extra_hosts"]
    assert "prometheus-agent" not in load_yaml(PROMETHEUS_CONFIG).get("remote_write", [])


def test_the_agent_writes_to_the_mimir_service_as_the_tenant_whose_rules_mimir_mounts() -> None:
    (write,) = load_yaml(AGENT_CONFIG)["remote_write"]
    url = urllib.parse.urlsplit(write["url"])
    assert (url.hostname, url.port, url.path) == ("mimir", _mimir_port(), "/api/v1/push")
    mimir = load_yaml(MIMIR_CONFIG)
    # The agent's tenant, with or without its header (Debian's build drops remote_write headers).
    assert mimir["multitenancy_enabled"] is False and mimir["no_auth_tenant"] == _tenant()
    assert mimir["ruler_storage"]["backend"] == "local"
    directory = PurePosixPath(mimir["ruler_storage"]["local"]["directory"])
    rules = _mount("mimir", str(directory / _tenant()))
    # The very rules directory the single server loads, read-only.
    assert rules["source"] == _mount("prometheus", "/etc/prometheus/rules")["source"]
    assert rules["read_only"] is True
    assert RULES_FILE.parent == _host_path(rules["source"])
    ports = _service("mimir")["ports"]
    assert ports == [f"127.0.0.1:{_mimir_port()}:{_mimir_port()}"]


def test_mimir_reads_its_mounted_config_and_keeps_its_data_in_its_volume() -> None:
    config = _mount("mimir", _args("mimir")["config.file"])
    assert _host_path(config["source"]) == MIMIR_CONFIG and config["read_only"] is True
    (data,) = [m for m in _mounts(_service("mimir")) if m["type"] == "volume"]
    mimir = load_yaml(MIMIR_CONFIG)
    paths = [
        mimir["blocks_storage"]["filesystem"]["dir"],
        mimir["blocks_storage"]["bucket_store"]["sync_dir"],
        mimir["blocks_storage"]["tsdb"]["dir"],
        mimir["compactor"]["data_dir"],
        mimir["ruler"]["rule_path"],
    ]
    assert all(PurePosixPath(p).is_relative_to(data["target"]) for p in paths), paths


def test_mimir_yml_is_valid_for_mimirs_configuration_reference() -> None:
    schema = json.loads(MIMIR_SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(load_yaml(MIMIR_CONFIG))


@pytest.mark.parametrize(
    "mistake",
    [
        lambda c: c["ruler"].update(evaluation_intervall="15s"),  # misspelt
        lambda c: c["ruler_storage"]["local"].update(
            dir=c["ruler_storage"]["local"].pop("directory")
        ),
        lambda c: c["ingester"]["ring"].update(replication_factor=0),
        lambda c: c.update(auth_enabled=False),  # Cortex's name, not Mimir's
    ],
    ids=["misspelt-field", "filesystem-field-on-local", "no-replicas", "cortex-field"],
)
def test_the_mimir_schema_rejects_a_mistake(mistake: Any) -> None:
    config = load_yaml(MIMIR_CONFIG)
    mistake(config)
    schema = json.loads(MIMIR_SCHEMA.read_text(encoding="utf-8"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(config)


def test_mimirs_ruler_runs_the_rules_at_the_servers_interval_and_alerts_the_same_manager() -> None:
    ruler = load_yaml(MIMIR_CONFIG)["ruler"]
    server = load_yaml(PROMETHEUS_CONFIG)
    # Groups without an interval of their own (liveness, events) run at the global one.
    assert ruler["evaluation_interval"] == server["global"]["evaluation_interval"]
    (alertmanagers,) = server["alerting"]["alertmanagers"]
    (target,) = alertmanagers["static_configs"][0]["targets"]
    assert ruler["alertmanager_url"] == f"http://{target}"
    assert "alertmanager" in _service("mimir")["depends_on"]


def test_grafana_reads_mimir_as_the_tenant_the_agent_writes() -> None:
    document = load_yaml(MIMIR_DATASOURCE)
    assert document["apiVersion"] == 1
    (source,) = document["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert source["url"] == f"http://mimir:{_mimir_port()}/prometheus"
    assert source["isDefault"] is False  # the single server stays the default
    assert source["jsonData"]["httpHeaderName1"] == "X-Scope-OrgID"
    assert source["secureJsonData"]["httpHeaderValue1"] == _tenant()
    assert (
        source["jsonData"]["timeInterval"] == load_yaml(AGENT_CONFIG)["global"]["scrape_interval"]
    )
    provisioning = _mount("grafana", "/etc/grafana/provisioning")
    assert MIMIR_DATASOURCE.is_relative_to(_host_path(provisioning["source"]))


# --- the agent service, run -----------------------------------------------------------------


class _Receiver(BaseHTTPRequestHandler):
    """A remote-write endpoint: records each push's path and headers, answers 204."""

    pushes: list[tuple[str, Message]] = []  # headers: case-insensitive
    arrived = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.pushes.append((self.path, self.headers))
        self.arrived.set()
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, type[_Receiver]]]:
    class Receiver(_Receiver):
        pushes = []
        arrived = threading.Event()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", Receiver
    finally:
        server.shutdown()
        server.server_close()


def _start_as_compose_would(
    tmp_path: Path, mimir_address: str
) -> tuple[subprocess.Popen[str], str]:
    """The agent service's own command, its mounts laid out under tmp_path as the container
    sees them, and the one name a container resolves (mimir) pointed at ``mimir_address``."""
    for mount in _mounts(_service("prometheus-agent")):
        target = tmp_path / mount["target"].lstrip("/")
        if mount["type"] == "volume":
            target.mkdir(parents=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_host_path(mount["source"]), target)
    args = _args("prometheus-agent")
    config = tmp_path / args["config.file"].lstrip("/")
    text = config.read_text(encoding="utf-8")
    url = f"url: http://mimir:{_mimir_port()}/"
    assert text.count(url) == 1
    config.write_text(text.replace(url, f"url: http://{mimir_address}/"), encoding="utf-8")
    command = [
        arg.replace("=/", f"={tmp_path}/") for arg in _service("prometheus-agent")["command"]
    ]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        listen = f"127.0.0.1:{probe.getsockname()[1]}"
    binary = required_tool("prometheus", "prometheus")
    process = subprocess.Popen(
        [binary, *command, f"--web.listen-address={listen}", "--log.level=warn"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return process, f"http://{listen}"


def _stop(process: subprocess.Popen[str]) -> str:
    process.terminate()
    try:
        _, errors = process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        _, errors = process.communicate()
    return errors


def _ready(url: str, process: subprocess.Popen[str]) -> None:
    for _ in range(60):
        if process.poll() is not None:
            raise AssertionError(f"prometheus exited: {process.communicate()[1]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        threading.Event().wait(0.5)
    raise AssertionError("the agent never became ready")


def test_real_prometheus_starts_the_agent_service_in_agent_mode(
    tmp_path: Path, receiver: tuple[str, type[_Receiver]]
) -> None:
    process, url = _start_as_compose_would(tmp_path, receiver[0])
    try:
        _ready(url, process)
        with urllib.request.urlopen(f"{url}/api/v1/status/flags", timeout=5) as response:
            flags = json.load(response)["data"]
        assert flags["enable-feature"] == "agent"
        assert flags["storage.agent.path"] == str(tmp_path / "prometheus")
        # An agent answers no queries: the rules and dashboards run in the store.
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{url}/api/v1/query?query=up", timeout=5)
    finally:
        _stop(process)
    assert (tmp_path / "prometheus" / "wal").is_dir()  # the write-ahead log, in the volume


@pytest.mark.slow
def test_the_agent_service_remote_writes_to_the_mimir_address_as_the_tenant(
    tmp_path: Path, receiver: tuple[str, type[_Receiver]]
) -> None:
    # The daemon's address (host.docker.internal) does not resolve here: its failed scrapes
    # still make `up` samples, which the agent forwards within a scrape interval (15 s) and
    # a send deadline (5 s).
    address, pushed = receiver
    process, url = _start_as_compose_would(tmp_path, address)
    try:
        _ready(url, process)
        assert pushed.arrived.wait(40), "no remote write arrived within 40 s"
    finally:
        _stop(process)
    path, headers = pushed.pushes[0]
    assert path == "/api/v1/push"
    # Go sends it as X-Scope-Orgid. Debian's prometheus 2.42 build sends no remote_write headers
    # at all (prometheus/prometheus#13030), which mimir.yml's no_auth_tenant makes harmless;
    # any other build must send the tenant.
    tenant = headers["X-Scope-OrgID"]
    assert tenant == _tenant() or (tenant is None and "+ds" in headers["User-Agent"]), headers
    assert headers["Content-Type"] == "application/x-protobuf"
    assert headers["Content-Encoding"] == "snappy"
