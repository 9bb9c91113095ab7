"""`stabmon report` on real runs: sections, embedded plots, anomaly rows, partial and live logs.

The page is also opened as a person would, in headless Chromium (Debian's
``chromium``, ``make tools``): skipped without it on a developer machine, a
failure in CI, as the promtool checks are. The screenshot is kept in
``test-artifacts/report.png``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, train_step
from report_helpers import FaultyRun, stabmon_cli, train_with_faults

import stabmon
from stabmon.report.html import SECTION_IDS

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> FaultyRun:
    """One real training with faults (a few seconds), shared by this module's tests."""
    return train_with_faults(tmp_path_factory.mktemp("runs"))


@dataclass(frozen=True)
class Report:
    result: subprocess.CompletedProcess[str]
    path: Path


@pytest.fixture(scope="module")
def faulty_report(faulty_run: FaultyRun, tmp_path_factory: pytest.TempPathFactory) -> Report:
    """``stabmon report`` of the faulty run, as a user runs it; its plots take seconds to
    draw, so the tests that read the same page share one."""
    path = tmp_path_factory.mktemp("report") / "report.html"
    return Report(stabmon_cli("report", str(faulty_run.directory), "-o", str(path)), path)


class _Page(HTMLParser):
    """What a test needs from a report: section ids, inline SVGs, anomaly rows, external refs."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.svgs = 0
        self.scripts = 0
        self.external: list[str] = []
        self.rows: list[list[str]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("id"):
            self.ids.append(str(attributes["id"]))
        self.svgs += tag == "svg"
        self.scripts += tag == "script"
        for name in ("src", "href"):
            if attributes.get(name) and not str(attributes[name]).startswith("#"):
                self.external.append(str(attributes[name]))
        if tag == "tr" and attributes.get("class") == "anomaly":
            self._row = []
        if tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _page(path: Path) -> tuple[_Page, str]:
    text = path.read_text(encoding="utf-8")
    page = _Page()
    page.feed(text)
    return page, text


def test_report_of_a_faulty_run_has_every_section_and_embedded_plots(
    faulty_report: Report,
) -> None:
    result = faulty_report.result

    assert result.returncode == 0, result.stderr
    assert str(faulty_report.path) in result.stdout
    page, text = _page(faulty_report.path)
    assert set(SECTION_IDS) <= set(page.ids)
    assert page.svgs >= 4  # loss, gradient norm, step time, memory (no GPU here)
    assert page.scripts == 0 and page.external == []  # opens with no network and no script
    assert "Not healthy" in text and "torch_version" in text and "2.13" in text
    assert "Not recorded: this run used no CUDA device." in text


def test_report_anomaly_table_rows_equal_the_injected_faults(
    faulty_run: FaultyRun, faulty_report: Report
) -> None:
    assert faulty_report.result.returncode == 0, faulty_report.result.stderr

    page, _ = _page(faulty_report.path)
    found = sorted((row[3], int(row[0])) for row in page.rows)
    expected = sorted(faulty_run.injected)
    assert [kind for kind, _ in found] == [kind for kind, _ in expected]
    for (kind, step), (expected_kind, expected_step) in zip(found, expected, strict=True):
        assert kind == expected_kind and (expected_step < 0 or step == expected_step), found
    details = {row[3]: row[4] for row in page.rows}
    assert "in module group(s) 0" in details["nonfinite_grad"]  # groups, not five parameters
    assert "no step completed" in details["stall"]


def test_report_skips_a_truncated_last_line_and_notes_it(
    faulty_run: FaultyRun, tmp_path: Path
) -> None:
    crashed = tmp_path / "faulty"
    crashed.mkdir()
    log = crashed / faulty_run.events.name
    lines = faulty_run.events.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if b'"event":"detach"' not in line]  # it never detached
    log.write_bytes(b"".join(kept) + b'{"time":1795400000.5,"event":"step_sample","st')
    output = tmp_path / "report.html"

    result = stabmon_cli("report", str(crashed), "-o", str(output))

    assert result.returncode == 0, result.stderr
    page, text = _page(output)
    assert "the last line (" in text and "is incomplete and was skipped" in text
    assert len(page.rows) == len(faulty_run.injected)
    assert "rank 0 stopped without a word" in text  # no detach, no live process: said so


def test_report_reads_a_run_that_is_still_going(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    output = tmp_path / "live.html"
    with stabmon.attach(
        model, optimizer, port=0, address="127.0.0.1", run_dir=str(tmp_path), run_id="live",
        sample_every=5, judge_seconds=0,  # the report reads the log mid-run
    ) as monitor:  # fmt: skip
        for _ in range(40):
            train_step(model, optimizer, monitor)

        result = stabmon_cli("report", str(tmp_path / "live"), "-o", str(output))

    assert result.returncode == 0, result.stderr
    page, text = _page(output)
    assert re.search(r"Healthy: 3\d steps on 1 rank, no anomalies; still running\.", text)
    assert "this is a snapshot" in text
    assert page.svgs >= 3 and page.rows == []


def test_report_of_a_clean_finished_run_says_healthy(tmp_path: Path) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with stabmon.attach(
        model, optimizer, port=0, run_dir=str(tmp_path), run_id="clean", sample_every=5
    ) as monitor:
        for _ in range(30):
            train_step(model, optimizer, monitor)
    output = tmp_path / "clean.html"

    result = stabmon_cli("report", str(tmp_path), "-o", str(output))  # the root: its one run

    assert result.returncode == 0, result.stderr
    _, text = _page(output)
    assert "Healthy: 30 steps on 1 rank, no anomalies; finished." in text
    assert "None: no anomaly was recorded." in text
    assert "Every line of every event log was read." in text


def test_report_without_matplotlib_fails_with_one_line_naming_the_extra(
    faulty_run: FaultyRun, tmp_path: Path
) -> None:
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from stabmon.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    output = tmp_path / "report.html"

    result = subprocess.run(
        [sys.executable, "-c", blocker, "report", str(faulty_run.directory), "-o", str(output)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip

    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "pip install matplotlib (the report extra: pip install './stabmon[report]')" in (
        result.stderr
    )
    assert not output.exists()


def test_report_of_a_directory_without_logs_exits_2_with_one_line(tmp_path: Path) -> None:
    result = stabmon_cli("report", str(tmp_path), "-o", str(tmp_path / "r.html"))

    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "no event log" in result.stderr


def test_report_imports_no_torch(faulty_run: FaultyRun, tmp_path: Path) -> None:
    code = (
        "import sys\nfrom stabmon.cli import main\n"
        f"code = main(['report', {str(faulty_run.directory)!r}, '-o', "
        f"{str(tmp_path / 'r.html')!r}])\n"
        "print('torch' in sys.modules, code)\n"
    )

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

    assert result.stdout.splitlines()[-1] == "False 0", result.stderr


def test_report_marks_anomalies_on_the_plots(faulty_report: Report) -> None:
    assert faulty_report.result.returncode == 0, faulty_report.result.stderr

    text = faulty_report.path.read_text(encoding="utf-8")

    # Each kind's legend entry is SVG text in its plot (svg.fonttype none keeps text as text).
    for kind in ("nonfinite_grad", "grad_spike", "loss_spike", "stall", "memory_leak"):
        assert re.search(rf"<text[^>]*>{kind}</text>", text), kind
    assert "leak threshold, host, rank 0" in text


def test_report_of_two_ranks_draws_a_line_per_rank_and_names_the_rank_of_each_anomaly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        model = tiny_model(seed=rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        with stabmon.attach(
            model, optimizer, port=0, run_dir=str(tmp_path), run_id="pair", sample_every=5
        ) as monitor:
            for step in range(20):
                train_step(model, optimizer, monitor, nan_grad=rank == 1 and step == 7)
    output = tmp_path / "pair.html"

    result = stabmon_cli("report", str(tmp_path / "pair"), "-o", str(output))

    assert result.returncode == 0, result.stderr
    page, text = _page(output)
    assert "2 ranks" in text and "rank-1.events.jsonl" in text
    for rank in (0, 1):
        assert re.search(rf"<text[^>]*>global, rank {rank}</text>", text)
    assert [(row[0], row[2], row[3]) for row in page.rows] == [("7", "1", "nonfinite_grad")]


_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
)  # fmt: skip


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed; CI must run this check (make tools)")
    pytest.skip("Requires: chromium (apt-get install chromium)")


def _browse(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium, *_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_report_opens_in_headless_chromium_with_every_section_and_no_console_error(
    faulty_report: Report, tmp_path: Path
) -> None:
    chromium = _chromium()
    report = faulty_report.path
    assert faulty_report.result.returncode == 0, faulty_report.result.stderr
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "report.png"
    screenshot.unlink(missing_ok=True)

    dom = _browse(chromium, tmp_path / "profile-dom", "--dump-dom", report.as_uri())
    shot = _browse(
        chromium, tmp_path / "profile-shot", f"--screenshot={screenshot}",
        "--window-size=1280,4000", report.as_uri(),
    )  # fmt: skip

    assert dom.returncode == 0, dom.stderr[-2000:]
    for section in SECTION_IDS:
        assert f'id="{section}"' in dom.stdout, section
    assert dom.stdout.count("<svg") >= 4
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == []
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert screenshot.stat().st_size > 50_000  # a rendered page, not a blank one
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
