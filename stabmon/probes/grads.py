"""Gradient health in one fused pass over every gradient, computed on the device.

``torch._foreach_norm`` gives the L2 norm of each gradient tensor in one fused
launch per (device, dtype) bucket, and one ``stack`` packs them into a 1-D
tensor: that is all the device does, the floor of reading every gradient once.
(A few CPU tensors skip the stack: their norms are host memory, read one by one.)
Everything else is reduced on the host from those per-tensor norms when they
are read back a step later (one asynchronous copy of a few bytes per tensor).
Every step needs only the total, for the spike and non-finite checks, and the
count of all-zero gradients: one ``math.hypot`` and one ``list.count``, both in
C. The non-finite check needs no pass of its own: a NaN or Inf anywhere makes
the total NaN or Inf. Sums per module group and per placement are computed
when somebody reads them (a scrape, a step sample), from the last step's norms
and the :class:`GradLayout`: most steps nobody does. Each device launch costs
the host a few microseconds of dispatch; doing the sums on the device cost five
more launches per step for a handful of numbers. Half-precision gradients are
normed in fp32 and the host sums run in fp64 (``hypot`` rescales, so a large
but finite norm cannot overflow into a false "non-finite"). This module knows
nothing of hooks, threads or metrics: tensors in, numbers out.

Sharded parameters (FSDP2's ``fully_shard`` and tensor parallelism: DTensors with
a ``Shard`` placement; FSDP1's flat parameters) hold only this rank's shard of
the gradient. The probe norms the local shard (``to_local()``, never a
collective: adding one to every step would cost every rank a round trip) and
keeps the squared norms of sharded and of replicated gradients apart, so the
global norm is ``sqrt(sum over ranks of the sharded part + the replicated part
of any one rank)``; PromQL computes it from every rank's export. A shard that
several ranks hold (HSDP's replicate dimension, tensor parallelism inside data
parallelism) would be counted once per holder, so each exports its share: the
shard's squared norm divided by the number of holders.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from stabmon.probes.grad_layout import GradLayout, GradSummary
from stabmon.probes.module_groups import ROOT_GROUP, automatic_groups
from stabmon.shared.log import LogLimiter

__all__ = [
    "GradLayout",
    "GradProbe",
    "GradSample",
    "GradSummary",
    "assign_groups",
    "build_grad_probe",
    "group_name",
]

#: Up to this many CPU tensors, their norms are read one by one rather than stacked first: one
#: ``stack`` costs the host more than a few reads of zero-dimensional tensors (the crossover was
#: a one-off callgrind count; bench/instructions.py counts whole steps, with this in them).
_READ_UNSTACKED = 16
#: Builds a named tuple in C, without the Python ``__new__`` that NamedTuple generates.
_tuple_new = tuple.__new__
#: Label of the module group that collects parameters beyond ``max_modules`` groups.
OTHER_GROUP = "other"


def group_name(param_name: str, depth: int) -> str:
    """The module group of a parameter: the first ``depth`` parts of its module path."""
    module_path = param_name.split(".")[:-1]
    if not module_path:
        return ROOT_GROUP
    return ".".join(module_path[:depth])


class GradSample(NamedTuple):
    """A measurement in flight: the packed norms and what the host needs to read them.

    A named tuple, not a frozen dataclass: one is built every measured step, and a
    tuple is the cheapest immutable record to build. The hot path builds it with
    ``tuple.__new__``: NamedTuple's generated ``__new__`` is one more Python call.
    """

    #: The per-tensor norms: a 1-D device tensor, or already host floats (a few CPU tensors).
    packed: torch.Tensor | list[float]
    #: Gradients that were None (they are measured as zero placeholders).
    none_count: int


@dataclass(frozen=True)
class _Bucket:
    """Parameters sharing a device and dtype: one fused ``_foreach_norm`` launch."""

    positions: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    #: The dtype norms are computed in: fp64 for fp64 gradients, else fp32 (fp16/bf16 would
    #: overflow). Fixed with the layout, so the hot path only compares it.
    norm_dtype: torch.dtype


class GradProbe:
    """Measures the gradients of a fixed list of trainable parameters.

    The layout (buckets, module groups, index tensor) is computed once and has a
    fixed length: a missing (None) gradient is measured as a zero placeholder,
    so the packed result never changes size and nothing is uploaded per step.
    The layout is rebuilt when the parameters move or change dtype (``model.to("cuda")``
    or ``.half()`` after attach). A step costs one list of ``.grad`` reads, one ``_foreach_norm``
    per bucket and a handful of tiny reductions, none of which waits for the
    device.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        *,
        module_depth: int = 1,
        max_modules: int = 32,
        candidates: Sequence[torch.Tensor] = (),
    ) -> None:
        """``named_params`` are measured; ``candidates`` (all of the optimizer's parameters)
        are watched for ``requires_grad`` changes, see :meth:`trainable_changed`."""
        self.names: tuple[str, ...] = tuple(name for name, _ in named_params)
        self._candidates = tuple(candidates)
        self._trainable = tuple(param.requires_grad for param in self._candidates)
        self._params: tuple[torch.Tensor, ...] = tuple(param for _, param in named_params)
        self._ids = frozenset(id(param) for param in self._params)
        self.groups, self._group_of = assign_groups(
            self.names, self._params, module_depth, max_modules
        )
        # Buckets whose fused launch failed on sparse gradients: normed per tensor from then on.
        self._per_tensor_buckets: set[int] = set()
        # Whether some gradient was ever None (unused parameters usually stay so): from then on
        # each step counts them and measures them as zero placeholders.
        self._none_seen = False
        self._build()

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        return self._params

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the measured parameters (a clip of it is ours to see)."""
        return id(param) in self._ids

    @property
    def sharded(self) -> bool:
        """Whether some parameter is sharded across ranks (FSDP, tensor parallelism)."""
        return self._sharded

    def trainable_changed(self) -> bool:
        """Whether a candidate parameter was frozen or unfrozen since the probe was built."""
        return tuple(param.requires_grad for param in self._candidates) != self._trainable

    def measure(self) -> GradSample | None:
        """Start measuring the current gradients; None when no gradient is present."""
        if self._params and (self._params[0].device, self._params[0].dtype) != self._placed_as:
            self._build()  # the model was moved or cast after attach (model.to(...), .half())
        grads = [param.grad for param in self._params]
        for position in self._distributed_positions:  # DTensor gradients: this rank's shard
            grad = grads[position]
            if grad is not None:
                grads[position] = grad.to_local()  # type: ignore[attr-defined]
        if not self._none_seen:
            # Every gradient has been present so far (the usual case): no count, and a None
            # appearing now makes the fused launch refuse the list, which switches to counting.
            try:
                packed = self._pack(grads)  # type: ignore[arg-type]  # a None raises: below
                return _tuple_new(GradSample, (packed, 0))
            except (TypeError, AttributeError):  # per-tensor (sparse) norms meet None.is_sparse
                if not any(grad is None for grad in grads):
                    raise
                self._none_seen = True
        # A comprehension, not `None in grads` (which would call Tensor.__eq__) nor a generator.
        none_count = len(grads) - len([grad for grad in grads if grad is not None])
        if none_count == len(grads):
            return None
        present = cast(
            list[torch.Tensor],
            [
                zero if grad is None else grad
                for grad, zero in zip(grads, self._placeholders, strict=True)
            ]
            if none_count
            else grads,
        )
        return _tuple_new(GradSample, (self._pack(present), none_count))

    def _pack(self, grads: list[torch.Tensor]) -> torch.Tensor | list[float]:
        """The per-tensor norms of ``grads`` (one per parameter, none None) as one 1-D tensor,
        or as host floats when a few CPU tensors are read directly (no device to wait for)."""
        if len(self._buckets) == 1:  # then every parameter is on self.device already
            norms = self._bucket_norms(0, grads)
            if self._read_unstacked:
                # 0-d CPU tensors: host memory already, and tolist() of one is a float.
                return [norm.tolist() for norm in norms]  # type: ignore[misc]
            return torch.stack(norms)
        return torch.cat(
            [
                torch.stack(self._bucket_norms(index, [grads[p] for p in bucket.positions])).to(
                    self.device, self._norm_dtype, non_blocking=True
                )
                for index, bucket in enumerate(self._buckets)
            ]
        )

    def _build(self) -> None:
        """Buckets, zero placeholders and the group index for where the parameters are now."""
        self._buckets = _bucket(self._params)
        self.device: torch.device = self._params[0].device if self._params else torch.device("cpu")
        self._read_unstacked = (
            len(self._buckets) == 1
            and self.device.type == "cpu"
            and len(self._params) <= _READ_UNSTACKED
        )
        self._placed_as = (self.device, self._params[0].dtype if self._params else None)
        # Order of the per-tensor norms in the packed result: bucket order.
        self._order: tuple[int, ...] = tuple(
            position for bucket in self._buckets for position in bucket.positions
        )
        zeros = {
            (bucket.device, bucket.dtype): torch.zeros((), dtype=bucket.dtype, device=bucket.device)
            for bucket in self._buckets
        }
        self._placeholders = [zeros[(param.device, param.dtype)] for param in self._params]
        # Several buckets are concatenated in one dtype: fp64 only if some gradient is fp64.
        any_fp64 = any(bucket.dtype == torch.float64 for bucket in self._buckets)
        self._norm_dtype = torch.float64 if any_fp64 else torch.float32
        sharded = [_is_sharded(self._params[p]) for p in self._order]
        self._sharded = any(sharded)
        self._distributed_positions = tuple(
            position for position, param in enumerate(self._params) if _is_dtensor(param)
        )
        # A shard held by r replicas (HSDP, tensor parallel x data parallel) is summed r times
        # over the ranks: each rank exports its share, 1/r of its squared norm.
        self.layout = GradLayout(
            self.groups,
            [self._group_of[p] for p in self._order],
            np.array(sharded, dtype=np.intp) if self._sharded else None,
            np.array(
                [
                    1.0 / _replicas(self._params[p]) if s else 1.0
                    for p, s in zip(self._order, sharded, strict=True)
                ]
            )
            if self._sharded
            else None,
            names=[self.names[p] for p in self._order],
            model_order=self._order,
            empty_shards=tuple(
                order
                for order, position in enumerate(self._order)
                if sharded[order] and _local_numel(self._params[position]) == 0
            ),
        )

    def _bucket_norms(self, index: int, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        bucket = self._buckets[index]
        norm_dtype = bucket.norm_dtype
        if index not in self._per_tensor_buckets:
            try:
                if bucket.dtype == norm_dtype:
                    # No dtype argument when it changes nothing: with one, the CPU kernel
                    # takes a slower path (a one-off timing; bench/overhead.py times whole steps).
                    return list(torch._foreach_norm(grads, 2.0))
                return list(torch._foreach_norm(grads, 2.0, dtype=norm_dtype))
            except (RuntimeError, NotImplementedError):
                if not any(grad.is_sparse for grad in grads):
                    raise
                # Sparse gradients (nn.Embedding(sparse=True)) have no fused kernel.
                self._per_tensor_buckets.add(index)
        return [_tensor_norm(grad, norm_dtype) for grad in grads]


def _is_dtensor(param: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return False
    return isinstance(param, DTensor)


def _is_sharded(param: torch.Tensor) -> bool:
    """Whether each rank holds only part of this parameter (and so of its gradient).

    DTensors (FSDP2, tensor parallelism) say so in their placements; FSDP1's flat
    parameters are shards (except under ``NO_SHARD``, which is DDP by another name).
    """
    if _is_dtensor(param):
        return any(placement.is_shard() for placement in param.placements)  # type: ignore[attr-defined]
    return bool(getattr(param, "_is_flat_param", False))


def _replicas(param: torch.Tensor) -> int:
    """How many ranks hold this rank's shard: the mesh sizes of the ``Replicate`` dimensions."""
    if not _is_dtensor(param):
        return 1
    mesh: Any = param.device_mesh  # type: ignore[attr-defined]
    replicas = 1
    for dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        if placement.is_replicate():
            replicas *= int(mesh.size(dim))
    return max(replicas, 1)


