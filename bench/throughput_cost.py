"""What throughput accounting costs: per batch, per block, and the one step whose FLOPs are counted.

    python bench/throughput_cost.py

Prints medians over repeats of the training thread's CPU time (``time.thread_time``):

- *counted() per batch*: ``track()``'s sample counting, the generator around the loader,
  against iterating the same list bare;
- *block close*: one ``ThroughputWatch.step_end`` (phase deltas, the slowdown rule, MFU), which
  runs once every ``throughput.slowdown_block_seconds`` (10 s), not per step;
- *counted step / plain step*: forward and backward of a small transformer block under
  ``FlopCounterMode`` (the one step counted, once per process) against the same step plain.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stabmon.config import ThroughputConfig  # noqa: E402
from stabmon.pipeline.readings import Readings  # noqa: E402
from stabmon.pipeline.throughput import ThroughputWatch  # noqa: E402
from stabmon.probes.flops import FlopCount  # noqa: E402
from stabmon.shared.log import LogLimiter  # noqa: E402


def cpu_seconds(work: Callable[[], None], repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        work()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    readings = Readings(labels={"rank": "0", "run": "bench"})
    watch = ThroughputWatch(
        ThroughputConfig(flops_per_step=1e12), readings, now=0.0, device_name=None,
        parameter_dtype=torch.float32, model=torch.nn.Linear(2, 2),
        anomaly=lambda *a, **k: None, write=lambda *a, **k: None,
        global_step=lambda: readings.steps, limiter=LogLimiter(),
    )  # fmt: skip
    batches = [(torch.zeros(32, 8), torch.zeros(32))] * 10_000

    def bare() -> None:
        for _ in iter(batches):
            pass

    def counted() -> None:
        for _ in watch.counted(iter(batches)):
            pass

    per_batch = (cpu_seconds(counted) - cpu_seconds(bare)) / len(batches)
    print(f"counted() per batch: {per_batch * 1e9:.0f} ns")

    clock = [0.0]

    def blocks() -> None:
        for _ in range(1000):
            for phase in ("data_wait", "forward", "backward", "optimizer"):
                readings.add_phase_time(phase, 0.025)
            readings.steps += 100
            clock[0] += 10.0
            watch.step_end(clock[0])

    print(f"block close: {cpu_seconds(blocks, repeats=5) / 1000 * 1e6:.1f} us (every 10 s)")

    block = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    inputs = torch.randn(8, 128, 256)

    def plain() -> None:
        block(inputs).sum().backward()

    def flops() -> None:
        counter = FlopCount()
        counter.start()
        block(inputs).sum().backward()
        counter.stop()

    ratio = cpu_seconds(flops, repeats=7) / cpu_seconds(plain, repeats=7)
    print(f"counted step / plain step (TransformerEncoderLayer 256x4, 8x128 tokens): {ratio:.2f}")


if __name__ == "__main__":
    main()
