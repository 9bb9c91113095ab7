"""stabmon.daemon.hang: the node's hang verdict over process samples, judged per run and per
user, and the collector that exports it. (Named after its package: tests/detectors/
test_hang.py holds the basename. The daemon end to end, over real ranks, is in
tests/daemon/test_node_hang.py.) Samples are built from real rundir records."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from stabmon.contract import NODE_HANG_VERDICT
from stabmon.daemon.hang import MAX_RUNS, NodeHangCollector, NodeHangJudge
from stabmon.daemon.processes import ProcessSample
from stabmon.shared.log import LogLimiter
from stabmon.shared.rundir import ProcessRecord

ALICE, MALLORY = 1000, 1001


def _sample(
    rank: int, state: str | None, *, run: str = "job", uid: int | None = ALICE, alive: bool = True
) -> ProcessSample:
    record = ProcessRecord(
        pid=100 + rank,
        create_time=0.0,
        run=run,
        rank=rank,
        hang_state=state,
        phase="forward",
        collectives=10,
    )
    return ProcessSample(
        record=record,
        alive=alive,
        reused=False,
        main_cpu_seconds=None,
        workers_cpu_seconds=None,
        main_memory_bytes=None,
        workers_memory_bytes=None,
        heartbeat_age_seconds=None,
        uid=uid,
    )


def _stuck(run: str = "job", uid: int = ALICE) -> list[ProcessSample]:
    """Four ranks stalled: three wait in a collective, rank 2 waits for data."""
    return [_sample(r, "data_wait" if r == 2 else "collective", run=run, uid=uid) for r in range(4)]


@pytest.fixture
def judge() -> NodeHangJudge:
    return NodeHangJudge(limiter=LogLimiter())


def _exported(judge: NodeHangJudge) -> dict[tuple[str, str, str], float]:
    registry = CollectorRegistry()
    registry.register(NodeHangCollector(judge))
    names = NODE_HANG_VERDICT.labels
    return {
        tuple(sample.labels[n] for n in names): sample.value  # type: ignore[misc]
        for metric in registry.collect()
        for sample in metric.samples
    }


def test_the_node_names_the_rank_that_holds_a_run_up(judge: NodeHangJudge) -> None:
    verdicts = judge.update(_stuck())
    (verdict,) = verdicts.values()
    assert verdict.culprits == (2,)
    assert verdict.reason == "data_starvation"
    assert list(verdicts) == [("job", ALICE)]
    assert _exported(judge) == {("2", "job", "data_starvation"): 1.0}


def test_no_verdict_while_some_rank_is_still_training(judge: NodeHangJudge) -> None:
    samples = _stuck()
    samples[0] = _sample(0, None)
    assert judge.update(samples) == {}
    assert _exported(judge) == {}


def test_a_dead_rank_is_not_stalled_evidence(judge: NodeHangJudge) -> None:
    samples = _stuck()
    samples[2] = _sample(2, "data_wait", alive=False)
    assert judge.update(samples) == {}


def test_samples_whose_user_is_unknown_are_not_believed(judge: NodeHangJudge) -> None:
    samples = [_sample(r, "data_wait" if r == 2 else "collective", uid=None) for r in range(4)]
    assert judge.update(samples) == {}


def test_another_users_ranks_under_the_same_run_id_get_no_verdict_and_a_warning(
    judge: NodeHangJudge, caplog: pytest.LogCaptureFixture
) -> None:
    samples = _stuck(uid=ALICE) + [_sample(9, "data_wait", uid=MALLORY)]
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        assert judge.update(samples) == {}
        judge.update(samples)
    assert caplog.text.count("registered by 2 local users") == 1
    assert _exported(judge) == {}


def test_each_run_is_judged_on_its_own(judge: NodeHangJudge) -> None:
    other = [_sample(r, "io" if r == 0 else "collective", run="other") for r in range(3)]
    verdicts = judge.update(_stuck() + other)
    assert {run: v.culprits for (run, _), v in verdicts.items()} == {"job": (2,), "other": (0,)}


def test_a_verdict_is_logged_once_while_it_holds_and_goes_when_the_run_recovers(
    judge: NodeHangJudge, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="stabmon"):
        judge.update(_stuck())
        judge.update(_stuck())
    assert caplog.text.count("hang verdict for run job") == 1
    judge.update([_sample(r, None) for r in range(4)])
    assert judge.verdicts() == {}
    assert _exported(judge) == {}


def test_runs_beyond_the_fence_are_not_judged(judge: NodeHangJudge) -> None:
    samples = [s for index in range(MAX_RUNS + 2) for s in _stuck(run=f"run{index:04d}")]
    assert len(judge.update(samples)) == MAX_RUNS
