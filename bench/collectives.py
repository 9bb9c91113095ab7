"""Cost of counting a collective (stabmon.probes.collectives) on a 1-rank gloo group.

    PYTHONPATH=. python bench/collectives.py

Prints the mean time of ``dist.all_reduce`` on a 4-element tensor, raw and counted.
"""

from __future__ import annotations

import tempfile
import timeit

import torch
import torch.distributed as dist

from stabmon.probes.collectives import CollectiveCounter


def main(calls: int = 20_000) -> None:
    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(f"{directory}/store", 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        tensor = torch.ones(4)
        try:
            raw = min(timeit.repeat(lambda: dist.all_reduce(tensor), number=calls, repeat=3))
            counter = CollectiveCounter()
            counter.install()
            try:
                counted = min(
                    timeit.repeat(lambda: dist.all_reduce(tensor), number=calls, repeat=3)
                )
            finally:
                counter.uninstall()
        finally:
            dist.destroy_process_group()
    print(
        f"all_reduce (gloo, 1 rank): raw {raw / calls * 1e6:.2f} us, counted "
        f"{counted / calls * 1e6:.2f} us, +{(counted - raw) / calls * 1e6:.2f} us per call"
    )


if __name__ == "__main__":
    main()
