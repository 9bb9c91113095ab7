"""Which batch each step trained on, so a spike or a NaN names the batches to look at or
skip.

A bounded ring holds the identity of the last :data:`RING_STEPS` steps' batches: the
dataset indices a ``DataLoader`` passed to ``track()`` drew for it, the ids the loop
passes to ``observe(batch_ids=...)``, or else its samples' content hashes. When a spike or
a non-finite episode is recorded, the identities of the last :data:`WINDOW_STEPS` steps up
to it go to a ``batch_identities`` event and to ``rank-<rank>.skip_batches.json`` in the
run directory: a JSON list of ``{"step": int, "rank": int, "kind": str, "indices": [int,
...]}`` (``"ids"`` for the loop's own, ``"hashes"`` for content hashes; ``"top_samples"``,
the highest per-sample losses, when the loop passes ``observe(sample_losses=...)``), ready
for a loop to skip those samples when it resumes (docs/loops.md, "The batches of an
incident").

Design: how a batch's indices are known. The loader's index sampler (its ``batch_sampler``,
or its ``sampler`` without automatic batching) is read through by :class:`_IndexReader`:
the same iteration, ``len()`` and attributes, each index batch also kept, numbered from
the pass's start. Its draws are never changed, and the dataset is never touched.

- A loader with worker processes draws its index batches in the main process, ahead of the
  batches it hands out: ``prefetch_factor * num_workers`` of them in its iterator's
  constructor, inside ``iter(loader)``, before anything could read its iterator. So
  ``track()`` opens each pass through :meth:`BatchIdentities.opening`: the loader's
  sampler attribute is our reader for the span of that ``iter()`` call only (the iterator
  keeps the reader as its ``_index_sampler``, the loader gets its own sampler back; another
  thread's ``iter()`` of the same loader within that call reads through it too, unfollowed,
  and a copy or pickle of the reader is the sampler itself). With
  ``persistent_workers=True`` ``iter(loader)`` reuses the iterator, whose ``_reset`` draws
  the next pass's first batches from the reader it keeps (one it had before ``track()``
  saw it is read through from then on). Draw *n* of a pass is task *n* sent to a worker
  (every draw is sent: a map-style dataset's workers never run dry), and with
  ``in_order=True``, the default, the loader hands out task ``_rcvd_idx - 1`` last: the
  batch handed out is the draw of that number, whatever the prefetch depth.
- A single-process loader draws each batch inside the ``next()`` that returns it: the
  batch is the pass's latest draw.
- Each pass is followed on its own (a validation loader's pass inside a training one's,
  two loaders zipped), and a pass that ends with no optimizer step taken (validation) has
  its batches taken out of the ring at its end: they are fetched under the next training
  step's number but trained nothing, and their indices are another dataset's. One left
  before its end (``break``) is known as one when the training pass, begun before it,
  fetches its next batch under the same step number (validation after an optimizer
  step), not when it ran between a training batch's fetch and its step.
- Named nothing, rather than a wrong index: ``in_order=False`` (workers hand batches out as
  they finish), an ``IterableDataset`` (no sampler indices), a sampler whose batches are not
  integers (keys, floats), a draw older than :data:`MAX_PENDING` batches, the batches a
  pass drew before its iterator reached ``track()`` (an iterator passed to ``track()``, a
  subclass whose ``_index_sampler`` is not its ``batch_sampler``/``sampler``: read from
  its next draw on), a loader that checkpoints its sampler's state (torchdata's
  ``StatefulDataLoader``: read through, its checkpoint would lose that state), and the
  Lightning, Hugging Face and Ultralytics adapters, whose
  trainers iterate their loaders without ``track()``. For these,
  ``observe(batch_ids=...)`` names the batches; where the loop passes none, a batch the
  model receives in host memory is named by its samples' content hashes
  (:mod:`stabmon.probes.sample_hash`, ``"hashes"`` in the records). One on a GPU is named
  nothing: hashing it would cost device work and a read-back every step.
"""

from __future__ import annotations

import itertools
import json
import logging
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset

from stabmon.probes.sample_hash import row_hashes
from stabmon.shared.guard import Guard
from stabmon.shared.rundir import prepare_run_directory, write_atomic

if TYPE_CHECKING:
    from stabmon.extension import Context

__all__ = ["RING_STEPS", "WINDOW_STEPS", "BatchIdentities", "Pass"]

T = TypeVar("T")

