"""CUDA_VISIBLE_DEVICES resolution, with the examples of NVIDIA's CUDA Programming Guide."""

from __future__ import annotations

import pytest
import torch

from stabmon.hardware.devices import PhysicalGpu, parse_visible_devices, resolve_visible
from stabmon.probes.identity import torch_device_uuids

# The UUIDs of the CUDA Programming Guide's examples, and a MIG UUID in the current driver format.
DOCS_GPU = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
OTHER_GPU = "GPU-5c1a2b3d-0000-4e5f-8a9b-1c2d3e4f5a6b"
THIRD_GPU = "GPU-8932aaaa-1111-2222-3333-444455556666"  # shares "GPU-8932" with DOCS_GPU
DOCS_MIG = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"

NODE = [
    PhysicalGpu(0, OTHER_GPU),
    PhysicalGpu(1, DOCS_GPU, mig_uuids=(DOCS_MIG,)),
    PhysicalGpu(2, THIRD_GPU),
]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("   ", []),
        ("0,1", ["0", "1"]),
        ("1", ["1"]),
        ("2,1", ["2", "1"]),
        ("0,2,-1,1", ["0", "2"]),
        (" 0 , 1 ", ["0", "1"]),
        ("-1", []),
        ("0,,1", ["0"]),
        ("0,gpu0,1", ["0"]),
        (DOCS_GPU, [DOCS_GPU]),
        ("GPU-8932f937", ["GPU-8932f937"]),
        (f"MIG-{DOCS_GPU}/1/2", [f"MIG-{DOCS_GPU}/1/2"]),
        (DOCS_MIG, [DOCS_MIG]),
        (f"{DOCS_GPU}, {OTHER_GPU}", [DOCS_GPU, OTHER_GPU]),
    ],
)
def test_parse_visible_devices_follows_cuda_rules(
    value: str | None, expected: list[str] | None
) -> None:
    assert parse_visible_devices(value) == expected


def test_resolve_visible_maps_indices_in_cuda_order() -> None:
    assert resolve_visible("2,0", NODE) == [THIRD_GPU, OTHER_GPU]


def test_resolve_visible_sees_every_gpu_in_index_order_when_unset() -> None:
    assert resolve_visible(None, list(reversed(NODE))) == [OTHER_GPU, DOCS_GPU, THIRD_GPU]


def test_resolve_visible_sees_no_gpu_when_set_to_the_empty_string() -> None:
    assert resolve_visible("", NODE) == []


def test_resolve_visible_stops_at_the_invalid_index_of_the_docs_example() -> None:
    assert resolve_visible("0,2,-1,1", NODE) == [OTHER_GPU, THIRD_GPU]


def test_resolve_visible_stops_at_an_index_that_names_no_gpu() -> None:
    assert resolve_visible("1,7,0", NODE) == [DOCS_GPU]


def test_resolve_visible_matches_a_full_uuid_case_insensitively() -> None:
    assert resolve_visible(DOCS_GPU.upper(), NODE) == [DOCS_GPU]


def test_resolve_visible_matches_a_unique_uuid_prefix() -> None:
    assert resolve_visible("GPU-8932f937,GPU-5c", NODE) == [DOCS_GPU, OTHER_GPU]


def test_resolve_visible_stops_at_an_ambiguous_uuid_prefix() -> None:
    assert resolve_visible("GPU-5c,GPU-8932", NODE) == [OTHER_GPU]


def test_resolve_visible_keeps_a_mig_uuid() -> None:
    assert resolve_visible(DOCS_MIG, NODE) == [DOCS_MIG]
    assert resolve_visible("MIG-c6d4", NODE) == [DOCS_MIG]


def test_resolve_visible_keeps_a_mig_uuid_this_node_does_not_list() -> None:
    other_mig = "MIG-0e1d2c3b-4a59-5867-9788-a9b0c1d2e3f4"
    assert resolve_visible(other_mig, NODE) == [other_mig]


def test_resolve_visible_maps_the_legacy_mig_form_to_its_parent_gpu() -> None:
    assert resolve_visible(f"MIG-{DOCS_GPU}/1/2", NODE) == [DOCS_GPU]


def test_resolve_visible_maps_the_legacy_mig_form_to_an_instance_listed_under_that_name() -> None:
    legacy = f"MIG-{DOCS_GPU}/1/2"
    node = [PhysicalGpu(0, DOCS_GPU, mig_uuids=(f"MIG-{DOCS_GPU}/1/0", legacy))]
    assert resolve_visible(legacy, node) == [legacy]


def test_resolve_visible_sees_nothing_without_physical_gpus() -> None:
    assert resolve_visible("0,1", []) == []
    assert resolve_visible(None, []) == []


def test_torch_device_uuids_is_empty_for_no_devices() -> None:
    assert torch_device_uuids([]) == []


def test_torch_device_uuids_skips_cpu_devices() -> None:
    assert torch_device_uuids([torch.device("cpu"), torch.device("cpu", 0)]) == []


@pytest.mark.gpu
def test_torch_device_uuids_names_each_cuda_device_once_in_nvml_spelling() -> None:
    uuids = torch_device_uuids([torch.device("cuda", 0), torch.device("cuda", 0)])
    assert len(uuids) == 1
    assert uuids[0].startswith("GPU-") and len(uuids[0]) == len(DOCS_GPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
def test_torch_device_uuids_is_empty_without_cuda() -> None:
    assert torch_device_uuids([torch.device("cuda", 0)]) == []
