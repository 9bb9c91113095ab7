"""Physical GPU identity, the driver version, LOCAL_RANK sanity and the environment record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import MonitorFactory
from helpers import tiny_model

from stabmon.probes import identity
from stabmon.probes.environment import environment_record, format_environment, relevant_variables
from stabmon.probes.identity import cuda_identities, driver_version, local_rank_problem, pci_bus_id

UUID = "GPU-3b5e2b71-2f0e-5f4c-9f55-7a1c2e8c9d01"


class FakeNvml:
    """The few pynvml calls identity.py makes, answering for one GPU at NVML index 5."""

    def nvmlSystemGetDriverVersion(self) -> bytes:  # noqa: N802 - pynvml's names
        return b"570.124.06"

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> str:  # noqa: N802
        if uuid.decode() != UUID:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "handle"

    def nvmlDeviceGetIndex(self, handle: str) -> int:  # noqa: N802
        return 5


class BrokenNvml:
    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")


def test_pci_bus_id_is_spelled_as_nvml_spells_it() -> None:
    properties = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x18, pci_device_id=0)
    assert pci_bus_id(properties) == "00000000:18:00.0"
    assert pci_bus_id(SimpleNamespace()) == ""  # a torch without the fields


def test_driver_version_from_nvml_or_empty() -> None:
    assert driver_version(FakeNvml()) == "570.124.06"
    assert driver_version(BrokenNvml()) == ""


def test_cuda_identities_resolve_uuid_nvml_index_and_pci(monkeypatch: pytest.MonkeyPatch) -> None:
    properties = SimpleNamespace(
        name="NVIDIA H200", uuid=UUID.removeprefix("GPU-"), pci_domain_id=0, pci_bus_id=0x9A,
        pci_device_id=0,
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    (found,) = cuda_identities([torch.device("cuda", 1), torch.device("cpu")], nvml=FakeNvml())
    assert found.labels() == {
        "device": "cuda:1",
        "uuid": UUID.lower(),
        "gpu": "5",
        "pci_bus_id": "00000000:9A:00.0",
        "name": "NVIDIA H200",
    }


def test_cuda_identities_are_empty_without_cuda() -> None:
    assert cuda_identities([torch.device("cpu")]) == []


@pytest.mark.parametrize(
    ("env", "count", "problem"),
    [
        ({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, 2, "cuda:3 does not exist"),
        (
            {"LOCAL_RANK": "7", "CUDA_VISIBLE_DEVICES": "GPU-8a3b,GPU-1c2d"},
            2,
            "'GPU-8a3b,GPU-1c2d'",
        ),
        ({"LOCAL_RANK": "2"}, 2, "CUDA_VISIBLE_DEVICES unset"),
        ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,2"}, 2, None),
        ({"LOCAL_RANK": "0"}, 0, None),  # no CUDA at all: nothing to say here
        ({}, 8, None),
    ],
)
def test_local_rank_problem_names_the_visible_devices(
    env: dict[str, str], count: int, problem: str | None
) -> None:
    found = local_rank_problem(env, count)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found and "LOCAL_RANK" in found


def test_relevant_variables_keep_what_matters_and_redact_credentials() -> None:
    env = {
        "NCCL_DEBUG": "INFO", "TORCH_HOME": "/x", "HOME": "/root", "NCCL_IB_KEY": "s3cr3t",
        "CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "0", "HF_TOKEN": "t", "OMP_NUM_THREADS": "4",
    }  # fmt: skip
    assert relevant_variables(env) == {
        "CUDA_VISIBLE_DEVICES": "1",
        "LOCAL_RANK": "0",
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_KEY": "<redacted>",
        "OMP_NUM_THREADS": "4",
        "TORCH_HOME": "/x",
    }


def test_environment_record_reads_as_a_table() -> None:
    gpu = {"device": "cuda:0", "gpu": "5", "uuid": UUID.lower(), "pci_bus_id": "00000000:9A:00.0",
           "name": "NVIDIA H200"}  # fmt: skip
    record = environment_record({"torch_version": "2.13.0"}, [gpu], "570.124.06",
                                {"CUDA_VISIBLE_DEVICES": "5"})  # fmt: skip
    text = format_environment(record)
    assert "570.124.06" in text and "NVIDIA H200" in text and "00000000:9A:00.0" in text
    assert "CUDA_VISIBLE_DEVICES='5'" in text or "CUDA_VISIBLE_DEVICES '5'" in text


def test_event_log_first_line_records_the_environment(
    attach: MonitorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    model = tiny_model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert monitor.event_log_path is not None
    first = json.loads(Path(monitor.event_log_path).read_text().splitlines()[0])
    assert first["event"] == "attach"
    environment: dict[str, Any] = first["environment"]
    assert environment["versions"]["torch_version"] == torch.__version__
    assert environment["variables"]["NCCL_DEBUG"] == "WARN"
    assert environment["cuda_available"] is torch.cuda.is_available()


def test_stabmon_env_prints_the_same_record() -> None:
    env_vars = {"NCCL_DEBUG": "INFO", "PATH": "/usr/bin:/bin"}
    table = subprocess.run([sys.executable, "-m", "stabmon", "env"], capture_output=True,
                           text=True, check=True, env=env_vars)  # fmt: skip
    assert "torch_version" in table.stdout and "NCCL_DEBUG=INFO" in table.stdout
    as_json = subprocess.run([sys.executable, "-m", "stabmon", "env", "--json"],
                             capture_output=True, text=True, check=True, env=env_vars)  # fmt: skip
    record = json.loads(as_json.stdout)
    assert record["variables"] == {"NCCL_DEBUG": "INFO"}
    assert record["versions"]["stabmon_version"]


def test_identity_module_imports_pynvml_lazily() -> None:
    assert "pynvml" not in vars(identity)


def test_default_run_id_is_shared_by_every_rank_of_a_job() -> None:
    from stabmon.probes.environment import default_run_id

    job = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "16"}
    assert default_run_id({**job, "TORCHELASTIC_RUN_ID": "abc123"}) == "abc123"
    static = default_run_id({**job, "TORCHELASTIC_RUN_ID": "none", "RANK": "3"})
    assert static.startswith("job-")
    assert default_run_id({**job, "RANK": "11"}) == static  # another rank computes the same
    other_job = default_run_id({**job, "MASTER_PORT": "29501"})
    assert other_job != static
    alone = default_run_id({})
    assert not alone.startswith("job-") and alone == default_run_id({})


def test_run_id_agreed_in_the_store_is_rank_zeros_when_it_comes_first() -> None:
    from stabmon.probes.environment import agree_run_id

    store = torch.distributed.HashStore()
    first = agree_run_id(store, rank=0, job="10.0.0.1:29500:4")
    assert first.startswith("job-")
    assert agree_run_id(store, rank=1, job="10.0.0.1:29500:4", wait_seconds=0.1) == first


def test_run_id_agreed_in_the_store_stays_one_when_rank_zero_attaches_late() -> None:
    from stabmon.probes.environment import agree_run_id

    store = torch.distributed.HashStore()
    waited_out = agree_run_id(store, rank=1, job="10.0.0.1:29500:4", wait_seconds=0.05)
    late_rank_zero = agree_run_id(store, rank=0, job="10.0.0.1:29500:4")
    assert late_rank_zero == waited_out
    assert agree_run_id(store, rank=2, job="10.0.0.1:29500:4", wait_seconds=0.05) == waited_out
