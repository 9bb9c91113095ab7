"""``StabmonCallback`` for Lightning (``lightning.pytorch``, else ``pytorch_lightning``).

Example::

    from lightning.pytorch import Trainer
    from stabmon.integrations.lightning import StabmonCallback

    trainer = Trainer(max_epochs=10, callbacks=[StabmonCallback(run_id="exp42")])
    trainer.fit(model, datamodule)

The callback attaches a Monitor at fit start, observes the training loss, marks
epochs, names validation and checkpointing as phases, saves the Monitor's state in
Lightning's checkpoints (so ``trainer.fit(..., ckpt_path=...)`` keeps step numbering
and baselines) and detaches at teardown. Keyword arguments are those of
``stabmon.attach``: ``config=`` and any config key. With both ``lightning`` and
``pytorch_lightning`` installed, this module uses ``lightning.pytorch``; import
``stabmon.integrations.pytorch_lightning`` for a ``pytorch_lightning.Trainer``.
See docs/integrations/lightning.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typed against the integrations extra, which installs pytorch_lightning
    from pytorch_lightning.callbacks import Callback
else:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # only the pytorch_lightning package is installed
        from pytorch_lightning.callbacks import Callback

from stabmon.integrations._lightning import LightningAdapter

__all__ = ["StabmonCallback"]


class StabmonCallback(LightningAdapter, Callback):
    """A Lightning callback that runs a :class:`~stabmon.Monitor` for ``Trainer.fit``."""
