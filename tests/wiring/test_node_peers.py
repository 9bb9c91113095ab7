"""A rank's view of the other ranks of its run on its node: who holds a phase, whose evidence."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stabmon.detectors.stall import PeerPhase
from stabmon.shared.rundir import ProcessRecord, write_atomic
from stabmon.wiring.node_peers import NodePeers, peer_phase, phase_holder


def _record(rank: int, **fields: object) -> ProcessRecord:
    base: dict[str, object] = {"pid": 1000 + rank, "create_time": 0.0, "run": "job",
                               "rank": rank, "attached_unix": 1000.0}  # fmt: skip
    base.update(fields)
    return ProcessRecord(**base)  # type: ignore[arg-type]


CHECKPOINTING = {"phase": "checkpoint", "stall_limit_seconds": 100.0, "last_step_unix": 1000.0}


def test_phase_holder_is_a_peer_in_a_named_phase_within_its_limit() -> None:
    records = [_record(0, **CHECKPOINTING), _record(1, phase="optimizer", stall_limit_seconds=3.0)]
    holder = phase_holder(records, rank=1, now_unix=1050.0)
    assert holder is not None and holder.rank == 0


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({**CHECKPOINTING, "hang_state": "compute"}, "stalled in its phase"),
        ({**CHECKPOINTING, "exited_unix": 1040.0}, "exited"),
        ({**CHECKPOINTING, "last_step_unix": 900.0}, "past the phase's limit"),
        ({**CHECKPOINTING, "phase": "backward"}, "a step-loop phase"),
        ({**CHECKPOINTING, "stall_limit_seconds": None}, "no limit written"),
    ],
)
def test_phase_holder_is_none_when_the_peer_is_not_a_working_phase(
    fields: dict[str, object], why: str
) -> None:
    assert phase_holder([_record(0, **fields)], rank=1, now_unix=1050.0) is None, why


def test_phase_holder_is_never_the_rank_itself() -> None:
    assert phase_holder([_record(1, **CHECKPOINTING)], rank=1, now_unix=1050.0) is None


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (CHECKPOINTING, PeerPhase.HOLDING),
        ({**CHECKPOINTING, "hang_state": "compute"}, PeerPhase.STALLED),
        ({**CHECKPOINTING, "last_step_unix": 900.0}, PeerPhase.STALLED),
        ({"phase": "backward", "hang_state": "data"}, PeerPhase.STALLED),
        ({**CHECKPOINTING, "phase": "data_wait"}, PeerPhase.NONE),  # left its phase
        ({**CHECKPOINTING, "exited_unix": 1040.0}, PeerPhase.NONE),
        ({"phase": None}, PeerPhase.NONE),  # registered, no heartbeat written yet
    ],
)
def test_peer_phase_tells_a_holder_from_a_stalled_peer_from_none(
    fields: dict[str, object], expected: PeerPhase
) -> None:
    records = [_record(0, **fields), _record(1, phase="optimizer", hang_state="collective")]
    assert peer_phase(records, rank=1, now_unix=1050.0) is expected  # its own state is not read


def test_node_peers_reads_its_run_and_caches_for_a_second(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    write_atomic(run_dir / "rank-0.json", _record(0, **CHECKPOINTING).to_json())
    now = [0.0]
    peers = NodePeers(run_dir, run="job", rank=1, clock=lambda: now[0], wall_clock=lambda: 1050.0)
    assert peers.peer_phase() is PeerPhase.HOLDING
    (run_dir / "rank-0.json").unlink()
    assert peers.peer_phase() is PeerPhase.HOLDING  # cached
    now[0] = 1.5
    assert peers.peer_phase() is not PeerPhase.HOLDING


def test_node_peers_ignores_another_runs_record_in_the_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    other = _record(0, **{**CHECKPOINTING, "run": "someone-else"})
    write_atomic(run_dir / "rank-0.json", other.to_json())
    peers = NodePeers(run_dir, run="job", rank=1, wall_clock=lambda: 1050.0)
    assert peers.peer_phase() is not PeerPhase.HOLDING and peers.evidence() == []


def test_node_peers_does_not_enter_a_symlinked_run_directory(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir()
    write_atomic(real / "rank-0.json", _record(0, **CHECKPOINTING).to_json())
    (tmp_path / "job").symlink_to(real)
    peers = NodePeers(tmp_path / "job", run="job", rank=1, wall_clock=lambda: 1050.0)
    assert peers.peer_phase() is not PeerPhase.HOLDING


def test_node_peers_does_not_follow_a_symlinked_record(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    write_atomic(tmp_path / "planted.json", _record(0, **CHECKPOINTING).to_json())
    (run_dir / "rank-0.json").symlink_to(tmp_path / "planted.json")
    peers = NodePeers(run_dir, run="job", rank=1, wall_clock=lambda: 1050.0)
    assert peers.peer_phase() is not PeerPhase.HOLDING


def test_node_peers_ignores_records_of_another_uid(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    write_atomic(run_dir / "rank-0.json", _record(0, **CHECKPOINTING).to_json())
    peers = NodePeers(run_dir, run="job", rank=1, wall_clock=lambda: 1050.0,
                      uid=os.geteuid() + 1)  # fmt: skip
    assert peers.peer_phase() is not PeerPhase.HOLDING


def test_flight_sequence_numbers_survive_the_record_and_reach_the_evidence(tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    record = _record(0, hang_state="collective", flight=(812, -1, 811))
    write_atomic(run_dir / "rank-0.json", record.to_json())
    (evidence,) = NodePeers(run_dir, run="job", rank=1).evidence()
    assert evidence.flight == (812, -1, 811)


@pytest.mark.parametrize("flight", [[1, 2], [1, 2, "3"], [1, -2, 3], [True, 1, 1], "812"])
def test_a_record_with_malformed_flight_numbers_is_not_a_record(flight: object) -> None:
    data = json.loads(_record(0).to_json())
    data["flight"] = flight
    with pytest.raises(ValueError, match="flight"):
        ProcessRecord.from_mapping(data)
