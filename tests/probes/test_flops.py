"""FLOPs counted once against hand counts, and the peak-FLOP/s table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stabmon.probes.flops import FlopCount, compute_dtype, peak_flops


class TransformerBlock(torch.nn.Module):
    """Pre-norm block: attention (fused QKV, causal SDPA) and a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def counted(step: torch.nn.Module, inputs: torch.Tensor) -> int:
    counter = FlopCount()
    counter.start()
    step(inputs).pow(2).mean().backward()
    return counter.stop()


def test_flop_count_of_a_small_mlp_matches_the_hand_count() -> None:
    batch, inputs, hidden, outputs = 16, 32, 64, 8
    model = torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, outputs)
    )
    # Forward: 2*B*(in*h + h*out). Backward: weight gradients of both layers (the same again)
    # and the input gradient of the second layer only (the batch needs none): 2*B*(in*h) +
    # 4*B*(h*out). Bias adds and the ReLU are not matrix products and are not counted.
    hand = 4 * batch * inputs * hidden + 6 * batch * hidden * outputs

    assert counted(model, torch.randn(batch, inputs)) == pytest.approx(hand, rel=0.05)


def test_flop_count_of_a_transformer_block_matches_the_hand_count() -> None:
    batch, length, width = 4, 32, 64
    block = TransformerBlock(width, heads=4)
    inputs = torch.randn(batch, length, width, requires_grad=True)  # as behind an embedding
    # Per sequence, forward: linear layers 2*T*(3d^2 + d^2 + 8d^2) = 24*T*d^2, attention
    # QK^T and AV 4*T^2*d (the full square: kernels do not halve causal work). Training is
    # 3x forward (backward: input and weight gradients). The flash backward also recomputes
    # QK^T, which PyTorch's counter includes: about 1% more at these sizes.
    hand = 3 * batch * (24 * length * width**2 + 4 * length**2 * width)

    assert counted(block, inputs) == pytest.approx(hand, rel=0.05)


def test_flop_count_stops_counting_at_stop() -> None:
    model = torch.nn.Linear(8, 8)
    counter = FlopCount()
    counter.start()
    model(torch.randn(2, 8))
    first = counter.stop()
    model(torch.randn(2, 8))

    assert first == 2 * 2 * 8 * 8
    assert not counter.counting
    assert counter.stop() == 0


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
        ("NVIDIA H100 PCIe", "bf16", 756.5e12),
        ("NVIDIA H100 NVL", "fp8", 1671e12),
        ("NVIDIA H200", "bf16", 989.5e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("NVIDIA L40S", "bf16", 362e12),
        ("NVIDIA L4", "fp16", 121e12),
        ("Tesla V100-SXM2-32GB", "fp16", 125e12),
        ("Tesla T4", "tf32", 8.1e12),  # no TF32 on Turing: the fp32 rate
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
        ("NVIDIA GeForce RTX 3090", "fp32", 35.6e12),
    ],
)
def test_peak_flops_table_knows_common_gpus(name: str, dtype: str, expected: float) -> None:
    assert peak_flops(name, dtype) == pytest.approx(expected)


def test_peak_flops_is_unknown_for_a_gpu_not_in_the_table() -> None:
    assert peak_flops("NVIDIA Imaginary X1", "bf16") is None
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta


def test_compute_dtype_reads_autocast_then_the_parameters() -> None:
    assert compute_dtype("cpu", torch.float32) == "fp32"
    assert compute_dtype("cpu", torch.bfloat16) == "bf16"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype("cpu", torch.float32) == "bf16"


def test_flop_count_that_a_formula_fails_on_leaves_the_operator_alone_and_counts_nothing() -> None:
    def broken(*args: object, **kwargs: object) -> int:
        raise AssertionError("a shape this formula does not expect")

    counter = FlopCount(formulas={torch.ops.aten.mm: broken})  # a formula that gets it wrong
    counter.start()
    result = torch.ones(2, 3) @ torch.ones(3, 4)
    flops = counter.stop()

    assert result.tolist() == [[3.0] * 4] * 2
    assert flops == 0
