"""What naming each batch's indices costs a tracked DataLoader: the read-through of its
index sampler (each index batch kept as integers when drawn) and the look-up when the
batch is handed out, against the plain sampler's own iteration.

    python bench/batch_identity_cost.py [--batch 64] [--batches 10000] [--rounds 5]

The work runs in the loader's main process whether or not it has workers (they never see
the sampler), so a pass of a shuffled ``BatchSampler`` is timed alone, without a dataset;
rounds alternate so that the machine's load falls on both alike. Prints the best round of
each, per batch, and the difference: what ``track()`` adds to a step for batch identities.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import BatchSampler, RandomSampler

from stabmon.probes.batch_identity import _IndexReader


def _sampler(size: int, batch: int) -> BatchSampler:
    return BatchSampler(
        RandomSampler(range(size), generator=torch.Generator().manual_seed(0)), batch, False
    )


def _plain(size: int, batch: int) -> None:
    for _ in _sampler(size, batch):
        pass


def _read(size: int, batch: int) -> None:
    draws = iter(_IndexReader(_sampler(size, batch)))
    for _ in draws:  # as track() does: a batch handed out is looked up by its draw's number
        draws.take(draws.drawn - 1)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    size = args.batch * args.batches
    best = {"plain": float("inf"), "read": float("inf")}
    for _ in range(args.rounds):
        for name, run in (("plain", _plain), ("read", _read)):
            start = time.perf_counter()
            run(size, args.batch)
            best[name] = min(best[name], (time.perf_counter() - start) / args.batches)
    plain, read = best["plain"] * 1e6, best["read"] * 1e6
    print(f"batch of {args.batch}: sampler {plain:.1f} us, read through {read:.1f} us, "
          f"added {read - plain:.1f} us per batch")  # fmt: skip


if __name__ == "__main__":
    main()