#: Steps whose batch identities are kept (per rank): a bounded ring.
RING_STEPS = 64
#: Steps up to an incident whose batches are named (a spike's cause may be a step early).
WINDOW_STEPS = 4
#: Entries a skip file holds at most (the oldest go first): bounded on disk too.
MAX_FILE_ENTRIES = 1000
#: Indices kept per batch at most.
MAX_INDICES = 4096
#: Index batches drawn and not yet handed out that are kept (a loader's prefetch depth,
#: ``prefetch_factor * num_workers``, is far below): at most 16 MiB of indices.
MAX_PENDING = 512
#: Samples with the highest loss named per batch, when the loop passes per-sample losses.
TOP_SAMPLES = 5
#: Anomalies whose batches are named.
INCIDENTS = frozenset({"grad_spike", "loss_spike", "nonfinite_grad", "nonfinite_loss"})


class BatchIdentities:
    """Plug-in: the ring of batch identities, and the record of an incident's batches."""

    component = "hooks"

    def __init__(self, context: Context) -> None:
        self._context = context
        # (step, kind of identity, the identity, the number of the pass it came from; None
        # for the loop's own ids).
        self._ring: deque[tuple[int, str, Sequence[int], int | None]] = deque(maxlen=RING_STEPS)
        self._passes = itertools.count()
        self._entries: list[dict[str, Any]] = []
        # The highest per-sample losses of recent steps: step -> [(position in batch, loss)].
        self._top: dict[int, list[tuple[int, float]]] = {}
        # Content hashes of the batches nothing else names: (step, the samples' hashes).
        self._hashes: deque[tuple[int, list[int]]] = deque(maxlen=RING_STEPS)
        self._ids_given = False  # the loop names its batches (observe(batch_ids=...))
        self.judge_top = self._judge_top  # bound once: carried by each readback tag
        self._path = context.run_directory / f"rank-{context.rank}.skip_batches.json"

    # --- the training thread ------------------------------------------------------------

    @staticmethod
    def opening(loader: Iterable[T], guard: Guard) -> Iterable[T]:
        """``loader`` as ``track()``'s pass iterates it: its ``iter()`` reads a DataLoader's
        index sampler through from the first draw (the module docstring says why)."""
        return _Opening(loader, guard)

    def follow(self, iterator: Iterator[Any]) -> Pass | None:
        """A pass of ``track()`` began with ``iterator``: what follows its draws, where they
        name the batches it hands out exactly (the pass hands it to :meth:`fetched`: passes
        interleave, a validation loader's inside a training one's); None where they do not."""
        workers = getattr(iterator, "_num_workers", None)
        if not isinstance(workers, int) or isinstance(
            getattr(iterator, "_dataset", None), IterableDataset
        ):
            return None  # not a DataLoader's iterator, or no sampler indices
        if workers > 0 and getattr(iterator, "_in_order", True) is not True:
            return None  # batches are handed out as workers finish them, not in draw order
        reader = getattr(iterator, "_index_sampler", None)
        drawing = getattr(iterator, "_sampler_iter", None)
        draws: _Draws | None
        if isinstance(reader, _IndexReader) and reader._stabmon_draws is drawing:
            draws = reader._stabmon_draws
        elif isinstance(drawing, _Draws):  # an iterator track() has seen before
            draws = drawing
        elif _checkpoints(iterator):
            return None  # its state holds the sampler iterator's: not read through
        else:  # an iterator opened without us: read from its next draw on
            sent = getattr(iterator, "_send_idx", 0) if workers > 0 else 0
            if drawing is None or not isinstance(sent, int):
                return None
            draws = _Draws(drawing, first=sent)
            iterator._sampler_iter = draws  # type: ignore[attr-defined]
        if draws is None:
            return None
        return Pass(next(self._passes), draws, weakref.ref(iterator) if workers > 0 else None)

    def fetched(self, step: int, followed: Pass | None) -> None:
        """A batch of the pass ``followed`` was handed out for ``step``: its sampler indices,
        if known."""
        if followed is None:
            return
        draws = followed.draws
        if followed.iterator is not None:  # workers: the task the loader handed out last
            number = getattr(followed.iterator(), "_rcvd_idx", None)
            if not isinstance(number, int):
                return
            indices = draws.take(number - 1)
        else:  # drawn inside the next() that returned the batch
            indices = draws.take(draws.drawn - 1)
        if indices is None:
            return
        ring, number = self._ring, followed.number
        # A pass begun after this one whose batches came under this same step number, with
        # no optimizer step after them: a validation pass between steps, left before its
        # end (no untrained() call). One begun before (the training pass around a
        # validation pass run between a fetch and its step, a zipped loader) stays.
        while ring and ring[-1][0] == step and (ring[-1][3] is not None) and ring[-1][3] > number:
            ring.pop()
        ring.append((step, "indices", indices, number))  # a list at an incident only

    def forward(self, step: int, args: Any, kwargs: Any) -> None:
        """A training forward of ``step``: its input's content hashes, where no dataset
        index or id names the batch and the input is in host memory (the module docstring
        says why not on a GPU). Once per micro-batch: gradient accumulation adds each."""
        if self._ids_given:
            return
        ring = self._ring
        if ring and ring[-1][0] == step:  # track() named it by its sampler indices
            return
        batch = _first_tensor(args, kwargs)
        if batch is None or not batch.is_cpu or batch.layout != torch.strided or batch.is_quantized:
            return  # on a GPU, or a kind of tensor (sparse, nested, quantized) not indexed so
        if batch.ndim and batch.shape[0] > MAX_INDICES:
            batch = batch[:MAX_INDICES]  # the rows kept: a large tabular batch pays for those
        hashes: list[int] = row_hashes(batch).tolist()  # host memory: no sync
        kept = self._hashes
        if kept and kept[-1][0] == step:
            kept[-1][1].extend(hashes[: MAX_INDICES - len(kept[-1][1])])
        else:
            kept.append((step, hashes))

    def untrained(self, followed: Pass | None) -> None:
        """The pass ``followed`` ended without an optimizer step (a validation loader): its
        batches trained nothing, though numbered with the next training step's number."""
        if followed is not None:
            number = followed.number
            kept = [entry for entry in self._ring if entry[3] != number]
            if len(kept) != len(self._ring):
                self._ring = deque(kept, maxlen=RING_STEPS)

    def observed(self, step: int, ids: Sequence[Any]) -> None:
        """``observe(batch_ids=...)`` for ``step``: the loop's own ids (ints), bounded.

        A tensor is read only on the CPU: ids moved to the GPU with the rest of the batch
        would be read back one element at a time (a host-device sync each, thousands a
        step); they are refused with a line saying what to pass."""
        if isinstance(ids, torch.Tensor):
            if ids.device.type != "cpu" or ids.is_floating_point():
                self._context.log(
                    "batch_ids", logging.WARNING,
                    "stabmon: observe(batch_ids=...) got a %s tensor on %s: batch ids must be "
                    "integers on the host (reading them off the device would stall every "
                    "step); pass the ids before moving the batch to the device, e.g. "
                    "batch_ids=batch['idx'] from the loader, or a list of ints",
                    ids.dtype, ids.device,
                )  # fmt: skip
                return
            values: list[Any] = ids.reshape(-1)[:MAX_INDICES].tolist()  # host memory: no sync
        else:
            values = list(itertools.islice(ids, MAX_INDICES))
        self._ring.append((step, "ids", [int(i) for i in values], None))
        self._ids_given = True

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
        named = [(at, what, values) for at, what, values, _ in list(self._ring)]
        steps = {at for at, _, _ in named}
        named += [(at, "hashes", values) for at, values in list(self._hashes) if at not in steps]
        batches = [
            self._entry(at, rank, kind, what, values)
            for at, what, values in sorted(named, key=lambda entry: entry[0])
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

    def _entry(
        self, at: int, rank: int, kind: str, what: str, values: Sequence[int]
    ) -> dict[str, Any]:
        entry: dict[str, Any] = {"step": at, "rank": rank, "kind": kind, what: list(values)}
        top = self._top.get(at)
        if top:  # the samples with the highest loss, by dataset index where known
            key = "hash" if what == "hashes" else "index"
            entry["top_samples"] = [
                {"position": p, "loss": loss, **({key: values[p]} if p < len(values) else {})}
                for p, loss in top
            ]
        return entry


class Pass:
    """One ``track()`` pass followed: its draws, and its loader iterator (weakly) where
    worker processes hand out the batches."""

    __slots__ = ("draws", "iterator", "number")

    def __init__(self, number: int, draws: _Draws, iterator: weakref.ref[Any] | None) -> None:
        self.number, self.draws, self.iterator = number, draws, iterator


class _Opening(Generic[T]):
    """A loader whose ``iter()`` goes through :func:`_open`."""

    __slots__ = ("_guard", "_loader")

    def __init__(self, loader: Iterable[T], guard: Guard) -> None:
        self._loader, self._guard = loader, guard

    def __iter__(self) -> Iterator[T]:
        loader, restore = self._loader, None
        with self._guard.contain("hooks"):
            restore = _open(loader)
        try:
            return iter(loader)  # the loader's own errors are the loop's
        finally:
            if restore is not None:
                with self._guard.contain("hooks"):
                    restore()


def _open(loader: object) -> Callable[[], None] | None:
    """Make the next ``iter(loader)`` draw through an :class:`_IndexReader`; return what
    puts the loader's own sampler back after it, if anything must be."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    if _checkpoints(loader):
        return None
    if loader.num_workers > 0 and getattr(loader, "in_order", True) is not True:
        return None
    iterator = getattr(loader, "_iterator", None)  # persistent workers: reused, reset inside iter()
    if loader.persistent_workers and loader.num_workers > 0 and iterator is not None:
        sampler = getattr(iterator, "_index_sampler", None)
        if sampler is not None and not isinstance(sampler, _IndexReader):
            iterator._index_sampler = _IndexReader(sampler)
        return None
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    sampler = getattr(loader, name)
    if loader._index_sampler is not sampler:  # a subclass's own: left alone
        return None
    # DataLoader refuses a new sampler once built; the swap lasts the iter() call only.
    object.__setattr__(loader, name, _IndexReader(sampler))
    return lambda: object.__setattr__(loader, name, sampler)


def _checkpoints(loader: object) -> bool:
    """Whether ``loader`` (or its iterator) saves its sampler's state in a checkpoint
    (torchdata's ``StatefulDataLoader``): it asks its index sampler and sampler iterator
    for their ``state_dict``, which a read-through's draws do not have (nor, where
    protocol checks ignore forwarded attributes, its sampler), so read through, it saved
    no sampler state and a resumed run drew other batches than without stabmon (torchdata
    0.11, shuffled, resumed after 3 batches). Left alone: named nothing."""
    return callable(getattr(loader, "state_dict", None))


class _IndexReader:
    """A loader's index sampler, read through: each ``iter()`` (a pass) is followed by the
    :class:`_Draws` it returns; ``len()`` and every attribute are the sampler's (ours are
    named so as not to hide one of its own: a ``BatchSampler`` has a ``sampler``)."""

    __slots__ = ("_stabmon_draws", "_stabmon_sampler")

    def __init__(self, sampler: Any) -> None:
        self._stabmon_sampler = sampler
        self._stabmon_draws: _Draws | None = None  # the latest pass's

    def __iter__(self) -> Iterator[Any]:
        self._stabmon_draws = _Draws(iter(self._stabmon_sampler))
        return self._stabmon_draws

    def __len__(self) -> int:
        return len(self._stabmon_sampler)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_stabmon_"):  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self._stabmon_sampler, name)

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        # A copy or a pickle (a spawned worker's arguments that reach the loader) is the
        # sampler itself: a pass's draws are this process's, and a generator cannot be pickled.
        return _itself, (self._stabmon_sampler,)


def _itself(value: Any) -> Any:
    return value


class _Draws:
    """A pass's sampler iterator, read through: each index batch is kept, numbered from
    ``first``, until :meth:`take` asks for it or a later one (bounded by MAX_PENDING)."""

    __slots__ = ("_iterator", "_pending", "drawn")

    def __init__(self, iterator: Iterator[Any], *, first: int = 0) -> None:
        self._iterator = iterator
        self._pending: deque[tuple[int, array[int] | None]] = deque(maxlen=MAX_PENDING)
        self.drawn = first  # the number of the next draw

    def __iter__(self) -> _Draws:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self._pending.append((self.drawn, _indices(batch)))
        self.drawn += 1
        return batch

    def take(self, number: int) -> array[int] | None:
        """Draw ``number``'s indices (None where unknown); earlier draws are dropped."""
        pending = self._pending
        while pending and pending[0][0] < number:
            pending.popleft()
        if pending and pending[0][0] == number:
            return pending.popleft()[1]
        return None


