"""HookSet on its own: torch's hooks installed for an owner, removed without a trace.

The owner here is a small recorder with the four hook methods (in stabmon it is the
Monitor's :class:`~stabmon.wiring.step_hooks.StepHooks`); the model, optimizer and GradScaler are
real (the scaler disabled: CPU).
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
from collections import OrderedDict
from typing import Any

import pytest
import torch

from stabmon.errors import AlreadyAttachedError
from stabmon.wiring.hooks import HookSet, unwrap_model, watch_gradient


class Owner:
    """Records which hook ran, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def forward_pre(self, module: Any, args: Any, kwargs: Any) -> None:
        self.calls.append("forward_pre")

    def forward_post(self, module: Any, args: Any, output: Any) -> None:
        self.calls.append("forward_post")

    def step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.calls.append("step_pre")

    def step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.calls.append("step_post")

    def scaler_update(self) -> None:
        self.calls.append("scaler_update")


def installed(
    owner: Owner, scaler: object | None = None
) -> tuple[HookSet, torch.nn.Module, torch.optim.Optimizer]:
    """A linear model and its SGD optimizer with ``owner``'s hooks installed."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = HookSet(model, optimizer, scaler)
    hooks.install(
        forward_pre=owner.forward_pre, forward_post=owner.forward_post,
        step_pre=owner.step_pre, step_post=owner.step_post, scaler_update=owner.scaler_update,
    )  # fmt: skip
    return hooks, model, optimizer


def users_hook(module: Any, args: Any, output: Any) -> None:
    """A user's own forward hook, there before stabmon's."""


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_hookset_calls_the_owner_at_each_forward_and_optimizer_step_boundary() -> None:
    owner = Owner()
    _, model, optimizer = installed(owner)

    step(model, optimizer)

    assert owner.calls == ["forward_pre", "forward_post", "step_pre", "step_post"]


def test_hookset_remove_leaves_the_model_and_optimizer_as_they_were() -> None:
    owner = Owner()
    hooks, model, optimizer = installed(owner)

    hooks.remove()
    step(model, optimizer)

    assert owner.calls == []
    assert type(model._forward_pre_hooks) is OrderedDict and not model._forward_pre_hooks
    assert type(model._forward_hooks) is OrderedDict and not model._forward_hooks
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_hookset_refuses_a_second_set_on_one_model_until_the_first_is_removed() -> None:
    hooks, model, optimizer = installed(Owner())

    with pytest.raises(AlreadyAttachedError, match="call detach\\(\\) on it first"):
        HookSet(model, torch.optim.SGD(model.parameters(), lr=0.1))
    hooks.remove()
    HookSet(model, optimizer).remove()  # free again


def test_hooks_hold_their_owner_weakly_and_do_nothing_once_it_is_gone() -> None:
    owner = Owner()
    _, model, optimizer = installed(owner)
    calls = owner.calls

    del owner
    gc.collect()
    step(model, optimizer)  # the hooks are still registered, and inert

    assert calls == []


def test_a_model_saved_with_hooks_installed_pickles_nothing_of_stabmon() -> None:
    _, model, _ = installed(Owner())

    buffer = io.BytesIO()
    torch.save(model, buffer)

    assert b"stabmon" not in buffer.getvalue()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert not loaded._forward_pre_hooks and not loaded._forward_hooks


def test_a_deep_copied_model_gets_hooks_that_call_no_owner() -> None:
    owner = Owner()
    model = torch.nn.Linear(2, 1)
    model.register_forward_hook(users_hook)  # a hook dict stabmon then does not replace
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    HookSet(model, optimizer).install(
        forward_pre=owner.forward_pre, forward_post=owner.forward_post,
        step_pre=owner.step_pre, step_post=owner.step_post,
    )  # fmt: skip

    twin = copy.deepcopy(model)  # what AveragedModel does mid-run
    twin(torch.randn(3, 2))
    pickle.dumps(twin._forward_hooks)  # inert hooks pickle without their owner

    assert owner.calls == []


def test_install_rejects_hook_methods_of_two_different_owners() -> None:
    first, second = Owner(), Owner()
    model = torch.nn.Linear(2, 1)
    hooks = HookSet(model, torch.optim.SGD(model.parameters(), lr=0.1))

    with pytest.raises(TypeError, match="bound method of the same object"):
        hooks.install(
            forward_pre=first.forward_pre, forward_post=second.forward_post,
            step_pre=first.step_pre, step_post=first.step_post,
        )  # fmt: skip
    hooks.remove()


def test_scaler_update_calls_the_owner_after_the_real_update_and_is_restored() -> None:
    owner = Owner()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    hooks, _, _ = installed(owner, scaler)

    scaler.update()
    hooks.remove()
    scaler.update()

    assert owner.calls == ["scaler_update"]
    assert "update" not in vars(scaler)  # the class's method again, nothing left on the instance


def test_unwrap_model_finds_the_module_inside_data_parallel() -> None:
    inner = torch.nn.Linear(2, 1)
    assert unwrap_model(torch.nn.DataParallel(inner)) is inner
    assert unwrap_model(inner) is inner


class _Watcher:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def forward(self, name: str, inputs: Any, output: Any) -> None:
        self.seen.append(name)


def test_watch_modules_sees_every_module_in_completion_order_until_unwatched() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 1)))
    hooks = HookSet(model, torch.optim.SGD(model.parameters(), lr=0.1))
    watcher = _Watcher()
    unwatch = hooks.watch_modules(watcher.forward)
    model(torch.randn(3, 2))
    assert watcher.seen == ["0", "1.0", "1", ""]  # leaves finish before their parents
    unwatch()
    model(torch.randn(3, 2))
    assert watcher.seen == ["0", "1.0", "1", ""]
    assert all(type(m._forward_hooks) is OrderedDict for m in model.modules())  # restored
    hooks.remove()


def test_watch_gradient_sees_a_tensors_total_gradient_and_leaves_it_unchanged() -> None:
    x = torch.randn(3, 2, requires_grad=True)
    hidden = x * 2.0
    seen: list[torch.Tensor] = []
    watch_gradient(hidden, seen.append)  # list.append returns None: the gradient stays
    (hidden.sum() + hidden.pow(2).sum()).backward()  # two uses: one total gradient
    assert len(seen) == 1 and torch.equal(seen[0], 1 + 2 * hidden.detach())
    assert x.grad is not None and torch.equal(x.grad, 2 * seen[0])


def test_watch_gradient_leaves_a_leaf_alone() -> None:
    # A parameter passed as a module's input: a hook on it would outlive the step.
    weight = torch.nn.Parameter(torch.randn(3))
    watch_gradient(weight, lambda grad: None)
    assert not weight._backward_hooks


def test_a_watch_ended_leaves_nothing_behind_over_many_cycles() -> None:
    # NaN provenance arms a module watch once per episode: each ended watch kept its
    # removal in the handle list for the rest of the run.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    hooks = HookSet(model, torch.optim.SGD(model.parameters(), lr=0.1))
    watcher = _Watcher()
    before = len(hooks._handles)
    for _ in range(50):
        hooks.watch_modules(watcher.forward)()
        hooks.watch_output(lambda kwargs, output: None)()
    assert len(hooks._handles) == before
    hooks.watch_modules(watcher.forward)  # still armed when the Monitor detaches
    hooks.remove()
    model(torch.randn(1, 2))
    assert watcher.seen == [] and not any(m._forward_hooks for m in model.modules())


def test_a_model_saved_while_watched_pickles_nothing_of_stabmon() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    hooks = HookSet(model, torch.optim.SGD(model.parameters(), lr=0.1))
    watcher = _Watcher()
    hooks.watch_modules(watcher.forward)

    buffer = io.BytesIO()
    torch.save(model, buffer)
    twin = copy.deepcopy(model)
    twin(torch.randn(3, 2))

    assert b"stabmon" not in buffer.getvalue()
    assert watcher.seen == []  # the copy's watches are inert
    hooks.remove()  # removes the watch with the other hooks
    model(torch.randn(3, 2))
    assert watcher.seen == []
