"""One rank of a 4-rank job that hangs on purpose, started by torchrun (gloo on CPU).

    torchrun --nproc_per_node=4 hang_trainee.py --mode MODE [--culprit R] [--action A]

Every rank trains with an explicit gradient all-reduce (a counted collective).
After ``--hang-after`` steps, ``--mode`` decides what happens; a ``--mode`` given
more than once runs each in turn, one step apart (the phases of a real loop: a checkpoint,
then an evaluation, one job instead of one per phase):

- ``data``: the culprit's dataset blocks in ``__getitem__`` (data starvation), in a
  loader worker process with ``--workers N``;
- ``sleep``: the culprit sleeps before the all-reduce (a collective not entered);
- ``deadlock``: the culprit takes a lock it already holds (a Python deadlock);
- ``checkpoint``: rank 0 alone writes a slow checkpoint inside ``mon.phase("checkpoint")``
  while the others wait in a barrier, then all train on and exit 0 (no verdict);
- ``eval``: every rank evaluates for a while inside ``mon.phase("eval")`` (no verdict);
- ``eval0``: rank 0 alone evaluates inside ``mon.phase("eval")`` while the others wait in a
  barrier (no verdict, no stall);
- ``checkpoint-hang``: rank 0's checkpoint never ends (a hang inside a phase): caught once
  the phase's own limit (``--phase-limit``) passes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

import stabmon

FOREVER = 3600.0
MODES = ("data", "sleep", "deadlock", "checkpoint", "eval", "eval0", "checkpoint-hang")


class Samples(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, block_from: int | None) -> None:
        self.block_from = block_from

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block_from is not None and index >= self.block_from:
            time.sleep(FOREVER)  # a stuck input pipeline: a dead mount, a hung worker
        generator = torch.Generator().manual_seed(index)
        return torch.randn(8, generator=generator), torch.randn(2, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=MODES, action="append", required=True)
    parser.add_argument("--culprit", type=int, default=2)
    parser.add_argument("--hang-after", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stall-seconds", type=float, default=3.0)
    parser.add_argument("--phase-seconds", type=float, default=7.0, help="eval/checkpoint time")
    parser.add_argument("--phase-limit", type=float, default=600.0, help="phase_stall_seconds")
    parser.add_argument("--after-phase-seconds", type=float, default=0.0,
                        help="the next step after the phase's barrier takes this long")  # fmt: skip
    parser.add_argument("--action", default="none")
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = stabmon.attach(
        model, optimizer, sample_seconds=0.2, judge_seconds=0,
        stall_seconds=args.stall_seconds, phase_stall_seconds=args.phase_limit,
        stall_action=args.action, stall_grace_seconds=args.grace,
    )  # fmt: skip
    print(f"ready {monitor.metrics_url}", flush=True)
    culprit = rank == args.culprit
    modes = {args.hang_after + index: mode for index, mode in enumerate(args.mode)}
    batch = 4
    block = args.hang_after * batch if "data" in args.mode and culprit else None
    loader = torch.utils.data.DataLoader(Samples(block), batch_size=batch,
                                         num_workers=args.workers)  # fmt: skip
    lock = threading.Lock()
    for step, (inputs, targets) in enumerate(monitor.track(loader)):
        if step == args.steps:
            break
        mode = modes.get(step)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        if culprit and mode == "sleep":
            time.sleep(FOREVER)  # busy elsewhere: never reaches the all-reduce
        if culprit and mode == "deadlock":
            lock.acquire()
            with lock:  # not reentrant: waits for itself forever
                pass
        for parameter in model.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
        optimizer.step()
        monitor.observe(loss)
        if mode in ("checkpoint", "checkpoint-hang"):
            if rank == 0:
                with monitor.phase("checkpoint"):
                    # A slow write to shared storage; or one that never ends.
                    time.sleep(args.phase_seconds if mode == "checkpoint" else FOREVER)
            dist.barrier()
        if mode == "eval0":
            if rank == 0:
                _evaluate(monitor, model, inputs, args.phase_seconds)
            dist.barrier()
        if mode == "eval":
            _evaluate(monitor, model, inputs, args.phase_seconds)
            dist.barrier()
        if mode in ("checkpoint", "eval0", "eval"):
            os.write(1, f"rank {rank} passed {mode}\n".encode())  # one write: ranks share a pipe
            time.sleep(args.after_phase_seconds)  # a slow step after it: a cold cache, a reload
    monitor.detach()
    dist.destroy_process_group()
    print("done", flush=True)


def _evaluate(
    monitor: stabmon.Monitor, model: torch.nn.Module, inputs: torch.Tensor, seconds: float
) -> None:
    with monitor.phase("eval"), torch.no_grad():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            model(inputs)
            time.sleep(0.05)


if __name__ == "__main__":
    main()
