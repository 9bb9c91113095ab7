"""Memory leak by trend: a robust slope over floors, with a significance test.

Works for any loop shape: it is fed memory samples by step (every few steps,
whether or not epochs end), not by epoch. Three steps make it robust to the noise
of allocators and RSS (page cache, arenas, a garbage collection):

- *floors*: samples are grouped into buckets of ``bucket`` samples and only each
  bucket's minimum is kept. Upward noise (a transient allocation, RSS that has not
  been returned yet) vanishes; a leak raises the floor itself.
- *Mann-Kendall*: over the last ``window`` floors, the statistic S (sum of the signs
  of all later-minus-earlier differences) against its no-trend variance gives a z
  score; a leak is growth with ``z >= z_threshold`` (one-sided; 4.0 is p < 4e-5).
- *Theil-Sen*: the median of the pairwise slopes is the growth rate, robust to
  outliers; the rule also needs the window to have grown by ``min_growth`` of its
  median level, and its *second half* to grow too, so a warm-up that rose and then
  flattened is not a leak. Once suspected, the suspicion holds until no upward trend is
  left (z below half the threshold): a leak that grows in steps is one leak, not one per step.

A bucket is ``bucket`` samples, or, with ``bucket_seconds``, the samples of that much time
on the caller's clock (``update(value, now)``): a window then spans a known time whatever
the step time, so a leak's latency is stated in seconds (:mod:`stabmon.detectors.leak_rules`
judges several such scales at once).

State is bounded: ``window`` floors and one bucket's running minimum.

    trend = MemoryTrend(bucket=10, window=24)
    for step, rss in samples:
        verdict = trend.update(rss)
        if verdict is not None and verdict.newly_suspected:
            print(f"leak: {verdict.slope:.0f} bytes/sample, z={verdict.zscore:.1f}")
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["MemoryTrend", "TrendVerdict", "mann_kendall_z", "theil_sen_slope"]


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i < j) of ``n`` values; cached, windows have one or two sizes."""
    pairs = _PAIRS.get(n)
    if pairs is None:
        pairs = _PAIRS[n] = np.triu_indices(n, 1)
    return pairs


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def mann_kendall_z(values: list[float]) -> float:
    """Mann-Kendall trend z score (continuity-corrected, ties ignored in the variance)."""
    n = len(values)
    if n < 3:
        return 0.0
    array = np.asarray(values, dtype=np.float64)
    first, later = _pairs(n)
    s = int(np.sign(array[later] - array[first]).sum())
    variance = n * (n - 1) * (2 * n + 5) / 18.0
    if s > 0:
        return (s - 1) / math.sqrt(variance)
    if s < 0:
        return (s + 1) / math.sqrt(variance)
    return 0.0


def theil_sen_slope(values: list[float]) -> float:
    """Median of the pairwise slopes (per index) of evenly spaced ``values``."""
    if len(values) < 2:
        return 0.0
    array = np.asarray(values, dtype=np.float64)
    first, later = _pairs(len(values))
    slopes = np.sort((array[later] - array[first]) / (later - first))
    # Not np.median: its first call imports numpy.ma, half a megabyte that a leak detector
    # should not add to the process it watches, mid-run.
    middle = len(slopes) // 2
    if len(slopes) % 2:
        return float(slopes[middle])
    return float((slopes[middle - 1] + slopes[middle]) / 2)


@dataclass(frozen=True)
class TrendVerdict:
    """The judgement made when a bucket closes."""

    floor: float
    """The minimum of the bucket that closed."""
    zscore: float
    """Mann-Kendall z of the window (0 until it holds ``min_floors`` floors)."""
    slope: float
    """Theil-Sen growth per *sample* (bytes), over the window."""
    growth: float
    """Growth over the window relative to its median level (0.05 = +5%)."""
    suspected: bool
    newly_suspected: bool
    per_second: float | None = None
    """Theil-Sen growth per second (bytes) when buckets are measured in time, else None."""


