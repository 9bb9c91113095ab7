"""stabmon.probes.sample_hash: a sample's hash depends on its content alone (not on the batch
it came in, its memory layout or the machine), so a resumed loop can find it again."""

from __future__ import annotations

import pytest
import torch

import stabmon
from stabmon.probes.sample_hash import HASH_ELEMENTS, row_hashes


def test_a_samples_hash_is_the_same_alone_in_any_batch_and_any_memory_layout() -> None:
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    hashes = stabmon.sample_hashes(images)
    assert len(set(hashes)) == 6
    assert [stabmon.sample_hashes(images[i : i + 1])[0] for i in range(6)] == hashes
    assert stabmon.sample_hashes(images[[4, 1]]) == [hashes[4], hashes[1]]
    assert stabmon.sample_hashes(images.to(memory_format=torch.channels_last)) == hashes
    assert stabmon.sample_hashes(images[:, :, ::2, ::2].contiguous()) != hashes[:6]


def test_every_value_read_moves_the_hash_and_the_values_read_span_the_sample() -> None:
    tokens = torch.randint(0, 50_000, (2, 1024), generator=torch.Generator().manual_seed(1))
    before = stabmon.sample_hashes(tokens)
    for position in (0, 1023):  # the first and the last element are always read
        changed = tokens.clone()
        changed[1, position] += 1
        after = stabmon.sample_hashes(changed)
        assert after[0] == before[0] and after[1] != before[1]
    small = torch.randn(3, HASH_ELEMENTS - 1)  # fewer elements than are read: every one
    for position in range(0, HASH_ELEMENTS - 1, 37):
        changed = small.clone()
        changed[2, position] = changed[2, position] + 1
        assert stabmon.sample_hashes(changed)[2] != stabmon.sample_hashes(small)[2]


@pytest.mark.parametrize(
    "batch",
    [torch.randn(4, 5).bfloat16(), torch.randn(4, 5, dtype=torch.complex64),
     torch.rand(4, 5) > 0.5, torch.arange(4, dtype=torch.uint8), torch.randn(4, 2, 3).half()],
    ids=["bfloat16", "complex", "bool", "uint8 rows of one value", "float16"],
)  # fmt: skip
def test_any_dtype_hashes_by_its_bits_one_int64_a_sample(batch: torch.Tensor) -> None:
    hashes = row_hashes(batch)
    assert hashes.dtype == torch.int64 and hashes.shape == (4,)
    assert stabmon.sample_hashes(batch) == hashes.tolist()


def test_empty_and_scalar_inputs_hash_without_error() -> None:
    assert stabmon.sample_hashes(torch.zeros(0, 3)) == []
    assert stabmon.sample_hashes(torch.zeros(2, 0)) == [0, 0]
    assert len(stabmon.sample_hashes(torch.tensor(3.0))) == 1
