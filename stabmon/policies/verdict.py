"""``rank-N.verdict.json``: what this rank decided, for a launcher to read, and the last
good checkpoint.

The file is one JSON object in the vocabulary of the resiliency tools (NVIDIA's
resiliency extension turns a failure into STOP or RESTART with a failure domain; Ray Train
decides to reattempt or not)::

    {"decision": "continue" | "restart" | "stop",
     "failure_domain": "workload" | "infrastructure" | "unknown",
     "reason": "...", "kind": "grad_spike" | null, "step": 300 | null, "rank": 1,
     "recommended_action": "...", "last_good_checkpoint": {...} | null,
     "updated": "2026-11-27T18:40:00Z"}

It is rewritten whole (a temporary file renamed over it: a reader sees the old verdict or
the new one) when a policy acts, when an anomaly whose action is ``stop`` is recorded, at a
checkpoint, and at the end (detach or exit). The run directory is on a shared node: it is
checked as ours before each write (:func:`~stabmon.shared.rundir.prepare_run_directory`)
and the temporary file is created exclusively, never through a symlink
(:func:`~stabmon.shared.rundir.write_atomic`). A ``stop`` or ``restart`` decision is never
turned back into ``continue`` by a later, milder event.

A checkpoint is *good* when its save completed and nothing had damaged the parameters
before it: no ``replica_mismatch``, and no non-finite gradient or loss that reached the
parameters (one the ``nonfinite_grad`` policy held back with ``skip`` or ``stop`` did not).
A rollback is recommended (its step and path), never performed.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections import deque
from pathlib import Path
from typing import Any

from stabmon.shared.rundir import prepare_run_directory, write_atomic

__all__ = ["DECISIONS", "Checkpoints", "Verdict", "checkpoint_size"]

#: Decisions, mildest first.
DECISIONS: tuple[str, ...] = ("continue", "restart", "stop")
#: Most files a directory checkpoint's size is summed over (a bound on the walk).
MAX_SIZE_ENTRIES = 10_000


def checkpoint_size(path: str) -> int | None:
    """Bytes of a saved checkpoint: a file's size, or the sum of a directory's regular files
    (at most :data:`MAX_SIZE_ENTRIES`); None when it cannot be read. The path is the loop's
    own, so it is stat'ed as named."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    if stat.S_ISREG(info.st_mode):
        return info.st_size
    if not stat.S_ISDIR(info.st_mode):
        return None
    total, seen, stack = 0, 0, [path]
    while stack and seen < MAX_SIZE_ENTRIES:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                    if seen >= MAX_SIZE_ENTRIES:
                        break
        except OSError:
            return None
    return total


#: Good saves remembered, so that damage recorded late can take the latest ones back.
MAX_GOOD_SAVES = 64


class Checkpoints:
    """The saves seen, and whether the parameters were damaged before each."""

    def __init__(self) -> None:
        #: The latest good save ({path, step, size, completed, good}), or None.
        self.last_good: dict[str, Any] | None = None
        #: The latest save, good or not.
        self.last: dict[str, Any] | None = None
        self._damage: str | None = None
        self._good: deque[dict[str, Any]] = deque(maxlen=MAX_GOOD_SAVES)

    def damaged(self, why: str, since: int | None = None) -> None:
        """The parameters may be wrong from now on: no later save is good. ``since``: the
        first step whose result may already have been damaged (anomalies are recorded after
        the fact: a NaN read back a step late, a replica check every K steps), so saves of
        that step or later, made before the damage was known, are not good either."""
        if self._damage is None:
            self._damage = why
        if since is None:
            return
        for entry in self._good:
            if entry["step"] is not None and entry["step"] >= since and entry["good"]:
                entry["good"] = False
                entry["why_not_good"] = why
        kept = [entry for entry in self._good if entry["good"]]
        self._good.clear()
        self._good.extend(kept)
        self.last_good = self._latest_good()

    def _latest_good(self) -> dict[str, Any] | None:
        """The latest good save; one without a path (a checkpoint phase an adapter opened
        around no save, or a loop that named none) never hides one whose path is known."""
        named = [entry for entry in self._good if entry["path"] is not None]
        latest: list[dict[str, Any]] = named or list(self._good)  # at most MAX_GOOD_SAVES
        return latest[-1] if latest else None

    def saved(self, step: int | None, path: str | None, completed: bool) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "path": path,
            "step": step,
            "size": None if path is None else checkpoint_size(path),
            "completed": completed,
            "good": completed and self._damage is None,
        }
        if not completed:
            entry["why_not_good"] = "the save raised before it completed"
        elif self._damage is not None:
            entry["why_not_good"] = self._damage
        self.last = entry
        if entry["good"]:
            self._good.append(entry)
            self.last_good = self._latest_good()
        return entry


class Verdict:
    """This rank's verdict, kept in memory and written whole to ``path``."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self._state: dict[str, Any] = {
            "decision": "continue",
            "failure_domain": "unknown",
            "reason": "no anomaly acted on",
            "kind": None,
            "step": None,
            "rank": rank,
            "recommended_action": "none",
            "last_good_checkpoint": None,
        }

    @property
    def state(self) -> dict[str, Any]:
        return dict(self._state)

    def decide(
        self,
        decision: str,
        *,
        failure_domain: str,
        reason: str,
        kind: str | None,
        step: int | None,
        recommended_action: str,
    ) -> bool:
        """Take a decision unless a stronger one stands; whether it was taken."""
        if DECISIONS.index(decision) < DECISIONS.index(self._state["decision"]):
            return False
        self._state.update(
            decision=decision, failure_domain=failure_domain, reason=reason, kind=kind,
            step=step, recommended_action=recommended_action,
        )  # fmt: skip
        return True

    def checkpoint(self, last_good: dict[str, Any] | None) -> None:
        self._state["last_good_checkpoint"] = None if last_good is None else dict(last_good)

    def write(self) -> None:
        """Replace the file with the verdict now; raises OSError (an unsafe directory too)."""
        state = self._state | {
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        prepare_run_directory(self.path.parent)  # ours, not a directory planted for us
        write_atomic(self.path, (json.dumps(state, indent=1) + "\n").encode())
