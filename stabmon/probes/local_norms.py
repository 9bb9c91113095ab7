"""Each data-parallel rank's *local* gradient norm, taken before DDP's all-reduce: the
replica check's weaker signal, for corruption that happens before the reduction.

A GPU that computes a wrong gradient corrupts the all-reduced average, which every
replica then applies alike: their parameters stay identical, so the fingerprint vote
(:mod:`stabmon.probes.replicas`) sees nothing. What differs is the rank's own gradient
before the reduction. DDP exposes it in one place only, a communication hook, which sees
each gradient bucket's flat buffer before it is reduced. This hook adds the bucket's
squared norm (on the device, no sync) to the step's total and then reduces exactly as DDP
does without a hook (:func:`_reduce`: multiply by the reciprocal of the group size,
all-reduce; not torch's ``allreduce_hook``, whose division rounds differently on the CPU).
Where DDP divides gradients that are bucket views in place (``gradient_as_bucket_view``
on the CPU) no hook can match it, and none is installed. At each
optimizer step the step's local norm is folded into the maximum over the replica check's
interval; at the check that maximum travels with the fingerprints (one more value in the
same gather) and the judge compares the ranks' maxima (:mod:`stabmon.detectors.replica`).

It is opt-in (``replica_local_norms``) because DDP allows one communication hook per
model: taking it means a ``register_comm_hook`` the loop calls later raises. It is not
installed over a hook the loop registered first, nor on a model that is not DDP.
The hook is given to DDP's reducer directly, not through ``register_comm_hook``, so the
wrapper's own attributes, and a pickle of it, are what they would be without stabmon.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LocalGradNorms", "install"]


class LocalGradNorms:
    """The hook's state: the step's summed squared bucket norms and the interval's maximum."""

    def __init__(self, process_group: Any, device: torch.device) -> None:
        self.process_group = process_group
        self._step = torch.zeros((), dtype=torch.float64, device=device)
        self._most = torch.zeros((), dtype=torch.float64, device=device)
        #: Whether a bucket was seen since the last fold (a step with no synchronised
        #: backward, all under ``no_sync``, has no local norm to fold).
        self._seen = False
        #: Whether the last synchronised backward's last bucket was seen and not folded
        #: since: the next bucket then opens a backward whose optimizer step did not follow
        #: the previous one (GradScaler skipped it on an overflow, or the loop ran another
        #: synchronised backward before stepping), and that backward's norm is dropped.
        self._ended = False
        #: Set at Monitor.detach(): DDP cannot take a communication hook back, so the hook
        #: stays, and from then on only reduces (as DDP does without one) and measures nothing.
        self.closed = False

    def close(self) -> None:
        """Monitor.detach(): measure nothing from now on (the reduction goes on)."""
        self.closed = True

    def add(self, buffer: torch.Tensor, last: bool = False) -> None:
        """A bucket's flat gradient buffer before its reduction (the backward's thread);
        ``last``: the backward's last bucket (``GradBucket.is_last()``).

        Only the last synchronised backward before an optimizer step counts: a step that
        GradScaler skips runs no optimizer step, so no fold, and its overflowed (infinite)
        local norm, routinely on one rank alone, would otherwise be added into the next
        step's and name that rank as corrupted at the next check."""
        if self._ended:
            self._step.zero_()
            self._ended = False
        # float32 reads a half-precision bucket at speed (a float64 or complex one is read as
        # it is: vector_norm refuses to narrow it, and every bucket raised); squared in
        # float64, a huge norm does not overflow.
        wide = buffer.dtype in (torch.float16, torch.bfloat16)
        norm = torch.linalg.vector_norm(buffer, dtype=torch.float32 if wide else None)
        self._step.add_(norm.double().square())
        self._seen = True
        self._ended = last

    def fold(self) -> None:
        """At an optimizer step: the step's local norm into the interval's maximum. A
        non-finite norm stays (``maximum`` propagates NaN): a NaN on one rank alone is the
        strongest local signal there is."""
        if not self._seen:
            return
        torch.maximum(self._most, self._step, out=self._most)
        self._step.zero_()
        self._seen = self._ended = False

    def take(self) -> torch.Tensor:
        """The interval's maximum local norm (a float64 scalar on the device; not squared),
        and a fresh interval."""
        most = self._most.sqrt()
        self._most = torch.zeros_like(self._most)
        return most


def _hook(state: LocalGradNorms, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook (``bucket``: a ``torch.distributed.GradBucket``)."""
    buffer = bucket.buffer()
    if not state.closed:
        try:
            state.add(buffer, bucket.is_last())
        except Exception:  # never in the way of the reduction: the interval just lacks it
            pass
    return _reduce(state.process_group, buffer)


def _reduce(process_group: Any, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``buffer`` over the group exactly as DDP's reducer does without a hook: it
    multiplies each gradient by the reciprocal of the group's size (``at::mul_out`` with a
    double scalar) before the summing all-reduce. torch's ``allreduce_hook`` divides
    instead, which on the CPU rounds differently whenever the size is not a power of two
    (3 gloo ranks: 19 of 836 parameters differed after 5 steps); on CUDA a division by a
    scalar is that same multiplication."""
    group: Any = process_group if process_group is not None else dist.group.WORLD
    buffer.mul_(1.0 / group.size())
    work: Any = dist.all_reduce(buffer, group=group, async_op=True)
    averaged: torch.futures.Future[torch.Tensor] = work.get_future().then(
        lambda done: done.value()[0]
    )
    return averaged


def install(model: Any, device: torch.device) -> LocalGradNorms | str:
    """Register the local-norm hook on a DistributedDataParallel ``model``; the state, or
    why it was not (a sentence for the log)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "the model is not wrapped in DistributedDataParallel (no gradient buckets)"
    if getattr(model, "_comm_hooks", None):
        return "the model has a DDP communication hook of its own (DDP allows one)"
    if device.type == "cpu" and getattr(model, "gradient_as_bucket_view", False):
        # Gradients that already are bucket views are divided in place by DDP's reducer, on
        # the CPU a true division that a hook's averaging cannot match bit for bit.
        return (
            "gradient_as_bucket_view=True on the CPU: DDP averages those gradients in a way "
            "a communication hook cannot reproduce exactly, so training would change; "
            "unset replica_local_norms or gradient_as_bucket_view"
        )
    state = LocalGradNorms(model.process_group, device)
    try:
        dist._register_comm_hook(model.reducer, state, _hook)  # type: ignore[attr-defined]
    except Exception as error:  # a built-in hook registered first, a torch without the API
        return f"DDP refused the hook ({error})"
    return state
