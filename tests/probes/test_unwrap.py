"""unwrap_model: the module inside compile, DDP or DataParallel, however they nest."""

from __future__ import annotations

import torch

from stabmon.probes.unwrap import unwrap_model


def test_the_module_inside_compile_of_data_parallel_is_found() -> None:
    inner = torch.nn.Linear(2, 2)
    wrapped = torch.compile(torch.nn.DataParallel(inner), backend="eager")
    assert unwrap_model(wrapped) is inner  # type: ignore[arg-type]
    assert unwrap_model(inner) is inner
