"""stabmon.probes.provenance on real loops: after a non-finite value, the module that
produced it (forward or backward) is named, the ones that only passed it on are told apart,
and a transient is "not reproduced" with the step to look at. Read through the event log.
The models are small and on CPU; the GPT-shaped one has nanoGPT's names and residuals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import MonitorFactory
from helpers import LoopClock, events
from torch import nn

from stabmon.probes.provenance import (
    INPUT,
    LOSS,
    NanProvenance,
    _first_stage,
    backward_producer,
    forward_producer,
)


class _NanGrad(torch.autograd.Function):
    """Identity forward; a NaN gradient backward (a broken custom kernel)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.poisoned = False
        self.backward_poisoned = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        if self.poisoned:
            y = torch.log(y * 0.0)  # log of zero: -inf, then NaN downstream
        if self.backward_poisoned:
            y = _NanGrad.apply(y)  # a broken custom kernel: finite forward, NaN gradient
        return y


class _Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Layer() for _ in range(12))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 0.5 + x * 0.5
        out: torch.Tensor = self.head(x)
        return out


def _train(model: nn.Module, monitor: object, optimizer: torch.optim.Optimizer,
           scaler: torch.amp.GradScaler | None, steps: int, *, poison_from: int | None = None,
           batch_nan_at: int | None = None, backward_from: int | None = None) -> None:  # fmt: skip
    """An AMP-style loop: GradScaler skips a step whose gradients are not finite, so the
    weights stay finite and the fault can be watched again (without a scaler: a plain one)."""
    for step in range(steps):
        if poison_from is not None and step == poison_from:
            model.layers[7].poisoned = True  # type: ignore[union-attr, index]
        if backward_from is not None and step == backward_from:
            model.layers[7].backward_poisoned = True  # type: ignore[union-attr, index]
        inputs = torch.randn(4, 8)
        if step == batch_nan_at:
            inputs[0, 0] = float("nan")  # one bad sample in one batch, healthy weights
        loss = model(inputs).pow(2).mean()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        monitor.observe(loss=loss)  # type: ignore[attr-defined]


def _attached(attach: MonitorFactory, **overrides: object) -> tuple[_Deep, object, Any, Any]:
    model = _Deep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = attach(model, optimizer, scaler=scaler, judge_seconds=0, **overrides)
    return model, monitor, optimizer, scaler


def _provenance(monitor: object, kind: str = "provenance") -> list[dict[str, object]]:
    monitor.detach()  # type: ignore[attr-defined]
    records = events(monitor.event_log_path)  # type: ignore[attr-defined]
    return [r for r in records if r["event"] == kind or r.get("kind") == kind]


def _first_nonfinite_step(monitor: object) -> object:
    records = events(monitor.event_log_path)  # type: ignore[attr-defined]
    return next(
        r["step"]
        for r in records
        if r.get("event") == "anomaly" and r.get("kind") == "nonfinite_loss"
    )


def test_a_log_of_zero_in_layer_7_is_produced_there_in_the_forward_and_passed_on_after(
    attach: MonitorFactory,
) -> None:
    model, monitor, optimizer, scaler = _attached(attach)
    _train(model, monitor, optimizer, scaler, 46, poison_from=40)
    (record,) = _provenance(monitor)
    assert record["producer"] == "layers.7"
    assert record["direction"] == "forward"
    assert record["step"] == _first_nonfinite_step(monitor)  # what the anomaly said
    assert record["observed_step"] == 40 and record["reproduced"] is True
    assert record["propagators"] and all(
        str(name).startswith(("layers.8", "layers.9", "layers.10", "layers.11", "head"))
        for name in record["propagators"]  # type: ignore[attr-defined]
    )


