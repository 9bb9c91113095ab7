"""stabmon.extension: the optional hooks a plug-in implements, recognised by shape.

The Monitor sorts plug-ins into one tuple per hook with these runtime-checkable
protocols (see tests/wiring/test_plugins.py for a plug-in served end to end); here each
protocol must claim exactly the plug-ins that implement its hook.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable

import pytest

from stabmon import contract as c
from stabmon.extension import (
    ClipJudged,
    Detaches,
    EpochEnd,
    EpochMemory,
    Finishes,
    GradsJudged,
    LossJudged,
    MeasuresOnDevice,
    Publishes,
    Reading,
    ScaleJudged,
    Stateful,
    StepEnd,
)

HOOKS = (
    MeasuresOnDevice, GradsJudged, LossJudged, ClipJudged, ScaleJudged, StepEnd, EpochMemory,
    EpochEnd, Publishes, Stateful, Finishes, Detaches,
)  # fmt: skip


class OnlyReadings:
    component = "exporter"

    def readings(self) -> Iterable[Reading]:
        return [(c.LOSS, [((), 1.0)])]


class EveryHook(OnlyReadings):
    next_step = 10
    measure_at = "after_step"
    state_key = "every_hook"

    def measure(self, step: int) -> None: ...

    def judge(self, step: int, values: list[float]) -> None: ...

    def grads_judged(self, step: int, summary: object) -> None: ...

    def loss_judged(self, step: int, value: float) -> None: ...

    def clip_judged(self, step: int, max_norm: float) -> None: ...

    def scale_judged(self, step: int, scale: float) -> None: ...

    def step_end(self, steps: int) -> None: ...

    def epoch_memory(self, samples: object) -> dict[str, float | None]:
        return {}

    def epoch_end(self, step: int | None) -> None: ...

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: object) -> None: ...

    def finish(self) -> None: ...

    def detach(self) -> None: ...


class NoComponent:
    next_step = 1

    def step_end(self, steps: int) -> None: ...

    def detach(self) -> None: ...


def test_a_plugin_with_one_hook_is_sorted_under_that_hook_only() -> None:
    plugin = OnlyReadings()
    assert [hook.__name__ for hook in HOOKS if isinstance(plugin, hook)] == ["Publishes"]


def test_a_plugin_with_every_hook_is_sorted_under_all_of_them() -> None:
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


def test_a_device_measurement_also_needs_its_judge_and_when_it_measures() -> None:
    class MeasuresOnly:
        component = "grads"
        measure_at = "before_step"

        def measure(self, step: int) -> None: ...

    class NoMoment:
        component = "grads"

        def measure(self, step: int) -> None: ...

        def judge(self, step: int, values: list[float]) -> None: ...

    assert not isinstance(MeasuresOnly(), MeasuresOnDevice)
    assert not isinstance(NoMoment(), MeasuresOnDevice)


def test_a_stateful_plugin_also_needs_its_state_key() -> None:
    class NoKey:
        component = "detectors"

        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, state: object) -> None: ...

    assert not isinstance(NoKey(), Stateful)


def test_importing_the_extension_point_imports_nothing_beyond_the_package() -> None:
    # stabmon exports stabmon.Plugin, so ``import stabmon`` loads the extension point: it must
    # add no module of its own, and neither may reach torch (the daemon imports stabmon too).
    code = (
        "import sys; import stabmon; plain = set(sys.modules); import stabmon.extension; "
        "print(sorted(set(sys.modules) - plain), 'stabmon.extension' in plain, "
        "'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True False"
