"""A small training process for integration tests: attaches stabmon and trains until killed.

    python trainee.py --run-dir D --run-id R --rank N [--worker-mb-per-second M]

With ``--worker-mb-per-second`` it starts a child process that allocates that
much memory every second, like a data loader worker with a slow leak.
Prints ``ready <metrics url>`` once attached.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

import stabmon

WORKER = """
import os, sys, time
parent = os.getppid()
hoard = []
while os.getppid() == parent:  # never outlive the trainee: a killed test must not leave a hog
    hoard.append(bytearray(int(float(sys.argv[1]) * 2**20)))  # bytearray pages are touched
    time.sleep(1.0)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--worker-mb-per-second", type=float, default=0.0)
    parser.add_argument("--steps-per-second", type=float, default=20.0)
    args = parser.parse_args()
    os.environ["RANK"] = str(args.rank)
    worker = None
    if args.worker_mb_per_second:
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(args.worker_mb_per_second)])
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=args.run_dir,
        run_id=args.run_id, sample_seconds=0.2,
    )  # fmt: skip
    print(f"ready {monitor.metrics_url}", flush=True)
    try:
        while True:
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
            time.sleep(1.0 / args.steps_per_second)
    finally:
        if worker is not None:
            worker.kill()


if __name__ == "__main__":
    main()
