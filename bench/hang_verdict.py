"""Time from a hang's start to its verdict, per case, on real torchrun jobs (gloo on CPU).

    python bench/hang_verdict.py [--cases data,sleep,...] [--stall-seconds 3]

Each case runs tests/integration/hang_trainee.py under torchrun and reads the event log:
the hang starts at the last step before it (the earliest ``stall`` anomaly's time minus its
``silent_seconds``); the verdict is the first ``hang_verdict`` written. Printed per case:
the stall limit, seconds to the first stall, seconds to the verdict, and the verdict. The
issue's bar is ``stall_seconds + 30`` s. Figures belong in bench/README.md, not in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAINEE = ROOT / "tests" / "integration" / "hang_trainee.py"
#: name -> (world, trainee arguments)
CASES: dict[str, tuple[int, list[str]]] = {
    "data": (4, ["--mode", "data", "--culprit", "2"]),
    "data-worker": (4, ["--mode", "data", "--culprit", "2", "--workers", "1"]),
    "sleep": (4, ["--mode", "sleep", "--culprit", "1"]),
    "deadlock": (4, ["--mode", "deadlock", "--culprit", "3"]),
    "two-ranks": (2, ["--mode", "data", "--culprit", "1"]),
    "checkpoint-hang": (4, ["--mode", "checkpoint-hang", "--phase-limit", "8"]),
}


def _events(run_dir: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(run_dir.glob("*/rank-*.events.jsonl")):
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


def measure(name: str, stall_seconds: float, timeout: float) -> str:
    world, arguments = CASES[name]
    with tempfile.TemporaryDirectory() as work:
        run_dir = Path(work)
        env = {**os.environ, "STABMON_DIR": str(run_dir), "STABMON_PORT": "0",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={world}", str(TRAINEE), *arguments,
             "--stall-seconds", str(stall_seconds)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        verdict: dict[str, Any] | None = None
        events: list[dict[str, Any]] = []
        try:
            while verdict is None and time.monotonic() < deadline:
                time.sleep(0.5)
                events = _events(run_dir)
                verdict = next((e for e in events if e["event"] == "hang_verdict"), None)
        finally:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        stalls = [e for e in events if e["event"] == "anomaly" and e.get("kind") == "stall"]
        if verdict is None or not stalls:
            return f"{name:16} no verdict within {timeout:.0f} s"
        began = min(e["time"] - e["silent_seconds"] for e in stalls)
        first_stall = min(e["time"] for e in stalls) - began
        return (f"{name:16} limit {stall_seconds:.0f} s; first stall {first_stall:5.1f} s; "
                f"verdict {verdict['time'] - began:5.1f} s after the hang began: "
                f"{verdict['detail']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--stall-seconds", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    for name in args.cases.split(","):
        print(measure(name, args.stall_seconds, args.timeout), flush=True)


if __name__ == "__main__":
    main()
