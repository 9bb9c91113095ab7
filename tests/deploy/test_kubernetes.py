"""deploy/kubernetes: manifests the API server and the Prometheus Operator would accept, that fit.

Offline, with no cluster: core objects are validated against Kubernetes' own OpenAPI schemas
(kubernetes-validate ships them per version, strict: an unknown field fails), the Prometheus
Operator and Kubeflow objects against hand-written strict schemas in tests/deploy/schemas/.
Then what no schema sees: the files kustomize would read exist, selectors select the pods
they are meant for, the port names they scrape are declared, and the generated PrometheusRule
and dashboard ConfigMaps are exact copies of their sources.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_helpers import (
    DEPLOY,
    PROMETHEUS_CONFIG,
    ROOT,
    RULES_FILE,
    dockerfile_user,
    load_documents,
    load_yaml,
    required_tool,
    run_tool,
)
from referencing import Registry, Resource

from stabmon import __version__
from stabmon.config import load_config
from stabmon.daemon import health
from stabmon.daemon.xid_state import state_path
from stabmon.shared.rundir import DEFAULT_RUN_DIR

KUBERNETES = DEPLOY / "kubernetes"
EXAMPLES = KUBERNETES / "examples"
SCHEMAS = Path(__file__).with_name("schemas")
#: The oldest Kubernetes the manifests claim (the Job example's batch.kubernetes.io/job-name
#: label needs 1.27) and a recent one; both must be shipped by kubernetes-validate.
KUBERNETES_VERSIONS = ("1.29", "1.33")
CUSTOM_SCHEMAS = {
    "PodMonitor": "podmonitor.schema.json",
    "PrometheusRule": "prometheusrule.schema.json",
    "PrometheusAgent": "prometheusagent.schema.json",
    "PyTorchJob": "pytorchjob.schema.json",
}
NAMESPACE = "stabmon"
DAEMON_IMAGE = "ghcr.io/stabmon/stabmon-daemon"
RANKS_PER_POD = 8


def _load_generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kubernetes_generate", KUBERNETES / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


def _kustomization() -> dict[str, Any]:
    document: dict[str, Any] = load_yaml(KUBERNETES / "kustomization.yaml")
    return document


def _applied() -> list[dict[str, Any]]:
    """Every object `kubectl apply -k deploy/kubernetes` creates, from the listed files."""
    return [
        doc for name in _kustomization()["resources"] for doc in load_documents(KUBERNETES / name)
    ]


def _examples() -> list[dict[str, Any]]:
    return [doc for path in sorted(EXAMPLES.glob("*.yaml")) for doc in load_documents(path)]


def _one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in _applied() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _id(document: dict[str, Any]) -> str:
    return f"{document['kind']}/{document['metadata']['name']}"


def _pod_templates(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a workload (a PyTorchJob has one per replica type)."""
    if document["kind"] == "PyTorchJob":
        return [spec["template"] for spec in document["spec"]["pytorchReplicaSpecs"].values()]
    return [document["spec"]["template"]]


