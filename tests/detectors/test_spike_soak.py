"""A compressed soak of the spike detectors: a million clean values raise nothing, and each
injected spike is found exactly once.

The series stand in for a tiny model's pre-clip gradient norm (log-normal batch noise,
drifting slowly) and a loss that converges to 1e-5 and then carries only float
noise. The detectors run with the defaults the Monitor gives them (stabmon.config.Config).
The real million-step run is ``python bench/soak.py --clean`` (see bench/README.md).
"""

from __future__ import annotations

import numpy as np

from stabmon.config import Config
from stabmon.detectors.spike import SpikeDetector

STEPS = 1_000_000


def _detectors() -> tuple[SpikeDetector, SpikeDetector]:
    cfg = Config()
    common = {"threshold": cfg.spike_threshold, "warmup": cfg.spike_warmup_steps,
              "alpha": cfg.spike_ema_alpha, "episode_gap": cfg.spike_episode_gap}  # fmt: skip
    loss = SpikeDetector(min_delta=cfg.loss_spike_min_delta, min_ratio=cfg.loss_spike_min_ratio,
                         **common)  # type: ignore[arg-type]  # fmt: skip
    grad = SpikeDetector(log_scale=True, min_ratio=cfg.grad_spike_min_ratio,
                         **common)  # type: ignore[arg-type]  # fmt: skip
    return loss, grad


def _series(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    steps = np.arange(STEPS)
    # Gradient norm: a slow drift and log-normal batch noise as measured on bench/soak.py's
    # tiny model (log standard deviation 0.33; 59,000 steps stayed within 2.5x the median),
    # here truncated at 3.5 standard deviations (3.2x).
    level = 0.5 * (1 + 0.5 * np.sin(steps / 50_000))
    grad = level * np.exp(0.33 * rng.standard_normal(STEPS).clip(-3.5, 3.5))
    # The second half is a smooth large-batch regime (log sd 0.03) where one batch in 2,000
    # is a hard one, 1.5-2x the norm: a z-score of 15-25, and no incident.
    half = STEPS // 2
    grad[half:] = level[half:] * np.exp(0.03 * rng.standard_normal(STEPS - half))
    hard = rng.random(STEPS - half) < 1 / 2000
    grad[half:][hard] *= rng.uniform(1.5, 2.0, int(hard.sum()))
    # Loss: converges from 2.0 to 1e-5, then float noise: 2e-10 jitter, and one step in
    # 10,000 a rounding step of 1e-7 (a z-score of about 10 against the relative floor).
    loss = 2.0 * np.exp(-steps / 20_000) + 1e-5 + 2e-10 * rng.standard_normal(STEPS)
    loss[rng.random(STEPS) < 1e-4] += 1e-7
    return grad, loss


def _spikes(detector: SpikeDetector, values: np.ndarray) -> list[int]:
    found = []
    for step, value in enumerate(values.tolist()):
        spike = detector.update(value)
        if spike is not None and spike.run_length == 1:  # one anomaly per episode
            found.append(step)
    return found


def test_a_clean_million_steps_raise_no_spike() -> None:
    loss_detector, grad_detector = _detectors()
    grad, loss = _series(0)
    assert _spikes(grad_detector, grad) == []
    assert _spikes(loss_detector, loss) == []


def test_each_injected_spike_in_a_million_steps_is_found_exactly_once() -> None:
    loss_detector, grad_detector = _detectors()
    grad, loss = _series(1)
    injected = list(range(50_000, STEPS, 50_000))
    for step in injected:
        grad[step : step + 3] *= 30.0  # a blow-up over three consecutive steps: one episode
        loss[step : step + 3] += 1.0
    assert _spikes(grad_detector, grad) == injected
    assert _spikes(loss_detector, loss) == injected
