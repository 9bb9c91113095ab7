"""Rewrite the generated results block of a Markdown file, between two marker comments.

The README's overhead figures are written only by ``bench/overhead.py --update-readme``:
everything between ``<!-- bench:overhead -->`` and ``<!-- /bench:overhead -->`` is
replaced, and nothing outside the markers is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

BEGIN = "<!-- bench:overhead -->"
END = "<!-- /bench:overhead -->"


def replace_block(path: Path, body: str) -> None:
    """Put ``body`` between the markers in ``path``; raise ValueError if they are missing."""
    text = path.read_text()
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise ValueError(
            f"{path}: expected the markers {BEGIN} ... {END} (in that order); add them where "
            "the results should go"
        )
    updated = f"{text[: begin + len(BEGIN)]}\n{body.strip()}\n{text[end:]}"
    # Write then rename: an interrupted run leaves the README as it was.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(updated)
    os.replace(temporary, path)
