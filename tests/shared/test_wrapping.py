"""SharedWrap: a process-wide wrapper installed by the first user and restored by the last."""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from pathlib import Path

import torch
from conftest import MonitorFactory

from stabmon.shared.own_record import ExitWatch
from stabmon.shared.wrapping import Patch, SharedWrap


def _target() -> tuple[types.SimpleNamespace, list[str]]:
    calls: list[str] = []
    return types.SimpleNamespace(greet=lambda: calls.append("original")), calls


def _counting(namespace: types.SimpleNamespace, calls: list[str]):  # type: ignore[no-untyped-def]
    def install(wrap: SharedWrap[str]) -> Sequence[Patch]:
        original = namespace.greet

        def greet() -> None:
            calls.extend(wrap.users)
            original()

        return [Patch(namespace, "greet", greet)]

    return install


def test_shared_wrap_installs_once_and_dispatches_to_every_attached_user() -> None:
    namespace, calls = _target()
    installs: list[int] = []
    install = _counting(namespace, calls)
    wrap: SharedWrap[str] = SharedWrap(lambda w: installs.append(1) or install(w))
    wrap.attach("a")
    wrap.attach("b")
    namespace.greet()
    assert (installs, calls) == ([1], ["a", "b", "original"])


def test_shared_wrap_restores_the_original_after_the_last_release_in_any_order() -> None:
    namespace, calls = _target()
    original = namespace.greet
    wrap: SharedWrap[str] = SharedWrap(_counting(namespace, calls))
    first, second = wrap.attach("a"), wrap.attach("b")
    first.release()
    namespace.greet()
    assert calls == ["b", "original"]
    assert namespace.greet is not original
    second.release()
    assert namespace.greet is original and not wrap.installed


def test_shared_wrap_release_is_idempotent_and_never_releases_another_hold() -> None:
    namespace, calls = _target()
    original = namespace.greet
    wrap: SharedWrap[str] = SharedWrap(_counting(namespace, calls))
    first, second = wrap.attach("a"), wrap.attach("b")
    first.release()
    first.release()
    assert wrap.users == ("b",) and namespace.greet is not original
    second.release()
    assert namespace.greet is original


def test_shared_wrap_leaves_a_wrapper_somebody_else_wrapped_over_ours() -> None:
    namespace, calls = _target()
    wrap: SharedWrap[str] = SharedWrap(_counting(namespace, calls))
    hold = wrap.attach("a")
    ours = namespace.greet
    namespace.greet = theirs = lambda: ours()
    hold.release()
    assert namespace.greet is theirs
    namespace.greet()
    assert calls == ["original"]  # ours, without users, only calls the original


def test_exit_watch_restores_sys_hooks_when_the_last_hold_is_released() -> None:
    excepthook, exit_function = sys.excepthook, sys.exit
    first, second = ExitWatch.install(), ExitWatch.install()
    assert sys.excepthook is not excepthook and sys.exit is not exit_function
    first.release()
    assert sys.excepthook is not excepthook
    second.release()
    assert sys.excepthook is excepthook and sys.exit is exit_function


def test_detaching_two_monitors_in_either_order_restores_sys_hooks(
    attach: MonitorFactory, tmp_path: Path
) -> None:
    excepthook, exit_function = sys.excepthook, sys.exit
    model = torch.nn.Linear(2, 1)
    other = torch.nn.Linear(2, 1)
    first = attach(model, torch.optim.SGD(model.parameters(), lr=0.1), run_id="first")
    second = attach(other, torch.optim.SGD(other.parameters(), lr=0.1), run_id="second")
    first.detach()
    assert sys.excepthook is not excepthook  # the second Monitor still records how it ends
    second.detach()
    assert sys.excepthook is excepthook and sys.exit is exit_function