def test_steps_gradscaler_skips_measured_under_one_step_number_are_each_judged_in_turn(
    attach: MonitorFactory,
) -> None:
    # GradScaler skips every step of the episode, so the watched steps share one step
    # number; judged together at the end (a judge interval longer than the run), each
    # measurement must meet its own record.
    clock = LoopClock()
    model = _Deep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = attach(model, optimizer, scaler=scaler, judge_seconds=0.035, clock=clock)
    for step in range(60):  # judged every fourth step, four results at a time
        clock.advance(0.01)
        _train(model, monitor, optimizer, scaler, 1, poison_from=0 if step >= 40 else None)
    (record,) = _provenance(monitor)
    assert (record["producer"], record["direction"]) == ("layers.7", "forward")
    assert record["observed_step"] == 40


def test_a_nan_already_applied_to_the_weights_is_said_so_not_blamed_on_the_first_layer(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # No GradScaler and no skip: the NaN of step 40 is applied, every weight upstream goes
    # NaN, and from then on the first layer's output is non-finite from its own weights. The
    # verdict must say the weights were already non-finite, not name layers.0 as a producer.
    model = _Deep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0)
    _train(model, monitor, optimizer, None, 46, poison_from=40)
    (record,) = _provenance(monitor)
    assert record["direction"] == "weights" and record["reproduced"] is True
    assert record["producer"] == "layers.0.linear"  # the first module holding NaN weights
    line = next(
        r.getMessage() for r in caplog.records if "had reached the weights" in r.getMessage()
    )
    assert "step 40's" in line and "skip holds such steps back" in line


class _Frozen(torch.optim.SGD):
    """An optimizer whose step changes nothing: the weights stay finite whatever the grads."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


class _BrokenBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.middle(self.stem(x))
        out: torch.Tensor = self.head(_NanGrad.apply(x))
        return out


def test_a_nan_gradient_from_a_custom_function_in_layer_7_is_produced_there_in_the_backward(
    attach: MonitorFactory,
) -> None:
    # GradScaler would skip these steps without a word (an overflow, to it), and a plain
    # step would apply the NaN to every weight upstream: the weights are kept as they are.
    model = _Deep()
    optimizer = _Frozen(model.parameters())
    monitor = attach(model, optimizer, judge_seconds=0)
    _train(model, monitor, optimizer, None, 46, backward_from=40)
    (record,) = _provenance(monitor)
    assert record["producer"] == "layers.7"
    assert record["direction"] == "backward"
    assert record["step"] == 40 and record["observed_step"] == 42  # armed at 41's step
    assert record["first_nonfinite"] == "layers.7.linear's output"
    propagators = record["propagators"]
    assert propagators == ["layers.7.linear", "layers.6", "layers.6.linear", "layers.5",
                           "layers.5.linear"]  # fmt: skip  # back towards the input


def test_a_nan_gradient_in_the_models_own_code_names_the_root_and_the_module_before_it(
    attach: MonitorFactory,
) -> None:
    model = _BrokenBackward()
    optimizer = _Frozen(model.parameters())  # steps (its hooks run) but applies nothing
    monitor = attach(model, optimizer, judge_seconds=0)
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    (record,) = _provenance(monitor)
    assert record["direction"] == "backward"
    assert record["producer"] == "(root)"  # between middle and head, in the root's forward
    assert record["first_nonfinite"] == "middle's output"
    assert record["propagators"] == ["middle", "stem"]


class _WeightOnlyNan(torch.autograd.Function):
    """x @ w with a finite input gradient and a NaN weight gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight.T, torch.full_like(weight, float("nan"))


class _WeightGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _WeightOnlyNan.apply(x, self.weight)
        return out


def test_a_nan_only_in_a_weight_gradient_is_named_by_its_parameters(
    attach: MonitorFactory,
) -> None:
    model = nn.Sequential(nn.Linear(8, 8), _WeightGradient(), nn.Linear(8, 1))
    optimizer = _Frozen(model.parameters())
    monitor = attach(model, optimizer, judge_seconds=0)
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    (record,) = _provenance(monitor)
    assert (record["direction"], record["producer"]) == ("backward", "1")
    assert record["first_nonfinite"] is None  # every activation gradient was finite


