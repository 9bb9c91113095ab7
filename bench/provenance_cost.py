"""What NaN provenance costs a step: disarmed (every run) and armed (the steps after a
non-finite value, or every step with provenance_always), on a CPU model of 12 blocks.

    python bench/provenance_cost.py [--steps 300] [--rounds 5] [--width 256]

Two monitors on two copies of one model, stepped in alternating blocks of steps so that
the machine's load falls on both alike; prints the median step time of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import stabmon


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(12):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, monitor: stabmon.Monitor,
           count: int, width: int) -> list[float]:  # fmt: skip
    times = []
    for _ in range(count):
        start = time.perf_counter()
        loss = model(torch.randn(64, width)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per block")
    parser.add_argument("--rounds", type=int, default=5, help="alternating blocks of each")
    parser.add_argument("--width", type=int, default=256, help="each layer's width")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[float]] = {"disarmed": [], "armed": []}
    with tempfile.TemporaryDirectory() as run_dir:
        pairs = {}
        for name in results:
            model = _model(args.width)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            monitor = stabmon.attach(model, optimizer, serve_metrics=False, run_dir=run_dir,
                                     run_id=name, provenance_always=name == "armed")  # fmt: skip
            pairs[name] = (model, optimizer, monitor)
        for _ in range(args.rounds):
            for name, (model, optimizer, monitor) in pairs.items():
                results[name] += _steps(model, optimizer, monitor, args.steps, args.width)
        for _, _, monitor in pairs.values():
            monitor.detach()
    medians = {name: statistics.median(times) for name, times in results.items()}
    for name, median in medians.items():
        print(f"{name:9s} median step {median * 1e3:.3f} ms")
    print(f"armed / disarmed: x{medians['armed'] / medians['disarmed']:.3f}")


if __name__ == "__main__":
    main()
