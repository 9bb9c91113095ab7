"""stabmon.extension: the five optional hooks a plug-in implements, recognised by shape.

The Monitor sorts plug-ins into one tuple per hook with these runtime-checkable
protocols (see tests/test_plugins.py for a plug-in served end to end); here each
protocol must claim exactly the plug-ins that implement its hook.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable

import pytest

from stabmon import contract as c
from stabmon.extension import Detaches, EpochEnd, GradsJudged, Publishes, Reading, StepEnd

HOOKS = (StepEnd, EpochEnd, GradsJudged, Publishes, Detaches)


class OnlyReadings:
    component = "exporter"

    def readings(self) -> Iterable[Reading]:
        return [(c.LOSS, [((), 1.0)])]


class EveryHook(OnlyReadings):
    next_step = 10

    def step_end(self, steps: int) -> None: ...

    def epoch_end(self, step: int | None) -> None: ...

    def grads_judged(self, step: int, summary: object) -> None: ...

    def detach(self) -> None: ...


class NoComponent:
    next_step = 1

    def step_end(self, steps: int) -> None: ...

    def detach(self) -> None: ...


def test_a_plugin_with_one_hook_is_sorted_under_that_hook_only() -> None:
    plugin = OnlyReadings()
    assert [hook.__name__ for hook in HOOKS if isinstance(plugin, hook)] == ["Publishes"]


def test_a_plugin_with_every_hook_is_sorted_under_all_five() -> None:
    assert all(isinstance(EveryHook(), hook) for hook in HOOKS)


@pytest.mark.parametrize("hook", HOOKS, ids=lambda hook: hook.__name__)
def test_a_plugin_without_a_component_is_sorted_under_no_hook(hook: type) -> None:
    # Its failures could not be counted against a bounded component label.
    assert not isinstance(NoComponent(), hook)


def test_step_end_also_needs_the_step_it_is_due_at() -> None:
    class NoSchedule:
        component = "memory"

        def step_end(self, steps: int) -> None: ...

    assert not isinstance(NoSchedule(), StepEnd)


def test_importing_the_extension_point_imports_nothing_beyond_the_package() -> None:
    code = (
        "import sys, stabmon; before = set(sys.modules); import stabmon.extension; "
        "print(sorted(set(sys.modules) - before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['stabmon.extension']"
