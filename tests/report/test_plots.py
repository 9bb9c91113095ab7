"""stabmon.report.plots: each plot of a run rendered to SVG by the real matplotlib, from
hand-made event logs in tmp_path. Text stays text in the SVG (svg.fonttype none), so a
plot's title, axis labels and legend are read back from it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from stabmon.errors import StabmonError
from stabmon.report.events import Run, read_run
from stabmon.report.plots import INSTALL_HINT, Plots, require_matplotlib


def _run(tmp_path: Path, logs: dict[int, list[dict[str, Any]]]) -> Run:
    run = tmp_path / "job"
    run.mkdir(parents=True)
    for rank, records in logs.items():
        lines = [json.dumps({"time": 100.0, "rank": rank, **r}) + "\n" for r in records]
        (run / f"rank-{rank}.events.jsonl").write_text("".join(lines))
    return read_run(run)


def _samples(**fields_by_step: Any) -> list[dict[str, Any]]:
    steps = len(next(iter(fields_by_step.values())))
    return [
        {"event": "step_sample", "step": step, **{k: v[step] for k, v in fields_by_step.items()}}
        for step in range(steps)
    ]


def test_plots_of_a_run_without_samples_are_all_none(tmp_path: Path) -> None:
    plots = Plots(_run(tmp_path, {0: [{"event": "attach"}]}))
    assert (
        plots.loss(),
        plots.grad_norm(),
        plots.step_time(),
        plots.memory(),
        plots.gpu_utilization(),
    ) == (None, None, None, None, None)


def test_loss_plot_is_an_inline_svg_with_a_line_per_rank(tmp_path: Path) -> None:
    losses = [1.0 / (step + 1) for step in range(10)]
    svg = Plots(_run(tmp_path, {0: _samples(loss=losses), 1: _samples(loss=losses)})).loss()
    assert svg is not None and svg.startswith("<svg")
    assert "rank 0" in svg and "rank 1" in svg
    assert "training loss, sampled" in svg
    assert "<script" not in svg


def test_loss_plot_turns_log_scale_when_a_spike_would_flatten_the_curve(tmp_path: Path) -> None:
    flat = Plots(_run(tmp_path / "a", {0: _samples(loss=[1.0, 2.0, 1.5])})).loss()
    spiky = Plots(_run(tmp_path / "b", {0: _samples(loss=[1.0, 500.0, 1.5])})).loss()
    assert flat is not None and "loss (log scale)" not in flat
    assert spiky is not None and "loss (log scale)" in spiky


def test_loss_plot_marks_an_anomaly_and_a_nan_value_at_its_step(tmp_path: Path) -> None:
    records = _samples(loss=[1.0, 1.1, 0.9, 1.0]) + [
        {"event": "anomaly", "kind": "loss_spike", "step": 1, "loss": 1.1},
        {"event": "anomaly", "kind": "nonfinite_loss", "step": 3, "loss": "nan"},
        {"event": "anomaly", "kind": "memory_leak", "step": 2},  # not a loss plot's kind
    ]
    svg = Plots(_run(tmp_path, {0: records})).loss()
    assert svg is not None
    assert "loss_spike" in svg and "nonfinite_loss" in svg
    assert "loss not finite (NaN/Inf)" in svg
    assert "memory_leak" not in svg


def test_grad_norm_plot_draws_modules_of_the_chosen_rank_or_the_lowest(tmp_path: Path) -> None:
    sample = _samples(grad_norm=[2.0, 3.0], module_grad_norms=[{"enc": 1.0}, {"enc": 2.0}])
    run = _run(tmp_path, {3: sample, 5: sample})
    assert "enc (rank 5)" in (Plots(run, module_rank=5).grad_norm() or "")
    assert "enc (rank 3)" in (Plots(run, module_rank=9).grad_norm() or "")


def test_step_time_plot_shows_step_time_and_input_wait(tmp_path: Path) -> None:
    records = _samples(step_seconds=[0.1, 0.2], data_wait_seconds=[0.01, 0.02])
    svg = Plots(_run(tmp_path, {0: records})).step_time()
    assert svg is not None
    assert "step time, rank 0" in svg and "input wait, rank 0" in svg


def test_memory_plot_draws_each_device_and_its_leak_threshold(tmp_path: Path) -> None:
    attach = {
        "event": "attach",
        "config": {"leak_window_epochs": 2, "leak_warmup_epochs": 0, "leak_threshold": 0.05},
    }
    epochs = [
        {"event": "epoch", "epoch": e, "step": e, "memory": {"cuda:0": 2**20 * (100 + e)}}
        for e in range(5)
    ]
    leak = {"event": "anomaly", "kind": "memory_leak", "epoch": 4, "step": 4, "bytes": 2**20 * 104}
    svg = Plots(_run(tmp_path, {0: [attach, *epochs, leak]})).memory()
    assert svg is not None
    assert "cuda:0, rank 0" in svg
    assert "leak threshold, cuda:0, rank 0" in svg
    assert "memory_leak" in svg
    assert "MiB at epoch end" in svg


def test_gpu_utilization_plot_names_each_device_and_rank(tmp_path: Path) -> None:
    records = _samples(gpu_utilization=[{"cuda:0": 0.5}, {"cuda:0": 0.9}])
    svg = Plots(_run(tmp_path, {2: records})).gpu_utilization()
    assert svg is not None and "cuda:0, rank 2" in svg


def test_require_matplotlib_names_the_extra_when_matplotlib_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_matplotlib()  # installed here: nothing to say
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(StabmonError, match=re.escape(INSTALL_HINT)):
        require_matplotlib()
