"""On a CUDA GPU, the figures issue 38 asks of a real GPT loop, in one run.

- **MFU**: a GPT-2-small (nanoGPT's shape: 12 layers, width 768, 12 heads, vocab 50,304,
  tied head, causal ``scaled_dot_product_attention``) trained with bf16 autocast, fused AdamW
  and ``clip_grad_norm_(1.0)``: the FLOPs per step stabmon exports
  (``stabmon_model_flops_total``) against the PaLM formula (6N + 12·L·H·Q·T per token) and
  ``FlopCounterMode``, and ``stabmon_mfu_ratio`` against the MFU worked out here from the
  formula and the wall clock.
- **Overhead**: plain against attached, in alternating blocks on the same model (drift between
  blocks cancels in the median of the paired ratios), eager and under ``torch.compile``, on
  that model and on a launch-bound small GPT (2 layers, width 128), where stabmon's host time
  per step shows: the extra microseconds per step are printed beside the ratio.
- **Syncs**: every attached block runs under ``torch.cuda.set_sync_debug_mode("error")``; a
  host-device sync inside stabmon is contained and counted, and any count fails the run.

Usage::

    python bench/gpu_gpt.py [--json PATH] [--blocks 6] [--compile no|yes|only]

It exits 1 when stabmon contained an error, exported no FLOPs or no MFU, or the FLOPs per step
are off the counter by more than 5%; 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import stabmon
from stabmon.probes.fingerprint import fingerprint, vote
from stabmon.probes.replicas import parameter_buckets


class Block(nn.Module):
    """nanoGPT's block: pre-norm, fused QKV, causal SDPA, a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.vocab, self.width, self.layers, self.heads = vocab, width, layers, heads
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits

    def palm_flops_per_token(self, length: int) -> int:
        """6N + 12·L·H·Q·T, N the matrix-product parameters (the blocks and the tied head)."""
        n = 12 * self.layers * self.width**2 + self.vocab * self.width
        return 6 * n + 12 * self.layers * self.heads * (self.width // self.heads) * length


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    width: int
    heads: int
    vocab: int
    context: int
    batch: int
    steps_per_block: int


#: Steps after each attach before the timed block: past throughput.flops_measure_step.
ATTACH_WARMUP_STEPS = 15
GPT2_SMALL = Shape("gpt2-small", 12, 768, 12, 50304, 1024, 8, 10)
SMALL = Shape("small-gpt", 2, 128, 4, 512, 128, 8, 100)


class Loop:
    """One model, its optimizer and a pool of batches: the training step real loops write."""

    def __init__(self, shape: Shape, *, compiled: bool, device: str = "cuda") -> None:
        torch.manual_seed(0)
        self.shape, self.device = shape, torch.device(device)
        self.model = GPT(
            vocab=shape.vocab, width=shape.width, layers=shape.layers, heads=shape.heads,
            context=shape.context,
        ).to(self.device)  # fmt: skip
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.trained: nn.Module = self.model
        if compiled:
            self.trained = torch.compile(self.model)  # type: ignore[assignment]  # OptimizedModule
        generator = torch.Generator().manual_seed(0)
        self.batches = [
            torch.randint(0, shape.vocab, (shape.batch, shape.context + 1), generator=generator)
            .to(self.device)
            for _ in range(8)
        ]  # fmt: skip
        self.index = 0

    def loss(self) -> torch.Tensor:
        tokens = self.batches[self.index % len(self.batches)]
        self.index += 1
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.trained(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def step(self, monitor: stabmon.Monitor | None = None) -> None:
        loss = self.loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.observe(loss=loss)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def block(self, steps: int, monitor: stabmon.Monitor | None = None) -> float:
        """Seconds for ``steps`` steps, the device drained at both ends."""
        self.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            self.step(monitor)
        self.synchronize()
        return time.perf_counter() - started

    @contextlib.contextmanager
    def sync_checked(self) -> Iterator[None]:
        """CUDA's sync debug mode "error" (a sync raises, and stabmon contains and counts it)."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def attached(loop: Loop, run_dir: Path, **settings: Any) -> Iterator[stabmon.Monitor]:
    # nanoGPT's order: model = torch.compile(model), then attach to what the loop calls.
    monitor = stabmon.attach(
        loop.trained, loop.optimizer, port=0, run_dir=str(run_dir), event_log=False, **settings
    )
    try:
        yield monitor
    finally:
        monitor.detach()


def sample(monitor: stabmon.Monitor, name: str) -> float | None:
    """The one sample called ``name`` (whatever its run and rank labels); None when absent."""
    values = [
        sample.value
        for family in monitor.registry.collect()
        for sample in family.samples
        if sample.name == name
    ]
    return sum(values) if values else None


def internal_errors(monitor: stabmon.Monitor) -> float:
    return sample(monitor, "stabmon_internal_errors_total") or 0.0


def counted_flops(loop: Loop) -> int:
    """What FlopCounterMode counts around one training step's forward and backward."""
    with FlopCounterMode(display=False) as counter:
        loop.loss().backward()
    loop.optimizer.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def measure_mfu(
    run_dir: Path, shape: Shape | None = None, device: str = "cuda", seconds: float = 7.0
) -> dict[str, Any]:
    """Train attached for a few throughput blocks; what stabmon exported against the formula."""
    loop = Loop(shape or GPT2_SMALL, compiled=False, device=device)
    shape = loop.shape
    for _ in range(3):
        loop.step()
    counter = counted_flops(loop)
    palm = loop.model.palm_flops_per_token(shape.context) * shape.batch * shape.context
    settings = {"throughput.flops_measure_step": 2, "throughput.slowdown_block_seconds": 2.0}
    with attached(loop, run_dir, **settings) as monitor:
        loop.block(10, monitor)  # warm-up; the count is made at step 2
        time.sleep(0.3)  # the readback of the last steps lands
        flops_before = sample(monitor, "stabmon_model_flops_total") or 0.0
        steps_before = sample(monitor, "stabmon_steps_total") or 0.0
        loop.synchronize()
        started, steps = time.perf_counter(), 0
        while time.perf_counter() - started < seconds:  # three 2-second blocks: an MFU is made
            loop.step(monitor)
            steps += 1
        loop.synchronize()
        seconds = time.perf_counter() - started
        time.sleep(0.3)
        flops_after = sample(monitor, "stabmon_model_flops_total") or 0.0
        steps_after = sample(monitor, "stabmon_steps_total") or 0.0
        mfu = sample(monitor, "stabmon_mfu_ratio")
        peak = sample(monitor, "stabmon_peak_flops_per_second")
        errors = internal_errors(monitor)
    counted_steps = steps_after - steps_before
    per_step = (flops_after - flops_before) / counted_steps if counted_steps else 0.0
    return {
        "model": f"{shape.name}: {shape.layers}x{shape.width}, {shape.heads} heads, vocab "
        f"{shape.vocab}, batch {shape.batch}x{shape.context}, bf16 autocast, fused AdamW, clip",
        "flops_per_step_exported": per_step,
        "flops_per_step_flop_counter": counter,
        "flops_per_step_palm": palm,
        "exported_over_counter": per_step / counter if counter else None,
        "exported_over_palm": per_step / palm if palm else None,
        "mfu_exported": mfu,
        "mfu_palm_wall_clock": (palm * steps / seconds / peak) if peak else None,
        "peak_flops_per_second": peak,
        "step_ms": 1000 * seconds / steps,
        "internal_errors": errors,
    }


def measure_overhead(
    shape: Shape, *, compiled: bool, blocks: int, run_dir: Path, device: str = "cuda"
) -> dict[str, Any]:
    """Plain and attached blocks taking turns (order swapped every pair) on one model."""
    loop = Loop(shape, compiled=compiled, device=device)
    steps = shape.steps_per_block
    loop.block(3 if not compiled else 5)  # warm-up (and compile) before anything is timed
    plain: list[float] = []
    monitored: list[float] = []
    errors = 0.0
    with attached(loop, run_dir) as monitor:
        loop.block(5, monitor)  # the attached graph compiles, the first count is made
    for index in range(blocks):
        order = ("plain", "stabmon") if index % 2 == 0 else ("stabmon", "plain")
        for variant in order:
            if variant == "plain":
                plain.append(loop.block(steps))
                continue
            with attached(loop, run_dir) as monitor:
                # Past the one-off work of an attach (the FLOPs count at its measure step, the
                # first readback): the steady state is what a long run pays.
                loop.block(ATTACH_WARMUP_STEPS, monitor)
                with loop.sync_checked():
                    monitored.append(loop.block(steps, monitor))
                errors += internal_errors(monitor)
    ratios = [m / p for m, p in zip(monitored, plain, strict=True)]
    plain_ms = 1000 * statistics.median(plain) / steps
    return {
        "model": shape.name,
        "compiled": compiled,
        "steps_per_block": steps,
        "blocks": blocks,
        "plain_ms_per_step": plain_ms,
        "stabmon_ms_per_step": 1000 * statistics.median(monitored) / steps,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "extra_us_per_step": 1000 * plain_ms * (statistics.median(ratios) - 1.0),
        "internal_errors": errors,
    }


def measure_replica_check(
    shape: Shape | None = None, device: str = "cuda", checks: int = 20, every: int = 100
) -> dict[str, Any]:
    """What one replica check costs on the model (fingerprint of every module group and the
    vote over four replicas' fingerprints; the all-gather of a few bytes is left out), and its
    share of the steps between two checks at ``replica_check_steps`` = ``every``."""
    loop = Loop(shape or GPT2_SMALL, compiled=False, device=device)
    loop.block(3)
    step_seconds = loop.block(10) / 10
    names, buckets = parameter_buckets(tuple(loop.model.named_parameters()), 0, 32)
    where = loop.device
    for _ in range(3):  # warm-up: the weights, the allocator
        vote(torch.stack([fingerprint(buckets, where)] * 4))
    loop.synchronize()
    started = time.perf_counter()
    for _ in range(checks):
        vote(torch.stack([fingerprint(buckets, where)] * 4))
    issued = time.perf_counter() - started
    loop.synchronize()
    seconds = (time.perf_counter() - started) / checks
    return {
        "model": shape.name if shape else GPT2_SMALL.name,
        "module_groups": len(names),
        "parameters": sum(len(bucket) for bucket in buckets),
        "check_ms": 1000 * seconds,
        "host_issue_ms": 1000 * issued / checks,
        "step_ms": 1000 * step_seconds,
        "share_of_steps_at_every": seconds / (every * step_seconds),
        "every": every,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--blocks", type=int, default=6, help="plain/attached pairs per setting")
    parser.add_argument(
        "--compile", choices=("no", "yes", "only"), default="yes",
        help="overhead under torch.compile too (yes), not (no: make gpu-check's budget), or only",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_gpt: this torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch)
        if args.compile != "only":
            results["mfu"] = measure_mfu(run_dir)
            print(json.dumps(results["mfu"], indent=1), flush=True)
            results["replica_check"] = measure_replica_check()
            print(json.dumps(results["replica_check"]), flush=True)
        settings = [] if args.compile == "only" else [(SMALL, False), (GPT2_SMALL, False)]
        if args.compile != "no":
            settings += [(SMALL, True), (GPT2_SMALL, True)]
        results["overhead"] = []
        for shape, compiled in settings:
            row = measure_overhead(shape, compiled=compiled, blocks=args.blocks, run_dir=run_dir)
            results["overhead"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    for problem in problems(results):
        print(f"gpu_gpt: {problem}", file=sys.stderr)
    return 1 if problems(results) else 0


def problems(results: dict[str, Any]) -> list[str]:
    """What fails the run: contained errors, no FLOPs or MFU, FLOPs off the counter by > 5%."""
    found = [
        f"{row['model']} compiled={row['compiled']}: {row['internal_errors']:.0f} contained errors"
        for row in results["overhead"]
        if row["internal_errors"]
    ]
    mfu = results.get("mfu")
    if mfu is None:
        return found
    if mfu["internal_errors"]:
        found.append(f"MFU run: {mfu['internal_errors']:.0f} contained errors")
    if not mfu["flops_per_step_exported"]:
        found.append("no FLOPs exported")
    elif abs((mfu["exported_over_counter"] or 0.0) - 1) > 0.05:
        found.append(f"exported FLOPs are {mfu['exported_over_counter']:.3f}x FlopCounterMode's")
    if mfu["mfu_exported"] is None:
        found.append("no MFU exported")
    return found


if __name__ == "__main__":
    sys.exit(main())
