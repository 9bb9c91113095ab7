"""Real gloo ranks on CPU (torchrun): the replica check names the corrupted rank, and is
quiet on clean runs, with a straggler, and where there are no replicas (FSDP).

The scenarios share two torchrun jobs (module-scoped fixtures: four ranks, two ranks), each
running its modes in turn with a model, Monitor and folder of its own; every scenario is still
a test of its own, and one whose mode never finished fails naming it (issue 43)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from process_groups import run_group

from stabmon.probes.replicas import find_replica_group

TRAINEE = Path(__file__).with_name("replica_trainee.py")
Records = dict[int, list[dict[str, Any]]]

#: The scenarios one launch of four ranks runs in turn (mode, optimizer steps): five Python
#: processes importing torch and a gloo rendezvous cost more than most modes' training, so
#: they are paid once (issue 43). Each mode has its own model, Monitor and folder
#: (replica_trainee.py); FSDP's meshes come last, after the plain DDP modes.
FOUR_RANKS = (
    ("flip", 70), ("skew", 70), ("fail", 70), ("frozen", 70), ("world", 70), ("local", 70),
    ("clean", 200), ("straggler", 200), ("hsdp", 70), ("fsdp", 30),
)  # fmt: skip
#: A job of two ranks: ``rank0`` last, where only rank 0 attaches.
TWO_RANKS = (("flip2", 70), ("rank0", 30))


class Launch:
    """One torchrun job that ran several modes: each test reads its own mode's records."""

    def __init__(self, run_dir: Path, modes: tuple[tuple[str, int], ...], ranks: int) -> None:
        self.run_dir, self.ranks = run_dir, ranks
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.result = run_group(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={ranks}", str(TRAINEE), str(run_dir),
             ",".join(f"{mode}:{steps}" for mode, steps in modes)],
            env=env, timeout=120 + 120 * len(modes),
        )  # fmt: skip

    def folder(self, mode: str, ranks: range | None = None) -> Path:
        """The mode's folder, once every rank in ``ranks`` finished the mode (its checks
        written), else a failure that names the mode and shows the job's output."""
        folder = self.run_dir / f"replicas-{mode}"
        done = [
            (folder / f"rank-{rank}.checks.json").exists() for rank in ranks or range(self.ranks)
        ]
        assert all(done), (
            f"mode {mode!r} did not finish on every rank (exit {self.result.returncode}):\n"
            + self.result.stderr[-3000:]
        )
        return folder

    def records(self, mode: str) -> Records:
        records: Records = {}
        for log in self.folder(mode).glob("rank-*.events.jsonl"):
            rank = int(log.name.split(".")[0].removeprefix("rank-"))
            records[rank] = [json.loads(line) for line in log.read_text().splitlines()]
        assert sorted(records) == list(range(self.ranks)), sorted(records)
        return records


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return Launch(tmp_path_factory.mktemp("four_ranks"), FOUR_RANKS, 4)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return Launch(tmp_path_factory.mktemp("two_ranks"), TWO_RANKS, 2)


@pytest.mark.slow
def test_each_shared_job_ends_cleanly_after_its_last_mode(
    four_ranks: Launch, two_ranks: Launch
) -> None:
    # What each scenario's own launch asserted before they shared one: every rank exits 0
    # (the process group torn down), here once per job.
    for launch in (four_ranks, two_ranks):
        assert launch.result.returncode == 0, launch.result.stderr[-3000:]


def mismatches(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r for r in records if r.get("event") == "anomaly" and r.get("kind") == "replica_mismatch"
    ]


def test_a_model_without_distributed_replicas_has_no_replica_group() -> None:
    assert isinstance(find_replica_group(torch.nn.Linear(2, 2)), str)


def test_a_model_seen_without_its_ddp_wrapper_is_told_what_to_set() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reason = find_replica_group(torch.nn.Linear(2, 2))
        found = find_replica_group(torch.nn.Linear(2, 2), "world")
    finally:
        dist.destroy_process_group()
    assert isinstance(reason, str) and "set replica_group: world" in reason
    assert not isinstance(found, str) and found.ranks == (0,)


@pytest.mark.slow
def test_one_flipped_bit_on_rank_2_is_named_at_the_next_check_on_every_rank(
    four_ranks: Launch,
) -> None:
    records = four_ranks.records("flip")

    for rank, logged in records.items():
        found = mismatches(logged)
        assert found, f"rank {rank} recorded no replica_mismatch"
        first = found[0]
        assert first["step"] == 59  # the first check after the flip at step 50 (every 10)
        assert first["culprit_ranks"] == [2]
        assert first["first_group"] == "blocks.1"
        assert "rank 2" in first["detail"] and "blocks.1" in first["detail"]
        assert "checkpoint" in first["detail"]  # and what to do
        assert first["culprits"][0]["where"] == f"{socket.gethostname()} cpu"  # its host


