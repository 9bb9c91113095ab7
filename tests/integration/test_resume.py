"""Train, checkpoint, SIGKILL, resume in a new process: stabmon continues as if never stopped.

Two real runs of ``resume_trainee.py`` (40 steps, epochs of 8, a loss spike
injected at step 24): one straight through, one killed at step 21, five steps
after its last checkpoint (step 16), and resumed from that checkpoint in a new
process. The resume point is chosen so that a reset spike detector would still
be warming up at step 24 and miss the spike, and the kill so that the killed
process never reaches it. (Marked slow: three Python processes.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import events

pytestmark = pytest.mark.slow

TRAINEE = Path(__file__).with_name("resume_trainee.py")
STEPS, EPOCH_STEPS, KILL_AT, SPIKE_AT = 40, 8, 21, 24
RESUMED_AT = KILL_AT // EPOCH_STEPS * EPOCH_STEPS  # the last checkpoint before the kill: 16
WARMUP = 10  # RESUMED_AT + WARMUP > SPIKE_AT: a reset detector could not flag the spike


Runs = dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]
# The autouse clean_environ fixture is per test; these processes start once per module.
_ISOLATED = ("CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
             "TORCHELASTIC_RUN_ID")  # fmt: skip


def _train(
    processes: list[subprocess.Popen[str]], tmp_path: Path, run_id: str, summary: str,
    *extra: str,
) -> tuple[int, dict[str, Any], str]:  # fmt: skip
    """Run the trainee to its end (or its kill); its exit code, summary and stderr."""
    args = [
        sys.executable, str(TRAINEE), "--run-dir", str(tmp_path / "runs"), "--run-id", run_id,
        "--checkpoint", str(tmp_path / f"{run_id}.pt"), "--summary", str(tmp_path / summary),
        "--steps", str(STEPS), "--epoch-steps", str(EPOCH_STEPS),
        "--spike-at-step", str(SPIKE_AT), "--spike-warmup-steps", str(WARMUP), *extra,
    ]  # fmt: skip
    environ = {
        name: setting
        for name, setting in os.environ.items()
        if not name.startswith("STABMON_") and name not in _ISOLATED
    }
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
        start_new_session=True,
    )  # fmt: skip
    processes.append(process)
    _, stderr = process.communicate(timeout=120)
    assert (tmp_path / summary).exists(), f"no summary (exit {process.returncode}): {stderr}"
    return process.returncode, json.loads((tmp_path / summary).read_text()), stderr


def _metric(summary_samples: list[dict[str, Any]], name: str, **labels: str) -> float | None:
    found = [
        s["value"]
        for s in summary_samples
        if s["name"] == name and labels.items() <= s["labels"].items()
    ]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else None


def _anomalies(records: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    return sorted((r["kind"], r["step"], r["epoch"]) for r in records if r["event"] == "anomaly")


def _epochs(records: list[dict[str, Any]]) -> list[tuple[int, int, float, float]]:
    """Epoch summaries without what differs between processes (times, memory)."""
    return [
        (r["epoch"], r["step"], r["grad_norm"], r["loss"]) for r in records if r["event"] == "epoch"
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """{"straight", "killed", "resumed"}: each process's summary, and each run's event log."""
    tmp_path = tmp_path_factory.mktemp("resume")
    processes: list[subprocess.Popen[str]] = []
    try:
        code, straight, stderr = _train(processes, tmp_path, "straight", "straight.json")
        assert code == 0, stderr
        code, killed, stderr = _train(
            processes, tmp_path, "interrupted", "killed.json", "--kill-at-step", str(KILL_AT)
        )
        assert code == -signal.SIGKILL, stderr
        code, resumed, stderr = _train(processes, tmp_path, "interrupted", "resumed.json")
        assert code == 0, stderr
        assert killed["event_log"] == resumed["event_log"]  # same run id and run dir: one log
        yield {
            "straight": (straight, events(Path(straight["event_log"]))),
            "killed": (killed, []),
            "resumed": (resumed, events(Path(resumed["event_log"]))),
        }
    finally:
        for process in processes:  # a failed run leaves no trainee behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def test_resumed_run_continues_numbering_and_spike_statistics_of_an_uninterrupted_run(
    runs: Runs,
) -> None:
    straight, killed, resumed = runs["straight"][0], runs["killed"][0], runs["resumed"][0]
    assert killed["killed"] and killed["steps"] == KILL_AT
    assert resumed["start_step"] == RESUMED_AT
    assert resumed["resumed_from"]["step"] == RESUMED_AT
    assert resumed["resumed_from"]["epoch"] == RESUMED_AT // EPOCH_STEPS
    for final in (straight["state"], resumed["state"]):
        assert final["step"] == STEPS
        assert final["epoch"] == STEPS // EPOCH_STEPS
        assert final["epochs_marked_by"] == "user"
    for detector in ("loss_spikes", "grad_spikes"):
        want, got = straight["state"][detector], resumed["state"][detector]
        assert got["count"] == want["count"] == STEPS  # not only the resumed process's values
        assert got["mean"] == pytest.approx(want["mean"], rel=1e-9)
        assert got["var"] == pytest.approx(want["var"], rel=1e-9)


def test_injected_spike_is_detected_once_at_the_same_step_with_or_without_a_resume(
    runs: Runs,
) -> None:
    straight_log, resumed_log = runs["straight"][1], runs["resumed"][1]
    spike_epoch = SPIKE_AT // EPOCH_STEPS
    expected = [("grad_spike", SPIKE_AT, spike_epoch), ("loss_spike", SPIKE_AT, spike_epoch)]
    assert _anomalies(straight_log) == expected
    assert _anomalies(resumed_log) == expected  # none right after the resume, none twice
    assert _epochs(resumed_log) == _epochs(straight_log)
    assert [e for e, *_ in _epochs(resumed_log)] == list(range(STEPS // EPOCH_STEPS))


def test_killed_and_resumed_processes_append_whole_records_to_one_event_log(
    runs: Runs,
) -> None:
    killed, (resumed, log) = runs["killed"][0], runs["resumed"]
    assert Path(resumed["event_log"]).read_bytes().endswith(b"\n")  # events() parsed every line
    attaches = [r for r in log if r["event"] == "attach"]
    assert [r["pid"] for r in attaches] == [killed["pid"], resumed["pid"]]
    # Both name the last step completed (docs/steps.md): RESUMED_AT steps were checkpointed.
    resumes = [(r["step"], r["epoch"]) for r in log if r["event"] == "resume"]
    assert resumes == [(RESUMED_AT - 1, RESUMED_AT // EPOCH_STEPS)]
    details = [(r["step"], r["epoch"]) for r in log if r["event"] == "detach"]
    assert details == [(STEPS - 1, STEPS // EPOCH_STEPS)]  # the killed process never detached
    assert {r["run"] for r in log} == {"interrupted"}


def test_memory_baseline_is_carried_across_the_resume_not_taken_again(
    runs: Runs,
) -> None:
    (straight, straight_log), (resumed, log) = runs["straight"], runs["resumed"]
    checkpointed = resumed["resumed_from"]["leaks"]
    assert set(checkpointed) == set(resumed["state"]["leaks"]) == set(straight["state"]["leaks"])
    assert "host" in checkpointed
    for device, leak in resumed["state"]["leaks"].items():
        baseline = checkpointed[device]["baseline"]
        assert baseline is not None  # taken before the kill, at the end of epoch 1
        assert leak["baseline"] == baseline
        want = straight["state"]["leaks"][device]
        assert leak["window_start_epoch"] == want["window_start_epoch"]
        for epoch_log in (straight_log, log):  # both took the baseline at epoch 1 (warm-up 1)
            by_epoch = {r["epoch"]: r for r in epoch_log if r["event"] == "epoch"}
            assert by_epoch[0]["drift"][device] is None
            assert by_epoch[1]["drift"][device] == 0.0
        resumed_epochs = [
            r for r in log if r["event"] == "epoch" and r["epoch"] >= RESUMED_AT // EPOCH_STEPS
        ]
        assert resumed_epochs
        for record in resumed_epochs:  # drift against the killed process's baseline
            drift = (record["memory"][device] - baseline) / baseline
            assert record["drift"][device] == pytest.approx(drift, rel=1e-9, abs=1e-12)


def test_counters_restart_in_the_new_process_while_epoch_and_last_step_continue(
    runs: Runs,
) -> None:
    straight, killed, resumed = runs["straight"][0], runs["killed"][0], runs["resumed"][0]
    epochs = STEPS // EPOCH_STEPS
    assert _metric(straight["metrics"], "stabmon_steps_total") == STEPS
    assert _metric(killed["metrics"], "stabmon_steps_total") == KILL_AT
    # README: counters count the current process, so a restart is a counter reset...
    assert _metric(resumed["metrics_at_start"], "stabmon_steps_total") == 0
    assert _metric(resumed["metrics"], "stabmon_steps_total") == STEPS - RESUMED_AT
    # ...which increase() sums across: every step executed, the five replayed ones twice.
    executed = KILL_AT + (STEPS - RESUMED_AT)
    assert executed == STEPS + (KILL_AT - RESUMED_AT)
    for kind in ("loss_spike", "grad_spike"):
        assert _metric(straight["metrics"], "stabmon_anomalies_total", kind=kind) == 1
        assert _metric(resumed["metrics"], "stabmon_anomalies_total", kind=kind) == 1
    # Gauges continue: the epoch from the checkpoint, the last step's time after the killed one's.
    assert _metric(killed["metrics"], "stabmon_epoch") == RESUMED_AT // EPOCH_STEPS
    assert _metric(resumed["metrics_at_start"], "stabmon_epoch") == RESUMED_AT // EPOCH_STEPS
    assert _metric(resumed["metrics"], "stabmon_epoch") == epochs
    assert _metric(straight["metrics"], "stabmon_epoch") == epochs
    last_killed = _metric(killed["metrics"], "stabmon_last_step_timestamp_seconds")
    last_resumed = _metric(resumed["metrics"], "stabmon_last_step_timestamp_seconds")
    assert last_killed is not None and last_resumed is not None
    assert last_resumed > last_killed
    assert last_resumed >= resumed["started_unix"]
