"""`stabmon status`'s NaN lines: the latest provenance verdict and the first non-finite rank
of a run, read from its event logs: a real attached run end to end, and logs that lie."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import events
from report_helpers import stabmon_cli
from torch import nn

import stabmon
from stabmon.report import status_provenance
from stabmon.report.status import RankStatus
from stabmon.report.status_provenance import MAX_NAME, provenance_lines
from stabmon.report.status_targets import RegisteredTarget

NOBODY = 65534  # a second local user


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.poisoned = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        return torch.log(y * 0.0) if self.poisoned else y  # log of zero: -inf, NaN after


class _Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Layer() for _ in range(6))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 0.5 + x * 0.5
        out: torch.Tensor = self.head(x)
        return out


def test_status_names_the_module_that_produced_a_nan_in_a_running_job(tmp_path: Path) -> None:
    model = _Deep()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # skips the NaN steps' updates
    with stabmon.attach(
        model, optimizer, scaler=scaler, port=0, address="127.0.0.1", run_dir=str(tmp_path),
        run_id="nan-job", judge_seconds=0,
    ) as monitor:  # fmt: skip
        log = monitor.event_log_path
        assert log is not None
        for step in range(400):  # clean steps after the fault, until the verdict is judged
            model.layers[3].poisoned = 20 <= step < 23  # type: ignore[index]
            loss = model(torch.randn(4, 8)).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            monitor.observe(loss=loss)
            if step > 25 and any(r["event"] == "provenance" for r in events(log)):
                break
        result = stabmon_cli("status", "--run-dir", str(tmp_path))

    assert result.returncode == 1, result.stdout + result.stderr  # non-finite: unhealthy
    (line,) = [line for line in result.stdout.splitlines() if "NaN provenance" in line]
    assert line.startswith("run nan-job: NaN provenance, step 20, rank 0: produced by layers.3 ")
    assert "in the forward pass, passed on by layers.4.linear, layers.4, layers.5.linear, " in line
    assert line.endswith("first non-finite: rank 0 at step 20")


def _status(run: str, *, nonfinite: float = 1.0, error: str | None = None) -> RankStatus:
    return RankStatus(url="http://127.0.0.1:1/metrics", run=run, rank="0", nonfinite=nonfinite,
                      error=error)  # fmt: skip


def _target(run: str, rank: int = 0) -> RegisteredTarget:
    return RegisteredTarget("http://127.0.0.1:1/metrics", os.geteuid(), run, str(rank))


def _write(directory: Path, rank: int, *lines: dict[str, Any] | str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{rank}.events.jsonl"
    text = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    path.write_text("\n".join(text) + "\n")
    return path


def _nan(rank: int, step: int, kind: str = "nonfinite_grad") -> dict[str, Any]:
    return {"event": "anomaly", "kind": kind, "step": step, "rank": rank, "time": 1.0}


def _verdict(rank: int, step: int, producer: object, **fields: Any) -> dict[str, Any]:
    return {"event": "provenance", "step": step, "rank": rank, "producer": producer,
            "direction": "forward", "propagators": [], "time": 2.0, **fields}  # fmt: skip


def test_the_rank_whose_own_loss_went_non_finite_first_is_named_with_its_verdict(
    tmp_path: Path,
) -> None:
    # Data parallel: both ranks non-finite at step 5 (the all-reduce spread it); rank 1's
    # own loss was non-finite there, so it is first, and its verdict is the one shown.
    run = tmp_path / "ddp"
    _write(run, 0, _nan(0, 5), _verdict(0, 5, "", direction="backward"))
    _write(run, 1, _nan(1, 5, "nonfinite_loss"), _verdict(1, 5, "blocks.2.attn",
           propagators=["blocks.3", "blocks.4"]))  # fmt: skip
    statuses = [_status("ddp"), _status("ddp", error="refused")]
    lines = provenance_lines(statuses, [_target("ddp", 0), _target("ddp", 1)], tmp_path)
    assert lines == [
        "run ddp: NaN provenance, step 5, rank 1: produced by blocks.2.attn in the forward "
        "pass, passed on by blocks.3, blocks.4; first non-finite: rank 1 at step 5"
    ]


def test_a_transient_reads_not_reproduced_and_the_latest_verdict_wins(tmp_path: Path) -> None:
    run = tmp_path / "flaky"
    _write(run, 0, _nan(0, 3), _verdict(0, 3, "layers.1"), _nan(0, 40),
           _verdict(0, 40, None, direction=None, watched_steps=[41, 42, 43]))  # fmt: skip
    (line,) = provenance_lines([_status("flaky")], [_target("flaky")], tmp_path)
    assert line.startswith("run flaky: NaN provenance, step 40, rank 0: not reproduced (steps "
                           "41, 42, 43 were clean): a transient")  # fmt: skip
    assert line.endswith("first non-finite: rank 0 at step 3")
    assert "(rank-0.skip_batches.json)" in line  # the rank's own file, not a placeholder


def test_a_nan_already_in_the_weights_says_no_producer_can_be_told(tmp_path: Path) -> None:
    run = tmp_path / "applied"
    _write(run, 0, _nan(0, 40), _verdict(0, 40, "layers.0.linear", direction="weights"))
    (line,) = provenance_lines([_status("applied")], [_target("applied")], tmp_path)
    assert "already in the weights when watched (layers.0.linear first)" in line
    assert "skip holds such steps back" in line


def test_a_healthy_run_costs_no_read_and_a_url_has_no_run_directory(tmp_path: Path) -> None:
    _write(tmp_path / "fine", 0, _nan(0, 3), _verdict(0, 3, "layers.1"))
    assert provenance_lines([_status("fine", nonfinite=0)], [_target("fine")], tmp_path) == []
    assert provenance_lines([_status("fine")], ["http://127.0.0.1:1/metrics"], tmp_path) == []


def test_hostile_records_neither_crash_status_nor_reach_the_terminal(tmp_path: Path) -> None:
    run = tmp_path / "hostile"
    evil = "\x1b]0;owned\x07\x1b[2J\u202eevil\r\n" + "x" * 1_000
    _write(
        run, 0,
        "not json", "[1, 2]", '{"event": "provenance", "step": "12"}', "{" * 100_000,
        {"event": "provenance", "step": 2**70, "producer": "huge"},
        {"event": "provenance", "step": 7, "producer": ["a list"], "propagators": "text"},
        _nan(0, 7),
        _verdict(0, 9, evil, direction="\x1b[31msideways", propagators=[evil, 3, None] * 5000),
        {"event": "anomaly", "kind": "nonfinite_loss", "step": -1},
        {"event": "provenance", "step": 50, "producer": {"not": "a name"}},  # no verdict
    )  # fmt: skip
    (line,) = provenance_lines([_status("hostile")], [_target("hostile")], tmp_path)
    assert line.isprintable() and len(line) < 8 * MAX_NAME
    assert line.startswith("run hostile: NaN provenance, step 9, rank 0: produced by ")
    assert "produced by ?]0;owned??[2J?evil??" in line and "in an unnamed pass" in line
    assert line.endswith("and 14995 more; first non-finite: rank 0 at step 7")


def test_logs_and_run_directories_that_are_symlinks_or_fifos_are_not_read(tmp_path: Path) -> None:
    elsewhere = _write(tmp_path / "elsewhere", 0, _nan(0, 1), _verdict(0, 1, "planted"))
    run = tmp_path / "linked"
    _write(run, 0, _nan(0, 4), _verdict(0, 4, "layers.0"))
    (run / "rank-1.events.jsonl").symlink_to(elsewhere)
    os.mkfifo(run / "rank-2.events.jsonl")  # a read would wait for a writer for ever
    (tmp_path / "dirlink").symlink_to(tmp_path / "elsewhere")
    targets = [_target("linked"), _target("dirlink")]
    lines = provenance_lines([_status("linked"), _status("dirlink")], targets, tmp_path)
    assert lines == [
        "run linked: NaN provenance, step 4, rank 0: produced by layers.0 in the forward pass; "
        "first non-finite: rank 0 at step 4"
    ]


def test_a_run_directory_or_a_log_another_user_owns_is_not_read(tmp_path: Path) -> None:
    # Under a world-writable root, another user may make the directory a run of ours will
    # be looked for in, or (were it writable) plant a log in ours: neither is believed.
    if os.geteuid() != 0:
        pytest.skip("Requires: root, to give files to a second local user (nobody)")
    theirs = tmp_path / "theirs"
    _write(theirs, 0, _nan(0, 1), _verdict(0, 1, "planted"))
    os.chown(theirs, NOBODY, NOBODY)
    ours = tmp_path / "ours"
    _write(ours, 0, _nan(0, 4), _verdict(0, 4, "layers.0"))
    os.chown(_write(ours, 1, _nan(1, 2, "nonfinite_loss"), _verdict(1, 9, "planted")), NOBODY, -1)
    statuses = [_status("theirs"), _status("ours")]
    lines = provenance_lines(statuses, [_target("theirs"), _target("ours")], tmp_path)
    assert lines == [
        "run ours: NaN provenance, step 4, rank 0: produced by layers.0 in the forward pass; "
        "first non-finite: rank 0 at step 4"
    ]


def test_an_overlong_line_is_skipped_to_its_end_and_the_next_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(status_provenance, "MAX_LINE_BYTES", 1000)
    overlong = _verdict(0, 30, "x" * 5000)
    exact = json.dumps(_verdict(0, 20, "y")).ljust(1000)  # with its newline: one byte over
    _write(tmp_path / "long", 0, _nan(0, 4), overlong, exact, _verdict(0, 4, "layers.0"))
    (line,) = provenance_lines([_status("long")], [_target("long")], tmp_path)
    assert line.startswith("run long: NaN provenance, step 4, rank 0: produced by layers.0 ")


def test_status_reads_a_bounded_number_of_bytes_and_says_when_it_read_logs_in_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A health check must return: a thousand ranks' logs of a long run are terabytes. Here
    # the bound is lowered to rank 0's log: rank 1's (its earlier NaN) is not read.
    samples = [{"event": "step", "step": n, "loss": 1.0, "pad": "x" * 40} for n in range(60)]
    root = tmp_path / ("a-long-run-directory-root-" * 6)  # the command is shown whole
    log = _write(root / "big", 0, *samples, _nan(0, 9), _verdict(0, 9, "layers.2"))
    _write(root / "big", 1, _nan(1, 7), _verdict(1, 7, "layers.1"))
    _write(root / "small", 0, _nan(0, 3), _verdict(0, 3, "layers.0"))
    monkeypatch.setattr(status_provenance, "MAX_READ_BYTES", log.stat().st_size + 10)
    first, second = provenance_lines(
        [_status("big"), _status("small")], [_target("big"), _target("small")], root
    )
    assert first.startswith("run big: NaN provenance, step 9, rank 0: produced by layers.2 ")
    assert "first non-finite: rank 0 at step 9 among the logs read; its logs were read in " in first
    assert first.endswith(f"stabmon report {root / 'big'} reads them all")
    assert second.startswith("run small: its logs were read in part")  # nothing left to read


def test_a_directory_of_many_logs_is_listed_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tracemalloc

    run = tmp_path / "many"
    run.mkdir()
    for rank in range(20000):  # empty logs: only the listing costs
        (run / f"rank-{rank}.events.jsonl").touch()
    monkeypatch.setattr(status_provenance, "MAX_LOGS", 8)
    tracemalloc.start()
    try:
        listed = status_provenance._logs(run, os.geteuid())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [rank for rank, _ in listed] == list(range(8))
    assert listed[0][1] == run / "rank-0.events.jsonl"
    assert peak < 500_000, peak  # every name kept: several MB


def test_a_log_whose_read_fails_is_said_to_be_read_in_part_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read error mid-log (EIO on a failing disk, a network file system gone): stood in
    # for by a directory opened as the log, which Python refuses to read (IsADirectoryError).
    _write(tmp_path / "eio", 0, _nan(0, 4), _verdict(0, 4, "layers.0"))
    real = status_provenance.open_regular

    def failing(path: Path, flags: int) -> tuple[int, os.stat_result]:
        fd, info = real(path, flags)
        os.close(fd)
        return os.open(path.parent, os.O_RDONLY), info

    monkeypatch.setattr(status_provenance, "open_regular", failing)
    (line,) = provenance_lines([_status("eio")], [_target("eio")], tmp_path)
    assert line.startswith("run eio: its logs were read in part")
