"""stabmon.export.http_server: the exporter's server, loaded only when one starts, serving a
WSGI app over a real socket with a deadline on each request."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from stabmon.export.http_server import bind


def _hello(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
    start("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


def test_importing_the_monitor_loads_no_http_server_until_an_exporter_starts() -> None:
    code = (
        "import sys, stabmon.monitor; print('stabmon.export.http_server' in sys.modules)\n"
        "from stabmon.export.exporter import Exporter\n"
        "from stabmon.shared.log import LogLimiter\n"
        "from prometheus_client import CollectorRegistry\n"
        "e = Exporter(CollectorRegistry(), address='127.0.0.1', ports=[0], limiter=LogLimiter())\n"
        "e.start()\n"
        "print('stabmon.export.http_server' in sys.modules); e.stop()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_bind_serves_the_app_and_drops_a_client_that_sends_nothing_past_its_deadline() -> None:
    server = bind("127.0.0.1", 0, _hello)
    server.limit(max_connections=2, request_seconds=0.2, min_request_seconds=0.0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
            assert response.read() == b"hello"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as idle:
            # Sends nothing: the server shuts the connection once its deadline passes.
            assert idle.recv(1) == b""
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_dataloader_worker_forked_while_serving_does_not_keep_the_port(tmp_path: Any) -> None:
    # A DataLoader worker is forked from the training process while the exporter listens:
    # it must not hold the listening socket, or the port stays taken after the exporter
    # closed (a restarted rank could not bind it again) for as long as the worker lives.
    import torch
    from torch.utils.data import DataLoader

    import stabmon

    model = torch.nn.Linear(2, 2)
    monitor = stabmon.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), port=0,
                             address="127.0.0.1", run_dir=str(tmp_path))  # fmt: skip
    url = monitor.metrics_url
    assert url is not None
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True,
                        multiprocessing_context="fork")  # fmt: skip
    batches = iter(loader)
    next(batches)  # the worker is forked and running
    monitor.detach()  # the exporter closes its socket; the worker lives on
    try:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))  # EADDRINUSE while a worker holds the listener
            probe.listen()
    finally:
        del batches
