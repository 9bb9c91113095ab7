"""stabmon.report.html: the one self-contained report page, rendered from hand-made event
logs in tmp_path and written to a real file. The clock of "generated" is injected."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from stabmon.errors import StabmonError
from stabmon.report.events import read_run
from stabmon.report.html import SECTION_IDS, render, write_report
from stabmon.report.verdict import when
from stabmon.shared.rundir import ProcessRecord, boot_id, run_directory_name

NOW = 1_700_000_500.0


def _write(tmp_path: Path, logs: dict[int, list[dict[str, Any]]], run_id: str = "job") -> Path:
    run = tmp_path / run_directory_name(run_id)
    run.mkdir(parents=True)
    for rank, records in logs.items():
        lines = [
            json.dumps({"time": 1_700_000_000.0, "rank": rank, "run": run_id, **r}) + "\n"
            for r in records
        ]
        (run / f"rank-{rank}.events.jsonl").write_text("".join(lines))
    return run


def _attach(**environment: Any) -> dict[str, Any]:
    return {
        "event": "attach",
        "pid": 11,
        "environment": {"hostname": "node-1", **environment},
        "config": {"spike_threshold": 6.0},
    }


def test_render_has_every_section_id_and_no_script(tmp_path: Path) -> None:
    page = render(
        read_run(_write(tmp_path, {0: [_attach(), {"event": "detach", "step": 0}]})), now=NOW
    )
    for section in SECTION_IDS:
        assert f'<section id="{section}">' in page
    assert "<script" not in page
    assert page.startswith("<!DOCTYPE html>")
    assert f"generated {when(NOW)}" in page


def test_render_escapes_everything_taken_from_a_log(tmp_path: Path) -> None:
    hostile = "<script>alert(1)</script>"
    records = [
        _attach(hostname=hostile),
        {
            "event": "anomaly",
            "kind": "stall",
            "step": 1,
            "detail": hostile,
            "stacks": {"MainThread": [hostile]},
        },
    ]
    page = render(read_run(_write(tmp_path, {0: records})), now=NOW)
    assert "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_render_says_healthy_or_not_in_the_verdict_section(tmp_path: Path) -> None:
    clean = render(
        read_run(_write(tmp_path / "a", {0: [_attach(), {"event": "detach", "step": 4}]})), now=NOW
    )
    assert '<div class="verdict ok">Healthy: 5 steps on 1 rank' in clean
    bad = render(
        read_run(
            _write(
                tmp_path / "b",
                {
                    0: [
                        _attach(),
                        {"event": "anomaly", "kind": "loss_spike", "step": 2, "detail": "spike"},
                        {"event": "detach", "step": 4},
                    ]
                },
            )
        ),
        now=NOW,
    )
    assert '<div class="verdict bad">Not healthy: 1 anomaly' in bad
    assert "<h2>Anomalies (1)</h2>" in bad


def test_render_spells_out_an_anomaly_without_a_detail_from_its_fields(tmp_path: Path) -> None:
    records = [_attach(), {"event": "anomaly", "kind": "grad_spike", "step": 3, "grad_norm": 99.0}]
    page = render(read_run(_write(tmp_path, {0: records})), now=NOW)
    assert "grad_norm=99.0" in page


def test_render_warns_when_ranks_run_other_versions(tmp_path: Path) -> None:
    logs = {0: [_attach(versions={"torch": "2.13.0"})], 1: [_attach(versions={"torch": "2.12.0"})]}
    page = render(read_run(_write(tmp_path, logs)), now=NOW)
    assert "Ranks 1 run other versions than rank 0." in page


def test_render_calls_a_report_of_a_running_run_a_snapshot(tmp_path: Path) -> None:
    run = _write(tmp_path, {0: [_attach()]})
    record = ProcessRecord(pid=os.getpid(), create_time=0.0, run="job", rank=0, boot_id=boot_id())
    (run / "rank-0.json").write_bytes(record.to_json())
    page = render(read_run(run), now=NOW)
    assert "this is a snapshot" in page


def test_render_lists_the_notes_of_lines_it_could_not_read(tmp_path: Path) -> None:
    run = _write(tmp_path, {0: [_attach()]})
    with (run / "rank-0.events.jsonl").open("a") as log:
        log.write('{"event": "ep')
    page = render(read_run(run), now=NOW)
    assert "incomplete and was skipped" in page


def test_write_report_writes_the_page_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    run = _write(tmp_path, {0: [_attach(), {"event": "detach", "step": 0}]})
    output = tmp_path / "out" / "report.html"
    output.parent.mkdir()
    write_report(run, output)
    assert output.read_text().endswith("</html>\n")
    assert os.listdir(output.parent) == ["report.html"]


def test_write_report_does_not_follow_a_link_planted_under_a_temporary_name(
    tmp_path: Path,
) -> None:
    run = _write(tmp_path, {0: [_attach(), {"event": "detach", "step": 0}]})
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / ".report.html.tmp").symlink_to(victim)  # the name it was once written under

    write_report(run, tmp_path / "report.html")

    assert victim.read_text() == "keep"
    assert (tmp_path / "report.html").read_text().endswith("</html>\n")


def test_write_report_refuses_a_module_rank_the_run_does_not_have(tmp_path: Path) -> None:
    run = _write(tmp_path, {0: [_attach()], 1: [_attach()]})
    output = tmp_path / "report.html"
    with pytest.raises(StabmonError, match="has no rank 4 \\(its ranks: 0, 1\\); pass one"):
        write_report(run, output, module_rank=4)
    assert not output.exists()


def test_the_environment_tells_variables_set_inside_the_process_from_the_users(
    tmp_path: Path,
) -> None:
    attach = _attach(
        variables={"NCCL_DEBUG": "INFO", "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_u"},
        set_in_process=["TORCHINDUCTOR_CACHE_DIR"],
    )
    page = render(read_run(_write(tmp_path, {0: [attach, {"event": "detach", "step": 0}]})),
                  now=NOW)  # fmt: skip
    assert "/tmp/torchinductor_u (set inside the process, by torch or stabmon)" in page
    assert "INFO (set inside" not in page
