"""How a packed gradient measurement reads on the host: whose norm each value is, and how
they add up to module groups and placements (torch-free: numbers in, numbers out).

The probe (:mod:`stabmon.probes.grads`) builds one :class:`GradLayout` per layout; every
measurement carries it while it waits to be read back, and :meth:`GradLayout.summarize`
turns the read-back values into a :class:`GradSummary`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["GradLayout", "GradSummary"]

#: Up to this many tensors, the group sums run in plain Python (numpy's call overhead is larger).
_SMALL = 64
#: Builds a named tuple in C, without the Python ``__new__`` that NamedTuple generates.
_tuple_new = tuple.__new__


class GradLayout:
    """How to read a packed result of one probe layout: whose norm each value is, and how
    they add up to module groups and placements.

    Built once per layout and never changed, so a measurement carries it while it
    waits to be judged (the probe may be rebuilt meanwhile: a model moved or cast),
    and a summary carries it to a reader on another thread (the exporter's scrape):
    the sums are computed there, when read, rather than at every step.
    """

    def __init__(
        self,
        groups: tuple[str, ...],
        group_of: Sequence[int],
        placement_index: np.ndarray[Any, Any] | None,
        placement_weights: np.ndarray[Any, Any] | None,
        *,
        names: Sequence[str],
        model_order: Sequence[int],
        empty_shards: tuple[int, ...],
    ) -> None:
        """``group_of[i]`` is the group of the i-th packed norm; ``placement_index[i]`` is 1
        for a sharded gradient (None: nothing is sharded), weighted by ``placement_weights``.
        ``names[i]`` is the parameter of the i-th norm, ``model_order[i]`` its position in the
        model; ``empty_shards`` are packed positions of shards this rank holds nothing of."""
        self.groups = groups
        self._group_of = tuple(group_of)
        self._group_index = np.array(group_of, dtype=np.intp)
        self._placement_index = placement_index
        self._placement_weights = placement_weights
        #: Parameter names in the order of the per-tensor norms of a packed result.
        self.names = tuple(names)
        self._model_order = tuple(model_order)
        #: Packed positions of sharded parameters of which this rank holds nothing.
        self.empty_shards = empty_shards

    @property
    def packed_groups(self) -> tuple[str, ...]:
        """Module group of each per-tensor norm of a packed result."""
        return tuple(self.groups[group] for group in self._group_of)

    def summarize(self, values: Sequence[float]) -> GradSummary:
        """Turn read-back per-tensor norms into the numbers every step needs.

        ``math.hypot`` is the total norm in one C call: a NaN makes it NaN, an Inf
        makes it Inf (even beside a NaN), so ``nonfinite`` is a check of the total.
        """
        tensor_norms = values if type(values) is list else list(values)  # poll() hands a new list
        total = math.hypot(*tensor_norms)
        zero = tensor_norms.count(0.0)  # None gradients are zero placeholders
        if self.empty_shards:  # a rank whose shard of a small tensor is empty holds no gradient
            zero -= sum(tensor_norms[order] == 0.0 for order in self.empty_shards)
        return _tuple_new(GradSummary, (total, zero, not math.isfinite(total), tensor_norms, self))

    def nonfinite_offenders(self, summary: GradSummary, limit: int = 5) -> list[str]:
        """Names of the first parameters, in model order, whose gradient norm is NaN or Inf
        (slow path)."""
        offenders = sorted(
            (position, name)
            for position, name, norm in zip(
                self._model_order, self.names, summary.tensor_norms, strict=True
            )
            if not math.isfinite(norm)
        )
        return [name for _, name in offenders[:limit]]

    def group_norms(self, tensor_norms: Sequence[float]) -> dict[str, float]:
        """The L2 norm of each module group; a NaN stays in its own group.

        ``bincount`` sums each group separately (a product with an indicator matrix
        would spread ``0 * NaN`` to every group).
        """
        group_sq: list[float]
        if len(tensor_norms) <= _SMALL:  # a few tensors: plain Python beats numpy's overhead
            group_sq = [0.0] * len(self.groups)
            for group, norm in zip(self._group_of, tensor_norms, strict=True):
                group_sq[group] += norm * norm
        else:
            norms = np.asarray(tensor_norms, dtype=np.float64)
            group_sq = np.bincount(
                self._group_index, weights=norms * norms, minlength=len(self.groups)
            ).tolist()
        return {name: _sqrt(sq) for name, sq in zip(self.groups, group_sq, strict=True)}

    def placement_squares(self, tensor_norms: Sequence[float]) -> tuple[float, float]:
        """``(replicated, sharded)`` squared norms: this rank's share of the sharded part.

        Without sharding everything is replicated: every rank holds the whole gradient.
        """
        if self._placement_index is None:
            total = math.fsum(norm * norm for norm in tensor_norms)
            return total, 0.0
        norms = np.asarray(tensor_norms, dtype=np.float64)
        squares = norms * norms
        if self._placement_weights is not None:
            squares = squares * self._placement_weights
        replicated, sharded = np.bincount(self._placement_index, weights=squares, minlength=2)
        return float(replicated), float(sharded)


class GradSummary(NamedTuple):
    """A measurement read back on the host.

    A named tuple for the reason GradSample is one (and built the same way): one
    is built every measured step. It holds what every step needs (the total and
    the zero count); group and placement sums are properties, computed from
    ``layout`` when read.
    """

    total_norm: float
    #: Trainable tensors whose gradient was None or all zero.
    zero_grad_params: int
    nonfinite: bool
    tensor_norms: list[float]
    layout: GradLayout

    @property
    def group_norms(self) -> dict[str, float]:
        return self.layout.group_norms(self.tensor_norms)

    @property
    def placement_squares(self) -> tuple[float, float]:
        """``(replicated, sharded)``: the squared norm of the gradients every rank holds whole
        (all of them without sharding), and this rank's share of the squared norm of sharded
        ones, its shards' squared norm divided by how many ranks hold the same shard."""
        return self.layout.placement_squares(self.tensor_norms)


def _sqrt(value: float) -> float:
    return math.sqrt(value) if value >= 0 else math.nan  # NaN stays NaN, inf stays inf