@pytest.mark.slow
def test_ranks_resumed_with_different_step_numbers_check_together_and_name_the_culprit(
    four_ranks: Launch,
) -> None:
    # Rank 0 restored a Monitor state of step 7, the others started at 0: the checks are
    # keyed to the optimizer steps this Monitor saw, the same count on every rank, so every
    # rank gathers at the same iteration (no collective paired with another, no hang) and
    # each reports the mismatch under its own step numbering.
    records = four_ranks.records("skew")

    for rank, logged in records.items():
        (first, *_) = mismatches(logged)
        assert first["culprit_ranks"] == [2]
        assert first["step"] == 59 + (7 if rank == 0 else 0)


@pytest.mark.slow
def test_a_rank_whose_fingerprint_fails_still_gathers_and_the_others_judge_without_it(
    four_ranks: Launch,
) -> None:
    # Rank 1's fingerprint raises from step 50 on (injected): it joins the gather with an
    # abstention instead of leaving the others waiting in it forever; ranks 0 and 3 outvote
    # the corrupted rank 2, and rank 1 is never named.
    records = four_ranks.records("fail")

    for rank in (0, 2, 3):
        (first, *_) = mismatches(records[rank])
        assert first["step"] == 59 and first["culprit_ranks"] == [2]
    assert not mismatches(records[1])


@pytest.mark.slow
def test_a_frozen_parameter_is_compared_and_one_ddp_ignores_is_not(four_ranks: Launch) -> None:
    # A corrupted frozen weight (a fine-tuned base model) makes its replica compute wrong
    # gradients from then on, while the trained parameters stay identical (all-reduced):
    # only comparing the frozen weight itself finds it. A parameter DDP is told to ignore
    # may differ across ranks by design: never a mismatch.
    records = four_ranks.records("frozen")

    for rank, logged in records.items():
        (first, *_) = mismatches(logged)
        assert first["step"] == 59, (rank, first["detail"])
        assert first["culprit_ranks"] == [2] and first["groups"] == ["stem"]


@pytest.mark.slow
def test_stabmon_attached_on_rank_0_alone_issues_no_collective_the_others_never_join(
    two_ranks: Launch,
) -> None:
    # A loop that monitors one rank: rank 0 must not gather with ranks that never will (a
    # hang at the first check, or its gather paired with DDP's all-reduce); it says why.
    assert two_ranks.result.returncode == 0, two_ranks.result.stderr[-3000:]  # rank 1 too
    log = two_ranks.folder("rank0", range(1)) / "rank-0.events.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    (off,) = [record for record in records if record.get("event") == "replica_check"]
    assert off["state"] == "off" and "1 of the 2" in off["reason"]
    assert not mismatches(records)


@pytest.mark.slow
def test_two_replicas_that_differ_report_a_mismatch_without_a_culprit(
    two_ranks: Launch,
) -> None:
    records = two_ranks.records("flip2")

    for logged in records.values():
        (first, *_) = mismatches(logged)
        assert first["culprit_ranks"] == []
        assert "no majority" in first["detail"]


