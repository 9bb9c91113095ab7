"""Readback: CPU results come back at once, in order, tagged."""

from __future__ import annotations

import pytest
import torch
from cuda_state import sync_debug_errors
from fake_cuda import FakeEvent, fake_cuda

from stabmon.pipeline.readback import Readback, _Slot


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


def _in_flight(values: torch.Tensor, event: _Event) -> _Slot:
    """The slot of a copy started and marked by ``event``."""
    slot = _Slot(values.clone(), event)
    slot.fence = event
    return slot


def test_host_values_wait_their_turn_behind_a_device_copy_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    event = _Event()

    def copy_in_flight(self: Readback[str], tag: str, values: torch.Tensor, fence: bool) -> None:
        self._pending.append((tag, _in_flight(values, event), None))

    monkeypatch.setattr(Readback, "_copy", copy_in_flight)
    readback: Readback[str] = Readback()
    readback._copy("grads 5", torch.tensor([1.0]), True)  # a CUDA copy, started and not finished
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

    def copy_in_flight(self: Readback[int], tag: int, values: torch.Tensor, fence: bool) -> None:
        self._pending.append((tag, _in_flight(values, event), None))

    monkeypatch.setattr(Readback, "_copy", copy_in_flight)
    readback: Readback[int] = Readback(max_pending=8)
    readback._copy(0, torch.tensor([1.0]), True)
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


def test_a_copy_submitted_without_an_event_is_marked_done_by_the_next_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The observed loss records no event of its own: the next copy's event, recorded after it
    on the same stream, marks both (fake CUDA runtime: its events complete at catch_up())."""
    with fake_cuda(monkeypatch) as cuda:
        readback: Readback[str] = Readback()
        readback.submit("loss 4", torch.zeros((), device="cuda"), False)  # 0-d: no reshape
        readback.submit("grads 5", torch.zeros(3, device="cuda"))
        assert cuda.device.copies == 2 and cuda.device.recorded == 1
        assert readback.poll() == []  # the device has not got there
        cuda.device.catch_up()
        assert readback.poll() == [("loss 4", [1.0]), ("grads 5", [1.0, 1.0, 1.0])]
        cuda.assert_clean()


def test_a_copy_no_later_copy_marks_gets_its_own_event_at_the_next_collect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with fake_cuda(monkeypatch) as cuda:
        readback: Readback[str] = Readback()
        readback.submit("loss 4", torch.zeros((), device="cuda"), False)
        assert cuda.device.recorded == 0
        assert readback.collect() == 0 and cuda.device.recorded == 1  # marked, not waited for
        cuda.device.catch_up()
        assert readback.poll() == [("loss 4", [1.0])]
        cuda.assert_clean()


def test_copies_on_another_stream_are_not_marked_by_this_streams_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stream order holds within a stream only: a copy on a side stream is marked by an event
    on that stream, recorded when the copy on the main stream records its own."""
    with fake_cuda(monkeypatch) as cuda:
        side, main = object(), object()
        streams = iter([side, main])
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: next(streams))
        recorded_on: list[object] = []
        record = FakeEvent.record
        monkeypatch.setattr(FakeEvent, "record",
                            lambda self, stream=None: (recorded_on.append(stream),
                                                       record(self, stream))[1])  # fmt: skip
        readback: Readback[str] = Readback()
        readback.submit("loss 4", torch.zeros((), device="cuda"), False)
        readback.submit("grads 5", torch.zeros(2, device="cuda"))
        assert recorded_on == [main, side]
        cuda.device.catch_up()
        assert [tag for tag, _ in readback.poll()] == ["loss 4", "grads 5"]


def test_an_unmarked_copy_dropped_past_the_bound_is_never_marked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with fake_cuda(monkeypatch) as cuda:
        readback: Readback[int] = Readback(max_pending=2)
        readback.submit(1, torch.zeros((), device="cuda"), False)
        readback.submit(2, [2.0])
        readback.submit(3, [3.0])  # the bound: the oldest (the unmarked copy) is dropped
        assert readback.dropped == 1
        assert readback.collect() == 2 and cuda.device.recorded == 0  # nothing left to mark
        assert [tag for tag, _ in readback.poll()] == [2, 3]
        cuda.device.catch_up()
