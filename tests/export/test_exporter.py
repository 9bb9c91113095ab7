"""The HTTP exporter: real sockets, real scrapes, busy ports that never reach training."""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import MonitorFactory
from helpers import scrape, tiny_model, train_step, value
from prometheus_client.parser import text_string_to_metric_families

import stabmon
from stabmon.export.collector import MAX_LABEL_CHARS
from stabmon.export.exporter import Security, candidate_ports


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port held by a listening socket for the duration of the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_candidate_ports_step_past_sibling_ranks() -> None:
    assert candidate_ports(9400, local_rank=1, local_world_size=4, attempts=3) == [9401, 9405, 9409]
    assert candidate_ports(0, local_rank=3, local_world_size=8, attempts=5) == [0]
    assert candidate_ports(65534, local_rank=0, local_world_size=1, attempts=4) == [65534, 65535]


def test_exporter_falls_back_when_its_port_is_busy(attach: MonitorFactory, busy_port: int) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, port=busy_port, port_attempts=4)
    assert monitor.metrics_url is not None
    assert f":{busy_port}/" not in monitor.metrics_url
    train_step(model, optimizer, monitor)
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 1


def test_training_goes_on_without_an_exporter_when_every_port_is_busy(
    attach: MonitorFactory, busy_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, port=busy_port, port_attempts=1)
    assert monitor.metrics_url is None
    for _ in range(3):
        train_step(model, optimizer, monitor)
    assert monitor.state_dict()["step"] == 3
    assert "could not bind the metrics exporter" in caplog.text


def test_training_goes_on_when_the_address_cannot_be_bound(attach: MonitorFactory) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, address="203.0.113.7")  # TEST-NET-3: not on this host
    train_step(model, optimizer, monitor)
    assert monitor.metrics_url is None


def test_detach_frees_the_port(attach: MonitorFactory) -> None:
    monitor = attach(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    url = monitor.metrics_url
    assert url is not None
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    monitor.detach()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))  # raises if the exporter still held it


def test_disabled_exporter_serves_nothing(attach: MonitorFactory) -> None:
    monitor = attach(
        tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1), serve_metrics=False
    )
    assert monitor.metrics_url is None


def _internal_errors(monitor: stabmon.Monitor, component: str) -> float | None:
    """Read through the registry: a monitor without an endpoint has nothing to scrape."""
    for family in monitor.registry.collect():
        for sample in family.samples:
            if (
                sample.name == "stabmon_internal_errors_total"
                and sample.labels.get("component") == component
            ):
                return sample.value
    return None


