"""on_anomaly on a real GPU: the skip is exact and sync-free in the device mode, and what
each mode costs a step (docs/policies.md).

    python bench/policy_gpu.py [--rounds 5] [--steps 40] [--json out.json]

1. correctness: a NaN gradient with ``nonfinite_grad: skip`` and a fused AdamW (with and
   without GradScaler) leaves parameters and optimizer state bit-identical, every steady
   step running under ``torch.cuda.set_sync_debug_mode("error")`` (a sync inside stabmon
   raises in a hook, is contained and counted: the internal error count must stay 0);
2. cost: the median step time of two workloads (a compute-bound MLP and a launch-bound
   one of many small layers), stabmon without a policy against the device mode (fused
   AdamW, skip) and the host mode (foreach AdamW, skip: one read a step), in alternating
   rounds of steps on one warm GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

import stabmon

SKIP = {"nonfinite_grad": "skip", "grad_spike": "skip"}


def _internal_errors(monitor: stabmon.Monitor) -> float:
    from prometheus_client import generate_latest

    text = generate_latest(monitor.registry).decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "stabmon_internal_errors_total")  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def correctness(amp: bool, run_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1)).cuda()  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda") if amp else None
    monitor = stabmon.attach(model, optimizer, scaler=scaler, serve_metrics=False,
                             run_dir=run_dir, run_id=f"gpu-amp{int(amp)}", on_anomaly=SKIP,
                             spike_warmup_steps=5)  # fmt: skip
    unchanged = []
    for step in range(30):
        if step == 3:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = model(torch.randn(32, 64, device="cuda")).float().pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()
        if step == 20:
            torch.cuda.set_sync_debug_mode("default")
            model[0].weight.grad.view(-1)[:1].fill_(float("nan"))
            before = copy.deepcopy((model.state_dict(), optimizer.state_dict()["state"]))
            torch.cuda.set_sync_debug_mode("error")
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if step == 20:
            torch.cuda.set_sync_debug_mode("default")
            same = _same(before, (model.state_dict(), optimizer.state_dict()["state"]))
            unchanged.append(same)
            torch.cuda.set_sync_debug_mode("error")
        optimizer.zero_grad(set_to_none=True)
        monitor.observe(loss=loss)
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    errors = _internal_errors(monitor)
    monitor.detach()
    return {"amp": amp, "nan_step_left_state_identical": unchanged == [True],
            "params_finite": finite, "internal_errors": errors}  # fmt: skip


def _workload(name: str) -> tuple[torch.nn.Module, int, int]:
    torch.manual_seed(0)
    if name == "mlp-4096x8":
        layers: list[torch.nn.Module] = []
        for _ in range(8):
            layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
        return torch.nn.Sequential(*layers).cuda(), 4096, 1024
    layers = []
    for _ in range(48):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda(), 256, 64


def cost(name: str, rounds: int, steps: int, run_dir: str) -> dict[str, Any]:
    modes = {
        "fused, no policy": (True, {}),
        "fused, skip (device mode)": (True, SKIP),
        "foreach, no policy": (False, {}),
        "foreach, skip (host mode)": (False, SKIP),
    }
    setups = {}
    for label, (fused, policy) in modes.items():
        model, width, batch = _workload(name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused,
                                      foreach=None if fused else True)  # fmt: skip
        monitor = stabmon.attach(model, optimizer, serve_metrics=False, run_dir=run_dir,
                                 run_id=f"cost-{len(setups)}", on_anomaly=policy)  # fmt: skip
        setups[label] = (model, optimizer, monitor, torch.randn(batch, width, device="cuda"))
    times: dict[str, list[float]] = {label: [] for label in modes}
    for round_index in range(rounds + 1):  # the first round warms up
        for label, (model, optimizer, monitor, inputs) in setups.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(inputs).float().pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                monitor.observe(loss=loss)
            torch.cuda.synchronize()
            if round_index:
                times[label].append((time.perf_counter() - start) / steps)
    for _, _, monitor, _ in setups.values():
        monitor.detach()
    return {label: statistics.median(values) for label, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json")
    args = parser.parse_args()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as run_dir:
        result["correctness"] = [correctness(amp, run_dir) for amp in (False, True)]
        for row in result["correctness"]:
            print(row, flush=True)
        result["cost"] = {}
        for name in ("mlp-4096x8", "small-48x256"):
            medians = cost(name, args.rounds, args.steps, run_dir)
            result["cost"][name] = medians
            for label, seconds in medians.items():
                print(f"{name:14} {label:28} {seconds * 1e3:8.3f} ms/step", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=1)
    ok = all(r["nan_step_left_state_identical"] and r["params_finite"]
             and r["internal_errors"] == 0 for r in result["correctness"])  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
