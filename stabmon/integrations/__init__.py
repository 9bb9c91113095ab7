"""Adapters that give the trainers people already use a :class:`~stabmon.Monitor` in one line.

Each adapter is thin: it attaches an ordinary Monitor when the trainer has built
its model and optimizer, forwards the trainer's events (loss, epoch ends,
evaluation, checkpoints) to the Monitor's public methods, carries the Monitor's
state through the trainer's checkpoints and detaches at the end. It holds no
monitoring logic of its own.

- :mod:`stabmon.integrations.lightning`: ``StabmonCallback`` for ``lightning.pytorch``
  (or ``pytorch_lightning`` when ``lightning`` is not installed);
  :mod:`stabmon.integrations.pytorch_lightning` always uses ``pytorch_lightning``.
- :mod:`stabmon.integrations.huggingface`: ``StabmonCallback`` for ``transformers.Trainer``.
- :mod:`stabmon.integrations.ultralytics`: ``add_stabmon(model_or_trainer)`` for YOLO training.

Importing this package imports no framework; each module imports its own when it is
imported. The guides are in ``docs/integrations/``.
"""
