"""The judging engine on a fake clock: when waiting results are judged, and by whom.

Times are plain numbers handed to ``judge_quiet`` (the loop clock is injected), so no
test here sleeps or reads the wall clock.
"""

from __future__ import annotations

import gc
import threading

from stabmon.pipeline import judging
from stabmon.pipeline.judging import Judging
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter


class _Sink:
    """The consumer: records every batch it is handed."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, list[float]]]] = []

    def consume(self, results: list[tuple[str, list[float]]]) -> None:
        self.batches.append(results)

    def judged(self) -> list[str]:
        return [tag for batch in self.batches for tag, _ in batch]


def _engine(sink: _Sink, judge_seconds: float = 10.0) -> Judging[str]:
    return Judging(sink.consume, guard=Guard(LogLimiter()), judge_seconds=judge_seconds)


def test_judge_quiet_leaves_results_waiting_until_the_loop_is_quiet_for_judge_seconds() -> None:
    sink = _Sink()
    engine = _engine(sink, judge_seconds=10.0)
    engine.readback.submit("step-1", [1.0])
    assert not engine.due(100.0, waiting=0)  # nothing on the host: no judgement, no mark
    assert engine.due(100.0, waiting=1)  # the last judgement: a step end at 100
    engine.judge_quiet(now=109.0, last_beat=105.0, median_step=None)
    assert sink.judged() == []
    engine.judge_quiet(now=115.0, last_beat=105.0, median_step=None)
    assert sink.judged() == ["step-1"]
    assert engine.judged_at == 115.0


def test_judge_quiet_waits_twice_the_median_step_when_steps_are_long() -> None:
    sink = _Sink()
    engine = _engine(sink, judge_seconds=1.0)
    engine.readback.submit("step-1", [1.0])
    engine.judge_quiet(now=10.0, last_beat=0.0, median_step=6.0)  # 10 s < 2 x 6 s: running
    assert sink.judged() == []
    engine.judge_quiet(now=12.5, last_beat=0.0, median_step=6.0)
    assert sink.judged() == ["step-1"]


def test_judge_quiet_never_waits_for_a_lock_another_thread_holds() -> None:
    sink = _Sink()
    engine = _engine(sink, judge_seconds=0.0)
    engine.readback.submit("step-1", [1.0])
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with engine.lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        engine.judge_quiet(now=100.0, last_beat=0.0, median_step=None)
        assert sink.judged() == []  # a hook holds the lock: the loop is not quiet
    finally:
        release.set()
        holder.join()
    engine.judge_quiet(now=100.0, last_beat=0.0, median_step=None)
    assert sink.judged() == ["step-1"]


def test_judge_quiet_judges_nothing_after_close_or_exit() -> None:
    for flag in ("close", "exit"):
        sink = _Sink()
        engine = _engine(sink, judge_seconds=0.0)
        engine.readback.submit("step-1", [1.0])
        getattr(engine, flag)()
        engine.judge_quiet(now=100.0, last_beat=0.0, median_step=None)
        assert sink.judged() == [], flag


def test_judge_waiting_judges_everything_on_the_host_in_one_batch() -> None:
    sink = _Sink()
    engine = _engine(sink)
    for step in range(3):
        engine.readback.submit(f"step-{step}", [float(step)])
    engine.judge_waiting()
    assert sink.batches == [[("step-0", [0.0]), ("step-1", [1.0]), ("step-2", [2.0])]]


def test_judge_waiting_skips_when_reentered_from_inside_a_judgement() -> None:
    sink = _Sink()
    engine = _engine(sink)
    engine.readback.submit("step-1", [1.0])
    with engine.lock:  # a signal handler calling back in while the engine judges
        assert engine.reentered()
        engine.judge_waiting()
        assert sink.judged() == []
    assert not engine.reentered()
    engine.judge_waiting()
    assert sink.judged() == ["step-1"]


def test_judge_last_runs_finish_under_the_lock_after_judging() -> None:
    sink = _Sink()
    engine = _engine(sink)
    engine.readback.submit("step-1", [1.0])
    seen: list[tuple[list[str], bool]] = []
    engine.judge_last(0.0, lambda: seen.append((sink.judged(), engine.reentered())))
    assert seen == [(["step-1"], True)]


def test_engine_holds_its_consumer_weakly() -> None:
    sink = _Sink()
    engine = _engine(sink)
    engine.readback.submit("step-1", [1.0])
    del sink
    gc.collect()
    engine.judge_waiting()  # the consumer is gone: nothing to hand the results to, no error
    assert engine.readback.pending == 0


def test_forked_child_gets_a_fresh_lock() -> None:
    engine = _engine(_Sink())
    before = engine.lock
    judging._after_fork_in_child()
    assert engine.lock is not before
