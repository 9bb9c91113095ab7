"""The models the overhead benchmark trains: three CPU workloads and one GPU workload.

Each is built fresh from a seed for every timed segment, so every variant of a
round trains an identical model on identical batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
BATCH_POOL = 16  # distinct batches, cycled; the same pool for every variant of a round


@dataclass(frozen=True)
class Workload:
    """A freshly seeded model, its optimizer and loss, and how to draw one batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_batch: Callable[[torch.Generator], Batch]
    description: str
    device: torch.device = torch.device("cpu")
    #: Mixed precision of the forward pass (bf16 on CUDA), or None for full precision.
    autocast: torch.dtype | None = None


def _mlp(widths: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(fan_in, fan_out))
        if index < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def mlp17m() -> Workload:
    """A ~17M-parameter MLP, batch 64, SGD with momentum, MSE loss."""
    widths = (1024, 4096, 2048, 1024, 1024, 1024)
    batch = 64
    model = _mlp(widths)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def make_batch(generator: torch.Generator) -> Batch:
        inputs = torch.randn(batch, widths[0], generator=generator)
        targets = torch.randn(batch, widths[-1], generator=generator)
        return inputs, targets

    description = f"MLP {'-'.join(map(str, widths))}, batch {batch}, SGD(momentum=0.9), MSE loss"
    return Workload(model, optimizer, nn.functional.mse_loss, make_batch, description)


def tiny() -> Workload:
    """A tiny MLP, batch 32, where Python overhead dominates the step."""
    widths = (32, 64, 64, 10)
    batch = 32
    model = _mlp(widths)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def make_batch(generator: torch.Generator) -> Batch:
        inputs = torch.randn(batch, widths[0], generator=generator)
        targets = torch.randint(0, widths[-1], (batch,), generator=generator)
        return inputs, targets

    description = (
        f"MLP {'-'.join(map(str, widths))}, batch {batch}, SGD(momentum=0.9), cross-entropy loss"
    )
    return Workload(model, optimizer, nn.functional.cross_entropy, make_batch, description)


def convnet() -> Workload:
    """A small CIFAR-sized convnet (three conv blocks and a linear head), batch 32, Adam."""
    batch, classes = 32, 10
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes),
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def make_batch(generator: torch.Generator) -> Batch:
        inputs = torch.randn(batch, 3, 32, 32, generator=generator)
        targets = torch.randint(0, classes, (batch,), generator=generator)
        return inputs, targets

    description = (
        f"convnet 3x(conv3x3+BN+ReLU) 32-64-128 on 3x32x32, batch {batch}, Adam, cross-entropy"
    )
    return Workload(model, optimizer, nn.functional.cross_entropy, make_batch, description)


class _Decoder(nn.Module):
    """A GPT-2-small-sized decoder: 12 pre-norm layers, width 768, 12 heads, tied head."""

    def __init__(self, vocab: int, context: int, width: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(
            width, width // 64, 4 * width, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        mask = nn.Transformer.generate_square_subsequent_mask(context)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.embed(tokens) + self.position(positions)
        hidden = self.blocks(hidden, mask=self.mask, is_causal=True)
        logits: torch.Tensor = self.norm(hidden) @ self.embed.weight.T
        return logits


def gpt2_small() -> Workload:
    """GPT-2-small-sized decoder on CUDA: AdamW, bf16 autocast, batch 8 x 512 tokens."""
    vocab, context, batch = 50257, 512, 8
    device = torch.device("cuda")
    model = _Decoder(vocab, context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def make_batch(generator: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=generator)
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    description = (
        f"GPT-2-small-sized decoder (12x768, 12 heads), batch {batch}x{context} tokens, "
        "AdamW, bf16 autocast"
    )
    return Workload(
        model, optimizer, loss_fn, make_batch, description, device=device, autocast=torch.bfloat16
    )


CPU_WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp17m": mlp17m,
    "tiny": tiny,
    "convnet": convnet,
}
GPU_WORKLOADS: dict[str, Callable[[], Workload]] = {"gpt2s": gpt2_small}
WORKLOADS = {**CPU_WORKLOADS, **GPU_WORKLOADS}


def build_workload(name: str, seed: int) -> Workload:
    """Build workload ``name`` with every parameter drawn from ``seed``."""
    torch.manual_seed(seed)
    return WORKLOADS[name]()


def parameter_count(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def batch_pool(workload: Workload, seed: int, size: int = BATCH_POOL) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [workload.make_batch(generator) for _ in range(size)]
