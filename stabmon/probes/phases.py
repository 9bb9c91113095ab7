"""Names of the user's phases (``with mon.phase("eval")``), bounded: they become label values.

A name must be a short identifier, must not be a built-in loop phase, and at most
``MAX_NAMED_PHASES`` names are kept; any other name is counted as ``other``, with one
warning, so a name built from a step number cannot grow the series without bound.
"""

from __future__ import annotations

import logging
import os
import re

from stabmon.contract import PHASES
from stabmon.shared.heartbeat import STARTUP_PHASE
from stabmon.shared.log import LogLimiter

__all__ = ["MAX_NAMED_PHASES", "PhaseBlock", "PhaseNames"]

#: Named phases beyond this many share the label "other" (bounded cardinality).
MAX_NAMED_PHASES = 16
_PHASE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_RESERVED_PHASES = frozenset((*PHASES, STARTUP_PHASE))


class PhaseBlock:
    """What ``with mon.phase(name) as block`` gives: for a ``checkpoint`` phase, ``path`` is
    where the save writes, settable inside the block when a framework names the file only
    once it has written it (docs/policies.md, "Last good checkpoint")."""

    __slots__ = ("path",)

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = path


class PhaseNames:
    """The phase labels handed out so far; :meth:`label` vets each new name once."""

    def __init__(self, limiter: LogLimiter) -> None:
        self._limiter = limiter
        self._named: set[str] = set()

    def label(self, name: str) -> str:
        """``name`` as a phase label, or ``"other"`` (logged once) when it cannot be one."""
        if isinstance(name, str) and name in self._named:
            return name
        problem = None
        if not isinstance(name, str) or not _PHASE_NAME.match(name):
            problem = "is not a short identifier ([A-Za-z_][A-Za-z0-9_]*, at most 64 characters)"
        elif name in _RESERVED_PHASES:
            problem = "is a built-in loop phase"
        elif len(self._named) >= MAX_NAMED_PHASES:
            problem = f"would be phase name number {MAX_NAMED_PHASES + 1}"
        if problem is not None:
            self._limiter.once(
                "phase-name",
                logging.WARNING,
                "stabmon: phase name %r %s; its time is counted as phase 'other' (logged once)",
                name,
                problem,
            )
            return "other"
        self._named.add(name)
        return name
