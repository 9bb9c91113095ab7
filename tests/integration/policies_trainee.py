"""One rank of the on_anomaly test job: gloo DDP on CPU, a spike on one rank only.

    torchrun --nproc_per_node=4 policies_trainee.py --action skip|stop --out DIR
             [--fused] [--spike-rank 1] [--spike-step 30] [--steps 40]

The spike is written into ``--spike-rank``'s gradients after DDP's all-reduce, so only
that rank sees it: without an agreement it alone would skip (or stop), and its replica
would part from the others. Each rank writes ``rank-N.json`` into ``--out``: the steps
that left its parameters and optimizer state bit-identical, a checksum of its final
parameters, and the AnomalyStop it raised (kind, step, rank), if any.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stabmon
from stabmon.policies import agreement


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--action", choices=("skip", "stop"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--spike-rank", type=int, default=1)
    parser.add_argument("--spike-step", type=int, default=30)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only-rank", type=int, default=-1)  # attach on that rank alone
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=args.fused)
    policy = {"grad_spike": args.action}
    attaching = args.only_rank in (-1, rank)
    if args.only_rank >= 0:  # the others never attach: no need to wait long for them
        agreement.ROLL_CALL_WAIT = 2.0
    monitor = None
    if attaching:
        monitor = stabmon.attach(model, optimizer, serve_metrics=False, judge_seconds=0,
                                 spike_warmup_steps=10, on_anomaly=policy)  # fmt: skip
    unchanged, stopped = [], None
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        loss = model(torch.randn(4, 8, generator=generator)).pow(2).mean()
        loss.backward()
        if rank == args.spike_rank and step == args.spike_step:
            for param in model.parameters():
                param.grad.mul_(10_000)  # type: ignore[union-attr]
        before = copy.deepcopy((inner.state_dict(), optimizer.state_dict()["state"]))
        try:
            optimizer.step()
        except stabmon.AnomalyStop as stop:
            stopped = {"kind": stop.kind, "step": stop.step, "rank": stop.rank,
                       "anomaly_step": stop.anomaly_step, "at_iteration": step}  # fmt: skip
            break
        if _same(before, (inner.state_dict(), optimizer.state_dict()["state"])):
            unchanged.append(step)
        optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.observe(loss=loss)
    if monitor is not None:
        monitor.detach()
    digest = hashlib.sha256()
    for param in inner.parameters():
        digest.update(param.detach().numpy().tobytes())
    result = {"rank": rank, "unchanged": unchanged, "params": digest.hexdigest(),
              "stopped": stopped}  # fmt: skip
    (args.out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
