"""A small training process for integration tests: attaches stabmon and trains until killed.

    python trainee.py --run-dir D --run-id R --rank N [--worker-mb-per-second M] [...]

With ``--worker-mb-per-second`` it starts a child process that allocates that
much memory every second, like a data loader worker with a slow leak.
Prints ``ready <metrics url>`` once attached.
"""

from __future__ import annotations

import argparse
import os
import signal
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
    parser.add_argument("--port", type=int, default=0, help="base port (0: any free port)")
    parser.add_argument("--steps-per-second", type=float, default=20.0)
    parser.add_argument("--nan-at-step", type=int, default=-1, help="inject a NaN gradient there")
    parser.add_argument(
        "--nan-on-sigusr1", action="store_true", help="inject a NaN gradient after SIGUSR1"
    )
    parser.add_argument("--stop-at-step", type=int, default=-1, help="then hang (no more steps)")
    parser.add_argument("--stall-seconds", type=float, default=None)
    parser.add_argument("--amp", action="store_true", help="train with a (CPU) GradScaler")
    args = parser.parse_args()
    os.environ["RANK"] = str(args.rank)  # LOCAL_RANK, if set, comes from the caller
    worker = None
    if args.worker_mb_per_second:
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(args.worker_mb_per_second)])
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # One fixed batch: a smooth, decreasing loss, so a clean run never spikes by chance.
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(args.rank))
    scaler = torch.amp.GradScaler("cpu") if args.amp else None
    monitor = stabmon.attach(
        model, optimizer, scaler=scaler, port=args.port, address="127.0.0.1", run_dir=args.run_dir,
        run_id=args.run_id, sample_seconds=0.2, window_steps=20, stall_seconds=args.stall_seconds,
    )  # fmt: skip
    if args.nan_on_sigusr1:
        # The next step after the signal gets the NaN (a test sends it once Prometheus scrapes).
        signal.signal(signal.SIGUSR1, lambda signum, frame: setattr(args, "nan_at_step", step + 1))
    print(f"ready {monitor.metrics_url}", flush=True)
    step = 0
    try:
        while True:
            if step == args.stop_at_step:
                time.sleep(3600)  # hung: a dead collective, a stuck file system
            loss = model(batch).pow(2).mean()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if step == args.nan_at_step:
                    model.weight.grad.view(-1)[0] = float("nan")
                saved = (
                    [p.detach().clone() for p in model.parameters()]
                    if step == args.nan_at_step
                    else []
                )
                optimizer.step()  # the step pre-hook measures the gradients, NaN included
                if step == args.nan_at_step:
                    with torch.no_grad():  # undo the poisoned update (plain SGD keeps no state)
                        for param, copy in zip(model.parameters(), saved, strict=True):
                            param.copy_(copy)
            optimizer.zero_grad()
            monitor.observe(loss=loss)
            step += 1
            time.sleep(1.0 / args.steps_per_second)
    finally:
        if worker is not None:
            worker.kill()


if __name__ == "__main__":
    main()