def test_a_nan_from_the_loss_function_is_named_as_the_loss(attach: MonitorFactory) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = _Frozen(model.parameters())
    monitor = attach(model, optimizer, judge_seconds=0)
    for _ in range(5):
        (model(torch.randn(4, 8)) * 0.0).sqrt().mean().backward()  # sqrt'(0): inf, then NaN
        optimizer.step()
        optimizer.zero_grad()
    (record,) = _provenance(monitor)
    assert (record["direction"], record["producer"]) == ("backward", LOSS)
    assert record["propagators"][:2] == ["(root)", "2"]


class _Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.log_zero = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # a legit -inf
        if self.log_zero:
            weights = torch.log(weights * 0.0)
        out: torch.Tensor = self.c_proj(weights @ v)
        return out


class _Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = (
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )  # fmt: skip
        self.nan_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gelu(self.c_fc(x))
        if self.nan_grad:
            h = _NanGrad.apply(h)
        out: torch.Tensor = self.c_proj(h)
        return out


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), _Attention(width)
        self.ln_2, self.mlp = nn.LayerNorm(width), _Mlp(width)
        self.residual_nan_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.attn(self.ln_1(x))
        if self.residual_nan_grad:
            branch = _NanGrad.apply(branch)  # the residual branch's gradient goes NaN
        x = x + branch
        return x + self.mlp(self.ln_2(x))


class _Gpt(nn.Module):
    """nanoGPT's shape and names, small: embeddings, blocks with residuals, a tied head."""

    def __init__(self, width: int = 16, layers: int = 4, vocab: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.ModuleDict(
            {"wte": nn.Embedding(vocab, width), "wpe": nn.Embedding(8, width),
             "h": nn.ModuleList(_Block(width) for _ in range(layers)),
             "ln_f": nn.LayerNorm(width)}
        )  # fmt: skip
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t["wte"](idx) + t["wpe"](torch.arange(idx.shape[1]))
        for block in t["h"]:
            x = block(x)
        logits: torch.Tensor = self.lm_head(t["ln_f"](x))
        return logits


def _train_gpt(model: _Gpt, monitor: object, optimizer: torch.optim.Optimizer, steps: int,
               watched: list[int] | None = None, until: Any = None) -> None:  # fmt: skip
    """nanoGPT's loop; ``watched`` gets how many modules hold a forward hook at each step,
    and ``until(step)``, when given, is called before each (to end a fault)."""
    for step in range(steps):
        if until is not None:
            until(step)
        if watched is not None:
            watched.append(sum(bool(m._forward_hooks) for m in model.modules()))
        idx = torch.randint(0, 32, (2, 8))
        logits = model(idx)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), idx.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("poison", "producer", "direction", "propagator"),
    [
        ("attn.log_zero", "transformer.h.1.attn", "forward", "transformer.h.1.ln_2"),
        ("mlp.nan_grad", "transformer.h.1.mlp", "backward", "transformer.h.1.mlp.gelu"),
        ("residual_nan_grad", "transformer.h.1", "backward", "transformer.h.1.attn"),
    ],
    ids=["forward-attention", "backward-mlp", "backward-residual-branch"],
)
def test_a_gpt_shaped_model_names_the_block_part_that_produced_the_nan(
    attach: MonitorFactory, poison: str, producer: str, direction: str, propagator: str
) -> None:
    model = _Gpt()
    part, _, flag = poison.rpartition(".")
    block = model.transformer["h"][1]  # type: ignore[index]
    setattr(block.get_submodule(part) if part else block, flag, True)
    optimizer = _Frozen(model.parameters())
    monitor = attach(model, optimizer, judge_seconds=0)
    _train_gpt(model, monitor, optimizer, 5)
    (record,) = _provenance(monitor)
    assert (record["producer"], record["direction"]) == (producer, direction)
    assert record["propagators"][0] == propagator  # type: ignore[index]
    if direction == "backward":  # the blocks before it pass the gradient on, not after it
        propagators = record["propagators"]
        assert "transformer.h.0" in propagators or len(propagators) == 5  # type: ignore[operator]
        assert not any(str(p).startswith(("transformer.h.2", "transformer.h.3", "lm_head"))
                       for p in propagators)  # type: ignore[attr-defined]  # fmt: skip


