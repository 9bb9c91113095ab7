"""stabmon's host time per training step on the launch-bound small GPT of issue 38.

On a GPU whose steps take a few milliseconds, what stabmon costs is host time: the Python of
its hooks and the torch calls they make (each CUDA launch, event record or copy costs the host
microseconds whatever the device does). This measures that time where it is spent, at the
entry points torch and the loop call into stabmon, on ``bench/gpu_gpt.py``'s small GPT
(2 layers, width 128, 4 heads, vocab 512, batch 8 x 128, bf16 autocast, fused AdamW,
``clip_grad_norm_``, ``observe(loss=loss)`` every step, attached with defaults):

- the root module's forward pre- and post-hook, the optimizer's step pre- and post-hook,
  the clip wrapper (less the clip itself) and ``observe()``: inclusive wall time of each,
  per step, in steady state (past the attach's one-off FLOPs count and first judgement);
- what the root module's hooks cost torch itself: ``Module.__call__`` takes its slow path
  when a module has hooks (timed apart on an empty module, with and without no-op hooks);
- counts that do not depend on the machine: stabmon's Python function calls, the torch
  functions it calls and the operators it dispatches, per step.

Time is the training thread's CPU time (``time.thread_time_ns``), so that other processes on
a shared machine do not inflate it (``--wall`` for wall time). A timed wrapper's own cost is
measured and taken off each call. On the
CPU, the gradient norms are computed by the host (on CUDA they are one launch): their share
is printed apart (``torch calls``), so the Python share can be read on its own.

stabmon is given a loop clock that advances ``--step-ms`` (5 ms, the step issue 38 sets its bound
for) per training step, whatever the step takes here: its batched judging (``judge_seconds``) and
the device timer's sampling of fast steps then run as on a 5 ms GPU step, so the counts per step
are those of that loop (a 55 ms CPU step would judge every step and time every step on the
device). ``--step-ms 0`` gives stabmon the real clock.

Usage::

    python bench/host_time.py [--steps 30] [--device cpu|cuda|fake-cuda] [--step-ms 5] [--wall]
                              [--json PATH]

Runs in well under a minute on two CPU cores. ``--device cuda`` times the same on a GPU
(the figure issue 38 sets a bound for: at most ~100 us a step). ``--device fake-cuda`` runs it
on tests/fake_cuda.py's fake runtime, where stabmon takes its CUDA branches (phase events,
pinned copies, event queries) on a machine without a GPU: its operators cost far more than
CUDA launches, so its times compare runs of that mode only (``--steps 16 --blocks 3``: each
fake step takes about half a second).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_gpt  # noqa: E402 - bench/ is a directory of scripts, not a package

import stabmon  # noqa: E402
from stabmon.wiring import hooks as hooks_module  # noqa: E402

STABMON_DIR = str(Path(stabmon.__file__).resolve().parent)
#: Steps after attach before anything is measured: past the FLOPs count and the first judgement.
WARMUP_STEPS = 30
#: The gradient norms' kernels (stabmon.probes.grads), timed apart: the host computes them on
#: a CPU; on CUDA each is one launch.
KERNELS = ("_foreach_norm", "stack")
#: Entry points, in the order a step reaches them.
ENTRY_POINTS = ("forward_pre", "forward_post", "clip", "step_pre", "step_post", "observe")


class LoopClock:
    """The loop clock stabmon is given: ``step_seconds`` a training step (:meth:`tick`), and a
    microsecond more at each read, so that it is strictly monotonic within a step."""

    def __init__(self, step_seconds: float) -> None:
        self.step_seconds = step_seconds
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now

    def tick(self) -> None:
        self.now += self.step_seconds


@contextmanager
def ticking(loop: gpu_gpt.Loop, clock: LoopClock | None) -> Iterator[None]:
    """Each ``loop.step()`` advances ``clock`` by a step (nothing without a clock)."""
    if clock is None:
        yield
        return
    step = loop.step

    def ticked(monitor: stabmon.Monitor | None = None) -> None:
        step(monitor)
        clock.tick()

    loop.step = ticked  # type: ignore[method-assign]
    try:
        yield
    finally:
        del loop.step


class Clock:
    """Inclusive nanoseconds per entry point, and whether the thread is inside stabmon now."""

    def __init__(self, clock: Callable[[], int] = time.thread_time_ns) -> None:
        self.clock = clock
        self.ns = dict.fromkeys(ENTRY_POINTS, 0)
        self.calls = dict.fromkeys(ENTRY_POINTS, 0)
        #: Inside the entry points: time in the gradient norms' kernels (computed by the host
        #: on a CPU, one launch each on CUDA).
        self.kernel_ns = 0
        self.inside = False

    def reset(self) -> None:
        for name in ENTRY_POINTS:
            self.ns[name] = self.calls[name] = 0
        self.kernel_ns = 0

    def kernel(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` (a torch kernel), its time inside an entry point counted apart."""
        clock = self.clock

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if not self.inside:
                return function(*args, **kwargs)
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.kernel_ns += clock() - started

        return kernel

    def timed(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        ns, calls, clock = self.ns, self.calls, self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.inside = True
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                ns[name] += clock() - started
                calls[name] += 1
                self.inside = False

        return timed

    def outside(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` called from inside an entry point, not stabmon's time (the clip)."""
        ns, clock = self.ns, self.clock

        def untimed(*args: Any, **kwargs: Any) -> Any:
            self.inside = False
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                ns[name] -= clock() - started
                self.inside = True

        return untimed


@contextmanager
def instrumented(loop: gpu_gpt.Loop, monitor: stabmon.Monitor, clock: Clock) -> Iterator[None]:
    """Every entry point of ``monitor`` on ``loop`` timed by ``clock``; put back at the end."""
    from torch.nn.utils import clip_grad

    undo: list[Callable[[], None]] = []

    def swap(hook_dict: Any, name: str) -> None:
        for key, hook in list(hook_dict.items()):
            if isinstance(getattr(hook, "__self__", None), hooks_module._Hooks):
                hook_dict[key] = clock.timed(name, hook)
                undo.append(lambda key=key, hook=hook: hook_dict.__setitem__(key, hook))

    model, optimizer = loop.trained, loop.optimizer
    swap(model._forward_pre_hooks, "forward_pre")
    swap(model._forward_hooks, "forward_post")
    swap(optimizer._optimizer_step_pre_hooks, "step_pre")
    swap(optimizer._optimizer_step_post_hooks, "step_post")
    wrapper = clip_grad._clip_grads_with_norm_
    cell = wrapper.__closure__[wrapper.__code__.co_freevars.index("original")]  # type: ignore[index]
    original = cell.cell_contents
    cell.cell_contents = clock.outside("clip", original)
    clip_grad._clip_grads_with_norm_ = clock.timed("clip", wrapper)  # type: ignore[assignment]
    monitor.observe = clock.timed("observe", monitor.observe)  # type: ignore[method-assign]
    kernels = {name: getattr(torch, name) for name in KERNELS}
    for name, function in kernels.items():
        setattr(torch, name, clock.kernel(function))
    try:
        yield
    finally:
        for name, function in kernels.items():
            setattr(torch, name, function)
        del monitor.observe
        clip_grad._clip_grads_with_norm_ = wrapper  # type: ignore[assignment]
        cell.cell_contents = original
        for step in undo:
            step()


def timer_cost_ns(clock: Clock) -> float:
    """What one timed call costs beyond the call itself (taken off each entry point)."""

    def nothing() -> None:
        return None

    timed = clock.timed("observe", nothing)
    rounds = 20000
    best = float("inf")
    for _ in range(5):
        started = clock.clock()
        for _ in range(rounds):
            timed()
        wrapped = clock.clock() - started
        started = clock.clock()
        for _ in range(rounds):
            nothing()
        plain = clock.clock() - started
        best = min(best, (wrapped - plain) / rounds)
    clock.reset()
    return best


def module_hook_cost_us(device: str) -> float:
    """Microseconds per call that a module's no-op forward pre- and post-hook cost torch
    (``Module.__call__``'s slow path), measured on an empty module: stabmon's root hooks make
    torch take it once per forward."""
    module = nn.Identity()
    tensor = torch.zeros(1, device=device)
    rounds = 20000

    def per_call() -> float:
        started = time.thread_time_ns()
        for _ in range(rounds):
            module(tensor)
        return (time.thread_time_ns() - started) / rounds

    plain = min(per_call() for _ in range(5))
    module.register_forward_pre_hook(lambda module, args, kwargs: None, with_kwargs=True)
    module.register_forward_hook(lambda module, args, output: None)
    hooked = min(per_call() for _ in range(5))
    return max(0.0, hooked - plain) / 1000


class _Counts(TorchDispatchMode):
    """Operators dispatched while the thread is inside stabmon."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.operators = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.clock.inside:
            self.operators += 1
        return func(*args, **(kwargs or {}))


def _is_torch(function: Any) -> bool:
    owner = getattr(function, "__self__", None)
    module = getattr(function, "__module__", None) or type(owner).__module__
    return module is not None and module.startswith("torch")


def count_calls(loop: gpu_gpt.Loop, monitor: stabmon.Monitor, clock: Clock, steps: int) -> dict:
    """Per step: stabmon's Python calls, the torch functions it calls, the operators it
    dispatches (exact counts: they do not depend on the machine or its load)."""
    python = torch_calls = 0
    frames: dict[str, int] = {}

    kernel = Clock().kernel(len).__code__  # the wrapper of a timed kernel: a torch call

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal python, torch_calls
        if event == "call":
            code = frame.f_code
            if code is kernel and frame.f_back.f_code.co_filename.startswith(STABMON_DIR):
                torch_calls += 1
            elif code.co_filename.startswith(STABMON_DIR):
                python += 1
                key = f"{Path(code.co_filename).name}:{code.co_name}"
                frames[key] = frames.get(key, 0) + 1
        elif event == "c_call" and frame.f_code.co_filename.startswith(STABMON_DIR):
            if _is_torch(arg):
                torch_calls += 1

    counts = _Counts(clock)
    with counts:
        sys.setprofile(profile)
        try:
            for _ in range(steps):
                loop.step(monitor)
        finally:
            sys.setprofile(None)
    return {
        "python_calls": python / steps,
        "torch_calls": torch_calls / steps,
        "operators": counts.operators / steps,
        "top_frames": {k: v / steps for k, v in sorted(frames.items(), key=lambda kv: -kv[1])[:80]},
    }


class FakeCudaLoop(gpu_gpt.Loop):
    """The same GPT loop on the fake CUDA runtime (tests/fake_cuda.py): stabmon takes its CUDA
    branches (device phase events, pinned copies, event queries), which a CPU loop never
    reaches. No figure of the model is real; the backward is stood in for (a fresh gradient
    for each parameter), and each fake operator costs far more than a CUDA launch, so compare
    runs of this mode with each other only."""

    def __init__(self, shape: gpu_gpt.Shape, cuda: Any) -> None:
        torch.manual_seed(0)
        self.shape, self.device, self.cuda = shape, torch.device("cuda"), cuda
        with torch.device("cuda"):  # a fake tensor cannot move: built on the device
            self.model = gpu_gpt.GPT(vocab=shape.vocab, width=shape.width, layers=shape.layers,
                                     heads=shape.heads, context=shape.context)  # fmt: skip
        self.trained = self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.batches = [
            torch.randint(0, shape.vocab, (shape.batch, shape.context + 1), device="cuda")
            for _ in range(2)
        ]  # fmt: skip
        self.index = 0

    def step(self, monitor: stabmon.Monitor | None = None) -> None:
        self.cuda.device.catch_up()  # the device runs a step behind the host
        loss = self.loss()
        self.cuda.stand_in_backward(self.model.parameters())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.observe(loss=loss)

    def synchronize(self) -> None:
        self.cuda.device.catch_up()


@contextmanager
def fake_cuda_loop(shape: gpu_gpt.Shape) -> Iterator[FakeCudaLoop]:
    """A :class:`FakeCudaLoop` inside the fake runtime, which is undone at the end."""
    import pytest

    sys.path.insert(0, str(HERE.parent / "tests"))
    from fake_cuda import fake_cuda

    with pytest.MonkeyPatch.context() as patch, fake_cuda(patch) as cuda:
        patch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        yield FakeCudaLoop(shape, cuda)
        cuda.assert_clean()


def measure(
    *, device: str = "cpu", steps: int = 30, blocks: int = 5, profile: bool = False,
    shape: gpu_gpt.Shape = gpu_gpt.SMALL, count_steps: int = 40, wall: bool = False,
    warmup: int = WARMUP_STEPS, step_ms: float = 5.0,
) -> dict[str, Any]:  # fmt: skip
    """stabmon's host microseconds per step at each entry point, the median of ``blocks``:
    the training thread's CPU time, or with ``wall`` its wall time (preemption included).
    ``device`` "fake-cuda" runs on the fake CUDA runtime (:class:`FakeCudaLoop`). stabmon's
    loop clock advances ``step_ms`` a step (:class:`LoopClock`; 0: the real clock)."""
    if device == "fake-cuda":
        with fake_cuda_loop(shape) as fake:
            return _measure(fake, steps=steps, blocks=blocks, profile=profile,
                            count_steps=count_steps, wall=wall, warmup=warmup,
                            step_ms=step_ms)  # fmt: skip
    return _measure(gpu_gpt.Loop(shape, compiled=False, device=device), steps=steps,
                    blocks=blocks, profile=profile, count_steps=count_steps, wall=wall,
                    warmup=warmup, step_ms=step_ms)  # fmt: skip


def _measure(
    loop: gpu_gpt.Loop, *, steps: int, blocks: int, profile: bool, count_steps: int,
    wall: bool, warmup: int, step_ms: float,
) -> dict[str, Any]:  # fmt: skip
    shape, device = loop.shape, "fake-cuda" if isinstance(loop, FakeCudaLoop) else loop.device.type
    for _ in range(3):
        loop.step()
    plain_ms = 1000 * loop.block(max(5, steps // 10)) / max(5, steps // 10)
    clock = Clock(time.perf_counter_ns if wall else time.thread_time_ns)
    overhead_ns = timer_cost_ns(clock)
    per_block: list[dict[str, float]] = []
    kernels: list[float] = []
    result: dict[str, Any] = {
        "model": f"{shape.name}: {shape.layers}x{shape.width}, {shape.heads} heads, vocab "
        f"{shape.vocab}, batch {shape.batch}x{shape.context}, bf16 autocast, fused AdamW, clip",
        "device": device,
        "clock": "wall" if wall else "thread CPU",
        "step_ms": step_ms,
        "torch": torch.__version__,
        "plain_ms_per_step": plain_ms,
        "timer_overhead_ns_per_call": overhead_ns,
        "module_hook_dispatch_us": module_hook_cost_us("cpu" if device == "fake-cuda" else device),
    }
    with tempfile.TemporaryDirectory() as scratch:
        loop_clock = LoopClock(step_ms / 1000) if step_ms else None
        settings = {} if loop_clock is None else {"clock": loop_clock}
        attached = gpu_gpt.attached(loop, Path(scratch), **settings)
        with attached as monitor, ticking(loop, loop_clock):
            loop.block(warmup, monitor)
            with instrumented(loop, monitor, clock):
                for _ in range(blocks):
                    clock.reset()
                    gc.collect()
                    loop.block(steps, monitor)
                    calls = {name: clock.calls[name] / steps for name in ENTRY_POINTS}
                    per_block.append({
                        name: (clock.ns[name] - clock.calls[name] * overhead_ns) / steps / 1000
                        for name in ENTRY_POINTS
                    })  # fmt: skip
                    kernels.append(clock.kernel_ns / steps / 1000)
                result.update(count_calls(loop, monitor, clock, count_steps))
                if profile:
                    profiler = cProfile.Profile()
                    profiler.enable()
                    loop.block(steps, monitor)
                    profiler.disable()
            result["internal_errors"] = gpu_gpt.internal_errors(monitor)
    entry = {name: statistics.median(b[name] for b in per_block) for name in ENTRY_POINTS}
    result["us_per_step"] = entry
    result["entry_calls_per_step"] = calls
    totals = [sum(b.values()) for b in per_block]
    result["stabmon_us_per_step"] = statistics.median(totals)
    result["stabmon_us_per_step_blocks"] = totals
    # A shared machine only adds time: the quietest block is the best estimate of the cost.
    result["stabmon_us_per_step_min"] = min(totals)
    result["kernel_us_per_step"] = statistics.median(kernels)
    without = [total - kernel for total, kernel in zip(totals, kernels, strict=True)]
    result["without_kernels_us_per_step"] = statistics.median(without)
    result["without_kernels_us_per_step_min"] = min(without)
    if profile:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(STABMON_DIR, 40)
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']} on {result['device']} (torch {result['torch']}); plain step "
        f"{result['plain_ms_per_step']:.2f} ms; stabmon's loop clock: "
        + (f"{result['step_ms']:g} ms a step" if result["step_ms"] else "real"),
        f"stabmon host time ({result['clock']}): {result['stabmon_us_per_step']:.1f} us/step "
        "(median of blocks "
        + ", ".join(f"{t:.1f}" for t in result["stabmon_us_per_step_blocks"])
        + f"; min {result['stabmon_us_per_step_min']:.1f}), + ~"
        f"{result['module_hook_dispatch_us']:.1f} us of torch's hooked Module.__call__",
        f"  of which the gradient norms' kernels {result['kernel_us_per_step']:.1f} us; without "
        f"them {result['without_kernels_us_per_step']:.1f} us/step "
        f"(min {result['without_kernels_us_per_step_min']:.1f})",
        "  " + ", ".join(f"{name} {us:.1f}" for name, us in result["us_per_step"].items()),
        f"per step: {result['python_calls']:.1f} stabmon Python calls, "
        f"{result['torch_calls']:.1f} torch calls, {result['operators']:.1f} operators "
        f"dispatched by stabmon",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks (the median)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or fake-cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--wall", action="store_true", help="wall time, not thread CPU time")
    parser.add_argument(
        "--step-ms",
        type=float,
        default=5.0,
        help="stabmon's loop clock advances this much a step (0: real clock)",
    )
    parser.add_argument(
        "--count-steps",
        type=int,
        default=40,
        help="steps over which the calls per step are counted",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--profile", action="store_true", help="cProfile of stabmon's frames")
    parser.add_argument("--frames", action="store_true", help="the most called stabmon frames")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(device=args.device, steps=args.steps, blocks=args.blocks,
                     profile=args.profile, wall=args.wall, step_ms=args.step_ms,
                     count_steps=args.count_steps)  # fmt: skip
    print(report(result))
    if args.frames:
        print(json.dumps(result["top_frames"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if result["internal_errors"]:
        print(f"host_time: {result['internal_errors']:.0f} contained errors", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
