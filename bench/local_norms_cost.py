"""What ``replica_local_norms`` costs a DDP step: the communication hook that takes each
rank's gradient norm before the all-reduce, against DDP's own reduction, on CPU.

    python bench/local_norms_cost.py [--steps 200] [--rounds 5] [--width 512]

One gloo rank in this process (the reduction of a group of one: what is measured is the
hook, the norm it takes per bucket and the fold at the step, not the network), two DDP
copies of one model, one with the hook, stepped in alternating blocks so that the
machine's load falls on both alike; prints each median step time and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from stabmon.probes.local_norms import LocalGradNorms, install


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           state: LocalGradNorms | None, count: int, width: int) -> list[float]:  # fmt: skip
    times = []
    for _ in range(count):
        start = time.perf_counter()
        model(torch.randn(64, width)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if state is not None:
            state.fold()  # what the replica probe does at each optimizer step
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per block")
    parser.add_argument("--rounds", type=int, default=5, help="alternating blocks of each")
    parser.add_argument("--width", type=int, default=512, help="each layer's width")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runs: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, LocalGradNorms | None]] = {}
    for name in ("ddp", "ddp+local norms"):
        model = _model(args.width)
        state = install(model, torch.device("cpu")) if name != "ddp" else None
        assert not isinstance(state, str), state
        runs[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-4), state)
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (model, optimizer, state) in runs.items():
            results[name] += _steps(model, optimizer, state, args.steps, args.width)
    dist.destroy_process_group()
    medians = {name: statistics.median(times) for name, times in results.items()}
    for name, median in medians.items():
        print(f"{name:16s} median step {median * 1e3:.3f} ms")
    print(f"with / without: x{medians['ddp+local norms'] / medians['ddp']:.4f}")


if __name__ == "__main__":
    main()