def _big_gpt(attach: MonitorFactory) -> tuple[_Gpt, Any, Any, torch.optim.Optimizer]:
    """A 12-block GPT (126 modules: watched in two stages), its blocks, its Monitor and a
    frozen optimizer (the weights stay finite, so a fault recurs)."""
    model = _Gpt(layers=12)
    optimizer = _Frozen(model.parameters())
    monitor = attach(model, optimizer, judge_seconds=0)
    return model, model.transformer["h"], monitor, optimizer


def test_a_large_model_is_watched_by_its_blocks_first_and_inside_the_block_named_next(
    attach: MonitorFactory,
) -> None:
    # 12 blocks: 126 modules. A hook on each would cost more than a small step's own work,
    # so the first stage watches the 19 down to the blocks, the second block 7's inside.
    model, blocks, monitor, optimizer = _big_gpt(attach)
    blocks[7].attn.log_zero = True
    watched: list[int] = []
    _train_gpt(model, monitor, optimizer, 8, watched)
    (record,) = _provenance(monitor)
    assert (record["producer"], record["direction"]) == ("transformer.h.7.attn", "forward")
    assert record["propagators"][:2] == ["transformer.h.7.ln_2", "transformer.h.7.mlp.c_fc"]
    assert "transformer.h.8" in record["propagators"]  # type: ignore[operator]
    assert len(record["watched_steps"]) == 2  # type: ignore[arg-type]  # one step each
    # Disarmed (the root's own step hooks), then the 19 modules down to the blocks, then
    # those and block 7's 9 modules.
    assert watched[:2] == [1, 1] and 19 in watched and 28 in watched, watched
    assert max(watched) == 28 and watched.index(19) < watched.index(28), watched


def test_a_backward_fault_is_named_in_its_block_then_in_the_part_that_made_it(
    attach: MonitorFactory,
) -> None:
    model, blocks, monitor, optimizer = _big_gpt(attach)
    blocks[7].mlp.nan_grad = True
    _train_gpt(model, monitor, optimizer, 8)
    (record,) = _provenance(monitor)
    assert (record["producer"], record["direction"]) == ("transformer.h.7.mlp", "backward")
    assert record["first_nonfinite"] == "transformer.h.7.mlp.gelu's output"
    propagators = record["propagators"]
    assert propagators[0] == "transformer.h.7.mlp.gelu"  # type: ignore[index]
    assert "transformer.h.6" in propagators  # type: ignore[operator]  # towards the input
    assert not any(str(p).startswith(("transformer.h.8", "lm_head"))
                   for p in propagators)  # type: ignore[attr-defined]  # fmt: skip


