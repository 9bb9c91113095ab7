"""Content hashes of a batch's samples: the identity of a batch no dataset index names.

An incident's batches are named by the dataset indices ``track()`` reads from a
``DataLoader``'s sampler, or by the ids a loop passes to ``observe(batch_ids=...)``. A loop
whose batches come from elsewhere (a ``get_batch()`` function, an ``IterableDataset``, a
trainer that iterates its own loader) has neither; its samples are named by a 64-bit hash
of their content instead, which the loop computes again with :func:`sample_hashes` to skip
them when it resumes (docs/loops.md).

A sample is a row along the first dimension of the model's first tensor input. It is
hashed from at most :data:`HASH_ELEMENTS` of its elements, evenly spaced: their bytes read
as integers (``float32`` as ``int32``, ``bfloat16`` as ``int16``), widened to ``int64``,
each multiplied by a fixed odd constant of its position and summed modulo 2^64. Integer
arithmetic: the same values in the same dtype hash alike on any machine and in any
reduction order. Two samples that differ only between the elements read share a hash: the
point is to find a batch again, not to tell every sample apart. A few small operations per
batch, whatever its size.
"""

from __future__ import annotations

import math

import torch

__all__ = ["HASH_ELEMENTS", "row_hashes", "sample_hashes"]

#: Elements of each sample a hash reads at most (evenly spaced).
HASH_ELEMENTS = 256
#: Sample shapes whose element positions are kept (a loop has a few; bounded anyway).
_CACHED_SHAPES = 16
_INTEGER_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Odd constants (each a bijection modulo 2^64), one per position read, from a fixed seed.
_WEIGHTS = (
    torch.randint(
        0,
        2**31,
        (HASH_ELEMENTS,),
        generator=torch.Generator().manual_seed(0x5A3B1E),
        dtype=torch.int64,
    )
    * 2
    + 1
)
_positions: dict[torch.Size, tuple[torch.Tensor, ...]] = {}


def sample_hashes(batch: torch.Tensor) -> list[int]:
    """The 64-bit content hash of each sample of ``batch`` (its rows along the first
    dimension), as stabmon names a batch in ``skip_batches.json`` where no dataset index
    is known. Hash the tensor as the model receives it (the same dtype) to find the samples
    a skip file names."""
    # The caller's own read (a resuming loop's), never stabmon's step: a GPU tensor syncs
    # here, as the caller chose; stabmon hashes host tensors only (BatchIdentities.forward).
    hashes: list[int] = row_hashes(batch).tolist()
    return hashes


def row_hashes(batch: torch.Tensor) -> torch.Tensor:
    """:func:`sample_hashes` as an ``int64`` tensor on ``batch``'s device (no read-back)."""
    # Attributes rather than method calls where torch has both: this runs every step.
    values = batch
    if values.ndim == 0:
        values = values.reshape(1)
    if values.dtype.is_complex:
        values = torch.view_as_real(values)
    rows, shape = values.shape[0], values.shape[1:]
    if rows == 0 or math.prod(shape) == 0:
        return torch.zeros(rows, dtype=torch.int64, device=values.device)
    index = _index(shape)
    # Indexing gathers the elements read, whatever the strides: no copy of the batch.
    key: tuple[slice | torch.Tensor, ...] = (slice(None), *index)
    picked = values[key] if shape else values.reshape(rows, 1)
    dtype = picked.dtype
    if dtype.is_floating_point or dtype == torch.bool:
        picked = picked.view(_INTEGER_VIEW[dtype.itemsize])
    weights = _WEIGHTS[: picked.shape[1]]
    integers = picked.to(torch.int64)  # a copy of what was read: no graph, no gradient
    if integers.is_cpu:  # one call: an integer matrix-vector product wraps as the sum does
        return integers @ weights
    # No integer matmul on GPUs.
    return (integers * weights.to(integers.device, non_blocking=True)).sum(dim=1)


def _index(shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """The positions read in a sample of ``shape``, one index tensor per dimension."""
    index = _positions.get(shape)
    if index is None:
        count = math.prod(shape)
        read = min(count, HASH_ELEMENTS)
        # Evenly spaced, first and last included; integer arithmetic, so exact at any size.
        flat = torch.arange(read, dtype=torch.int64) * (count - 1) // max(read - 1, 1)
        index = tuple(torch.unravel_index(flat, shape)) if shape else ()
        if len(_positions) >= _CACHED_SHAPES:
            _positions.clear()
        _positions[shape] = index
    return index
