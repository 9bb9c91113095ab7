"""The rows of ``stabmon compare`` beside step time: environment, throughput, memory, AMP,
anomalies and goodput, each a list of plain JSON-ready dicts with an ``a`` and a ``b`` side.

Where a figure is per rank, rows are per rank (``rank``), and throughput has a whole-run row
(``rank`` None) as well. Needs no torch.
"""

from __future__ import annotations

from typing import Any

from stabmon.report.digest import RankDigest, RunDigest
from stabmon.report.goodput import TRAINING_PHASES, RankGoodput

__all__ = [
    "MAX_STEPS_SHOWN",
    "amp_rows",
    "anomalies_past",
    "anomaly_rows",
    "environment_rows",
    "goodput_rows",
    "memory_rows",
    "throughput_rows",
]

#: Steps listed per anomaly kind and run (the count is always whole).
MAX_STEPS_SHOWN = 20


def environment_rows(
    a: RunDigest, b: RunDigest, a_ranks: list[RankDigest], b_ranks: list[RankDigest]
) -> list[dict[str, Any]]:
    """Each fact that differs, with both values (per rank where the ranks differ)."""
    facts_a, facts_b = _facts(a, a_ranks), _facts(b, b_ranks)
    return [
        {"key": key, "a": facts_a.get(key), "b": facts_b.get(key)}
        for key in sorted(facts_a.keys() | facts_b.keys(), key=_fact_order)
        if facts_a.get(key) != facts_b.get(key)
    ]


def _facts(run: RunDigest, ranks: list[RankDigest]) -> dict[str, str]:
    per_rank = {rank.rank: rank.environment() for rank in ranks}
    facts: dict[str, str] = {
        "world_size": str(run.world_size()),
        "ranks_per_node": str(run.ranks_per_node()),
    }
    for key in {key for found in per_rank.values() for key in found}:
        values = {rank: found.get(key, "unset") for rank, found in per_rank.items()}
        if len(set(values.values())) == 1:
            facts[key] = next(iter(values.values()))
        else:
            facts[key] = "; ".join(f"rank {rank}: {value}" for rank, value in values.items())
    return facts


def _fact_order(key: str) -> tuple[int, str]:
    # Lower-case facts (versions, host, topology) first, then variables (upper case).
    return (1 if key.isupper() or key[:1].isupper() else 0, key)


def anomaly_rows(a: list[RankDigest], b: list[RankDigest], last: int) -> list[dict[str, Any]]:
    """Per kind: how many in each run up to step ``last`` (the last both runs reached), at
    which steps and on which ranks. An anomaly without a step is counted."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for name, ranks in (("a", a), ("b", b)):
        for rank in ranks:
            for kind, step in rank.anomalies():
                if step is not None and step > last:
                    continue
                side = found.setdefault(kind, {}).setdefault(
                    name, {"count": 0, "steps": [], "ranks": []}
                )
                side["count"] += 1
                if step is not None and len(side["steps"]) < MAX_STEPS_SHOWN:
                    side["steps"].append(step)
                if rank.rank not in side["ranks"]:
                    side["ranks"].append(rank.rank)
    empty = {"count": 0, "steps": [], "ranks": []}
    return [
        {"kind": kind, "a": sides.get("a", empty), "b": sides.get("b", empty)}
        for kind, sides in sorted(found.items())
    ]


def anomalies_past(ranks: list[RankDigest], last: int) -> int:
    """How many of ``ranks``' anomalies fall after step ``last`` (left out of the rows)."""
    return sum(1 for r in ranks for _, step in r.anomalies() if step is not None and step > last)


def memory_rows(a: list[RankDigest], b: list[RankDigest], warmup: int) -> list[dict[str, Any]]:
    """Per rank and device: peak bytes, slope after warm-up (bytes per step), leak verdict."""
    rows = []
    for rank in sorted({r.rank for r in (*a, *b)}):
        sides: dict[str, _Memory | None] = {}
        for name, ranks in (("a", a), ("b", b)):
            digest = next((r for r in ranks if r.rank == rank), None)
            sides[name] = None if digest is None else _Memory(digest, warmup)
        devices = sorted({d for side in sides.values() if side for d in side.peaks})
        for device in devices:
            row: dict[str, Any] = {"rank": rank, "device": device}
            for name, side in sides.items():
                row[name] = None if side is None else side.of(device)
            rows.append(row)
    return rows


