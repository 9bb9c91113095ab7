"""Three gloo ranks on the CPU train the same DDP model twice, without and with the
local-norm hook (tests/probes/test_local_norms.py): three, because a group whose size is not
a power of two is where averaging by a division and by a multiplication with the
reciprocal round differently. Rank 0 writes to ``argv[1]`` how many parameters differ.

Run as ``python local_norms_trainee.py OUT``; it forks its own ranks (a FileStore beside
OUT), each ``OMP_NUM_THREADS=1``: forked after torch and stabmon are imported, and before
torch runs anything (no thread pool to inherit), so three ranks do not pay three more imports
of torch (issue 43).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from stabmon.probes.local_norms import LocalGradNorms, install  # noqa: E402

RANKS = 3


def rank_main(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(out + ".store", RANKS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS)
    trained = []
    for hooked in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
        model = nn.parallel.DistributedDataParallel(net)
        if hooked:
            assert isinstance(install(model, torch.device("cpu")), LocalGradNorms)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(5):
            model(torch.randn(16, 8, generator=generator)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        trained.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    if rank == 0:
        differing = int((trained[0] != trained[1]).sum())
        Path(out).write_text(json.dumps({"differing": differing, "of": trained[0].numel()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(rank_main, args=(sys.argv[1],), nprocs=RANKS, start_method="fork")