class MemoryTrend:
    """Judges one device's memory samples; :meth:`update` per sample."""

    def __init__(
        self,
        *,
        bucket: int = 10,
        window: int = 24,
        min_floors: int = 12,
        z_threshold: float = 4.0,
        min_growth: float = 0.02,
        warmup_samples: int = 0,
        bucket_seconds: float | None = None,
    ) -> None:
        if bucket < 1 or window < 4 or not 4 <= min_floors <= window:
            raise ValueError(
                f"MemoryTrend needs bucket >= 1 and 4 <= min_floors <= window (for example "
                f"10, 12, 24), got bucket={bucket!r}, min_floors={min_floors!r}, window={window!r}"
            )
        if bucket_seconds is not None and not bucket_seconds > 0:
            raise ValueError(f"MemoryTrend bucket_seconds must be > 0, got {bucket_seconds!r}")
        if not (z_threshold > 0 and min_growth >= 0 and warmup_samples >= 0):
            raise ValueError(
                f"MemoryTrend needs z_threshold > 0, min_growth >= 0 and warmup_samples >= 0, "
                f"got {z_threshold!r}, {min_growth!r}, {warmup_samples!r}"
            )
        self._bucket = bucket
        self._bucket_seconds = bucket_seconds
        self._bucket_start: float | None = None  # on the caller's clock (time buckets)
        self._min_floors = min_floors
        self._z_threshold = z_threshold
        self._min_growth = min_growth
        self._warmup = warmup_samples
        self._floors: deque[float] = deque(maxlen=window)
        self._seen = 0
        self._in_bucket = 0
        self._minimum = math.inf
        self._suspected = False
        #: The first floor after warm-up: the baseline of the drift ratio.
        self.baseline: float | None = None

    @property
    def suspected(self) -> bool:
        """Whether the last verdict held a leak."""
        return self._suspected

    def update(self, value: float, now: float | None = None) -> TrendVerdict | None:
        """One sample (taken at ``now``, needed with ``bucket_seconds``); a verdict when it
        closes a bucket, else None."""
        self._seen += 1
        if self._seen <= self._warmup or not math.isfinite(value):
            return None
        if value < self._minimum:
            self._minimum = value
        self._in_bucket += 1
        seconds = self._bucket_seconds
        if seconds is None:
            if self._in_bucket < self._bucket:
                return None
        else:
            if now is None:
                raise ValueError("a MemoryTrend with bucket_seconds needs update(value, now)")
            if self._bucket_start is None:
                self._bucket_start = now
                return None
            if now - self._bucket_start < seconds:
                return None
            self._bucket_start = now  # the next bucket starts after this sample
        floor = self._minimum
        in_bucket, self._in_bucket = self._in_bucket, 0
        self._minimum = math.inf
        if self.baseline is None:
            self.baseline = floor
        floors = self._floors
        floors.append(floor)
        if len(floors) < self._min_floors:
            return TrendVerdict(floor, 0.0, 0.0, 0.0, self._suspected, False)
        values = list(floors)
        zscore = mann_kendall_z(values)
        slope = theil_sen_slope(values)
        level = statistics.median(values)
        growth = slope * (len(values) - 1) / level if level > 0 else 0.0
        half = values[len(values) // 2 :]
        late_slope = theil_sen_slope(half)
        late_growth = late_slope * (len(half) - 1) / level if level > 0 else 0.0
        if self._suspected:
            # Hysteresis: a leak that grows in steps (a batch of objects kept each epoch) has
            # flat stretches; it is over once no trend is left at all, not at the first pause.
            holds = zscore >= self._z_threshold / 2 and growth > 0
        else:
            holds = (
                zscore >= self._z_threshold
                and growth >= self._min_growth
                and late_growth >= self._min_growth / 2
            )
        newly = holds and not self._suspected
        self._suspected = holds
        if seconds is not None:  # per floor: one floor a bucket of ``seconds``
            per_sample = slope / max(1, in_bucket)
            return TrendVerdict(
                floor, zscore, per_sample, growth, holds, newly, per_second=slope / seconds
            )
        # Per sample, not per floor: a floor spans ``bucket`` samples.
        return TrendVerdict(floor, zscore, slope / self._bucket, growth, holds, newly)
