"""FLOPs per step counted through a real Monitor in the loops real training runs: a GPT with
causal SDPA under autocast, gradient accumulation and clipping, fused AdamW, activation
checkpointing, torch.compile; and the count checked against the PaLM formula.

The loop clock never moves, so no throughput block ever closes: the FLOPs counter must move
with each step, not with each block (it stayed 0 in any run shorter than a block).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from conftest import MonitorFactory
from helpers import LoopClock, scrape, value
from torch.nn.attention import SDPBackend, sdpa_kernel

import stabmon
from stabmon.probes.flops import FlopCount

#: Steps run after attach; the count is made at step 1 and the counter moves at steps 1-3.
STEPS, MEASURED_AT = 4, 1


class Block(torch.nn.Module):
    """GPT-2's block: pre-norm, fused QKV, causal SDPA, a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(torch.nn.Module):
    """GPT-2 small's shape (tied embedding and head), scaled down for a CPU."""

    def __init__(
        self, *, vocab: int = 64, width: int = 32, layers: int = 2, heads: int = 2,
        context: int = 16, checkpointed: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        torch.manual_seed(0)
        self.vocab, self.width, self.layers, self.heads = vocab, width, layers, heads
        self.checkpointed = checkpointed
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    def palm_flops_per_token(self, length: int) -> int:
        """6N + 12·L·H·Q·T: N the matrix-product parameters (blocks and the tied head)."""
        n = 12 * self.layers * self.width**2 + self.vocab * self.width
        return 6 * n + 12 * self.layers * self.heads * (self.width // self.heads) * length


def batch(model: GPT, size: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, model.vocab, (size, length))


def micro_batch_loss(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())


def run(
    attach: MonitorFactory,
    model: GPT,
    *,
    autocast: torch.dtype | None = None,
    accumulate: int = 1,
    fused: bool = False,
    compiled: bool = False,
    fullgraph: bool = True,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[stabmon.Monitor, float | None]:
    """Train STEPS steps on a still loop clock; the Monitor and its FLOPs counter after."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    settings = {"throughput.flops_measure_step": MEASURED_AT}
    trained: torch.nn.Module = model
    if compiled:  # as nanoGPT does: model = torch.compile(model), then attach to it
        trained = torch.compile(model, backend="eager", fullgraph=fullgraph)  # type: ignore[assignment]  # an OptimizedModule
    monitor = attach(trained, optimizer, clock=LoopClock(), **settings)
    for _ in range(STEPS):
        for _ in range(accumulate):
            autocasting = (
                torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
            )
            with autocasting, context():
                loss = micro_batch_loss(trained, batch(model)) / accumulate
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return monitor, value(scrape(monitor.metrics_url), "stabmon_model_flops_total")


def eager_count(model: GPT, micro_batches: int = 1) -> int:
    """What FlopCounterMode counts around ``micro_batches`` forwards and backwards."""
    counter = FlopCount()
    counter.start()
    for _ in range(micro_batches):
        micro_batch_loss(model, batch(model)).backward()
    model.zero_grad(set_to_none=True)
    return counter.stop()


COUNTED_STEPS = STEPS - MEASURED_AT


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in run_dir.rglob("rank-0.events.jsonl")
        for line in path.read_text().splitlines()
    ]


@pytest.fixture(autouse=True)
def _forget_compiled_code() -> Any:
    yield
    torch._dynamo.reset()


def test_flops_per_step_of_a_gpt2_shaped_model_match_the_palm_formula() -> None:
    model = GPT(vocab=512, width=64, layers=4, heads=4, context=64)
    counted = eager_count(model)  # one sequence-batch step: 2 x 16 tokens
    tokens, length = 2 * 16, 16

    # The counter adds the flash backward's recompute of QK^T; the formula leaves it out.
    assert counted == pytest.approx(model.palm_flops_per_token(length) * tokens, rel=0.03)


def test_model_flops_move_with_each_step_under_bf16_autocast_accumulation_and_clipping(
    attach: MonitorFactory,
) -> None:
    model = GPT()
    per_step = eager_count(model, micro_batches=2)

    _, total = run(attach, model, autocast=torch.bfloat16, accumulate=2)

    assert total == pytest.approx(per_step * COUNTED_STEPS, rel=0.01)


def test_model_flops_are_counted_under_fp16_autocast(attach: MonitorFactory) -> None:
    model = GPT()
    per_step = eager_count(model)

    _, total = run(attach, model, autocast=torch.float16)

    assert total == pytest.approx(per_step * COUNTED_STEPS, rel=0.01)


@pytest.mark.parametrize("backend", [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION])
def test_model_flops_are_the_same_whichever_sdpa_backend_runs(
    attach: MonitorFactory, backend: SDPBackend
) -> None:
    model = GPT()
    per_step = eager_count(model)

    _, total = run(attach, model, context=lambda: sdpa_kernel(backend))

    assert total == pytest.approx(per_step * COUNTED_STEPS, rel=0.02)


def test_model_flops_are_counted_with_a_fused_optimizer(attach: MonitorFactory) -> None:
    model = GPT()
    per_step = eager_count(model)

    _, total = run(attach, model, fused=True)

    assert total == pytest.approx(per_step * COUNTED_STEPS, rel=0.01)


def test_model_flops_count_the_forwards_activation_checkpointing_recomputes(
    attach: MonitorFactory,
) -> None:
    plain = eager_count(GPT())

    _, total = run(attach, GPT(checkpointed=True))

    assert total is not None
    assert total / COUNTED_STEPS > plain * 1.2  # the blocks' forwards run twice


def test_model_flops_are_counted_under_torch_compile_fullgraph(attach: MonitorFactory) -> None:
    model = GPT()
    per_step = eager_count(model, micro_batches=2)

    _, total = run(attach, model, compiled=True, accumulate=2)

    # Replayed on meta tensors: the math path of SDPA, no flash recompute of QK^T.
    assert total == pytest.approx(per_step * COUNTED_STEPS, rel=0.03)


class Unreplayable(GPT):
    """A forward that reads a value (``.item()``): meta tensors have none to read."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.max().item() < 0:
            raise AssertionError("token ids are never negative")
        return super().forward(idx)


def test_a_count_that_cannot_be_made_says_why_once_and_exports_no_zero(
    attach: MonitorFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="stabmon"):
        monitor, total = run(attach, Unreplayable(), compiled=True, fullgraph=False)

    assert total is None  # absent, not a 0 that reads as "no work done"
    unavailable = [e for e in events(tmp_path) if e["event"] == "flops_unavailable"]
    assert len(unavailable) == 1
    assert "torch.compile" in unavailable[0]["reason"]
    assert sum("FLOPs per step not counted" in r.getMessage() for r in caplog.records) == 1


def test_a_step_whose_forward_is_never_seen_says_why(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = GPT()
    model.compile(backend="eager", fullgraph=True)  # the forward hooks are traced away

    _, total = run(attach, model)

    assert total is None
    reasons = [e["reason"] for e in events(tmp_path) if e["event"] == "flops_unavailable"]
    assert len(reasons) == 1 and "no forward" in reasons[0]


def test_a_wrapper_whose_own_forward_never_runs_is_told_what_the_loop_calls_instead(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    # A LightningModule's training_step calls self.model(x): the attached module's own
    # forward never runs. The reason must say so (not blame a compile nobody called).
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Linear(8, 8)

    wrapper = Wrapper()
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.01)
    monitor = attach(wrapper, optimizer, clock=LoopClock(),
                     **{"throughput.flops_measure_step": MEASURED_AT})  # fmt: skip
    for _ in range(STEPS):
        wrapper.model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe()
    monitor.detach()

    reasons = [e["reason"] for e in events(tmp_path) if e["event"] == "flops_unavailable"]
    assert len(reasons) == 1 and "calls a submodule" in reasons[0], reasons
    assert "training_step" in reasons[0]


class Paced(GPT):
    """A GPT whose forward takes half a second of loop-clock time."""

    def __init__(self, clock: LoopClock) -> None:
        super().__init__()
        self.clock = clock

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.clock.advance(0.5)
        return super().forward(idx)


def test_mfu_on_cpu_is_counted_flops_over_training_time_and_a_configured_peak(
    attach: MonitorFactory,
) -> None:
    clock = LoopClock()
    model = Paced(clock)
    per_step = eager_count(GPT())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    settings = {"throughput.flops_measure_step": 1, "throughput.peak_flops": 1e9,
                "throughput.slowdown_block_seconds": 2.0}  # fmt: skip
    monitor = attach(model, optimizer, clock=clock, **settings)
    for _ in range(12):  # the block holding the counted step has no MFU; the next ones do
        micro_batch_loss(model, batch(model)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_peak_flops_per_second") == 1e9
    mfu = value(samples, "stabmon_mfu_ratio")
    assert mfu == pytest.approx(per_step / 0.5 / 1e9, rel=0.01)  # 0.5 s of forward per step
