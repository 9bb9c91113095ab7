"""Global CUDA state a GPU test changes, put back whatever happens, so GPU tests pass in any order.

``torch.cuda.set_sync_debug_mode`` is process-wide: a test that leaves ``"error"`` on makes
the next test's own ``.cuda()`` calls fail (issue 38: five failures that passed alone).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def sync_debug_errors() -> Iterator[None]:
    """Run the block under ``set_sync_debug_mode("error")``; the mode before it is put back."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def default_cuda_state() -> Iterator[None]:
    """Start and end with sync-debug mode off, whatever ran before or fails inside."""
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
