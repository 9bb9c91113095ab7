"""stabmon.probes.loader: the loader that can hang for good, and dead workers reported once.

``loader_problem`` is checked on real DataLoaders (constructing one starts no
worker). ``WorkerWatch`` reads the private worker list of PyTorch's
multiprocessing iterator; here a small stand-in with the same three attributes
(``_workers``, ``_workers_status``, ``_shutdown``) drives it through exits a real
worker cannot be made to take on demand. tests/test_loader_health.py kills a
real worker through a Monitor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from stabmon.probes.loader import MAX_REPORTED, WorkerWatch, loader_problem


def _loader(**settings: Any) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2, **settings)


def test_loader_problem_names_workers_without_a_timeout() -> None:
    problem = loader_problem(_loader(num_workers=2))

    assert problem is not None
    assert problem.startswith("the DataLoader has num_workers=2 and timeout=0")
    assert "Set DataLoader(timeout=...)" in problem


@pytest.mark.parametrize(
    "loader",
    [_loader(), _loader(num_workers=2, timeout=120), [1, 2, 3], object()],
    ids=["in-process", "with-timeout", "a-list", "anything"],
)
def test_loader_problem_is_none_for_loaders_that_cannot_wait_forever(loader: object) -> None:
    assert loader_problem(loader) is None


@dataclass
class _Worker:
    pid: int
    exitcode: int | None = None


@dataclass
class _Iterator:
    _workers: list[_Worker]
    _workers_status: list[bool] = field(default_factory=list)
    _shutdown: bool = False


def _watch() -> tuple[WorkerWatch, list[dict[str, Any]]]:
    reports: list[dict[str, Any]] = []
    return WorkerWatch(reports.append), reports


def test_worker_watch_reports_a_killed_worker_once_with_its_signal() -> None:
    watch, reports = _watch()
    workers = [_Worker(100), _Worker(101)]
    iterator = _Iterator(workers, [True, True])
    watch.follow(iterator)
    watch.check()
    assert reports == []

    workers[1].exitcode = -9
    watch.check()
    watch.check()

    assert reports == [{"worker": 1, "pid": 101, "exitcode": -9, "signal": "SIGKILL"}]


def test_worker_watch_leaves_out_workers_told_to_stop() -> None:
    watch, reports = _watch()
    # Worker 0 finished its share of an IterableDataset (status False) and exited 0.
    iterator = _Iterator([_Worker(100, exitcode=0), _Worker(101, exitcode=1)], [False, True])
    watch.follow(iterator)

    watch.check()

    assert reports == [{"worker": 1, "pid": 101, "exitcode": 1, "signal": None}]


def test_worker_watch_checks_a_shut_down_iterator_only_after_the_loader_raised() -> None:
    watch, reports = _watch()
    iterator = _Iterator([_Worker(100, exitcode=-15)], [True], _shutdown=True)
    watch.follow(iterator)

    watch.check()
    assert reports == []
    watch.failed(RuntimeError("DataLoader worker (pid 100) exited unexpectedly"))

    assert reports == [{"worker": 0, "pid": 100, "exitcode": -15, "signal": "SIGTERM"}]


def test_worker_watch_follows_nothing_for_an_in_process_iterator_or_a_collected_one() -> None:
    watch, reports = _watch()
    watch.follow(iter([1, 2]))  # no workers
    watch.check()
    iterator = _Iterator([_Worker(100, exitcode=-9)], [True])
    watch.follow(iterator)
    del iterator  # held weakly: a finished pass is not kept alive by the watch
    watch.check()

    assert reports == []


def test_worker_watch_remembers_a_bounded_number_of_reported_workers() -> None:
    watch, reports = _watch()
    count = MAX_REPORTED + 10
    iterator = _Iterator([_Worker(1000 + i, exitcode=1) for i in range(count)], [True] * count)
    watch.follow(iterator)

    watch.check()

    assert len(reports) == count
    watch.check()  # beyond the bound, a worker may be reported again: memory stays flat
    assert len(reports) == count + 10
