"""Shared fixtures: environment isolation, tiny models, monitors that clean up, real scrapes."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# One intra-op thread for torch here and in every process a test starts (they inherit the
# environment), unless the caller chose a number. The tests' models are tiny, so more
# threads add nothing but OpenMP's spin-waiting, which on a busy machine burns the cores the
# other workers and processes need (`stabmon demo --fast`: 4 s of CPU with one thread, 24 s
# with two while the machine was busy). Read by torch when it is first imported, below.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 (after OMP_NUM_THREADS)
from process_groups import describe, kill_group, mark_owner, stray_processes  # noqa: E402

import stabmon

_ISOLATED_VARIABLES = ("CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "WORLD_SIZE", "TORCHELASTIC_RUN_ID")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    # Every process a test starts carries this process's pid in its environment, so the
    # session's end finds what is left, orphans too (a daemon whose parent was killed at a
    # timeout, say). An xdist worker marks its own.
    mark_owner()


@pytest.fixture(scope="session", autouse=True)
def no_stray_processes() -> Iterator[None]:
    """Fails the session (as an error at its last teardown) when a process a test started,
    or a process that one started, is still running at the end; each is killed first."""
    yield
    strays = stray_processes()
    for process in strays:
        with contextlib.suppress(OSError):
            kill_group(os.getpgid(process.pid))
        with contextlib.suppress(Exception):
            process.kill()
    if strays:
        listed = "\n".join(describe(process) for process in strays)
        raise AssertionError(f"{len(strays)} process(es) outlived the tests, killed now:\n{listed}")


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's STABMON_* or launcher variables."""
    for name in list(os.environ):
        if name.startswith("STABMON_") or name in _ISOLATED_VARIABLES:
            monkeypatch.delenv(name)


@pytest.hookimpl(tryfirst=True)  # the order first, then the GPU marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "loadgroup", False):  # set on xdist's workers under loadgroup
        _schedule(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="Requires: CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _schedule(items: list[pytest.Item]) -> None:
    """The slow tests first, on each xdist worker (see ``pytest_xdist_make_scheduler``).

    They are real processes that mostly wait, so the long ones overlap each other and the
    quick tests fill in behind them, instead of one long test starting last. The order
    within the slow and within the quick tests is kept.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@functools.cache
def _shares_a_module_fixture(module: str) -> bool:
    path = Path(__file__).parent.parent / module
    return path.suffix == ".py" and 'scope="module"' in path.read_text(encoding="utf-8")


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (pyproject.toml's addopts), with each test its own unit.

    Each test goes to whichever worker is free, except that the tests of a module with a
    module-scoped fixture (a Prometheus stack, a training run) are one unit, so the fixture
    is built once rather than once per worker. (xdist's own ``xdist_group`` does not group
    on pytest 9: it renames ``item._nodeid``, which pytest 9 no longer reads.)
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Scheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if "@" not in nodeid and _shares_a_module_fixture(module):
                return module
            return str(super()._split_scope(nodeid))

    return Scheduling(config, log)


MonitorFactory = Callable[..., stabmon.Monitor]


@pytest.fixture
def attach(tmp_path: Path) -> Iterator[MonitorFactory]:
    """``attach(model, optimizer, **overrides)`` on port 0 in a tmp run dir, detached after."""
    monitors: list[stabmon.Monitor] = []

    def factory(
        model: torch.nn.Module, optimizer: torch.optim.Optimizer, **overrides: Any
    ) -> stabmon.Monitor:
        # No scrape cache: tests scrape right after a step and expect to see it.
        settings: dict[str, Any] = {"port": 0, "address": "127.0.0.1", "run_dir": str(tmp_path),
                                    "run_id": "test-run", "scrape_cache_seconds": 0}  # fmt: skip
        settings.update(overrides)
        monitor = stabmon.attach(model, optimizer, **settings)
        monitors.append(monitor)
        return monitor

    yield factory
    for monitor in monitors:
        monitor.detach()


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made here with the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("Requires: the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test started (see ``helpers.start_announcing``); each group killed after."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGCONT)
            os.killpg(process.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the leader is gone; its workers too
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()
