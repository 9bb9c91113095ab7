"""Committed generated files (dashboard JSON, Kubernetes YAML, the mixin): which are stale,
``--check``, and the YAML style they are written in.

``dashboards/generate.py``, ``deploy/kubernetes/generate.py`` and ``deploy/mixin/generate.py``
render text from a single source and commit it; CI runs each with ``--check``. They share
this module so "stale" means the same thing, and the error reads the same, in all.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

import yaml

__all__ = ["BlockDumper", "check_fresh", "stale_files"]


class BlockDumper(yaml.SafeDumper):
    """Block style with indented sequences, and multi-line strings as literal blocks."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


BlockDumper.add_representer(str, _represent_text)


def stale_files(
    rendered: Mapping[str, str], directory: Path, *, owned_glob: str | None = None
) -> list[str]:
    """The files in ``directory`` that are missing or differ from ``rendered``, sorted.

    With ``owned_glob``, a file matching it that nothing rendered (its source was
    deleted) is stale too.
    """
    names = set(rendered)
    if owned_glob is not None:
        names |= {path.name for path in directory.glob(owned_glob)}
    return sorted(
        name
        for name in names
        if name not in rendered
        or not (directory / name).is_file()
        or (directory / name).read_text(encoding="utf-8") != rendered[name]
    )


def check_fresh(
    outdated: list[str], directory: Path, *, what: str, command: str, stderr: TextIO | None = None
) -> int:
    """``--check``'s answer: 0 when nothing is ``outdated``, else one error line and 1."""
    if not outdated:
        return 0
    (stderr or sys.stderr).write(
        f"ERROR: stale {what} in {directory}: {', '.join(outdated)}; run: {command}\n"
    )
    return 1
