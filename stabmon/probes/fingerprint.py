"""Integer fingerprints of parameters, and the vote that names the replica that differs.

Data-parallel replicas hold bit-identical parameters after every optimizer step, so a
replica whose parameters differ by one bit was corrupted (a GPU computing or storing a
wrong value without an error, a bad kernel, a bad copy). A float checksum cannot show
that: float sums depend on the reduction order and round a one-bit change away. Here
every parameter's bytes are read as integers (``float32`` as ``int32``, ``bfloat16`` as
``int16``), widened to ``int64`` and summed with wrap-around, i.e. modulo 2^64: integer
addition is associative, so the sum is the same bit for bit whatever order the device
reduces in, and a flipped bit ``k`` of one element moves it by exactly 2^k (never 0
modulo 2^64). A second, position-weighted sum (the column sums of the flattened tensor
laid out in rows of :data:`ROW`, each weighted by a fixed odd constant) also sees values
that moved. Two ``int64`` per bucket of parameters (a module group): a few bytes, a few
kernels per parameter, no copy of the parameters.

:func:`vote` runs on the gathered fingerprints of every replica, on the device too: per
bucket, the median over replicas is the majority value whenever a strict majority agrees
(sorting puts the majority across the middle), so a replica whose fingerprint is not the
median is a culprit; with no strict majority (two replicas) a mismatch has no culprit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ABSTAIN", "ROW", "abstention", "fingerprint", "vote", "vote_layout"]

#: Row length of the position-weighted sum: the weights are one vector of this many int64.
ROW = 1024
_INTEGER_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[torch.device, torch.Tensor] = {}
#: Odd (so multiplying by it is a bijection modulo 2^64): the golden-ratio constant, signed.
_KEY_MULTIPLIER = 0x9E3779B97F4A7C15 - 2**64
#: Every value of the fingerprint a rank sends when it could not take one (an error on that
#: rank alone, e.g. out of memory): it still takes part in the gather, so the others do not
#: wait for it forever, and the vote leaves it out.
ABSTAIN = -(2**63)


def _row_weights(device: torch.device) -> torch.Tensor:
    """Odd constants, the same on every rank (a fixed generator), cached per device."""
    weights = _weights.get(device)
    if weights is None:
        generator = torch.Generator().manual_seed(0x5AB3)
        drawn = torch.randint(0, 2**31, (ROW,), generator=generator, dtype=torch.int64)
        weights = _weights[device] = (drawn * 2 + 1).to(device)
    return weights


def _as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat tensor of integers of the same width (a view, no copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == torch.bool:
        if flat.dtype.is_complex:
            flat = torch.view_as_real(flat).reshape(-1)
        return flat.view(_INTEGER_VIEW[flat.element_size()])
    return flat


def _bucket_sums(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[plain sum, position-weighted sum]`` of a bucket's integers, int64, modulo 2^64.

    Per tensor two reductions (its sum, and its column sums in rows of :data:`ROW`, a
    short tail zero-padded to one row); the weighting is done once per bucket on the summed
    columns, so a check costs about two kernels per parameter. Each tensor is reduced on its
    own device and the small results are moved to ``device`` (a model split over a rank's
    GPUs, or partly offloaded to the CPU): a copy between devices, never a host wait.
    """
    if not tensors:
        return torch.zeros(2, dtype=torch.int64, device=device)
    plains: list[torch.Tensor] = []
    columns: list[torch.Tensor] = []
    for tensor in tensors:
        ints = _as_integers(tensor)
        count = ints.numel()
        whole = count - count % ROW
        plains.append(ints.sum(dtype=torch.int64).to(device))
        if whole:
            columns.append(ints[:whole].view(-1, ROW).sum(dim=0, dtype=torch.int64).to(device))
        if whole < count:
            tail = ints[whole:].to(device, torch.int64)
            columns.append(torch.nn.functional.pad(tail, (0, ROW - (count - whole))))
    plain = torch.stack(plains).sum()
    if not columns:  # only zero-size tensors (a placeholder, an empty shard): nothing weighs
        return torch.stack([plain, torch.zeros_like(plain)])
    weighted = (torch.stack(columns).sum(dim=0) * _row_weights(device)).sum()
    return torch.stack([plain, weighted])


def fingerprint(buckets: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """``[len(buckets), 2]`` int64 on ``device``: each bucket's two sums over its tensors.

    Issued on the device, read by nobody here: no host-device synchronisation.
    """
    return torch.stack([_bucket_sums(tensors, device) for tensors in buckets])


def abstention(buckets: int, device: torch.device) -> torch.Tensor:
    """The fingerprint of a rank that could not take one: :data:`ABSTAIN` everywhere."""
    return torch.full((buckets, 2), ABSTAIN, dtype=torch.int64, device=device)


def vote_layout(replicas: int, buckets: int) -> tuple[int, int, int]:
    """Offsets of :func:`vote`'s three parts: (mismatch per bucket, majority per bucket,
    culprit per replica) in its flat output, and its length."""
    return buckets, 2 * buckets, 2 * buckets + replicas


def vote(gathered: torch.Tensor) -> torch.Tensor:
    """From ``[replicas, buckets, 2]`` int64 fingerprints, a flat float tensor (exact 0/1
    and small integers, safe to read back as floats):

    - per bucket, 1 where the replicas disagree;
    - per bucket, 1 where a strict majority agrees (so the minority can be named);
    - per replica, the 1-based index of the first bucket in which it differs from the
      majority, or 0 (no culprit, or no majority).
    """
    replicas, buckets, _ = gathered.shape
    device = gathered.device
    # Replicas that sent :func:`abstention` take no part: not compared, not counted.
    voting = ~(gathered == ABSTAIN).flatten(1).all(dim=1)  # [replicas]
    voters = voting.sum()
    # One sort key per (replica, bucket): equal pairs give equal keys, and unequal pairs
    # (almost surely) unequal ones; every pair is then compared whole with the median's.
    # The abstaining replicas are sorted after the others (a second, stable sort).
    key = gathered[..., 0] * _KEY_MULTIPLIER + gathered[..., 1]
    order = torch.sort(key, dim=0, stable=True).indices
    order = order.gather(0, torch.sort((~voting)[order].int(), dim=0, stable=True).indices)
    middle = order.gather(0, (voters // 2).expand(1, buckets))[0]  # [buckets]: the median's
    median = gathered[middle, torch.arange(buckets, device=device)]  # [buckets, 2]
    votes = voting.unsqueeze(1)  # [replicas, 1]
    differs = (gathered != median.unsqueeze(0)).any(dim=-1) & votes  # [replicas, buckets]
    agreeing = (~differs & votes).sum(dim=0)
    majority = agreeing * 2 > voters
    mismatch = differs.any(dim=0)  # a voter differs from the median: they do not all agree
    blamed = differs & majority.unsqueeze(0)
    positions = torch.arange(1, buckets + 1, device=device)
    first = torch.where(blamed, positions, buckets + 1).min(dim=1).values
    culprit = torch.where(first <= buckets, first, 0)
    return torch.cat([mismatch.float(), majority.float(), culprit.float()])