def test_a_fault_gone_before_the_inside_is_watched_names_the_block_and_says_so(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    model, blocks, monitor, optimizer = _big_gpt(attach)
    attention = blocks[7].attn
    attention.log_zero = True
    watched: list[int] = []

    def until(step: int) -> None:  # the fault lasts while the blocks are watched, no longer
        if sum(bool(m._forward_hooks) for m in model.modules()) == 28:
            attention.log_zero = False

    _train_gpt(model, monitor, optimizer, 10, watched, until)
    (record,) = _provenance(monitor)
    assert (record["producer"], record["direction"]) == ("transformer.h.7", "forward")
    assert len(record["watched_steps"]) == 4  # type: ignore[arg-type]  # 1 + provenance_steps
    line = next(r.getMessage() for r in caplog.records if "did not recur" in r.getMessage())
    assert "the modules inside transformer.h.7 were watched next" in line


def test_a_fault_that_moved_before_the_inside_is_watched_is_named_where_it_went(
    attach: MonitorFactory,
) -> None:
    # The second stage watches the blocks too: block 7's input, non-finite from block 2 on,
    # must not make block 7 the producer.
    model, blocks, monitor, optimizer = _big_gpt(attach)
    blocks[7].attn.log_zero = True

    def moved(step: int) -> None:
        if sum(bool(m._forward_hooks) for m in model.modules()) == 28:
            blocks[7].attn.log_zero, blocks[2].attn.log_zero = False, True

    _train_gpt(model, monitor, optimizer, 10, [], moved)
    (record,) = _provenance(monitor)
    assert (record["producer"], record["direction"]) == ("transformer.h.2", "forward")
    assert record["propagators"][0] == "transformer.h.3"  # type: ignore[index]


def test_a_run_that_ends_before_the_inside_is_watched_still_names_the_block(
    attach: MonitorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    model, blocks, monitor, optimizer = _big_gpt(attach)
    blocks[7].attn.log_zero = True
    watched: list[int] = []
    _train_gpt(model, monitor, optimizer, 4, watched)  # detached as the first stage ends
    assert 28 not in watched, watched
    (record,) = _provenance(monitor)
    assert (record["producer"], record["direction"]) == ("transformer.h.7", "forward")
    line = next(r.getMessage() for r in caplog.records if "provenance" in r.getMessage()
                or "produced in the forward" in r.getMessage())  # fmt: skip
    assert "the run ended before the modules inside transformer.h.7 were watched" in line


def test_first_stage_is_the_depth_that_keeps_both_stages_small() -> None:
    def names(model: nn.Module) -> list[str]:
        return [name for name, _ in model.named_modules()]

    assert _first_stage(names(_Gpt(layers=4))) is None  # 47 modules: watched whole at once
    first = _first_stage(names(_Gpt(layers=12)))
    assert first is not None and len(first) == 19
    assert {"", "transformer.h.11", "transformer.wte", "lm_head"} <= first
    assert not any(name.startswith("transformer.h.0.") for name in first)
    flat = nn.Sequential(*(nn.Linear(2, 2) for _ in range(60)))  # no tree to split
    assert _first_stage(names(flat)) is None


def test_gradient_hooks_only_while_armed_after_a_nan_that_may_arise_in_the_backward(
    attach: MonitorFactory,
) -> None:
    model = _Deep()
    optimizer = _Frozen(model.parameters())
    monitor = attach(model, optimizer, judge_seconds=0, provenance_steps=2)
    outputs: list[torch.Tensor] = []
    model.layers[3].register_forward_hook(lambda m, i, o: outputs.append(o))

    def hooked(since: int) -> list[bool]:
        return [bool(output._backward_hooks) for output in outputs[since:]]

    _train(model, monitor, optimizer, None, 3)
    assert hooked(0) == [False] * 3  # disarmed: nothing on the graph
    _train(model, monitor, optimizer, None, 6, batch_nan_at=0)  # a non-finite loss
    assert hooked(3) == [False] * 6  # the forward is watched; the gradients are left alone
    _train(model, monitor, optimizer, None, 6, backward_from=0)  # the loss stays finite
    assert hooked(9) == [False, False, True, True, False, False]  # two watched steps
    records = _provenance(monitor)
    assert [(r["producer"], r["direction"]) for r in records] == [
        (None, None), ("layers.7", "backward")]  # fmt: skip


def test_a_watched_step_the_read_back_dropped_does_not_hold_the_verdict_back(
    attach: MonitorFactory,
) -> None:
    model = _Deep()
    optimizer = _Frozen(model.parameters())
    monitor = attach(model, optimizer, judge_seconds=0)
    plugin = next(p for p in monitor._plugged.plugins if isinstance(p, NanProvenance))  # type: ignore[attr-defined]
    judge, dropped = plugin.judge, []

    def lossy(step: int, values: list[float]) -> None:
        if step in plugin._waiting and not dropped:  # the read-back drops the first watched step
            dropped.append(step)
            return
        judge(step, values)

    plugin.judge = lossy  # type: ignore[method-assign]
    _train(model, monitor, optimizer, None, 12, batch_nan_at=0)  # a transient: three clean steps
    (record,) = _provenance(monitor)
    assert dropped and record["reproduced"] is False
    assert dropped[0] not in record["watched_steps"]  # type: ignore[operator]
    assert len(record["watched_steps"]) == 2  # type: ignore[arg-type]  # the two judged


def test_a_nan_in_one_batch_with_healthy_weights_is_not_reproduced_with_its_step(
    attach: MonitorFactory,
) -> None:
    model, monitor, optimizer, scaler = _attached(attach)
    _train(model, monitor, optimizer, scaler, 30, batch_nan_at=20)
    (record,) = _provenance(monitor)
    assert record["producer"] is None and record["reproduced"] is False
    assert record["step"] == _first_nonfinite_step(monitor)
    assert record["watched_steps"] == [21, 22, 23]  # the steps after the bad batch


def test_always_mode_names_a_bad_batch_as_the_input_at_its_own_step(
    attach: MonitorFactory,
) -> None:
    model, monitor, optimizer, scaler = _attached(attach, provenance_always=True)
    _train(model, monitor, optimizer, scaler, 25, batch_nan_at=20)
    records = _provenance(monitor)
    assert [(r["observed_step"], r["producer"]) for r in records] == [(20, INPUT)]


def test_forward_producer_tells_the_producer_from_its_containers_and_propagators() -> None:
    # Slots: 0 the batch, 1..4 the outputs of layers.6, layers.7.linear, layers.7, layers.8,
    # 5 the head's output (the model's too).
    calls = [("layers.6", (0,), (1,)), ("layers.7.linear", (1,), (2,)), ("layers.7", (1,), (3,)),
             ("layers.8", (3,), (4,)), ("head", (4,), (5,)), ("", (0,), (5,))]  # fmt: skip
    finite = [True, True, True, False, False, False]
    assert forward_producer(calls, finite) == ("layers.7", ["layers.8", "head"])
    assert forward_producer(calls[:1], finite) == (None, [])
    # The batch itself non-finite: the input.
    assert forward_producer(calls, [False] * 6)[0] == INPUT
    # layers.8's input is made by layers.7's own code after its linear (slot 6, not a
    # module's output): non-finite while layers.7.linear's output is finite.
    calls[3] = ("layers.8", (6,), (4,))
    calls[2] = ("layers.7", (1,), (6,))
    assert forward_producer(calls, [True, True, True, True, False, False, True])[0] == "layers.8"
    calls[3] = ("layers.8", (7,), (4,))  # made by the root's own code between the layers
    finite = [True, True, True, True, False, False, True, False]
    assert forward_producer(calls, finite)[0] == "(root)"


def test_backward_producer_names_the_module_around_a_shared_input() -> None:
    # ln_1 makes slot 0 from the block's input (5); attn takes slot 0, and so do q, k and v
    # (one tensor): their gradients meet in slot 0. The block's output is slot 6.
    calls = [("h.0.ln_1", (5,), (0,)), ("h.0.attn.q", (0,), (1,)), ("h.0.attn.k", (0,), (2,)),
             ("h.0.attn.v", (0,), (3,)), ("h.0.attn", (0,), (4,)), ("h.0", (5,), (6,)),
             ("", (5,), (6,))]  # fmt: skip
    order = [6, 4, 1, 2, 3, 0, 5]  # the order autograd computed the gradients in
    finite = [True, True, True, True, True, False, False]  # from slot 0 on: non-finite
    assert backward_producer(calls, order, finite) == ("h.0.attn", ["h.0.ln_1"],
                                                       "h.0.ln_1's output")  # fmt: skip
    # The NaN arises in attn's own code (after its projections): q's output gradient first.
    finite = [True, True, False, False, False, False, False]
    producer, propagators, first = backward_producer(calls, order, finite)
    assert (producer, first) == ("h.0.attn", "h.0.attn.q's output")
    assert propagators == ["h.0.attn.q", "h.0.attn.k", "h.0.attn.v", "h.0.ln_1"]
    # Already non-finite where it entered the model: the loss.
    assert backward_producer(calls, order, [False] * 7)[0] == LOSS
    assert backward_producer(calls, order, [True] * 7) == (None, [], None)


class _Unsummable(torch.Tensor):
    """A tensor subclass whose ``sum`` fails: a hook's failure, planted."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.sum:
            raise RuntimeError("planted: no sum")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_failing_watch_is_contained_counted_and_stops_while_training_goes_on(
    attach: MonitorFactory,
) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model[1].register_forward_hook(lambda m, i, o: o.as_subclass(_Unsummable))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0, provenance_always=True)
    for _ in range(6):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)  # type: ignore[attr-defined]
    assert monitor._guard.counts["grads"] == 1  # type: ignore[attr-defined]  # once: stopped
    assert _provenance(monitor) == []


def test_a_watched_model_compiled_with_fullgraph_still_trains(attach: MonitorFactory) -> None:
    # The watch arms after a NaN; under torch.compile its hooks are constant no-ops, so a
    # fullgraph compile neither breaks nor errors (a compiled forward is not watched).
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0, provenance_always=True)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    for step in range(4):
        inputs = torch.randn(4, 8)
        if step == 1:
            inputs[0, 0] = float("nan")
        loss = compiled(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)
    assert _provenance(monitor) == []  # not watched under compile, and nothing broke


def test_arming_and_refining_the_watch_of_a_compiled_model_compiles_nothing_again(
    attach: MonitorFactory,
) -> None:
    # Hooks added and removed while armed (both stages, then disarmed) are not guarded on:
    # a run with many NaN episodes never reaches dynamo's recompile limit (and so never
    # falls back to eager) because of the watch.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _Gpt(layers=12)
    compiled = torch.compile(model, backend="eager")
    optimizer = _Frozen(model.parameters())
    monitor = attach(model, optimizer, judge_seconds=0)
    attention = model.transformer["h"][7].attn  # type: ignore[index]
    watched: list[int] = []

    def fault(step: int) -> None:  # two NaN episodes
        attention.log_zero = step in (2, 3, 4, 14, 15, 16)

    _train_gpt(compiled, monitor, optimizer, 26, watched, fault)  # type: ignore[arg-type]
    assert max(watched) == 19  # armed: the first stage's hooks (never refined: not watched)
    assert watched[-1] == 1  # and disarmed again
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2, dict(counters["stats"])  # the clean forward and the poisoned one
    assert _provenance(monitor) == []  # a compiled forward is not watched


class _Queries(nn.Module):
    """DETR-style: a learned parameter passed as a submodule's input (query embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(4, 8))
        self.decoder = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.decoder(self.queries) + x)
        return out


def test_a_parameter_passed_as_a_module_input_keeps_no_gradient_hook_and_pickles_as_before(
    attach: MonitorFactory,
) -> None:
    # A gradient hook on a leaf (a parameter) is not part of one step's graph: it stayed on
    # the parameter for good, one more each watched step (each holding its step's record),
    # fired after the watch ended, and pickling the model warned that hooks are dropped.
    import pickle
    import warnings

    model = _Queries()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0, provenance_always=True)
    for _ in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)  # type: ignore[attr-defined]
    assert not model.queries._backward_hooks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pickle.dumps(model)
    monitor.detach()  # type: ignore[attr-defined]


