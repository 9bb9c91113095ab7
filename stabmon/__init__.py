"""stabmon: stability monitoring for long PyTorch training runs, exported to Prometheus.

One line in a training script::

    mon = stabmon.attach(model, optimizer)

records gradient health, non-finite values, spikes, timing, memory drift and a
heartbeat, and serves them at ``mon.metrics_url``.
"""

from typing import TYPE_CHECKING, Any

from stabmon._version import __version__
from stabmon.errors import (
    AlreadyAttachedError,
    AnomalyStop,
    ConfigError,
    DeviceMismatchError,
    StabmonError,
    TrainingStalled,
)
from stabmon.extension import Plugin

if TYPE_CHECKING:
    from stabmon.config import Config, load_config
    from stabmon.monitor import Monitor, attach
    from stabmon.probes.sample_hash import sample_hashes


def __getattr__(name: str) -> Any:
    """Import the monitor (and with it torch) and the config on first use, not at
    ``import stabmon``.

    The node daemon and the CLI's other commands run where torch is not installed (the
    daemon's container image), and ``import stabmon`` must not cost torch's import time;
    ``import stabmon.contract`` (dashboards, rule generators) needs nothing beyond the
    standard library.
    """
    if name in ("Monitor", "attach"):
        from stabmon import monitor

        return getattr(monitor, name)
    if name in ("Config", "load_config"):
        from stabmon import config

        return getattr(config, name)
    if name == "sample_hashes":
        from stabmon.probes import sample_hash

        return sample_hash.sample_hashes
    raise AttributeError(f"module 'stabmon' has no attribute {name!r}")


__all__ = [
    "AlreadyAttachedError",
    "AnomalyStop",
    "Config",
    "ConfigError",
    "DeviceMismatchError",
    "Monitor",
    "Plugin",
    "StabmonError",
    "TrainingStalled",
    "__version__",
    "attach",
    "load_config",
    "sample_hashes",
]
