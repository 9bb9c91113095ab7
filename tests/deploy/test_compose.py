"""deploy/compose: a docker-compose file that would start, and configs the real tools accept.

No Docker engine runs here, so the compose file is checked against the parts of the
compose-spec that decide whether `docker compose up` works and whether the pieces find each
other: pinned images, paths that exist, host PID and network for the daemon, the host gateway
for Prometheus, and service names and ports that agree with the mounted configs. The mounted
configs themselves go through promtool and amtool.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from deploy_helpers import (
    PROMETHEUS_CONFIG,
    ROOT,
    load_yaml,
    required_tool,
    run_tool,
)

from stabmon import __version__
from stabmon.config import load_config
from stabmon.shared.rundir import DEFAULT_RUN_DIR

COMPOSE_DIR = ROOT / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
ALERTMANAGER_CONFIG = COMPOSE_DIR / "alertmanager.yml"
DASHBOARD_PROVIDER = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "stabmon.yml"
DATASOURCE = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "stabmon.yml"
RUN_DIR = "/var/tmp/stabmon"
#: Official images and the release-tag shape each project publishes.
THIRD_PARTY = {
    "prometheus": ("prom/prometheus", r"v2\.\d+\.\d+"),
    "alertmanager": ("prom/alertmanager", r"v0\.\d+\.\d+"),
    "grafana": ("grafana/grafana", r"\d+\.\d+\.\d+"),
}
#: Each UI service and the port it listens on inside its container.
UI_PORTS = {"prometheus": 9090, "alertmanager": 9093, "grafana": 3000}


def _compose() -> dict[str, Any]:
    document: dict[str, Any] = load_yaml(COMPOSE_FILE)
    return document


def _service(name: str) -> dict[str, Any]:
    service: dict[str, Any] = _compose()["services"][name]
    return service


def _mounts(service: dict[str, Any]) -> list[dict[str, Any]]:
    """A service's volumes in long syntax (short "source:target[:mode]" entries expanded)."""
    mounts = []
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            mounts.append(entry)
            continue
        source, target, *mode = entry.split(":")
        is_path = source.startswith((".", "/", "~", "$"))
        mounts.append(
            {
                "type": "bind" if is_path else "volume",
                "source": source,
                "target": target,
                "read_only": mode == ["ro"],
            }
        )
    return mounts


def _mount(service: str, target: str) -> dict[str, Any]:
    matches = [m for m in _mounts(_service(service)) if m["target"] == target]
    assert len(matches) == 1, f"{service} mounts {target} {len(matches)} times"
    return matches[0]


def _host_path(source: str) -> Path:
    """A relative bind source as Docker resolves it: against the compose file's directory."""
    return (COMPOSE_DIR / source).resolve()


def _flags(service: str) -> dict[str, str]:
    """``--name=value`` arguments of a service's command."""
    return dict(arg.removeprefix("--").split("=", 1) for arg in _service(service)["command"])


def _daemon_port() -> int:
    command = _service("daemon")["command"]
    return int(command[command.index("--port") + 1])


def test_compose_every_service_has_an_image_or_a_build() -> None:
    for name, service in _compose()["services"].items():
        assert "image" in service or "build" in service, name


@pytest.mark.parametrize("service", sorted(THIRD_PARTY))
def test_compose_official_images_are_pinned_to_a_release(service: str) -> None:
    repository, version = THIRD_PARTY[service]
    image = _service(service)["image"]
    assert re.fullmatch(rf"{re.escape(repository)}:{version}", image), image


def test_compose_images_are_never_latest_or_untagged() -> None:
    for name, service in _compose()["services"].items():
        image = service.get("image")
        if image is None:
            continue
        name_part, _, tag = image.rpartition(":")
        assert name_part and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest", f"{name}: {image}"


def test_compose_grafana_is_at_least_10() -> None:
    # The dashboards use timeseries/stat panels and a datasource variable (Grafana 10+).
    tag = _service("grafana")["image"].rpartition(":")[2]
    assert int(tag.split(".")[0]) >= 10


