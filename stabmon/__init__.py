"""stabmon: stability monitoring for long PyTorch training runs, exported to Prometheus.

One line in a training script::

    mon = stabmon.attach(model, optimizer)

records gradient health, non-finite values, spikes, timing, memory drift and a
heartbeat, and serves them at ``mon.metrics_url``.
"""

__version__ = "0.1.0"

from stabmon.config import Config, load_config  # noqa: E402 - __version__ first: monitor imports it
from stabmon.errors import AlreadyAttachedError, ConfigError, StabmonError  # noqa: E402
from stabmon.monitor import Monitor, attach  # noqa: E402

__all__ = [
    "AlreadyAttachedError",
    "Config",
    "ConfigError",
    "Monitor",
    "StabmonError",
    "__version__",
    "attach",
    "load_config",
]
