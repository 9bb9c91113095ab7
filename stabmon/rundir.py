"""Where a run's files live.

Layout: ``<run_dir>/<run_id>/rank-<rank>.events.jsonl``. The default root is
``/var/tmp/stabmon``: node-wide, so the node daemon finds every run without
configuration, and, unlike ``/tmp``, kept across reboots, so an event log
outlives a crashed machine. ``run_dir`` in the config (or ``STABMON_DIR``)
moves it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_RUN_DIR", "RunPaths", "safe_component"]

DEFAULT_RUN_DIR = Path("/var/tmp/stabmon")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_component(value: str) -> str:
    """``value`` made safe as one path component (run ids come from users)."""
    cleaned = _UNSAFE.sub("_", value)[:128].lstrip(".")
    return cleaned or "run"


@dataclass(frozen=True)
class RunPaths:
    """Paths of one process's files in the run directory."""

    root: Path
    run_id: str
    rank: int

    @property
    def run_directory(self) -> Path:
        return self.root / safe_component(self.run_id)

    @property
    def events(self) -> Path:
        return self.run_directory / f"rank-{self.rank}.events.jsonl"
