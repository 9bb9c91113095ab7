"""The dead-branch detector: zero for a whole window, by name; flickering zeros are not dead."""

from __future__ import annotations

from pathlib import Path

from stabmon.detectors.dead import DeadGradients, module_of
from stabmon.probes.grads import GradLayout, GradSummary
from tests.judges import Judges

NAMES = ("encoder.weight", "encoder.bias", "aux.head.weight", "aux.head.bias")
GROUPS = ("encoder", "encoder", "aux", "aux")


def _feed(detector: DeadGradients, norms: list[float]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    report = detector.update(norms, norms.count(0.0))
    return report.newly_dead, report.revived


def test_a_branch_zero_for_the_whole_window_is_reported_once_by_name() -> None:
    detector = DeadGradients(NAMES, GROUPS, window=3)
    assert _feed(detector, [1.0, 1.0, 0.0, 0.0]) == ((), ())
    assert _feed(detector, [1.0, 1.0, 0.0, 0.0]) == ((), ())
    assert _feed(detector, [1.0, 1.0, 0.0, 0.0]) == (("aux.head.weight", "aux.head.bias"), ())
    assert _feed(detector, [1.0, 1.0, 0.0, 0.0]) == ((), ())  # reported once
    assert detector.dead_by_group() == {"encoder": 0, "aux": 2}


def test_a_branch_used_every_other_step_is_never_dead() -> None:
    detector = DeadGradients(NAMES, GROUPS, window=3)
    for step in range(20):
        aux = 0.0 if step % 2 else 0.5
        assert _feed(detector, [1.0, 1.0, aux, aux]) == ((), ())
    assert detector.dead_by_group() == {"encoder": 0, "aux": 0}


def test_a_dead_branch_that_learns_again_is_revived() -> None:
    detector = DeadGradients(NAMES, GROUPS, window=2)
    _feed(detector, [1.0, 0.0, 1.0, 1.0])
    assert _feed(detector, [1.0, 0.0, 1.0, 1.0]) == (("encoder.bias",), ())
    assert _feed(detector, [1.0, 0.3, 1.0, 1.0]) == ((), ("encoder.bias",))
    assert detector.dead_by_group() == {"encoder": 0, "aux": 0}
    # The window starts over: one zero step is not dead again.
    assert _feed(detector, [1.0, 0.0, 1.0, 1.0]) == ((), ())


def test_module_of_names_the_owning_module() -> None:
    assert module_of("aux.head.weight") == "aux.head"
    assert module_of("bias") == ""


def test_dead_gradient_judge_raises_one_anomaly_per_newly_dead_group(tmp_path: Path) -> None:
    # Two parameters of group "encoder" go dead one step apart: one anomaly (the group),
    # a dead_gradients record each, and the per-group counts the exporter publishes.
    layout = GradLayout(
        ("encoder", "head"),
        (0, 0, 1),
        None,
        None,
        names=("encoder.0.weight", "encoder.1.weight", "head.weight"),
        model_order=(0, 1, 2),
        empty_shards=(),
    )
    harness = Judges(tmp_path, dead_grad_steps=1)
    for step, norms in ((100, [0.0, 1.0, 1.0]), (101, [0.0, 0.0, 1.0])):
        summary = GradSummary(1.0, norms.count(0.0), False, norms, layout)
        harness.plugged.grads_judged(step, summary)
    (anomaly,) = harness.anomalies("dead_grad")
    assert anomaly["modules"] == ["encoder"]
    assert [r["modules"] for r in harness.records("dead_gradients")] == [
        ["encoder.0"],
        ["encoder.1"],
    ]
    assert harness.readings.dead_grad_params == {"encoder": 2, "head": 0}


def test_dead_gradient_message_names_the_parameters_bounded(tmp_path: Path) -> None:
    names = tuple(f"aux.{i}.weight" for i in range(8))
    layout = GradLayout(("aux",), (0,) * 8, None, None, names=names,
                        model_order=tuple(range(8)), empty_shards=())  # fmt: skip
    harness = Judges(tmp_path, dead_grad_steps=1)
    harness.plugged.grads_judged(0, GradSummary(0.0, 8, False, [0.0] * 8, layout))
    (anomaly,) = harness.anomalies("dead_grad")
    assert (
        "(parameters aux.0.weight, aux.1.weight, aux.2.weight, aux.3.weight, aux.4.weight "
        "and 3 more)" in anomaly["detail"]
    )
    assert "aux.5.weight" not in anomaly["detail"]
