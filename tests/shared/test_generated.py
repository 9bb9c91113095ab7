"""Committed generated files: which are stale, and the one-line ``--check`` answer."""

from __future__ import annotations

import io
from pathlib import Path

from stabmon.shared.generated import check_fresh, stale_files


def test_stale_files_names_missing_changed_and_orphaned_files(tmp_path: Path) -> None:
    (tmp_path / "same.json").write_text("x", encoding="utf-8")
    (tmp_path / "changed.json").write_text("old", encoding="utf-8")
    (tmp_path / "orphan.json").write_text("y", encoding="utf-8")
    rendered = {"same.json": "x", "changed.json": "new", "missing.json": "z"}
    assert stale_files(rendered, tmp_path) == ["changed.json", "missing.json"]
    assert stale_files(rendered, tmp_path, owned_glob="*.json") == [
        "changed.json",
        "missing.json",
        "orphan.json",
    ]


def test_check_fresh_is_one_error_line_and_exit_1_when_stale(tmp_path: Path) -> None:
    err = io.StringIO()
    assert check_fresh([], tmp_path, what="YAML", command="make", stderr=err) == 0
    assert err.getvalue() == ""
    assert check_fresh(["a.yaml"], tmp_path, what="YAML", command="make", stderr=err) == 1
    assert err.getvalue() == f"ERROR: stale YAML in {tmp_path}: a.yaml; run: make\n"
