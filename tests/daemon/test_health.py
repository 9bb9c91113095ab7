"""stabmon.daemon.health: ``/healthz`` answers without credentials and says nothing, served
here by a real Exporter with basic auth on, as the daemon serves it, and fetched over HTTP."""

from __future__ import annotations

import base64
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from stabmon.daemon import health
from stabmon.export.exporter import Exporter
from stabmon.export.security import Security
from stabmon.shared.log import LogLimiter


@pytest.fixture
def base_url(tmp_path: Path) -> Iterator[str]:
    auth = tmp_path / "auth"
    auth.write_text("prom:secret\n")
    registry = CollectorRegistry()
    Gauge(
        "stabmon_daemon_test", "A series only an authenticated scrape may read.", registry=registry
    ).set(1)
    exporter = Exporter(
        registry,
        address="127.0.0.1",
        ports=[0],
        limiter=LogLimiter(),
        security=Security(basic_auth_file=str(auth)),
        public_routes={health.PATH: health.healthz},
    )
    assert exporter.start()
    assert exporter.url is not None
    yield exporter.url.removesuffix("/metrics")
    exporter.stop()


def _get(url: str, authorization: str | None = None) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read(), response.headers["Content-Type"]
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers["Content-Type"]


def test_healthz_answers_ok_without_credentials_while_metrics_asks_for_them(base_url: str) -> None:
    status, body, content_type = _get(base_url + health.PATH)
    assert (status, body) == (200, b"ok\n")
    assert content_type.startswith("text/plain")
    assert _get(base_url + "/metrics")[0] == 401


def test_healthz_says_the_same_to_everyone_and_nothing_more(base_url: str) -> None:
    good = "Basic " + base64.b64encode(b"prom:secret").decode()
    anonymous = _get(base_url + health.PATH)
    authenticated = _get(base_url + health.PATH, good)
    assert anonymous == authenticated
    assert b"stabmon" not in anonymous[1]
    assert b"stabmon_daemon_test" in _get(base_url + "/metrics", good)[1]


def test_healthz_ignores_whatever_the_request_carries() -> None:
    assert health.healthz({}) == health.healthz({"QUERY_STRING": "verbose=1", "PATH_INFO": "/x"})