def test_a_double_backward_keeps_no_graph_alive_through_the_gradient_sums(
    attach: MonitorFactory,
) -> None:
    # backward(create_graph=True) (a gradient penalty): each gradient a hook sums has a
    # graph, which reaches the step's whole forward; a sum kept with it held that graph (all
    # the step's activations) until the step was judged.
    from stabmon.probes.provenance import _GradientSum, _Step

    step = _Step()
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.tanh(x * 2.0)
    y.register_hook(_GradientSum(step, 0))
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    assert g.requires_grad and len(step.grads) == 1
    assert not step.grads[0].requires_grad


class _Checkpointed(_Deep):
    """Activation checkpointing: the blocks after the first re-run in the backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for index, layer in enumerate(self.layers):
            y = layer(x) if not index else checkpoint(layer, x, use_reentrant=self.reentrant)
            x = y * 0.5 + x * 0.5
        out: torch.Tensor = self.head(x)
        return out


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_name_the_forward_producer_in_forward_order(
    attach: MonitorFactory, reentrant: bool
) -> None:
    # Reentrant checkpointing runs its blocks under no_grad in the forward and again in the
    # backward: they were left out of the forward and seen in backward order, so the head's
    # non-finite input came from nowhere watched and the root was named as the producer.
    model = _Checkpointed(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = attach(model, optimizer, scaler=scaler, judge_seconds=0)
    _train(model, monitor, optimizer, scaler, 46, poison_from=40)
    (record,) = _provenance(monitor)
    assert (record["producer"], record["direction"]) == ("layers.7", "forward")
    assert record["propagators"][:2] == ["layers.8.linear", "layers.8"]  # type: ignore[index]


def test_an_evaluation_under_no_grad_in_a_watched_step_is_no_producer(
    attach: MonitorFactory,
) -> None:
    model, monitor, optimizer, scaler = _attached(attach, provenance_always=True)
    for step in range(6):
        if step == 3:
            with torch.no_grad():  # a NaN in an evaluation batch, not in training
                model(torch.full((4, 8), float("nan")))
                model.layers[2](torch.full((4, 8), float("nan")))
        loss = model(torch.randn(4, 8)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        monitor.observe(loss=loss)  # type: ignore[attr-defined]
    assert _provenance(monitor) == []


_DTENSOR_SCRIPT = """
import os, socket, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from stabmon.probes.provenance import _weight_norms
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
model = torch.nn.Linear(4, 4)
for name in ("weight", "bias"):
    sharded = distribute_tensor(getattr(model, name).detach(), mesh, [Shard(0)])
    setattr(model, name, torch.nn.Parameter(sharded))
