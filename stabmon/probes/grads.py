"""Gradient health in one fused pass over every gradient, computed on the device.

``torch._foreach_norm`` gives the L2 norm of each gradient tensor in one fused
launch per (device, dtype) bucket; everything else is reduced from those norms
on the device: squared norms summed per module group (``index_add_``) and in
total, and the count of all-zero gradients. The non-finite check needs no pass
of its own: a NaN or Inf anywhere makes the total NaN or Inf, which the host
sees when the packed result is read back a step later. Half-precision
gradients are normed in fp32 and the sums run in fp64, so a large but finite
norm cannot overflow into a false "non-finite".

The result is one packed 1-D fp64 tensor (see :class:`Packed`), so reading it
back costs one asynchronous copy. This module knows nothing of hooks, threads
or metrics: tensors in, tensors out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

__all__ = ["GradProbe", "GradSample", "GradSummary", "Packed", "group_name"]

#: Label of the module group that collects parameters beyond ``max_modules`` groups.
OTHER_GROUP = "other"
#: Label of parameters that sit directly on the root module (``bias`` rather than ``fc.bias``).
ROOT_GROUP = "root"


class Packed:
    """Offsets of the packed result: ``[total_sq, zero_count, group_sq..., tensor_norms...]``."""

    TOTAL_SQ = 0
    ZERO_COUNT = 1
    GROUPS = 2


def group_name(param_name: str, depth: int) -> str:
    """The module group of a parameter: the first ``depth`` parts of its module path."""
    module_path = param_name.split(".")[:-1]
    if not module_path:
        return ROOT_GROUP
    return ".".join(module_path[:depth])


@dataclass(frozen=True)
class GradSample:
    """A measurement in flight: the packed device tensor and what the host needs to read it."""

    packed: torch.Tensor
    none_count: int
    #: Positions (into the probe's parameter list) of the gradients that were present,
    #: or None when all were; needed to name offenders on the slow path.
    present: tuple[int, ...] | None


@dataclass(frozen=True)
class GradSummary:
    """A measurement read back on the host."""

    total_norm: float
    group_norms: dict[str, float]
    zero_grad_params: int
    nonfinite: bool
    tensor_norms: list[float]
    present: tuple[int, ...] | None


@dataclass(frozen=True)
class _Bucket:
    """Parameters sharing a device and dtype: one fused ``_foreach_norm`` launch."""

    positions: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype


class GradProbe:
    """Measures the gradients of a fixed list of trainable parameters.

    The layout (buckets, module groups, index tensors) is computed once; a step
    costs one list of ``.grad`` reads, one ``_foreach_norm`` per bucket and a
    handful of tiny reductions, none of which waits for the device.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        *,
        module_depth: int = 1,
        max_modules: int = 32,
    ) -> None:
        self.names: tuple[str, ...] = tuple(name for name, _ in named_params)
        self._params: tuple[torch.Tensor, ...] = tuple(param for _, param in named_params)
        self.groups, group_of = _assign_groups(self.names, self._params, module_depth, max_modules)
        self._group_of: tuple[int, ...] = group_of
        self._buckets = _bucket(self._params)
        self.device: torch.device = self._params[0].device if self._params else torch.device("cpu")
        # Order of the per-tensor norms when every gradient is present: bucket order.
        self._full_order: tuple[int, ...] = tuple(
            position for bucket in self._buckets for position in bucket.positions
        )
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        # Buckets whose fused launch failed once (sparse gradients): normed per tensor from then on.
        self._per_tensor_buckets: set[int] = set()

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return self._params

    def measure(self) -> GradSample | None:
        """Start measuring the current gradients; None when no gradient is present."""
        grads = [param.grad for param in self._params]
        none_count = sum(grad is None for grad in grads)  # `None in grads` would call Tensor.__eq__
        if none_count == len(grads):
            return None
        stacked: list[torch.Tensor] = []
        order: list[int] = []
        for index, bucket in enumerate(self._buckets):
            if none_count:
                positions = tuple(p for p in bucket.positions if grads[p] is not None)
            else:
                positions = bucket.positions
            if not positions:
                continue
            if len(self._buckets) == 1 and not none_count:
                # The common case: one bucket holding every parameter, in order, all present.
                present_grads = cast(list[torch.Tensor], grads)
            else:
                present_grads = [grad for grad in (grads[p] for p in positions) if grad is not None]
            norms = torch.stack(self._bucket_norms(index, present_grads))
            stacked.append(norms.to(self.device, non_blocking=True))
            order.extend(positions)
        present = None if none_count == 0 else tuple(order)
        tensor_norms = stacked[0] if len(stacked) == 1 else torch.cat(stacked)
        packed = _pack(tensor_norms, self._group_index(tuple(order)), len(self.groups))
        return GradSample(packed=packed, none_count=none_count, present=present)

    def summarize(
        self, sample_values: Sequence[float], none_count: int, present: tuple[int, ...] | None
    ) -> GradSummary:
        """Turn a read-back packed result into host numbers."""
        group_count = len(self.groups)
        total_sq = sample_values[Packed.TOTAL_SQ]
        group_sq = sample_values[Packed.GROUPS : Packed.GROUPS + group_count]
        tensor_norms = list(sample_values[Packed.GROUPS + group_count :])
        return GradSummary(
            total_norm=_sqrt(total_sq),
            group_norms={name: _sqrt(sq) for name, sq in zip(self.groups, group_sq, strict=True)},
            zero_grad_params=int(sample_values[Packed.ZERO_COUNT]) + none_count,
            nonfinite=not math.isfinite(total_sq),
            tensor_norms=tensor_norms,
            present=present,
        )

    def nonfinite_offenders(self, summary: GradSummary, limit: int = 5) -> list[str]:
        """Names of the first parameters whose gradient norm is NaN or Inf (slow path)."""
        order = summary.present if summary.present is not None else self._full_order
        offenders = [
            self.names[position]
            for position, norm in zip(order, summary.tensor_norms, strict=True)
            if not math.isfinite(norm)
        ]
        offenders.sort(key=self.names.index)  # model order, not bucket order
        return offenders[:limit]

    def _bucket_norms(self, index: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        bucket = self._buckets[index]
        norm_dtype = torch.float64 if bucket.dtype == torch.float64 else torch.float32
        if index not in self._per_tensor_buckets:
            try:
                return list(torch._foreach_norm(grads, 2.0, dtype=norm_dtype))
            except (RuntimeError, NotImplementedError):
                # Sparse gradients (nn.Embedding(sparse=True)) have no fused kernel.
                self._per_tensor_buckets.add(index)
        return [_tensor_norm(grad, norm_dtype) for grad in grads]

    def _group_index(self, order: tuple[int, ...]) -> torch.Tensor:
        index = self._index_cache.get(order)
        if index is None:
            if len(self._index_cache) >= 16:  # None-patterns vary rarely; stay bounded if they do
                self._index_cache.clear()
            index = torch.tensor(
                [self._group_of[position] for position in order], dtype=torch.long
            ).to(self.device)
            self._index_cache[order] = index
        return index


def _pack(tensor_norms: torch.Tensor, group_index: torch.Tensor, group_count: int) -> torch.Tensor:
    """Pack ``[total_sq, zero_count, group_sq..., tensor_norms...]`` in fp64 (fp32 on MPS)."""
    accumulate = torch.float32 if tensor_norms.device.type == "mps" else torch.float64
    norms = tensor_norms.to(accumulate)
    squares = norms * norms
    group_sq = squares.new_zeros(group_count).index_add_(0, group_index, squares)
    total_sq = group_sq.sum(0, keepdim=True)
    zero_count = (norms == 0).sum(0, keepdim=True).to(accumulate)
    return torch.cat([total_sq, zero_count, group_sq, norms])


def _tensor_norm(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if grad.is_sparse:
        # Uncoalesced sparse gradients repeat indices; their norm is the coalesced one.
        # Coalescing synchronises on CUDA: sparse gradients are the documented exception.
        norm: torch.Tensor = torch.linalg.vector_norm(grad.coalesce().values(), dtype=dtype)
    else:
        norm = torch.linalg.vector_norm(grad, dtype=dtype)
    return norm


def _sqrt(value: float) -> float:
    return math.sqrt(value) if value >= 0 else math.nan  # NaN stays NaN, inf stays inf


def _bucket(params: Sequence[torch.Tensor]) -> tuple[_Bucket, ...]:
    positions: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for position, param in enumerate(params):
        positions.setdefault((param.device, param.dtype), []).append(position)
    return tuple(
        _Bucket(positions=tuple(items), device=device, dtype=dtype)
        for (device, dtype), items in positions.items()
    )


def _assign_groups(
    names: Iterable[str],
    params: Sequence[torch.Tensor],
    depth: int,
    max_modules: int,
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Module group per parameter, at most ``max_modules`` labels (bounded cardinality).

    When there are more groups than allowed, the largest by element count keep
    their own label and the rest share ``other``.
    """
    per_param = [group_name(name, depth) for name in names]
    sizes: dict[str, int] = {}
    for name, param in zip(per_param, params, strict=True):
        sizes[name] = sizes.get(name, 0) + param.numel()
    if len(sizes) > max_modules:
        keep_count = max_modules - 1
        largest = sorted(sizes, key=lambda name: -sizes[name])[:keep_count]
        kept = set(largest)
        per_param = [name if name in kept else OTHER_GROUP for name in per_param]
    groups = tuple(dict.fromkeys(per_param))  # first-appearance order
    index_of = {name: index for index, name in enumerate(groups)}
    return groups, tuple(index_of[name] for name in per_param)
