"""stabmon.probes.environment: who this process is (rank, run id) and what it runs on.

The run-id agreement runs against a real c10d ``HashStore`` (the store every rank of a
process group shares), with two "ranks" calling in turn. Identifying GPUs needs NVML,
which cannot exist here: the one test of a failing driver stands ``identify_gpus`` in.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from typing import Any

import pytest
import torch

from stabmon.probes import environment
from stabmon.probes.environment import (
    agree_run_id,
    build_info,
    default_run_id,
    describe_environment,
    environment_record,
    format_environment,
    process_identity,
)
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter


def _hash_store() -> Any:
    """torch's in-process c10d store (the one torch.distributed exports untyped)."""
    from torch._C._distributed_c10d import HashStore

    return HashStore()


JOB = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "8"}


def test_process_identity_reads_torchruns_variables() -> None:
    identity = process_identity({"RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (identity.rank, identity.local_rank, identity.local_world_size) == (5, 1, 4)


def test_process_identity_falls_back_on_missing_or_bad_values() -> None:
    identity = process_identity({"RANK": "five", "LOCAL_WORLD_SIZE": "0"})
    assert (identity.rank, identity.local_rank, identity.local_world_size) == (0, 0, 1)


def test_default_run_id_is_torchelastics_rendezvous_id_when_there_is_one() -> None:
    assert default_run_id({"TORCHELASTIC_RUN_ID": "rdzv-42", **JOB}) == "rdzv-42"


def test_default_run_id_is_the_same_for_every_rank_of_a_static_rendezvous() -> None:
    ranks = [
        default_run_id({"TORCHELASTIC_RUN_ID": "none", "RANK": str(r), **JOB}) for r in range(3)
    ]
    assert len(set(ranks)) == 1
    assert ranks[0].startswith("job-")
    other_job = default_run_id({**JOB, "MASTER_PORT": "29501"})
    assert other_job != ranks[0]


def test_default_run_id_of_a_single_process_names_host_and_pid_and_stays_put() -> None:
    run_id = default_run_id({})
    assert run_id.startswith(socket.gethostname() + "-")
    assert run_id.endswith(f"-{os.getpid()}")
    assert default_run_id({}) == run_id


def test_agree_run_id_gives_every_rank_rank_zeros_proposal() -> None:
    store = _hash_store()
    first = agree_run_id(store, rank=0, job="10.0.0.1:29500:2")
    second = agree_run_id(store, rank=1, job="10.0.0.1:29500:2", wait_seconds=0)
    assert first == second
    assert first.startswith("job-")


def test_agree_run_id_keeps_the_first_proposal_when_rank_zero_attaches_late() -> None:
    store = _hash_store()
    early = agree_run_id(store, rank=1, job="10.0.0.1:29500:2", wait_seconds=0)
    late = agree_run_id(store, rank=0, job="10.0.0.1:29500:2")
    assert late == early  # rank 0 joins the others' run rather than splitting the label


def test_build_info_names_the_versions_in_use() -> None:
    info = build_info("9.9.9")
    assert info["stabmon_version"] == "9.9.9"
    assert info["torch_version"] == torch.__version__
    assert info["cuda_version"] == (torch.version.cuda or "")
    assert set(info) == {
        "stabmon_version",
        "torch_version",
        "cuda_version",
        "cudnn_version",
        "nccl_version",
        "python_version",
    }


def test_environment_record_keeps_only_relevant_variables_redacted() -> None:
    record = environment_record(
        {"torch_version": "2"},
        [],
        "",
        {
            "NCCL_DEBUG": "INFO",
            "HOME": "/root",
            "WANDB_API_KEY": "x",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "NCCL_SOCKET_PASSWORD": "p",
        },
    )
    assert record["variables"] == {
        "NCCL_DEBUG": "INFO",
        "NCCL_SOCKET_PASSWORD": "<redacted>",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    assert record["cuda_visible_devices"] is None
    assert record["torch_threads"] == torch.get_num_threads()


def test_the_environment_record_names_the_platform_without_starting_a_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # platform.platform() runs `uname -p` for the processor: a subprocess in the main thread
    # of a training process at attach, after which a SIGTERM sent at once could reach another
    # thread and wait (tests/shared/test_exit_signals.py). A fresh uname cache, so a test
    # before this one cannot have run it already.
    monkeypatch.setattr(platform, "_uname_cache", None)
    started: list[object] = []

    def refuse(self: subprocess.Popen[bytes], args: object, *rest: Any, **kwargs: Any) -> None:
        started.append(args)
        raise OSError("no process may be started here")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    record = environment_record({"torch_version": "2"}, [], "", {})
    assert started == []
    monkeypatch.undo()  # platform.platform() may fork again: the words must be its own
    assert record["platform"] == platform.platform()


def test_format_environment_says_unset_and_none_set_when_so() -> None:
    text = format_environment(environment_record({"torch_version": "2"}, [], "", {}))
    assert "not available; CUDA_VISIBLE_DEVICES unset" in text
    assert "- (no NVML driver)" in text
    assert text.endswith("Variables\n  (none set)")


def test_describe_environment_without_cuda_devices_records_no_gpus() -> None:
    guard = Guard(LogLimiter())
    record, gpus = describe_environment({"torch_version": "2"}, [], guard)
    assert gpus == [] and record["gpus"] == [] and record["driver_version"] == ""
    assert sum(guard.counts.values()) == 0


def test_describe_environment_contains_a_driver_that_fails_and_writes_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(devices: object) -> tuple[str, list[object]]:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(environment, "identify_gpus", broken)
    guard = Guard(LogLimiter())
    record, gpus = describe_environment({"torch_version": "2"}, [torch.device("cuda", 0)], guard)
    assert gpus == [] and record["versions"] == {"torch_version": "2"}
    assert guard.counts["hooks"] == 1


def test_build_info_without_a_cudnn_version_when_cudnn_cannot_initialise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a GPU machine cuDNN's first use initialises it on every device, which can fail (a
    # device that does not answer); attach must go on without the version (gpu-check, H200).
    def broken() -> int:
        raise RuntimeError("cuDNN could not initialise")

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", broken)

    assert build_info("9.9.9")["cudnn_version"] == ""


def test_variables_set_inside_the_process_are_told_apart_from_the_users() -> None:
    # torch sets TORCHINDUCTOR_CACHE_DIR itself the first time inductor looks for its cache;
    # a report that shows it as the user's sends them looking for a setting they never made.
    at_start = {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}
    now = {**at_start, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_u"}
    record = environment_record({"torch_version": "2"}, [], "", now, at_start)

    assert record["set_in_process"] == ["OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR"]
    text = format_environment(record)
    assert "TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_u  (set inside the process" in text
    assert "NCCL_DEBUG=INFO\n" in text + "\n"
