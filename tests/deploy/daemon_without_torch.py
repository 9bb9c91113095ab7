"""Run the node daemon as its container image does: with torch and numpy not importable.

    python tests/deploy/daemon_without_torch.py RUN_DIR

tests/deploy/test_image.py runs this in a fresh interpreter (the test process has torch loaded
already). The daemon image installs stabmon with --no-deps plus prometheus-client,
nvidia-ml-py, psutil and pyyaml, so any import of torch or numpy on the daemon's path would
crash it there; a meta-path finder that refuses both stands in for their absence. Prints one
JSON object with what it observed; the test asserts on it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import socket
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

BLOCKED = ("torch", "numpy")


class _Absent(importlib.abc.MetaPathFinder):
    """Makes ``import torch`` (and numpy) fail as it would where neither is installed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def _get(url: str, host: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return str(response.read().decode())


def main(run_dir: Path) -> dict[str, Any]:
    sys.meta_path.insert(0, _Absent())
    import psutil
    from prometheus_client.parser import text_string_to_metric_families

    from stabmon.cli import main as cli_main
    from stabmon.config import load_config
    from stabmon.daemon.app import DaemonApp
    from stabmon.shared.rundir import ProcessRecord, RunPaths, boot_id, write_atomic

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
        cli_main(["daemon", "--help"])

    # This process registers as rank 0 of run "image", as a training process would, with a
    # port it really listens on (the daemon advertises only verified ports).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    paths = RunPaths(run_dir, "image", 0)
    paths.run_directory.mkdir(parents=True)
    now = time.time()
    record = ProcessRecord(
        pid=os.getpid(), create_time=psutil.Process().create_time(), run="image", rank=0,
        hostname=socket.gethostname(), boot_id=boot_id(),
        metrics_url=f"http://127.0.0.1:{port}/metrics", attached_unix=now, last_step_unix=now,
        steps=1, updated_unix=now,
    )  # fmt: skip
    write_atomic(paths.record, record.to_json())

    config = load_config(
        {"run_dir": str(run_dir), "daemon": {"port": 0, "address": "127.0.0.1"}}, env={}
    )
    app = DaemonApp(config)
    started = app.start()
    try:
        assert app.url is not None
        metrics = _get(app.url)
        targets = json.loads(_get(app.url.replace("/metrics", "/targets"), host="node-7:9399"))
    finally:
        app.stop()
        listener.close()
    process_up = [
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "stabmon_process_up" and sample.labels.get("run") == "image"
    ]
    return {
        "help": help_text.getvalue(),
        "started": started,
        "process_up": process_up,
        "nvml_up_exported": "stabmon_daemon_nvml_up" in metrics,
        "targets": targets,
        "port": port,
        "loaded": sorted(name for name in sys.modules if name.partition(".")[0] in BLOCKED),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
