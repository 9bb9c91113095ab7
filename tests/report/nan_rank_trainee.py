"""One rank of a 2-rank gloo DDP job whose rank 1 feeds a NaN batch at step 10 (for
tests/report/test_incidents.py): torchrun --nproc_per_node=2 nan_rank_trainee.py RUN_DIR"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import stabmon


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = stabmon.attach(model, optimizer, port=0, address="127.0.0.1", run_dir=sys.argv[1],
                             run_id="nan-job", judge_seconds=0)  # fmt: skip
    for step in range(14):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        if rank == 1 and step == 10:
            inputs[0, 0] = float("nan")  # a bad sample on one rank: the all-reduce spreads it
        loss = model(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
    monitor.detach()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
