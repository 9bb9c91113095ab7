"""Readback: CPU results come back at once, in order, tagged."""

from __future__ import annotations

import pytest
import torch
from cuda_state import sync_debug_errors

from stabmon.pipeline.readback import Readback, _Pending, _Slot


def test_readback_returns_cpu_results_in_submission_order() -> None:
    readback: Readback[str] = Readback()
    readback.submit("a", torch.tensor([1.0, 2.0]))
    readback.submit("b", torch.tensor([3.0]))
    assert readback.pending == 2
    assert readback.poll() == [("a", [1.0, 2.0]), ("b", [3.0])]
    assert readback.poll() == []
    assert readback.pending == 0


def test_readback_hands_a_nan_back_as_a_nan() -> None:
    readback: Readback[int] = Readback()
    readback.submit(1, torch.tensor([float("nan")]))
    assert readback.in_flight == 0  # a CPU tensor is on the host already
    ((tag, values),) = readback.poll()
    assert tag == 1 and values[0] != values[0]


class _Event:
    """A CUDA event stand-in whose completion the test decides."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_host_values_wait_their_turn_behind_a_device_copy_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    event = _Event()

    def copy_in_flight(self: Readback[str], tag: str, values: torch.Tensor) -> None:
        self._pending.append(_Pending(tag, _Slot(values.clone(), event)))  # type: ignore[arg-type]

    monkeypatch.setattr(Readback, "_copy", copy_in_flight)
    readback: Readback[str] = Readback()
    readback._copy("grads 5", torch.tensor([1.0]))  # a CUDA copy, started and not finished
    # Host values wait behind the copy; submit counts everything waiting, in flight or ready.
    assert readback.submit("loss 5", [2.0]) == 2
    assert readback.submit("loss 6", torch.tensor([3.0])) == 3  # a CPU tensor likewise
    assert readback.collect() == 0 and readback.poll() == []

    event.done = True

    assert readback.collect() == 3
    assert readback.poll() == [("grads 5", [1.0]), ("loss 5", [2.0]), ("loss 6", [3.0])]
    assert readback.pending == 0


def test_host_values_behind_a_copy_that_never_finishes_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung device must not make the queue grow with every loss observed behind it."""
    event = _Event()  # never done

    def copy_in_flight(self: Readback[int], tag: int, values: torch.Tensor) -> None:
        self._queue(_Pending(tag, _Slot(values.clone(), event)))  # type: ignore[arg-type]

    monkeypatch.setattr(Readback, "_copy", copy_in_flight)
    readback: Readback[int] = Readback(max_pending=8)
    readback._copy(0, torch.tensor([1.0]))
    for step in range(1, 1000):
        assert readback.submit(step, [float(step)]) <= 8
    assert readback.pending == 8 and readback.dropped == 1000 - 8
    event.done = True  # the newest results are the ones kept, in order
    assert [tag for tag, _ in readback.poll()] == list(range(1000 - 8, 1000))


@pytest.mark.gpu
def test_readback_of_cuda_tensors_never_synchronises() -> None:
    readback: Readback[int] = Readback()
    results: list[tuple[int, list[float]]] = []
    torch.cuda.synchronize()
    with sync_debug_errors():
        for step in range(50):
            values = torch.randn(1000, device="cuda").norm().reshape(1)
            readback.submit(step, values)
            results += readback.poll()  # a fast device hands most back here already
    torch.cuda.synchronize()
    results += readback.poll()
    # Every result, in step order, however many came back inside the loop.
    assert readback.pending == 0 and readback.dropped == 0
    assert [tag for tag, _ in results] == list(range(50))
