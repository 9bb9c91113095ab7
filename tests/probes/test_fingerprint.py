"""Parameter fingerprints are exact integer sums (checked against Python's own integers), the
same whatever the reduction order, and move with any one flipped bit; the vote names the
outvoted replica. The CUDA half checks the device's result bit for bit against the CPU's."""

from __future__ import annotations

import random

import pytest
import torch

from stabmon.probes.fingerprint import ROW, abstention, fingerprint, vote, vote_layout

CPU = torch.device("cpu")
MASK = 2**64


def signed(value: int) -> int:
    value %= MASK
    return value - MASK if value >= 2**63 else value


def reference(tensor: torch.Tensor) -> tuple[int, int]:
    """The two sums with Python's unbounded integers, reduced modulo 2^64 at the end."""
    view = {4: torch.int32, 2: torch.int16, 8: torch.int64}[tensor.element_size()]
    ints = tensor.reshape(-1).view(view).tolist()
    generator = torch.Generator().manual_seed(0x5AB3)
    drawn = torch.randint(0, 2**31, (ROW,), generator=generator, dtype=torch.int64)
    weights = (drawn * 2 + 1).tolist()
    plain = sum(ints)
    weighted = sum(value * weights[index % ROW] for index, value in enumerate(ints))
    return signed(plain), signed(weighted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_each_buckets_sums_are_the_exact_integer_sums_modulo_2_64(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(3 * ROW + 17).to(dtype), torch.randn(7, 5).to(dtype)]

    got = fingerprint([tensors[:1], tensors[1:], []], CPU).tolist()

    assert got[0] == list(reference(tensors[0]))
    assert got[1] == list(reference(tensors[1]))
    assert got[2] == [0, 0]  # an empty bucket


def test_one_flipped_bit_anywhere_changes_the_plain_sum() -> None:
    torch.manual_seed(1)
    weight = torch.randn(2 * ROW + 3)
    before = fingerprint([[weight]], CPU)
    for element, bit in ((0, 0), (ROW + 1, 22), (2 * ROW + 2, 31)):
        corrupted = weight.clone()
        corrupted.view(torch.int32)[element] ^= 1 << bit
        assert not torch.equal(fingerprint([[corrupted]], CPU)[0, 0], before[0, 0])


def test_two_values_swapped_keep_the_plain_sum_but_not_the_weighted_one() -> None:
    weight = torch.arange(10, dtype=torch.float32)
    swapped = weight.clone()
    swapped[[2, 7]] = swapped[[7, 2]]
    a, b = fingerprint([[weight]], CPU)[0], fingerprint([[swapped]], CPU)[0]
    assert a[0] == b[0] and a[1] != b[1]


def _replicas(count: int, corrupt: dict[int, int]) -> torch.Tensor:
    """``count`` replicas' fingerprints of three buckets; ``corrupt`` maps replica -> bucket."""
    torch.manual_seed(2)
    buckets = [[torch.randn(50)] for _ in range(3)]
    rows = []
    for replica in range(count):
        copy = [[t.clone() for t in bucket] for bucket in buckets]
        if replica in corrupt:
            copy[corrupt[replica]][0].view(torch.int32)[3] ^= 1
        rows.append(fingerprint(copy, CPU))
    return torch.stack(rows)


def _read(values: torch.Tensor, replicas: int) -> tuple[list[float], list[float], list[float]]:
    majority_at, culprit_at, end = vote_layout(replicas, 3)
    flat = values.tolist()
    assert len(flat) == end
    return flat[:majority_at], flat[majority_at:culprit_at], flat[culprit_at:end]


def test_the_vote_names_the_outvoted_replica_and_its_first_differing_bucket() -> None:
    mismatch, majority, culprit = _read(vote(_replicas(5, {3: 1})), 5)
    assert mismatch == [0, 1, 0] and majority == [1, 1, 1]
    assert culprit == [0, 0, 0, 2, 0]  # replica 3, first in bucket 1 (1-based: 2)


def test_the_vote_with_two_replicas_finds_a_mismatch_and_no_culprit() -> None:
    mismatch, majority, culprit = _read(vote(_replicas(2, {1: 2})), 2)
    assert mismatch == [0, 0, 1] and majority[2] == 0 and culprit == [0, 0]


def test_the_vote_of_identical_replicas_is_all_zero() -> None:
    mismatch, _, culprit = _read(vote(_replicas(4, {})), 4)
    assert not any(mismatch) and not any(culprit)


@pytest.mark.gpu
def test_fingerprints_on_cuda_equal_the_cpus_bit_for_bit() -> None:
    # Whatever order the GPU's reduction takes, integer sums modulo 2^64 are the CPU's.
    torch.manual_seed(3)
    tensors = [torch.randn(4096 * 1024 + 5), torch.randn(768, 3072).bfloat16()]
    on_cpu = fingerprint([tensors[:1], tensors[1:]], CPU)
    on_gpu = fingerprint([[t.cuda() for t in tensors[:1]], [t.cuda() for t in tensors[1:]]],
                         torch.device("cuda"))  # fmt: skip
    assert torch.equal(on_gpu.cpu(), on_cpu)
    gathered = torch.stack([on_gpu, on_gpu, on_gpu.clone().add_(1)])
    assert vote(gathered).cpu().tolist()[-3:] == [0, 0, 1]


@pytest.mark.gpu
def test_a_bucket_over_two_devices_is_fingerprinted_on_the_one_asked() -> None:
    # A rank whose model is split over devices (one layer offloaded to the CPU, or over two
    # GPUs): each tensor is reduced where it lives, the sums are the one-device sums.
    torch.manual_seed(4)
    tensors = [torch.randn(3000), torch.randn(64, 1024)]
    on_cpu = fingerprint([tensors], CPU)
    split = fingerprint([[tensors[0], tensors[1].cuda()]], torch.device("cuda"))
    assert split.device.type == "cuda" and torch.equal(split.cpu(), on_cpu)


def test_a_bucket_of_zero_size_tensors_has_zero_sums_instead_of_failing() -> None:
    # A placeholder parameter (torch.empty(0)) or an HSDP shard left empty (a dimension
    # smaller than the shard count) is a module group with no elements: it must not turn
    # the check into an internal error at every check.
    got = fingerprint([[torch.empty(0)], [torch.empty(0, 4), torch.empty(0)]], CPU).tolist()
    assert got == [[0, 0], [0, 0]]
    flat = [torch.randn(5)]
    assert fingerprint([[*flat, torch.empty(0)]], CPU).tolist() == fingerprint([flat], CPU).tolist()


def test_parameters_of_every_dtype_are_read_as_their_bytes() -> None:
    # int8, uint8, bool, complex and fp8 parameters (quantised or masked models): summed
    # as integers of their width, and one changed element moves the sum.
    tensors = [
        torch.tensor([-128, 5, 7], dtype=torch.int8),
        torch.tensor([True, False, True]),
        torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn),
    ]
    for tensor in tensors:
        before = fingerprint([[tensor]], CPU)
        changed = tensor.clone()
        changed.view(torch.uint8).view(-1)[0] ^= 1
        assert not torch.equal(fingerprint([[changed]], CPU), before), tensor.dtype


