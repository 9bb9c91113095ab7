"""One rank of a distributed test job, started by torchrun: gloo on CPU, DDP, FSDP2 or HSDP.

    torchrun --nproc_per_node=N ddp_trainee.py --mode ddp|fsdp|hsdp --steps S [--slow-rank R]

Attaches stabmon with no distributed configuration at all: rank, local rank,
port and run id come from torchrun's environment. Trains ``--steps`` steps on
batches that depend only on (step, rank), so a test can replay the same
training on one unsharded model, then keeps the process (and its exporter)
alive until killed, like a rank waiting for its peers. A collective that fails
because a peer died ends the training loop, not the process.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import stabmon

IN, HIDDEN, OUT = 16, 24, 4
BATCH = 8


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "fsdp", "hsdp"), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="pause every rank")
    parser.add_argument("--slow-forward-rank", type=int, default=-1, help="a slow GPU's rank")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model: torch.nn.Module = make_model()
    if rank == args.slow_forward_rank:  # compute, not input, is slow here: inside the forward
        model.register_forward_pre_hook(lambda module, inputs: time.sleep(args.slow_seconds))
    if args.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if args.mode == "hsdp":  # replicate over 2 groups, shard within each
            world = dist.get_world_size()
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = stabmon.attach(model, optimizer, sample_seconds=0.2, judge_seconds=0)
    print(f"ready {monitor.metrics_url}", flush=True)
    try:
        for step in range(args.steps):
            inputs, targets = batch(step, rank)
            if rank == args.slow_rank:
                time.sleep(args.slow_seconds)  # a slow input pipeline on this rank only
            time.sleep(args.step_seconds)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
        print(f"done {args.steps}", flush=True)
    except RuntimeError as error:  # a peer died: gloo reports it here
        print(f"collective failed: {error}", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:  # hold: keep serving until killed, never outlive the launcher
        time.sleep(0.5)


if __name__ == "__main__":
    main()