class _Memory:
    """One rank's memory figures, read once (each reading walks the rank's records)."""

    def __init__(self, rank: RankDigest, warmup: int) -> None:
        self.series = rank.memory()
        self.peaks = rank.peaks()
        self.leaks = rank.leaks()
        self.warmup = warmup

    def of(self, device: str) -> dict[str, Any] | None:
        points = self.series.get(device, [])
        peak = self.peaks.get(device)
        if peak is None and not points:
            return None
        settled = [p for p in points if p[0] >= self.warmup]
        return {
            "peak_bytes": peak,
            "slope_bytes_per_step": _slope(settled if len(settled) > 1 else points),
            "leak": device in self.leaks,
        }


def _slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares bytes per step; None with fewer than two distinct steps."""
    if len({step for step, _ in points}) < 2:
        return None
    mean_x = sum(s for s, _ in points) / len(points)
    mean_y = sum(v for _, v in points) / len(points)
    spread = sum((s - mean_x) ** 2 for s, _ in points)
    return sum((s - mean_x) * (v - mean_y) for s, v in points) / spread


def amp_rows(a: list[RankDigest], b: list[RankDigest]) -> list[dict[str, Any]]:
    """Per rank: the GradScaler's last and lowest scale, and the steps it skipped."""
    rows = []
    for rank in sorted({r.rank for r in (*a, *b)}):
        row: dict[str, Any] = {"rank": rank}
        for name, ranks in (("a", a), ("b", b)):
            digest = next((r for r in ranks if r.rank == rank), None)
            scales = [s.loss_scale for s in digest.samples if s.loss_scale] if digest else []
            skipped = len(digest.log.of("amp_skip")) if digest else 0
            row[name] = (
                {
                    "last_scale": scales[-1] if scales else None,
                    "min_scale": min(scales) if scales else None,
                    "skipped_steps": skipped,
                }
                if scales or skipped
                else None
            )
        if row["a"] is not None or row["b"] is not None:
            rows.append(row)
    return rows


def throughput_rows(a: list[RankDigest], b: list[RankDigest]) -> list[dict[str, Any]]:
    """Per rank and for the whole run (``rank`` None): rates over wall time, MFU, goodput."""
    scopes: list[int | None] = [None]
    if len(a) > 1 or len(b) > 1:
        scopes += sorted({r.rank for r in (*a, *b)})
    rows = []
    for scope in scopes:
        row: dict[str, Any] = {"rank": scope}
        for name, ranks in (("a", a), ("b", b)):
            chosen = [r.goodput for r in ranks if r.goodput and scope in (None, r.rank)]
            row[name] = _rates(chosen) if chosen else None
        rows.append(row)
    return rows


def _rates(ranks: list[RankGoodput]) -> dict[str, Any]:
    wall = sum(r.wall_seconds for r in ranks) / len(ranks)
    steps = max(r.steps for r in ranks)
    samples, tokens = sum(r.samples for r in ranks), sum(r.tokens for r in ranks)
    mfus = [r.mfu for r in ranks if r.mfu is not None]
    flops = [r.flops_per_step for r in ranks if r.flops_per_step is not None]
    training = sum(r.spent.get("training", 0.0) for r in ranks)
    total_wall = sum(r.wall_seconds for r in ranks)
    return {
        "steps": steps,
        "wall_seconds": wall,
        "steps_per_second": steps / wall if wall > 0 else None,
        "samples_per_second": samples / wall if wall > 0 and samples else None,
        "tokens_per_second": tokens / wall if wall > 0 and tokens else None,
        "samples_per_step": samples / len(ranks) / steps if steps and samples else None,
        "flops_per_step": sum(flops) / len(flops) if flops else None,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "goodput": training / total_wall if total_wall > 0 else None,
    }


def goodput_rows(a: list[RankDigest], b: list[RankDigest]) -> list[dict[str, Any]]:
    """Each cause's share of wall time in both runs (every selected rank together)."""
    shares = {
        name: _shares([r.goodput for r in ranks if r.goodput])
        for name, ranks in (("a", a), ("b", b))
    }
    causes = sorted(
        shares["a"].keys() | shares["b"].keys(),
        key=lambda c: (c != "training", c in TRAINING_PHASES, c),
    )
    return [{"cause": c, "a": shares["a"].get(c), "b": shares["b"].get(c)} for c in causes]


def _shares(ranks: list[RankGoodput]) -> dict[str, float]:
    wall = sum(r.wall_seconds for r in ranks)
    if wall <= 0:
        return {}
    causes = {cause for r in ranks for cause in r.spent}
    return {c: sum(r.spent.get(c, 0.0) for r in ranks) / wall for c in causes}