def _local_numel(param: torch.Tensor) -> int:
    local = param.to_local() if _is_dtensor(param) else param  # type: ignore[attr-defined]
    return int(local.numel())


def _tensor_norm(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if grad.is_sparse:
        # Uncoalesced sparse gradients repeat indices; their norm is the coalesced one.
        # Coalescing synchronises on CUDA: sparse gradients are the documented exception.
        norm: torch.Tensor = torch.linalg.vector_norm(grad.coalesce().values(), dtype=dtype)
    else:
        norm = torch.linalg.vector_norm(grad, dtype=dtype)
    return norm


def _bucket(params: Sequence[torch.Tensor]) -> tuple[_Bucket, ...]:
    positions: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for position, param in enumerate(params):
        positions.setdefault((param.device, param.dtype), []).append(position)
    return tuple(
        _Bucket(
            positions=tuple(items),
            device=device,
            dtype=dtype,
            norm_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
        )
        for (device, dtype), items in positions.items()
    )


def assign_groups(
    names: Iterable[str],
    params: Sequence[torch.Tensor],
    depth: int,
    max_modules: int,
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Module group per parameter, at most ``max_modules`` labels (bounded cardinality).

    ``depth`` 0 groups by the model's repeated blocks (:mod:`stabmon.probes.module_groups`;
    top-level modules when it has none). When there are more groups than allowed, the
    largest by element count keep their own label and the rest share ``other``.
    """
    names = list(names)
    shapes = [tuple(param.shape) for param in params]
    per_param = automatic_groups(names, max_modules, shapes) if depth == 0 else None
    if per_param is None:
        per_param = [group_name(name, depth or 1) for name in names]
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


def build_grad_probe(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    module_depth: int,
    max_modules: int,
    limiter: LogLimiter,
) -> GradProbe:
    """A probe over the optimizer's trainable parameters, named by ``named_parameters``
    (the unwrapped model's).

    Complex-valued parameters are left out (logged once): their norms are not comparable
    with the real ones, and the fused kernel takes one dtype per bucket.
    """
    named_parameters = list(named_parameters)  # read twice: names, then model order
    names = {id(param): name for name, param in named_parameters}
    named: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            if param.is_complex():
                limiter.once(
                    "complex-param",
                    logging.WARNING,
                    "stabmon: parameter %s is complex-valued; its gradient is left out of the "
                    "gradient norms (the others are measured; logged once)",
                    names.get(id(param), f"group{group_index}.param{param_index}"),
                )
                continue
            named.append((names.get(id(param), f"group{group_index}.param{param_index}"), param))
    # Model order, not the optimizer's (Hugging Face's Trainer puts every decayed weight
    # before every bias): the module groups, and the parameters a message names first, are
    # then listed as the model runs. Parameters the model does not name keep their place last.
    position = {id(param): index for index, (_, param) in enumerate(named_parameters)}
    named.sort(key=lambda item: position.get(id(item[1]), len(position)))
    return GradProbe(
        named,
        module_depth=module_depth,
        max_modules=max_modules,
        candidates=[p for group in optimizer.param_groups for p in group["params"]],
    )
