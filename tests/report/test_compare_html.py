"""stabmon.report.compare_html: the page, from event logs written by hand."""

from __future__ import annotations

import re
from pathlib import Path

from compare_helpers import attach_record, throughput_records, write_run

from stabmon.report.compare import compare_runs
from stabmon.report.compare_html import SECTION_IDS, render_page, write_page
from stabmon.report.digest import read_digest

STEADY = {"data_wait": 0.001, "forward": 0.004, "backward": 0.004, "optimizer": 0.001}


def _page(tmp_path: Path, **variables: str) -> str:
    a = write_run(tmp_path / "a", {0: [attach_record(), *throughput_records([STEADY] * 4)]})
    slow = [{**STEADY, "data_wait": 0.01}] * 4
    b = write_run(tmp_path / "<b>", {0: [attach_record(**variables), *throughput_records(slow)]})
    return render_page(compare_runs(read_digest(a), read_digest(b)), now=1_795_000_000.0)


def test_the_page_has_every_section_plots_and_no_script(tmp_path: Path) -> None:
    page = _page(tmp_path)

    assert all(f'<section id="{section}">' in page for section in SECTION_IDS)
    # Step time by step and by wall time after warm-up, and the phases side by side.
    assert page.count("<svg") == 3
    assert "step time by wall time after warm-up" in page
    assert "<script" not in page
    assert re.findall(r'(?:src|href)="(?!#)', page) == []  # loads nothing from anywhere
    assert '<div class="verdict bad">REGRESSED</div>' in page


def test_the_page_escapes_what_the_logs_say(tmp_path: Path) -> None:
    page = _page(tmp_path, OMP_NUM_THREADS="<img src=x onerror=alert(1)>")

    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&lt;b&gt;" in page and "(<b>)" not in page


def test_write_page_replaces_the_file_whole(tmp_path: Path) -> None:
    output = tmp_path / "page.html"
    output.write_text("old")
    a = write_run(tmp_path / "a", {0: [attach_record(), *throughput_records([STEADY] * 2)]})

    write_page(compare_runs(read_digest(a), read_digest(a)), output)

    assert output.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_write_page_does_not_follow_a_link_planted_under_a_temporary_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    output = tmp_path / "page.html"
    (tmp_path / ".page.html.tmp").symlink_to(victim)  # the name the page was once written under
    a = write_run(tmp_path / "a", {0: [attach_record(), *throughput_records([STEADY] * 2)]})

    write_page(compare_runs(read_digest(a), read_digest(a)), output)

    assert victim.read_text() == "keep"
    assert output.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