def _as_pod(template: dict[str, Any]) -> dict[str, Any]:
    metadata = {"name": "template", **template.get("metadata", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def _schema_validator(kind: str) -> jsonschema.Draft202012Validator:
    """A validator for ``kind`` that resolves $refs between the schemas by their $id, offline."""
    registry: Registry = Registry()
    for path in SCHEMAS.glob("*.schema.json"):
        resource = Resource.from_contents(json.loads(path.read_text(encoding="utf-8")))
        uri = resource.id()
        assert uri, f"{path.name} has no $id"
        registry = registry.with_resource(uri, resource)
    schema = json.loads((SCHEMAS / CUSTOM_SCHEMAS[kind]).read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema, registry=registry)


CORE = [d for d in _applied() + _examples() if d["kind"] not in CUSTOM_SCHEMAS]
CUSTOM = [d for d in _applied() + _examples() if d["kind"] in CUSTOM_SCHEMAS]
TRAINING_WORKLOADS = [d for d in _examples() if d["kind"] in ("PyTorchJob", "Job")]


# --- kustomize ------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_nothing_else() -> None:
    listed = _kustomization()["resources"]
    present = sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == present
    assert len(listed) == len(set(listed))


def test_kustomization_uses_only_fields_these_tests_check() -> None:
    # Generators, patches and components each need their own check here (files exist, inside
    # the kustomization's directory, as kustomize's load restrictor demands).
    assert set(_kustomization()) == {"apiVersion", "kind", "namespace", "resources"}


def test_kustomization_leaves_the_examples_out() -> None:
    assert not any(name.startswith("examples") for name in _kustomization()["resources"])
    # Training jobs to copy from, and the agent-mode layout past one Prometheus (issue 39).
    assert {d["kind"] for d in _examples()} == {
        "PyTorchJob",
        "Job",
        "PrometheusAgent",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "NetworkPolicy",
    }


def test_every_applied_object_lives_in_the_stabmon_namespace() -> None:
    assert _kustomization()["namespace"] == NAMESPACE
    for document in _applied():
        if document["kind"] == "Namespace":
            assert document["metadata"]["name"] == NAMESPACE
        else:
            assert document["metadata"]["namespace"] == NAMESPACE, _id(document)


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    """What `kustomize build` makes of ``directory``; skipped without kustomize or kubectl."""
    if kustomize := shutil.which("kustomize"):
        command = [kustomize, "build", str(directory)]
    elif kubectl := shutil.which("kubectl"):
        command = [kubectl, "kustomize", str(directory)]
    else:
        pytest.skip("Requires: kustomize or kubectl (the Python checks here stand in for it)")
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_kustomize_build_yields_the_objects_the_files_declare() -> None:
    built = _kustomize(KUBERNETES)
    assert sorted(map(_id, built)) == sorted(map(_id, _applied()))
    assert {d["metadata"].get("namespace", NAMESPACE) for d in built} == {NAMESPACE}


def test_the_documented_site_overlay_sets_the_image_and_the_release_label(tmp_path: Path) -> None:
    docs = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    found = re.search(r"```yaml\n# my-overlay/kustomization.yaml\n(.*?)```", docs, re.DOTALL)
    assert found, "docs/deployment.md lost its overlay example"
    shutil.copytree(KUBERNETES, tmp_path / "stabmon" / "deploy" / "kubernetes")
    (tmp_path / "my-overlay").mkdir()
    (tmp_path / "my-overlay" / "kustomization.yaml").write_text(found[1])
    built = _kustomize(tmp_path / "my-overlay")
    monitoring = [d for d in built if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["metadata"]["labels"]["release"] for d in monitoring} == {"my-release"}
    (daemonset,) = [d for d in built if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images == {f"registry.example.com/stabmon-daemon:{__version__}"}


# --- schemas --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("document", CORE, ids=_id)
def test_core_object_is_valid_for_kubernetes(document: dict[str, Any], version: str) -> None:
    assert kubernetes_validate.validate(document, version, strict=True) == version


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("workload", TRAINING_WORKLOADS, ids=_id)
def test_example_pod_templates_are_valid_pods(workload: dict[str, Any], version: str) -> None:
    for template in _pod_templates(workload):
        assert kubernetes_validate.validate(_as_pod(template), version, strict=True) == version


@pytest.mark.parametrize("document", CUSTOM, ids=_id)
def test_custom_resource_is_valid_for_its_operator(document: dict[str, Any]) -> None:
    _schema_validator(document["kind"]).validate(document)


@pytest.mark.parametrize("name", sorted(p.name for p in SCHEMAS.glob("*.schema.json")))
def test_hand_written_schema_is_a_valid_json_schema(name: str) -> None:
    jsonschema.Draft202012Validator.check_schema(json.loads((SCHEMAS / name).read_text()))


def _misspelt_endpoints(podmonitor: dict[str, Any]) -> None:
    podmonitor["spec"]["podMetricEndpoints"] = podmonitor["spec"].pop("podMetricsEndpoints")


def _string_scrape_interval(podmonitor: dict[str, Any]) -> None:
    podmonitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"


def _rule_with_unknown_field(rule: dict[str, Any]) -> None:
    rule["spec"]["groups"][0]["rules"][0]["severity"] = "critical"  # belongs under labels


def _agent_with_misspelt_shards(agent: dict[str, Any]) -> None:
    agent["spec"]["shard"] = agent["spec"].pop("shards")


def _agent_writing_without_a_url(agent: dict[str, Any]) -> None:
    agent["spec"]["remoteWrite"][0]["endpoint"] = agent["spec"]["remoteWrite"][0].pop("url")


def _two_masters(job: dict[str, Any]) -> None:
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2


def _renamed_container(job: dict[str, Any]) -> None:
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        spec["template"]["spec"]["containers"][0]["name"] = "train"


@pytest.mark.parametrize(
    ("kind", "name", "mistake"),
    [
        ("PodMonitor", "stabmon-training", _misspelt_endpoints),
        ("PodMonitor", "stabmon-daemon", _string_scrape_interval),
        ("PrometheusRule", "stabmon", _rule_with_unknown_field),
        ("PrometheusAgent", "stabmon", _agent_with_misspelt_shards),
        ("PrometheusAgent", "stabmon", _agent_writing_without_a_url),
        ("PyTorchJob", "llm-pretrain", _two_masters),
        ("PyTorchJob", "llm-pretrain", _renamed_container),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_hand_written_schema_rejects_a_mistake(kind: str, name: str, mistake: Any) -> None:
    (document,) = [
        d for d in _applied() + _examples() if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    mistake(document)
    with pytest.raises(jsonschema.ValidationError):
        _schema_validator(kind).validate(document)


# --- the daemon -----------------------------------------------------------------------------


def _daemon_pod() -> dict[str, Any]:
    spec: dict[str, Any] = _one("DaemonSet", "stabmon-daemon")["spec"]["template"]["spec"]
    return spec


def _daemon_container() -> dict[str, Any]:
    (container,) = _daemon_pod()["containers"]
    return dict(container)


def test_daemonset_selector_matches_its_pod_template_labels() -> None:
    daemonset = _one("DaemonSet", "stabmon-daemon")
    selector = daemonset["spec"]["selector"]["matchLabels"]
    assert selector.items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()


def test_daemonset_runs_on_gpu_nodes_including_tainted_ones() -> None:
    pod = _daemon_pod()
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


def test_daemonset_shares_the_host_pid_namespace_and_the_run_directory() -> None:
    pod = _daemon_pod()
    assert pod["hostPID"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == "run-dir"]
    assert volume["hostPath"] == {"path": str(DEFAULT_RUN_DIR), "type": "DirectoryOrCreate"}
    (mount,) = [m for m in _daemon_container()["volumeMounts"] if m["name"] == volume["name"]]
    assert mount == {"name": volume["name"], "mountPath": str(DEFAULT_RUN_DIR), "readOnly": True}
    args = _daemon_container()["args"]
    assert args[args.index("--run-dir") + 1] == str(DEFAULT_RUN_DIR)


def test_daemonset_runs_as_the_images_uid_read_only_with_no_capabilities() -> None:
    context = _daemon_container()["securityContext"]
    uid, gid = dockerfile_user().split(":")
    assert context["runAsNonRoot"] is True
    assert (context["runAsUser"], context["runAsGroup"]) == (int(uid), int(gid))
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}


def test_daemonset_only_its_init_step_runs_as_root_and_it_only_prepares_the_directories() -> None:
    (init,) = _daemon_pod()["initContainers"]
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert init["args"][0].startswith(f"chmod 1777 {DEFAULT_RUN_DIR} ||")
    uid, gid = dockerfile_user().split(":")
    assert f"chown {uid}:{gid} /state" in init["args"][0]


def test_daemonset_keeps_the_daemons_state_outside_the_shared_run_directory() -> None:
    pod = _daemon_pod()
    (volume,) = [v for v in pod["volumes"] if v["name"] == "daemon-state"]
    assert volume["hostPath"]["path"] == "/var/lib/stabmon-daemon"
    (mount,) = [m for m in _daemon_container()["volumeMounts"] if m["name"] == "daemon-state"]
    # Where the daemon looks for it by default: its run directory's .stabmon-daemon.
    assert Path(mount["mountPath"]) == state_path(DEFAULT_RUN_DIR).parent
    assert not mount.get("readOnly", False)


def test_networkpolicy_lets_only_prometheus_reach_the_daemon_and_the_daemon_reach_no_one() -> None:
    (policy,) = [d for d in _applied() if d["kind"] == "NetworkPolicy"]
    daemonset = next(d for d in _applied() if d["kind"] == "DaemonSet")
    assert policy["spec"]["podSelector"] == daemonset["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["egress"] == []
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] and all("podSelector" in peer for peer in rule["from"])


def test_daemonset_images_are_the_project_version() -> None:
    pod = _daemon_pod()
    for container in pod["containers"] + pod["initContainers"]:
        assert container["image"] == f"{DAEMON_IMAGE}:{__version__}", container["name"]


def test_daemonset_sees_every_gpu_through_the_nvidia_runtime_for_nvml_only() -> None:
    env = {e["name"]: e["value"] for e in _daemon_container()["env"]}
    assert env == {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility"}
    assert "nvidia.com/gpu" not in json.dumps(_daemon_container()["resources"])


def test_daemonset_metrics_port_is_the_daemon_port_and_the_probes_use_it() -> None:
    container = _daemon_container()
    (port,) = container["ports"]
    args = container["args"]
    assert port["name"] == "metrics"
    assert port["containerPort"] == int(args[args.index("--port") + 1])
    assert port["containerPort"] == load_config({}, env={}).daemon.port
    for probe in ("livenessProbe", "readinessProbe"):
        # The health check needs no credentials: probes keep working with basic_auth_file.
        assert container[probe]["httpGet"] == {"path": health.PATH, "port": "metrics"}, probe


def _mebibytes(quantity: str) -> float:
    match = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert match, f"memory quantity {quantity!r}: expected Mi or Gi"
    return int(match[1]) * (1024 if match[2] == "Gi" else 1)


def test_daemonset_requests_and_limits_are_small() -> None:
    resources = _daemon_container()["resources"]
    assert set(resources) == {"requests", "limits"}
    assert _mebibytes(resources["requests"]["memory"]) <= _mebibytes(resources["limits"]["memory"])
    assert _mebibytes(resources["limits"]["memory"]) <= 256
    assert resources["limits"]["cpu"].endswith("m")


# --- scraping -------------------------------------------------------------------------------


def _endpoint_ports(podmonitor: dict[str, Any]) -> list[str]:
    return [endpoint["port"] for endpoint in podmonitor["spec"]["podMetricsEndpoints"]]


def _scrape_interval() -> str:
    interval: str = load_yaml(PROMETHEUS_CONFIG)["global"]["scrape_interval"]
    return interval


def test_daemon_podmonitor_selects_the_daemon_pods_on_their_metrics_port() -> None:
    podmonitor = _one("PodMonitor", "stabmon-daemon")
    labels = _one("DaemonSet", "stabmon-daemon")["spec"]["template"]["metadata"]["labels"]
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert _endpoint_ports(podmonitor) == [p["name"] for p in _daemon_container()["ports"]]


def test_training_podmonitor_scrapes_one_port_per_rank_in_every_namespace() -> None:
    podmonitor = _one("PodMonitor", "stabmon-training")
    assert _endpoint_ports(podmonitor) == [f"stabmon-{rank}" for rank in range(RANKS_PER_POD)]
    assert podmonitor["spec"]["namespaceSelector"] == {"any": True}


@pytest.mark.parametrize("name", ["stabmon-daemon", "stabmon-training"])
def test_podmonitor_scrapes_at_the_interval_the_rules_assume(name: str) -> None:
    for endpoint in _one("PodMonitor", name)["spec"]["podMetricsEndpoints"]:
        assert endpoint["interval"] == _scrape_interval()
        assert endpoint["path"] == "/metrics"


def test_monitoring_objects_carry_one_release_label() -> None:
    monitoring = [d for d in _applied() if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert len(monitoring) == 3
    assert {d["metadata"]["labels"]["release"] for d in monitoring} == {generate.RELEASE}


def _example(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in _examples() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_example_agents_scrape_both_podmonitors_and_forward_without_shard_labels() -> None:
    # Issue 39: the agents select the PodMonitors by the label both carry (not the release
    # label, which is kube-prometheus-stack's), in the namespace they live in ...
    agent = _example("PrometheusAgent", "stabmon")["spec"]
    for name in ("stabmon-daemon", "stabmon-training"):
        podmonitor = _one("PodMonitor", name)
        assert agent["podMonitorSelector"]["matchLabels"].items() <= (
            podmonitor["metadata"]["labels"].items()
        )
        namespace = {"kubernetes.io/metadata.name": podmonitor["metadata"]["namespace"]}
        assert agent["podMonitorNamespaceSelector"]["matchLabels"] == namespace
    # ... keep no label that differs between shards on what they forward ...
    assert agent["shards"] > 1
    assert agent["prometheusExternalLabelName"] == agent["replicaExternalLabelName"] == ""
    assert "externalLabels" not in agent
    (write,) = agent["remoteWrite"]
    assert write["url"].endswith("/api/v1/push")
    # ... run as their own service account, which may list pods everywhere ...
    account = _example("ServiceAccount", agent["serviceAccountName"])
    binding = _example("ClusterRoleBinding", "stabmon-agent")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    (rule,) = _example("ClusterRole", binding["roleRef"]["name"])["rules"]
    assert rule == {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    # ... and may reach the daemon's metrics port, which its own policy keeps from others.
    policy = _example("NetworkPolicy", "stabmon-daemon-from-agents")["spec"]
    assert policy["podSelector"] == _one("NetworkPolicy", "stabmon-daemon")["spec"]["podSelector"]
    ((source,),) = [rule["from"] for rule in policy["ingress"]]
    assert source["podSelector"]["matchLabels"].items() <= agent["podMetadata"]["labels"].items()
    assert [port["port"] for rule in policy["ingress"] for port in rule["ports"]] == ["metrics"]


def _training_container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return dict(container)


@pytest.mark.parametrize("workload", TRAINING_WORKLOADS, ids=_id)
def test_example_training_pods_opt_in_as_the_training_podmonitor_expects(
    workload: dict[str, Any],
) -> None:
    podmonitor = _one("PodMonitor", "stabmon-training")
    base_port = load_config({}, env={}).port
    for template in _pod_templates(workload):
        selector = podmonitor["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items()
        container = _training_container(template)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert set(ports) <= set(_endpoint_ports(podmonitor))
        assert ports == {f"stabmon-{rank}": base_port + rank for rank in range(len(ports))}
        (nproc,) = re.findall(r"--nproc_per_node=(\d+)", " ".join(container["command"]))
        assert int(nproc) == len(ports)  # one declared port per rank the pod runs


@pytest.mark.parametrize("workload", TRAINING_WORKLOADS, ids=_id)
def test_example_training_pods_register_where_the_daemon_looks(workload: dict[str, Any]) -> None:
    for template in _pod_templates(workload):
        pod = template["spec"]
        assert not pod.get("hostPID")  # the daemon maps the pod's own pids (stabmon.daemon.pidns)
        (volume,) = [v for v in pod["volumes"] if "hostPath" in v]
        assert volume["hostPath"]["path"] == _daemon_pod()["volumes"][0]["hostPath"]["path"]
        mounts = _training_container(template)["volumeMounts"]
        (mount,) = [m for m in mounts if m["name"] == volume["name"]]
        assert mount["mountPath"] == str(DEFAULT_RUN_DIR)


@pytest.mark.parametrize("workload", TRAINING_WORKLOADS, ids=_id)
def test_example_training_pods_share_one_run_id_per_job(workload: dict[str, Any]) -> None:
    # A label the job's controller puts on every pod it creates, so every rank of every node
    # reports under the same run label.
    job_label = {
        "PyTorchJob": "training.kubeflow.org/job-name",
        "Job": "batch.kubernetes.io/job-name",
    }[workload["kind"]]
    for template in _pod_templates(workload):
        env = {e["name"]: e for e in _training_container(template)["env"]}
        field = env["STABMON_RUN_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert field == f"metadata.labels['{job_label}']"


# --- generated objects ----------------------------------------------------------------------


def test_prometheusrule_groups_are_the_rules_files_groups_exactly() -> None:
    rule = _one("PrometheusRule", "stabmon")
    assert rule["spec"]["groups"] == load_yaml(RULES_FILE)["groups"]


def test_generated_kubernetes_yaml_is_fresh() -> None:
    assert generate.stale(generate.render_all()) == []
    assert generate.main(["--check"]) == 0


def test_generate_check_fails_naming_the_file_that_drifted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    drifted = tmp_path / "prometheusrule.yaml"
    drifted.write_text(drifted.read_text().replace("for: 1m", "for: 2m", 1))
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    assert "stale Kubernetes YAML" in capsys.readouterr().err


def test_promtool_accepts_the_prometheusrule_spec_as_a_rules_file(tmp_path: Path) -> None:
    promtool = required_tool("promtool", "prometheus")
    rules = tmp_path / "from-prometheusrule.rules.yml"
    rules.write_text(
        yaml.safe_dump({"groups": _one("PrometheusRule", "stabmon")["spec"]["groups"]})
    )
    result = run_tool(promtool, "check", "rules", rules)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SUCCESS: [1-9]\d* rules found", result.stdout), result.stdout


def _dashboard_config_maps() -> list[dict[str, Any]]:
    return [d for d in _applied() if d["kind"] == "ConfigMap"]


def test_dashboard_configmaps_carry_each_dashboard_verbatim_for_grafanas_sidecar() -> None:
    sources = sorted((ROOT / "dashboards" / "json").glob("*.json"))
    config_maps = _dashboard_config_maps()
    assert len(config_maps) == len(sources)
    carried = {}
    for config_map in config_maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = config_map["data"].items()
        carried[name] = text
    assert carried == {path.name: path.read_text(encoding="utf-8") for path in sources}


def test_dashboard_configmaps_fit_in_a_client_side_apply() -> None:
    # `kubectl apply` (client side) stores the object in an annotation of at most 256 KiB.
    for config_map in _dashboard_config_maps():
        assert len(json.dumps(config_map)) < 256 * 1024, config_map["metadata"]["name"]
