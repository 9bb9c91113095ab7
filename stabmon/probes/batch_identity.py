"""Which batch each step trained on, so a spike or a NaN names the batches to look at or
skip.

A bounded ring holds the identity of the last :data:`RING_STEPS` steps' batches: the
dataset indices a single-process ``DataLoader`` drew for it (seen as ``track()`` hands the
batch out: its sampler iterator is read through, never changed), or the ids the loop
passes to ``observe(batch_ids=...)``. When a spike or a non-finite episode is recorded,
the identities of the last :data:`WINDOW_STEPS` steps up to it go to a
``batch_identities`` event and to ``rank-<rank>.skip_batches.json`` in the run directory:
a JSON list of ``{"step": int, "rank": int, "kind": str, "indices": [int, ...]}``
(``"ids"`` for the loop's own; ``"top_samples"``, the highest per-sample losses, when the
loop passes ``observe(sample_losses=...)``), ready for a loop to skip those samples when it
resumes
(docs/loops.md, "Skipping the batches of an incident"). A loader with worker processes
prefetches indices before a pass can see them: its batches have no indices, and
``observe(batch_ids=...)`` is the way to name them.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stabmon.shared.rundir import prepare_run_directory, write_atomic

if TYPE_CHECKING:
    from stabmon.extension import Context

__all__ = ["RING_STEPS", "WINDOW_STEPS", "BatchIdentities"]

#: Steps whose batch identities are kept (per rank): a bounded ring.
RING_STEPS = 64
#: Steps up to an incident whose batches are named (a spike's cause may be a step early).
WINDOW_STEPS = 4
#: Entries a skip file holds at most (the oldest go first): bounded on disk too.
MAX_FILE_ENTRIES = 1000
#: Indices kept per batch at most.
MAX_INDICES = 4096
#: Samples with the highest loss named per batch, when the loop passes per-sample losses.
TOP_SAMPLES = 5
#: Anomalies whose batches are named.
INCIDENTS = frozenset({"grad_spike", "loss_spike", "nonfinite_grad", "nonfinite_loss"})


class BatchIdentities:
    """Plug-in: the ring of batch identities, and the record of an incident's batches."""

    component = "hooks"

    def __init__(self, context: Context) -> None:
        self._context = context
        self._ring: deque[tuple[int, str, list[int]]] = deque(maxlen=RING_STEPS)
        self._drawn: deque[list[int]] = deque(maxlen=RING_STEPS)  # sampler batches not yet out
        self._entries: list[dict[str, Any]] = []
        # The highest per-sample losses of recent steps: step -> [(position in batch, loss)].
        self._top: dict[int, list[tuple[int, float]]] = {}
        self.judge_top = self._judge_top  # bound once: carried by each readback tag
        self._path = context.run_directory / f"rank-{context.rank}.skip_batches.json"

    # --- the training thread ------------------------------------------------------------

    def follow(self, iterator: Iterator[Any]) -> None:
        """A pass of ``track()`` began: read a single-process DataLoader's sampler through."""
        sampler_iter = getattr(iterator, "_sampler_iter", None)
        if sampler_iter is None or getattr(iterator, "_num_workers", 1) != 0:
            return
        self._drawn.clear()
        iterator._sampler_iter = _Drawn(sampler_iter, self._drawn)  # type: ignore[attr-defined]

    def fetched(self, step: int) -> None:
        """A tracked batch was handed out for ``step``: its sampler indices, if drawn."""
        if self._drawn:
            self._ring.append((step, "indices", self._drawn.popleft()))

    def observed(self, step: int, ids: Sequence[Any]) -> None:
        """``observe(batch_ids=...)`` for ``step``: the loop's own ids (ints), bounded."""
        self._ring.append((step, "ids", [int(i) for i in list(ids)[:MAX_INDICES]]))

    def top_samples(self, losses: torch.Tensor) -> torch.Tensor | None:
        """The batch's highest per-sample losses and their positions, on the device (read
        back later for :meth:`judge_top`); None for an empty or non-1-D tensor."""
        flat = losses.detach().reshape(-1)
        if flat.numel() == 0:
            return None
        values, positions = flat.float().topk(min(TOP_SAMPLES, flat.numel()))
        return torch.cat([values, positions.float()])

    def _judge_top(self, step: int, values: list[float], extra: object) -> None:
        half = len(values) // 2
        self._top[step] = [(int(p), v) for v, p in zip(values[:half], values[half:], strict=True)]
        while len(self._top) > RING_STEPS:
            del self._top[min(self._top)]

    # --- an incident (whichever thread records it) --------------------------------------

    def anomaly_recorded(self, kind: str, step: int | None) -> None:
        if kind not in INCIDENTS or step is None:
            return
        rank = self._context.rank
        batches = [
            self._entry(at, rank, kind, what, values)
            for at, what, values in list(self._ring)
            if step - WINDOW_STEPS < at <= step
        ]
        if not batches:
            return
        self._context.event("batch_identities", step=step, kind=kind, batches=batches)
        fresh = {batch["step"] for batch in batches}
        kept = [entry for entry in self._entries if entry["step"] not in fresh]
        # One entry per step, the latest (a later incident of the step may know its top samples).
        self._entries = (kept + batches)[-MAX_FILE_ENTRIES:]
        try:
            prepare_run_directory(self._path.parent)  # ours, not a directory planted for us
            write_atomic(self._path, json.dumps(self._entries).encode())
        except OSError as error:
            self._context.log(
                "skip_batches", logging.WARNING,
                "stabmon: cannot write %s (%s); the batches are in the event log",
                self._path, error,
            )  # fmt: skip

    def _entry(self, at: int, rank: int, kind: str, what: str, values: list[int]) -> dict[str, Any]:
        entry: dict[str, Any] = {"step": at, "rank": rank, "kind": kind, what: list(values)}
        top = self._top.get(at)
        if top:  # the samples with the highest loss, by dataset index where known
            entry["top_samples"] = [
                {"position": p, "loss": loss, **({"index": values[p]} if p < len(values) else {})}
                for p, loss in top
            ]
        return entry


class _Drawn:
    """A sampler iterator read through: each index batch is also queued for ``fetched``."""

    __slots__ = ("_drawn", "_iterator")

    def __init__(self, iterator: Iterator[Any], drawn: deque[list[int]]) -> None:
        self._iterator, self._drawn = iterator, drawn

    def __iter__(self) -> _Drawn:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        try:
            indices = list(batch) if isinstance(batch, (list, tuple)) else [batch]
            self._drawn.append([int(i) for i in indices[:MAX_INDICES]])
        except (TypeError, ValueError):
            self._drawn.append([])  # a sampler of keys that are not integers
        return batch