#: The keys under which a model takes its samples, in a dict batch (Ultralytics passes its
#: whole batch: ``img`` beside per-object ``batch_idx``) or as keyword arguments (Hugging
#: Face: ``input_ids`` before ``attention_mask``), looked for before the first tensor.
_SAMPLE_KEYS = ("input_ids", "pixel_values", "input_values", "img", "images", "inputs", "x")


def _first_tensor(args: Any, kwargs: Any) -> torch.Tensor | None:
    """The model's samples: the first positional tensor (or the first inside a tuple or
    list given first, or a dict's by :data:`_SAMPLE_KEYS`), else a keyword one."""
    for value in (*args, kwargs):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, dict):
            named = (value.get(key) for key in _SAMPLE_KEYS)
            value = [*(item for item in named if item is not None), *value.values()]
        if isinstance(value, (tuple, list)) and value:
            return next((item for item in value if isinstance(item, torch.Tensor)), None)
    return None


def _indices(batch: Any) -> array[int] | None:
    """An index batch (or one index) as integers; None for keys that are not integers."""
    try:
        if isinstance(batch, torch.Tensor):
            if batch.device.type != "cpu" or batch.is_floating_point():
                return None  # a device tensor would be read back with a sync
            batch = batch.reshape(-1)[:MAX_INDICES].tolist()  # a CPU tensor: no sync
        values = batch[:MAX_INDICES] if isinstance(batch, (list, tuple, range)) else [batch]
        if values and isinstance(values[0], bool):  # a mask, not indices (a sampler's are alike)
            return None
        return array("q", values)  # integers only (``__index__``): a float or a key raises
    except (TypeError, ValueError, OverflowError, IndexError):
        return None