def test_every_busy_port_gives_one_log_line_and_an_exporter_error_count(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    holders = []
    try:
        for _ in range(3):  # three busy ports in a row: the whole fallback range
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            holders.append(holder)
        ports = [h.getsockname()[1] for h in holders]
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        monitor = attach(model, optimizer, port=ports[0], port_attempts=1)
        assert monitor.metrics_url is None
        for _ in range(3):
            train_step(model, optimizer, monitor)
    finally:
        for holder in holders:
            holder.close()
    lines = [r for r in caplog.records if "could not bind the metrics exporter" in r.getMessage()]
    assert len(lines) == 1
    assert monitor.state_dict()["step"] == 3
    assert _internal_errors(monitor, "exporter") == 1


def test_an_address_not_on_this_host_gives_one_log_line_and_an_exporter_error_count(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, address="192.0.2.1", port_attempts=3)  # TEST-NET-1
    train_step(model, optimizer, monitor)
    assert monitor.metrics_url is None
    lines = [r.getMessage() for r in caplog.records if "could not bind" in r.getMessage()]
    assert len(lines) == 1
    assert "assign requested address" in lines[0]  # EADDRNOTAVAIL, said in the log line
    assert _internal_errors(monitor, "exporter") == 1


def _request(url: str, method: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_exporter_serves_only_metrics_and_answers_405_to_a_post_without_reading_it(
    attach: MonitorFactory,
) -> None:
    monitor = attach(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    assert monitor.metrics_url is not None
    root = monitor.metrics_url.removesuffix("/metrics")
    assert _request(monitor.metrics_url, "GET")[0] == 200
    assert _request(monitor.metrics_url, "HEAD")[0] == 200
    for path in ("/", "/debug", "/metrics/../etc/passwd", "/targets"):
        assert _request(root + path, "GET")[0] == 404
    for method in ("POST", "PUT", "DELETE"):
        assert _request(monitor.metrics_url, method, b"x" * 10_000)[0] == 405
    # A request announcing a huge body that never comes is answered at once: nothing reads it.
    with socket.create_connection(("127.0.0.1", int(root.rsplit(":", 1)[1])), timeout=5) as sock:
        sock.sendall(b"POST /metrics HTTP/1.0\r\nContent-Length: 1000000000\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.0 405")


def test_exporter_binds_only_the_configured_address(attach: MonitorFactory) -> None:
    monitor = attach(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1))
    assert monitor.metrics_url is not None
    port = int(monitor.metrics_url.rsplit(":", 1)[1].split("/")[0])
    other = _non_loopback_address()
    if other is None:
        pytest.skip("no non-loopback IPv4 address on this host")
    with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
        pass


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: only picks the route
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


def _https_get(url: str, cafile: Path, authorization: str | None = None) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(cafile))
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_exporter_serves_https_with_the_configured_certificate(
    attach: MonitorFactory, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, tls_certfile=str(cert), tls_keyfile=str(key))
    assert monitor.metrics_url is not None and monitor.metrics_url.startswith("https://")
    train_step(model, optimizer, monitor)
    status, text = _https_get(monitor.metrics_url, cert)
    assert status == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["stabmon_steps_total"] == 1
    plain = monitor.metrics_url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(plain, timeout=5)  # plain HTTP gets no metrics


def test_a_silent_client_does_not_hold_up_an_https_scrape(
    attach: MonitorFactory, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    monitor = attach(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1),
                     tls_certfile=str(cert), tls_keyfile=str(key))  # fmt: skip
    assert monitor.metrics_url is not None
    port = int(monitor.metrics_url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # connects, never handshakes
        assert _https_get(monitor.metrics_url, cert)[0] == 200


def test_exporter_answers_401_without_basic_auth_and_200_with_it(
    attach: MonitorFactory, certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, key = certificate
    credentials = tmp_path / "scrape-credentials"
    credentials.write_text("prometheus:s3cret:with-colon\n")
    monitor = attach(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1),
                     tls_certfile=str(cert), tls_keyfile=str(key),
                     basic_auth_file=str(credentials))  # fmt: skip
    assert monitor.metrics_url is not None
    status, body = _https_get(monitor.metrics_url, cert)
    assert status == 401 and "stabmon_" not in body
    wrong = "Basic " + base64.b64encode(b"prometheus:guess").decode()
    assert _https_get(monitor.metrics_url, cert, wrong)[0] == 401
    assert _https_get(monitor.metrics_url, cert, "Basic !!!not-base64")[0] == 401
    right = "Basic " + base64.b64encode(b"prometheus:s3cret:with-colon").decode()
    status, body = _https_get(monitor.metrics_url, cert, right)
    assert status == 200 and "stabmon_steps_total" in body


@pytest.mark.parametrize("setting", ["tls_certfile", "basic_auth_file"])
def test_exporter_fails_closed_when_its_security_files_cannot_be_read(
    attach: MonitorFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture, setting: str
) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, **{setting: str(tmp_path / "missing.pem")})
    train_step(model, optimizer, monitor)
    assert monitor.metrics_url is None  # no plain or open endpoint instead
    assert monitor.state_dict()["step"] == 1
    lines = [r.getMessage() for r in caplog.records if "not serving metrics" in r.getMessage()]
    assert len(lines) == 1
    assert f"{setting} '{tmp_path / 'missing.pem'}' is not a readable file" in lines[0]
    assert _internal_errors(monitor, "exporter") == 1


def test_security_problem_names_the_setting_and_is_none_for_usable_files(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    cert, key = certificate
    credentials = tmp_path / "auth"
    credentials.write_text("scraper:s3cret\n")
    assert Security(tls_certfile=str(cert), tls_keyfile=str(key)).problem() is None
    assert Security(basic_auth_file=str(credentials)).problem() is None
    assert Security().problem() is None
    assert Security(tls_keyfile=str(tmp_path)).problem() == (
        f"tls_keyfile {str(tmp_path)!r} is not a readable file"  # a directory
    )
    not_a_certificate = Security(tls_certfile=str(key)).problem()  # a key is no certificate
    assert not_a_certificate is not None
    assert not_a_certificate.startswith("tls_certfile/tls_keyfile cannot be used:")
    assert Security(tls_keyfile=str(key)).problem() == (
        "tls_certfile/tls_keyfile cannot be used: tls_keyfile is set but tls_certfile is not"
    )
    credentials.write_text("no colon here\n")
    assert Security(basic_auth_file=str(credentials)).problem() == (
        f"basic_auth_file cannot be used: {credentials}: expected one line username:password"
    )


def test_long_and_hostile_module_names_are_escaped_and_bounded(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A configured run_id must be in the safe alphabet; a launcher's id may be anything.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", 'run "1"\\\n')
    names = ['quo"te', "back\\slash", "new\nline", "ünïcødé✓", "x" * 10_000, "x" * 9_999 + "y"]
    model = torch.nn.Module()
    for name in names:
        model.add_module(name, torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, run_id=None)
    loss = sum(child(torch.ones(1, 2)).sum() for child in model.children())
    loss.backward()
    optimizer.step()
    monitor.observe(loss=loss)
    samples = scrape(monitor.metrics_url)  # parses: every value was escaped
    modules = {
        dict(labels)["module"] for (name, labels) in samples if name == "stabmon_module_grad_norm"
    }
    assert {'quo"te', "back\\slash", "new\nline", "ünïcødé✓"} <= modules
    long = [m for m in modules if m.startswith("xxx")]
    assert len(long) == 2  # both kept apart by the hash
    assert all(len(m) <= MAX_LABEL_CHARS for m in long)
    runs = {dict(labels).get("run") for (name, labels) in samples if name == "stabmon_steps_total"}
    assert runs == {'run "1"\\\n'}


@pytest.mark.parametrize(
    ("depth", "expected"),
    [(1, {"other", "0", "30"}), (0, {"0-31", "992-999"})],
    ids=["top-level-modules", "runs-of-blocks"],
)
def test_a_thousand_modules_export_a_bounded_number_of_series(
    attach: MonitorFactory, depth: int, expected: set[str]
) -> None:
    # By top-level module, the 31 largest keep a label and the rest share 'other'; by the
    # model's repeated blocks (the default), consecutive blocks share a run's label.
    model = torch.nn.Sequential(*[torch.nn.Linear(1, 1) for _ in range(1000)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer, module_depth=depth)
    model(torch.ones(1, 1)).sum().backward()
    optimizer.step()
    monitor.observe(loss=torch.tensor(1.0))
    samples = scrape(monitor.metrics_url)
    modules = {dict(lbl)["module"] for (n, lbl) in samples if n == "stabmon_module_grad_norm"}
    assert len(modules) == 32  # max_modules
    assert expected <= modules


def test_daemon_serves_https_with_basic_auth_from_the_same_config_keys(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    from stabmon.config import load_config
    from stabmon.daemon.app import DaemonApp

    cert, key = certificate
    credentials = tmp_path / "credentials"
    credentials.write_text("prometheus:daemon-secret\n")
    config = load_config(
        {"run_dir": str(tmp_path), "daemon": {"port": 0, "address": "127.0.0.1"},
         "tls_certfile": str(cert), "tls_keyfile": str(key),
         "basic_auth_file": str(credentials)},
        env={},
    )  # fmt: skip
    daemon = DaemonApp(config)  # the real NVML reader: up on a GPU node, down here
    assert daemon.start()
    try:
        assert daemon.url is not None and daemon.url.startswith("https://127.0.0.1:")
        assert _https_get(daemon.url, cert)[0] == 401
        targets = daemon.url.replace("/metrics", "/targets")
        assert _https_get(targets, cert)[0] == 401  # every path, not only /metrics
        right = "Basic " + base64.b64encode(b"prometheus:daemon-secret").decode()
        status, body = _https_get(daemon.url, cert, right)
        assert status == 200 and "stabmon_daemon_nvml_up" in body
    finally:
        daemon.stop()


def test_the_default_bind_address_is_printed_with_its_trade_off() -> None:
    from stabmon.export.exporter import address_note

    assert "every interface" in address_note("0.0.0.0") and "anyone" in address_note("::")
    assert address_note("127.0.0.1") == ""
