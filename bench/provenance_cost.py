"""What NaN provenance costs a step: disarmed (every run) and armed (the steps after a
non-finite value, or every step with provenance_always), on a CPU model of 12 blocks.

    python bench/provenance_cost.py [--steps 20] [--rounds 60] [--width 256] [--model mlp|gpt]
    python bench/provenance_cost.py --floor [--width 256]   # bare hooks: what any design pays

Monitors on copies of one model: without provenance (provenance_steps 0, the baseline),
disarmed (the default: no hook until a NaN), forward (the forward watch alone, what a
non-finite loss arms) and armed (provenance_always: every module's forward sums and
gradient hooks, every step, what a non-finite gradient with a finite loss arms on a model of
at most 48 modules). On a model of more modules (``--model gpt``: 110), a non-finite value
arms two stages, each timed too: first (the top of the module tree: here the 12 blocks and
the head, forward and gradients) and inside (those and the modules inside block 5). They are
stepped in alternating blocks of steps, each round starting with the next, so that the
machine's load falls on all alike; prints the median step time of each and the ratios, as
wall time and as the thread's CPU time (torch on one thread: the step's own work, which a
machine shared with other jobs disturbs less).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

import stabmon


def _mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(12):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


class _Block(torch.nn.Module):
    """A pre-norm transformer block's shape: two residual branches of several modules."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


def _gpt(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_Block(width) for _ in range(12)), torch.nn.Linear(width, 1))


def _batch(model_kind: str, width: int) -> torch.Tensor:
    return torch.randn(64, width) if model_kind == "mlp" else torch.randn(4, 16, width)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, monitor: stabmon.Monitor,
           count: int, batch: torch.Tensor) -> tuple[list[float], list[float]]:  # fmt: skip
    walls, cpus = [], []
    for _ in range(count):
        start, start_cpu = time.perf_counter(), time.thread_time()
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - start_cpu)
    return walls, cpus


def _floor(build: Any, batch: torch.Tensor, width: int, steps: int) -> None:
    """What any design with a Python hook per module pays: bare hooks on copies of the model
    (no stabmon), forward and backward only, stepped in turn; thread CPU time."""

    def forward_hook(module: Any, args: Any, output: Any) -> None:
        pass

    def forward_sum(module: Any, args: Any, output: Any) -> None:
        output = output[0] if isinstance(output, tuple) else output  # attention's (out, None)
        output.detach().sum(dtype=torch.float32)

    def gradient_hook(module: Any, args: Any, output: Any) -> None:
        output = output[0] if isinstance(output, tuple) else output
        if output.requires_grad:
            output.register_hook(lambda grad: None)

    def gradient_sum(module: Any, args: Any, output: Any) -> None:
        output = output[0] if isinstance(output, tuple) else output
        output.detach().sum(dtype=torch.float32)
        if output.requires_grad:
            output.register_hook(lambda grad: grad.sum(dtype=torch.float32) and None)

    kinds = {"bare": None, "+ a Python hook a module": forward_hook,
             "+ a sum an output": forward_sum, "+ a gradient hook an output": gradient_hook,
             "+ sums of outputs and gradients": gradient_sum}  # fmt: skip
    models = {}
    for name, hook in kinds.items():
        model = build(width)
        if hook is not None:
            for module in model.modules():
                module.register_forward_hook(hook)
        models[name] = model
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for step in range(steps + 10):
        for name, model in models.items():
            start = time.thread_time()
            model(batch).pow(2).mean().backward()
            if step >= 10:
                times[name].append(time.thread_time() - start)
    base = statistics.median(times["bare"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:34s} {median * 1e3:8.3f} ms  x{median / base:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--rounds", type=int, default=60, help="alternating blocks of each")
    parser.add_argument("--width", type=int, default=256, help="each layer's width")
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--floor", action="store_true",
                        help="instead: bare hooks on every module, no stabmon")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    build = _mlp if args.model == "mlp" else _gpt
    batch = _batch(args.model, args.width)
    if args.floor:
        _floor(build, batch, args.width, args.rounds * args.steps // 3)
        return
    always = {"provenance_always": True}
    settings: dict[str, dict[str, object]] = {
        "without": {"provenance_steps": 0}, "disarmed": {}, "forward": always, "armed": always
    }  # fmt: skip
    if args.model == "gpt":
        settings |= {"first": {}, "inside": {}}
    walls: dict[str, list[float]] = {name: [] for name in settings}
    cpus: dict[str, list[float]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as run_dir:
        runs = {}
        for name, overrides in settings.items():
            model = build(args.width)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
            monitor = stabmon.attach(model, optimizer, serve_metrics=False, run_dir=run_dir,
                                     run_id=name, **overrides)  # type: ignore[arg-type]  # fmt: skip
            plugin = next(p for p in monitor._plugged.plugins
                          if type(p).__name__ == "NanProvenance")  # fmt: skip
            if name == "forward":  # the forward watch alone: what a non-finite loss arms
                plugin._gradients = False
            if name in ("first", "inside"):  # armed as a non-finite gradient arms it, for good
                plugin._steps = 10**9
                plugin._arm(0)
                plugin._start_watching()
                if name == "inside":
                    plugin._start_refining("5")
            runs[name] = (model, optimizer, monitor)
            _steps(model, optimizer, monitor, 10, batch)  # warm up (and arm)
        names = list(runs)
        for round_ in range(args.rounds):  # each round starts with the next one: no order bias
            turn = round_ % len(names)
            for name in names[turn:] + names[:turn]:
                model, optimizer, monitor = runs[name]
                wall, cpu = _steps(model, optimizer, monitor, args.steps, batch)
                walls[name] += wall
                cpus[name] += cpu
        for _, _, monitor in runs.values():
            monitor.detach()
    print(f"model {args.model}, width {args.width}, {args.rounds} x {args.steps} steps each")
    for label, times in (("wall", walls), ("cpu", cpus)):
        medians = {name: statistics.median(values) for name, values in times.items()}
        line = "  ".join(f"{name} {median * 1e3:.3f} ms" for name, median in medians.items())
        print(f"{label:4s} median step: {line}")
        base = medians["disarmed"]
        print(f"{label:4s} disarmed / without: x{base / medians['without']:.3f}  "
              + "  ".join(f"{name} / disarmed: x{medians[name] / base:.3f}"
                          for name in list(settings)[2:]))  # fmt: skip


if __name__ == "__main__":
    main()