owners, norms = _weight_norms(model)
torch.cat([torch.zeros(2), norms])  # stacked with the step's sums, as measure() does
print(type(norms).__name__, owners)
dist.destroy_process_group()
"""


def test_the_weights_norms_of_sharded_parameters_are_this_ranks_plain_tensors() -> None:
    # FSDP2 / tensor parallelism: parameters are DTensors; their norms were DTensors, which
    # the first watched step's sums could not be concatenated with (the step was lost,
    # counted as an internal error) and may redistribute (a collective) on one rank alone.
    import os
    import sys
    from pathlib import Path

    from process_groups import run_group

    root = Path(__file__).resolve().parents[2]
    done = run_group([sys.executable, "-c", _DTENSOR_SCRIPT], timeout=120,
                     env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["Tensor", "['',", "'']"]


def test_an_evaluation_under_no_grad_puts_no_gradient_hook_on_what_it_is_given(
    attach: MonitorFactory,
) -> None:
    # The evaluation's slots are dropped and given to the training forward's tensors after
    # it: a hook on a tensor with a gradient passed in would report into one of those.
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0, provenance_always=True)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()  # the watch begins
    hidden = torch.randn(4, 8, requires_grad=True) * 1.0  # in some graph, not a leaf
    with torch.no_grad():
        model(hidden)
    assert not hidden._backward_hooks
    monitor.detach()  # type: ignore[attr-defined]


def test_a_watch_that_sees_no_module_call_ends_after_its_steps(attach: MonitorFactory) -> None:
    # A compiled forward is not watched: its steps had no calls, were not counted, and the
    # watch armed by a NaN stayed on every module for the rest of the run (and never armed
    # again); it ends after provenance_steps now, without a verdict (nothing was watched).
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0, provenance_steps=2)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    hooked = []
    for step in range(10):
        inputs = torch.randn(4, 8)
        if step == 1:
            inputs[0, 0] = float("nan")
        loss = compiled(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.observe(loss=loss)  # type: ignore[attr-defined]
        hooked.append(bool(model[0]._forward_hooks))
    assert any(hooked) and not hooked[-1]
    assert _provenance(monitor) == []  # no verdict: nothing was watched
