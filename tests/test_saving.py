"""A model saved with torch.save while attached is the model without stabmon."""

from __future__ import annotations

import io
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import MonitorFactory
from tests.helpers import scrape, train_step, value


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _pickle_globals(path: Path) -> set[str]:
    """Every global a torch.save file names (GLOBAL and STACK_GLOBAL opcodes)."""
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        data = archive.read(name)
    found: set[str] = set()
    strings: list[str] = []
    for opcode, argument, _ in pickletools.genops(io.BytesIO(data)):
        if opcode.name == "GLOBAL":
            found.add(str(argument).replace(" ", "."))
        elif opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(str(argument))
        elif opcode.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
    return found


_LOADER = """
import sys, torch
path, weights_only = sys.argv[1], sys.argv[2] == "1"
if weights_only:
    torch.serialization.add_safe_globals(
        [torch.nn.Sequential, torch.nn.Linear, torch.nn.ReLU]
    )
model = torch.load(path, weights_only=weights_only)
model(torch.randn(2, 8)).sum().backward()
assert not any(name.startswith("stabmon") for name in sys.modules), "stabmon was imported"
print(len(model._forward_pre_hooks), len(model._forward_hooks))
"""


@pytest.fixture
def saved(attach: MonitorFactory, tmp_path: Path) -> Path:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, optimizer)
    train_step(model, optimizer, monitor)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    train_step(model, optimizer, monitor)  # still attached and measuring after the save
    assert value(scrape(monitor.metrics_url), "stabmon_steps_total") == 2
    return path


def test_saved_model_names_no_stabmon_global(saved: Path) -> None:
    names = _pickle_globals(saved)
    assert "collections.OrderedDict" in names  # the parser reads the globals it should
    assert not [name for name in names if "stabmon" in name]


@pytest.mark.parametrize("weights_only", [False, True])
def test_saved_model_loads_in_a_process_that_never_imported_stabmon(
    saved: Path, weights_only: bool
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LOADER, str(saved), "1" if weights_only else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0"]  # the loaded model carries no hooks of ours


def test_detach_leaves_plain_hook_dicts(attach: MonitorFactory) -> None:
    from collections import OrderedDict

    model = _model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    monitor.detach()
    for name in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks"):
        hook_dict = vars(model)[name]
        assert type(hook_dict) is OrderedDict and not hook_dict


def test_a_users_hook_registered_while_attached_is_saved_and_removable(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    model = _model()
    monitor = attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls: list[int] = []
    handle = model.register_forward_hook(lambda module, args, output: calls.append(1))
    model(torch.randn(2, 8))
    monitor.detach()
    model(torch.randn(2, 8))
    handle.remove()
    model(torch.randn(2, 8))
    assert calls == [1, 1]