def test_a_non_contiguous_parameter_reads_as_its_values_in_logical_order() -> None:
    weight = torch.randn(8, ROW + 3)
    assert torch.equal(
        fingerprint([[weight.t()]], CPU), fingerprint([[weight.t().contiguous()]], CPU)
    )


def test_a_replica_that_abstains_is_left_out_of_the_vote() -> None:
    # A rank whose fingerprint failed (an error on it alone) still joins the gather with
    # abstention(): the others are judged among themselves, and it is never named.
    rows = _replicas(4, {2: 1})
    rows[1] = abstention(3, CPU)
    mismatch, majority, culprit = _read(vote(rows), 4)
    assert mismatch == [0, 1, 0] and majority == [1, 1, 1]  # replicas 0 and 3 outvote 2
    assert culprit == [0, 0, 2, 0]

    clean = _replicas(3, {})
    clean[0] = abstention(3, CPU)
    mismatch, majority, culprit = _read(vote(clean), 3)
    assert not any(mismatch) and not any(culprit)

    alone = torch.stack([abstention(3, CPU)] * 2)
    mismatch, _, culprit = _read(vote(alone), 2)
    assert not any(mismatch) and not any(culprit)


def test_the_vote_agrees_with_a_plain_majority_count_on_random_replicas() -> None:
    # Against the rule counted by hand (collections.Counter): 1 to 7 replicas, some
    # abstaining, few distinct values per bucket so that ties and majorities both occur.
    from collections import Counter

    rng = random.Random(0)
    for _ in range(500):
        count, buckets = rng.randint(1, 7), rng.randint(1, 4)
        values = [[(rng.randint(0, 2), rng.randint(0, 1)) for _ in range(buckets)]
                  for _ in range(count)]  # fmt: skip
        abstains = [rng.random() < 0.2 for _ in range(count)]
        rows = [abstention(buckets, CPU) if out else torch.tensor(row) for row, out
                in zip(values, abstains, strict=True)]  # fmt: skip
        mismatch_at, culprit_at, end = vote_layout(count, buckets)
        flat = vote(torch.stack(rows)).tolist()
        voters = [r for r in range(count) if not abstains[r]]
        culprits = [0] * count
        for bucket in range(buckets):
            seen = Counter(values[r][bucket] for r in voters)
            top, agree = seen.most_common(1)[0] if seen else (None, 0)
            assert flat[bucket] == float(len(seen) > 1)
            assert flat[mismatch_at + bucket] == float(agree * 2 > len(voters))
            if agree * 2 > len(voters):
                for r in voters:
                    if values[r][bucket] != top and not culprits[r]:
                        culprits[r] = bucket + 1
        assert flat[culprit_at:end] == [float(c) for c in culprits], (values, abstains)
