"""One rank of a two-rank gloo DDP job whose rank 1 input pipeline slows from step K.

    torchrun --standalone --nproc_per_node=2 slowdown_trainee.py RUN_DIR

A get_batch() loop (no DataLoader): 10 ms of input wait a step, 60 ms on rank 1 from step
``SLOW_FROM``. The rule names the phase that grew most a step; on a loaded machine (two CPU
burners beside the suite) a 10 ms growth once lost to the backward's own jitter, so the
planted one is 50 ms. The slowdown rule runs on short blocks and a 3 s hold.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import stabmon

SLOW_FROM = 200
STEPS = 450


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    settings = {
        "throughput.slowdown_block_seconds": 0.25,
        "throughput.slowdown_hold_seconds": 3.0,
        "throughput.slowdown_baseline_seconds": 6.0,
        "throughput.slowdown_warmup_steps": 20,
    }
    monitor = stabmon.attach(model, optimizer, port=0, run_dir=sys.argv[1], **settings)
    for step in range(STEPS):
        time.sleep(0.06 if rank == 1 and step >= SLOW_FROM else 0.01)  # get_batch()
        loss = model(torch.randn(32, 64)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss, samples=32)
    monitor.detach()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