def test_compose_daemon_image_is_built_here_and_tagged_with_the_project_version() -> None:
    daemon = _service("daemon")
    context = (COMPOSE_DIR / daemon["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / daemon["build"]["dockerfile"]).is_file()
    assert (context / ".dockerignore").is_file()
    assert daemon["image"] == f"stabmon-daemon:{__version__}"


def test_compose_every_relative_bind_mount_source_exists() -> None:
    checked = 0
    for name, service in _compose()["services"].items():
        for mount in _mounts(service):
            if mount["type"] == "bind" and mount["source"].startswith("."):
                assert _host_path(mount["source"]).exists(), f"{name}: {mount['source']}"
                checked += 1
    assert checked >= 5  # prometheus.yml, rules, alertmanager.yml, provisioning, dashboards


def test_compose_named_volumes_are_declared_and_every_declared_one_is_used() -> None:
    used = {
        mount["source"]
        for service in _compose()["services"].values()
        for mount in _mounts(service)
        if mount["type"] == "volume"
    }
    assert used == set(_compose()["volumes"])


def test_compose_daemon_shares_the_host_pid_namespace_and_network() -> None:
    daemon = _service("daemon")
    assert daemon["pid"] == "host"
    assert daemon["network_mode"] == "host"
    assert "ports" not in daemon  # Docker discards published ports on the host network


def test_compose_daemon_mounts_the_run_directory_read_only_and_never_creates_it() -> None:
    mount = _mount("daemon", RUN_DIR)
    assert mount["type"] == "bind" and mount["read_only"] is True
    # The host side follows STABMON_DIR like the training processes do, defaulting the same way.
    assert mount["source"] == "${STABMON_DIR:-" + RUN_DIR + "}"
    assert Path(RUN_DIR) == DEFAULT_RUN_DIR
    # Docker would create a missing source root-owned 0755, where other users cannot register.
    assert mount["bind"]["create_host_path"] is False
    command = _service("daemon")["command"]
    assert command[command.index("--run-dir") + 1] == RUN_DIR


def test_compose_daemon_reserves_every_nvidia_gpu_for_nvml() -> None:
    daemon = _service("daemon")
    (device,) = daemon["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == "all"
    assert set(device["capabilities"]) == {"gpu", "utility"}
    assert daemon["environment"]["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


def test_compose_daemon_runs_read_only_without_capabilities() -> None:
    daemon = _service("daemon")
    assert daemon["read_only"] is True
    assert daemon["cap_drop"] == ["ALL"] and "cap_add" not in daemon
    assert "no-new-privileges:true" in daemon["security_opt"]


def test_compose_prometheus_maps_host_docker_internal_to_the_host_gateway() -> None:
    assert "host.docker.internal:host-gateway" in _service("prometheus")["extra_hosts"]


@pytest.mark.parametrize("service", sorted(UI_PORTS))
def test_compose_publishes_each_ui_on_loopback_at_its_container_port(service: str) -> None:
    (mapping,) = _service(service)["ports"]
    assert isinstance(mapping, str), "quote port mappings: YAML reads some as base-60 numbers"
    address, host_port, container_port = mapping.split(":")
    assert address == "127.0.0.1"
    assert int(host_port) == int(container_port) == UI_PORTS[service]


def test_compose_prometheus_reads_the_mounted_config_and_keeps_data_in_its_volume() -> None:
    flags = _flags("prometheus")
    config = _mount("prometheus", flags["config.file"])
    assert _host_path(config["source"]) == PROMETHEUS_CONFIG
    assert config["read_only"] is True
    assert _mount("prometheus", flags["storage.tsdb.path"])["type"] == "volume"
    assert re.fullmatch(r"\d+[dhwy]", flags["storage.tsdb.retention.time"])


def test_compose_mounted_rules_are_the_ones_prometheus_yml_loads() -> None:
    (pattern,) = load_yaml(PROMETHEUS_CONFIG)["rule_files"]
    directory = str(PurePosixPath(pattern).parent)
    mount = _mount("prometheus", directory)
    rules = sorted(_host_path(mount["source"]).iterdir())
    assert rules
    for rule_file in rules:
        assert fnmatch.fnmatch(f"{directory}/{rule_file.name}", pattern), rule_file.name


def test_compose_alertmanager_reads_the_mounted_config() -> None:
    flags = _flags("alertmanager")
    mount = _mount("alertmanager", flags["config.file"])
    assert _host_path(mount["source"]) == ALERTMANAGER_CONFIG
    assert _mount("alertmanager", flags["storage.path"])["type"] == "volume"


def test_compose_grafana_mounts_dashboards_where_the_provider_reads_them() -> None:
    (provider,) = load_yaml(DASHBOARD_PROVIDER)["providers"]
    mount = _mount("grafana", provider["options"]["path"])
    assert _host_path(mount["source"]) == ROOT / "dashboards" / "json"
    provisioning = _mount("grafana", "/etc/grafana/provisioning")
    assert _host_path(provisioning["source"]) == DATASOURCE.parents[1]


def test_compose_service_names_and_ports_match_the_mounted_configs() -> None:
    prometheus = load_yaml(PROMETHEUS_CONFIG)
    (alertmanagers,) = prometheus["alerting"]["alertmanagers"]
    assert alertmanagers["static_configs"][0]["targets"] == [
        f"alertmanager:{UI_PORTS['alertmanager']}"
    ]
    (datasource,) = load_yaml(DATASOURCE)["datasources"]
    assert datasource["url"] == f"http://prometheus:{UI_PORTS['prometheus']}"
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    daemon_address = f"host.docker.internal:{_daemon_port()}"
    assert jobs["stabmon-daemon"]["static_configs"][0]["targets"] == [daemon_address]
    assert (
        jobs["stabmon-training"]["http_sd_configs"][0]["url"] == f"http://{daemon_address}/targets"
    )
    assert _daemon_port() == load_config({}, env={}).daemon.port


def test_promtool_accepts_the_prometheus_config_as_the_container_sees_it(tmp_path: Path) -> None:
    promtool = required_tool("promtool", "prometheus")
    # Lay the mounts out under tmp_path as the container sees them under /, and point the
    # absolute rule_files pattern there, so promtool also loads the rules the config names.
    for mount in _mounts(_service("prometheus")):
        if mount["type"] != "bind":
            continue
        target = tmp_path / mount["target"].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        source = _host_path(mount["source"])
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy(source, target)
    config_path = tmp_path / _flags("prometheus")["config.file"].lstrip("/")
    text = config_path.read_text(encoding="utf-8")
    (pattern,) = load_yaml(config_path)["rule_files"]
    config_path.write_text(text.replace(pattern, f"{tmp_path}{pattern}"), encoding="utf-8")
    result = run_tool(promtool, "check", "config", config_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout
    assert re.search(r"SUCCESS: [1-9]\d* rules found", result.stdout), result.stdout


def test_promtool_accepts_every_mounted_rules_file() -> None:
    promtool = required_tool("promtool", "prometheus")
    rules = sorted(_host_path(_mount("prometheus", "/etc/prometheus/rules")["source"]).iterdir())
    result = run_tool(promtool, "check", "rules", *rules)
    assert result.returncode == 0, result.stdout + result.stderr


def test_amtool_accepts_alertmanager_yml() -> None:
    amtool = required_tool("amtool", "prometheus-alertmanager")
    result = run_tool(amtool, "check-config", ALERTMANAGER_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _uncomment_examples(text: str) -> str:
    """The config with its commented-out YAML restored (prose comments start with a capital)."""
    return re.sub(r"^(\s*)# (\s*(?:- |[a-z_]+:).*)$", r"\1\2", text, flags=re.MULTILINE)


def test_alertmanager_yml_routes_everything_to_one_receiver_grouped_by_alert_and_run() -> None:
    config = load_yaml(ALERTMANAGER_CONFIG)
    assert [receiver["name"] for receiver in config["receivers"]] == ["default"]
    assert config["route"]["receiver"] == "default"
    assert config["route"]["group_by"] == ["alertname", "run"]
    # Node alerts carry no run: grouped by node instead, as deploy/alertmanager/ does.
    (node_route,) = config["route"]["routes"]
    assert node_route["matchers"] == ['run=""']
    assert node_route["group_by"] == ["alertname", "node", "instance"]


def test_amtool_accepts_alertmanager_yml_with_its_examples_uncommented(tmp_path: Path) -> None:
    amtool = required_tool("amtool", "prometheus-alertmanager")
    example = tmp_path / "alertmanager.yml"
    example.write_text(_uncomment_examples(ALERTMANAGER_CONFIG.read_text(encoding="utf-8")))
    config = load_yaml(example)
    assert [receiver["name"] for receiver in config["receivers"]] == [
        "default",
        "slack",
        "pagerduty",
    ]
    node_alerts, run_alerts = config["route"]["routes"]
    for child in (node_alerts, run_alerts):  # each group by its key, then by severity
        assert [route["receiver"] for route in child["routes"]] == ["pagerduty", "slack"]
    result = run_tool(amtool, "check-config", example)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning_files_have_the_shape_grafana_reads() -> None:
    """The fields Grafana's file provisioning requires (apiVersion 1, one provider of type file)."""
    datasources = load_yaml(DATASOURCE)
    assert datasources["apiVersion"] == 1
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus" and datasource["access"] == "proxy"
    assert datasource["uid"] == "stabmon-prometheus"
    providers = load_yaml(DASHBOARD_PROVIDER)
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


def test_provisioned_dashboards_load_unchanged_into_grafana_10_and_later() -> None:
    """Provisioning reads the JSON as is: a dashboard model, not the export-for-sharing form."""
    dashboards = sorted((ROOT / "dashboards" / "json").glob("*.json"))
    assert dashboards
    uids = set()
    for path in dashboards:
        model = json.loads(path.read_text())
        assert not model.get("__inputs") and "dashboard" not in model, path.name
        assert model["uid"] and model["title"], path.name
        uids.add(model["uid"])
        # schemaVersion 39 is what Grafana 10.3 writes; the compose image is newer.
        assert 36 <= model["schemaVersion"] <= 39, path.name
        variables = {v["name"]: v for v in model["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
    assert len(uids) == len(dashboards)
