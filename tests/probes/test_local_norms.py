"""The local-norm hook on a real DDP model (one gloo rank in this process; four ranks naming
a corrupted one: tests/probes/test_replicas.py): it measures the gradient before the
reduction, reduces exactly as DDP does without a hook, and stays out of the wrapper."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stabmon.probes.local_norms import LocalGradNorms, install


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp(seed: int = 0) -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    # Small buckets: the hook runs once per bucket, and the step's norm sums them all.
    return nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)


def _train(model: nn.Module, steps: int, state: LocalGradNorms | None = None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(steps):
        model(torch.randn(4, 8, generator=generator)).pow(2).mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        optimizer.step()
        optimizer.zero_grad()
        if state is not None:
            state.fold()
    return norms


def test_the_interval_maximum_is_the_largest_local_gradient_norm_of_its_steps(
    one_rank: None,
) -> None:
    model = _ddp()
    state = install(model, torch.device("cpu"))
    assert isinstance(state, LocalGradNorms)
    norms = _train(model, 5, state)  # one rank: the local gradient is the reduced one
    assert float(state.take()) == pytest.approx(max(norms), rel=1e-5)
    assert float(state.take()) == 0.0  # a fresh interval


def test_training_with_the_hook_is_bit_for_bit_training_without_it(one_rank: None) -> None:
    plain, hooked = _ddp(), _ddp()
    state = install(hooked, torch.device("cpu"))
    assert isinstance(state, LocalGradNorms)
    _train(plain, 4)
    _train(hooked, 4, state)
    for a, b in zip(plain.parameters(), hooked.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_nan_on_the_rank_stays_in_the_interval_maximum(one_rank: None) -> None:
    model = _ddp()
    state = install(model, torch.device("cpu"))
    assert isinstance(state, LocalGradNorms)
    state.add(torch.tensor([float("nan")]))
    state.fold()
    state.add(torch.tensor([3.0]))
    state.fold()
    assert torch.isnan(state.take())


def test_a_step_without_a_synchronised_backward_folds_nothing(one_rank: None) -> None:
    model = _ddp()
    state = install(model, torch.device("cpu"))
    assert isinstance(state, LocalGradNorms)
    with model.no_sync():  # accumulation: DDP reduces nothing, the hook is not called
        model(torch.randn(4, 8)).sum().backward()
    state.fold()
    assert float(state.take()) == 0.0


def test_it_is_not_installed_over_the_loops_own_hook_nor_on_a_plain_model(
    one_rank: None,
) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    theirs = _ddp()
    theirs.register_comm_hook(None, allreduce_hook)
    assert "communication hook of its own" in str(install(theirs, torch.device("cpu")))
    assert "not wrapped" in str(install(nn.Linear(2, 2), torch.device("cpu")))


def test_the_wrapper_pickles_as_it_would_without_the_hook(one_rank: None) -> None:
    plain, hooked = _ddp(), _ddp()
    assert isinstance(install(hooked, torch.device("cpu")), LocalGradNorms)
    assert hooked._comm_hooks == [] and set(vars(hooked)) == set(vars(plain))
    # What a pickle of the wrapper holds (DDP's __getstate__): nothing of stabmon's.
    held, plain_held = hooked.__getstate__(), plain.__getstate__()
    assert set(held) == set(plain_held) and held["_comm_hooks"] == []
    assert "stabmon" not in repr(pickle.dumps(hooked))


@pytest.mark.slow  # three forked gloo ranks: about 6 CPU s, 10-20 s on a loaded 2-core box
def test_the_hook_averages_as_ddp_does_where_the_group_size_is_not_a_power_of_two(
    tmp_path: Path,
) -> None:
    # DDP's reducer multiplies each gradient by 1/size; torch's allreduce_hook divides by
    # size, which on the CPU rounds differently for 3 ranks: training changed.
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(Path(__file__).parent / "local_norms_trainee.py"), str(out)],
        check=True, env=env, timeout=240,
    )  # fmt: skip
    assert json.loads(out.read_text())["differing"] == 0


def test_it_is_not_installed_where_ddp_divides_bucket_views_in_place_on_the_cpu(
    one_rank: None,
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True)
    why = install(model, torch.device("cpu"))
    assert isinstance(why, str) and "gradient_as_bucket_view" in why
    assert model._comm_hooks == []


def test_a_backward_whose_step_gradscaler_skipped_does_not_count(one_rank: None) -> None:
    # fp16 loss scaling overflows now and then, on one rank alone as often as not; GradScaler
    # then skips optimizer.step (no fold). That backward's infinite local norm must not be
    # added into the next step's: it would name a healthy rank as corrupted.
    model = _ddp()
    state = install(model, torch.device("cpu"))
    assert isinstance(state, LocalGradNorms)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))  # overflows at once
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    scaler.scale(model(batch).pow(2).mean()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)  # skipped: the gradients are not finite
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()  # the next, finite, step: stepped and folded
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    optimizer.step()
    state.fold()
    assert float(state.take()) == pytest.approx(norm, rel=1e-5)


def test_a_float64_model_has_its_local_norm_taken(one_rank: None) -> None:
    # vector_norm(dtype=float32) refuses a float64 bucket: every bucket raised, the hook
    # swallowed it, and a float64 model's local norm was always 0 (nothing ever named).
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).double()
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.0001)
    state = install(model, torch.device("cpu"))
    assert isinstance(state, LocalGradNorms)
    model(torch.randn(4, 8, dtype=torch.float64)).pow(2).mean().backward()
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])))
    state.fold()
    assert float(state.take()) == pytest.approx(norm, rel=1e-9)
    assert state.take().dtype == torch.float64


def test_after_detach_the_hook_only_reduces(one_rank: None) -> None:
    # DDP cannot take a comm hook back: after Monitor.detach() (ReplicaCheck.detach closes
    # the state) it must cost what DDP's own reduction costs, measuring nothing.
    from types import SimpleNamespace

    from stabmon.detectors.replica import ReplicaCheck

    model = _ddp()
    state = install(model, torch.device("cpu"))
    assert isinstance(state, LocalGradNorms)
    probe: Any = SimpleNamespace(local_norms=state, measure=lambda step: None)
    ReplicaCheck(probe, SimpleNamespace()).detach()  # type: ignore[arg-type]
    plain = _ddp()
    assert _train(model, 2, state) == _train(plain, 2)  # still reduced, the same way
    assert not state._seen and float(state.take()) == 0.0