@pytest.mark.slow
def test_clean_ddp_with_bf16_accumulation_and_a_straggler_raises_no_mismatch(
    four_ranks: Launch,
) -> None:
    clean = four_ranks.records("clean")
    straggler = four_ranks.records("straggler")

    for records in (clean, straggler):
        for logged in records.values():
            assert not mismatches(logged)
            assert not outliers(logged)  # clean also takes the local norms: none stands out
    # ... and not because no check was made (one that failed would be contained, silently):
    # every rank judged every check, one every CHECK_EVERY (10) steps.
    for folder, steps in (("clean", 200), ("straggler", 200)):
        for rank in range(4):
            done = json.loads((four_ranks.folder(folder) / f"rank-{rank}.checks.json").read_text())
            assert done == [steps // 10], (folder, rank, done)


@pytest.mark.slow
def test_hsdp_compares_each_shard_across_the_replicate_dimension(four_ranks: Launch) -> None:
    # A 2x2 mesh (replicate x shard): rank 2's shard of blocks.1 is corrupted; its replica
    # is rank 0's. Two replicas: a mismatch without a culprit, seen by that pair only.
    records = four_ranks.records("hsdp")

    for rank in (0, 2):
        (first, *_) = mismatches(records[rank])
        assert first["step"] == 59 and first["first_group"] == "blocks.1"
        assert first["culprit_ranks"] == [] and "HSDP" in first["detail"]
    for rank in (1, 3):
        assert not mismatches(records[rank])


@pytest.mark.slow
def test_fsdp_alone_has_no_replicas_says_so_once_and_issues_nothing(
    four_ranks: Launch,
) -> None:
    records = four_ranks.records("fsdp")

    for logged in records.values():
        (off,) = [record for record in logged if record.get("event") == "replica_check"]
        assert off["state"] == "off" and "FSDP" in off["reason"]
        assert not mismatches(logged)


@pytest.mark.gpu
def test_a_check_on_cuda_issues_its_collective_and_vote_without_a_host_sync(
    tmp_path: Path,
) -> None:
    # One NCCL rank is a replica group of one: enough to run the real collective and vote
    # on the device under sync-debug "error". The first check also gathers each member's
    # host and GPU (a one-off object gather, outside the mode).
    import torch.distributed as dist
    from cuda_state import sync_debug_errors

    from stabmon.probes.local_norms import LocalGradNorms
    from stabmon.probes.replicas import ReplicaGroup, ReplicaProbe

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
        group = dist.group.WORLD
        named = tuple(model.named_parameters())
        local = LocalGradNorms(group, torch.device("cuda"))  # the local norms' path too
        probe = ReplicaProbe(ReplicaGroup(group, (0,), named, "test"), 1, 0, 32,
                             local_norms=local)  # fmt: skip
        probe.measure(0)  # the first check: the object gather
        torch.cuda.synchronize()
        with sync_debug_errors():
            local.add(torch.full((16,), 2.0, device="cuda"))  # a bucket, as the hook sees it
            values = probe.measure(1)
        assert values is not None
        buckets = len(probe.group_names)
        flat = values.cpu().tolist()
        assert flat[:buckets] == [0.0] * buckets and flat[-2] == 0.0  # no mismatch, no culprit
        assert flat[-1] == 8.0  # the local norm of the interval: |(2,) * 16|
        assert probe.where and "GPU-" in probe.where[0]
    finally:
        dist.destroy_process_group()


def test_the_first_check_gathers_hosts_on_the_parameters_device_not_as_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # all_gather_object puts its tensors on torch.cuda.current_device(): GPU 0 on every
    # rank of a node whose loop placed its model with device_ids and never called
    # set_device, an NCCL error that can tear the process group down. The host and GPU
    # go in a tensor on the parameters' device instead, through the same all_gather.
    import torch.distributed as dist

    from stabmon.probes.replicas import ReplicaGroup, ReplicaProbe

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("all_gather_object uses the current CUDA device")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "all_gather_object", refused)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        named = tuple(model.named_parameters())
        probe = ReplicaProbe(ReplicaGroup(dist.group.WORLD, (0,), named, "test"), 1, 0, 32)
        values = probe.measure(0)
        assert values is not None and probe.where == [f"{socket.gethostname()} cpu"]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_replica_group_world_compares_a_model_attached_inside_its_ddp_wrapper(
    four_ranks: Launch,
) -> None:
    # The adapters attach to the module DDP wraps: stabmon cannot see the wrapper, and the
    # user says every rank is a replica (replica_group: world).
    records = four_ranks.records("world")

    for logged in records.values():
        (first, *_) = mismatches(logged)
        assert first["culprit_ranks"] == [2] and first["first_group"] == "blocks.1"
        assert "replica_group: world" in first["detail"]


def outliers(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r
        for r in records
        if r.get("event") == "anomaly" and r.get("kind") == "replica_grad_outlier"
    ]


@pytest.mark.slow
def test_a_gradient_corrupted_before_the_all_reduce_names_its_rank_by_local_norm(
    four_ranks: Launch,
) -> None:
    # Rank 2's backward multiplies a gradient by 10^6 at step 50: every replica applies the
    # same corrupted average, so the parameters stay identical (no mismatch), but rank 2's
    # own gradient before the reduction stood out: named at the next check, on every rank.
    records = four_ranks.records("local")

    for rank, logged in records.items():
        assert not mismatches(logged)
        (first,) = outliers(logged)
        assert first["step"] == 59 and first["culprit_ranks"] == [2], (rank, first)
        assert "rank 2" in first["detail"] and "before the all-reduce" in first["detail"]


def test_a_model_partly_offloaded_to_the_cpu_checks_on_its_accelerator() -> None:
    # NCCL gathers accelerator tensors only; a first parameter on the CPU (an offloaded
    # embedding) must not make the check gather there. ("meta" stands in for a GPU here.)
    from stabmon.probes.replicas import home_device

    on_cpu, elsewhere = torch.zeros(2), torch.empty(2, device="meta")
    assert home_device([("embed", on_cpu), ("blocks.0", elsewhere)]).type == "meta"
    assert home_device([("embed", on_cpu)]).type == "cpu"
