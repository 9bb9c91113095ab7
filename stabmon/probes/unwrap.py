"""The user's module inside its wrappers: what stabmon names parameters and modules by.

One definition for the hooks (:mod:`stabmon.wiring.hooks`), which watch and name modules,
and the probes that must name them the same way (NaN provenance's weight norms).
"""

from __future__ import annotations

import torch

__all__ = ["unwrap_model"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP/DataParallel (``.module``) or compile (``._orig_mod``).

    Parameter names are taken from the unwrapped module, so module groups read
    ``encoder`` rather than ``module.encoder``.
    """
    wrapper_types: tuple[type, ...] = (torch.nn.DataParallel,)
    if torch.distributed.is_available():
        from torch.nn.parallel import DistributedDataParallel

        wrapper_types = (*wrapper_types, DistributedDataParallel)
    for _ in range(8):  # wrappers nest (compile of DDP); never loop on a self-reference
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = model.module if isinstance(model, wrapper_types) else None
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model
