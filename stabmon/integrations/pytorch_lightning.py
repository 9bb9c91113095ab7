"""``StabmonCallback`` for a ``pytorch_lightning.Trainer`` (the package's older name).

The same callback as :mod:`stabmon.integrations.lightning`, built on
``pytorch_lightning.Callback``, for when ``lightning`` is installed too and the
trainer comes from ``pytorch_lightning``. See docs/integrations/lightning.md.
"""

from __future__ import annotations

from pytorch_lightning.callbacks import Callback

from stabmon.integrations._lightning import LightningAdapter

__all__ = ["StabmonCallback"]


class StabmonCallback(LightningAdapter, Callback):
    """A ``pytorch_lightning`` callback running a :class:`~stabmon.Monitor` for ``Trainer.fit``."""
