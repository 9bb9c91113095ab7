"""``StabmonCallback`` for the Hugging Face ``transformers.Trainer``.

Example::

    from transformers import Trainer
    from stabmon.integrations.huggingface import StabmonCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[StabmonCallback(run_id="exp42")])
    trainer.train()

At ``on_train_begin`` the callback attaches a Monitor to the model and to the
optimizer inside Accelerate's wrapper (with its GradScaler under fp16). The loss is
read from what the model returns (``output["loss"]``, or ``output[0]``) at each training
forward, on the device, and observed at ``on_step_end``: one loss per optimizer step, NaN
included. (The Trainer's own ``loss`` record is not enough: with its default
``logging_nan_inf_filter=True`` a NaN step's record holds the mean of the steps before
it, 0.0 when logged every step.) A model whose output holds no loss (a
``compute_loss_func``, label smoothing) falls back to the ``loss`` of each training
``on_log`` record. Epochs end at ``on_epoch_end``;
evaluation and checkpointing are phases, entered when ``TrainerControl`` says they
come next and left at ``on_evaluate`` and ``on_save``.

Throughput: at each ``on_step_end`` the step's samples go to ``observe(samples=...)``:
the batches the step took (``gradient_accumulation_steps``, fewer at an epoch's end)
times the Trainer's per-process batch size, the epoch's last batch as short as the
train loader makes it. Tokens go to ``observe(tokens=...)`` when the Trainer counts
them (``include_num_input_tokens_seen``): its count is summed over all processes, so
each rank reports its share (the total over the world size).

Resume: at each ``on_save`` the Monitor's state is written into the checkpoint
folder as ``stabmon-rank<rank>.pt``; ``trainer.train(resume_from_checkpoint=...)``
restores the Trainer's step, and ``on_train_begin`` loads the file from
``<output_dir>/checkpoint-<step>``. See docs/integrations/huggingface.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from stabmon.integrations._common import (
    ConfigSource,
    EpochBatches,
    PhaseSwitch,
    load_state,
    save_state,
)
from stabmon.monitor import Monitor

__all__ = ["ModelLoss", "StabmonCallback", "state_file"]


class _ModelSave:
    """``on_anomaly``'s checkpoint action for the Trainer: the model's weights, before the
    anomalous step is applied, into ``<output_dir>/stabmon-step<N>`` (``save_pretrained``)
    or ``stabmon-step<N>.pt`` (a plain module's ``state_dict``), from the main process (the
    callback sees no Trainer, whose full checkpoint saves after the step)."""

    def __init__(self, model: torch.nn.Module, output_dir: Path) -> None:
        self._model = weakref.ref(model)
        self._output_dir = output_dir

    def __call__(self, step: int) -> None:
        model = self._model()
        if model is None or _process_index() != 0:
            return
        save_pretrained = getattr(model, "save_pretrained", None)
        if callable(save_pretrained):
            save_pretrained(str(self._output_dir / f"stabmon-step{step}"))
        else:
            self._output_dir.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), self._output_dir / f"stabmon-step{step}.pt")


def _process_index() -> int:
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    return 0


def state_file(checkpoint_folder: str | Path, rank: int) -> Path:
    """Where the callback keeps a rank's Monitor state inside a Trainer checkpoint folder."""
    return Path(checkpoint_folder) / f"stabmon-rank{rank}.pt"


class StabmonCallback(TrainerCallback):
    """A ``TrainerCallback`` that runs a :class:`~stabmon.Monitor` for ``Trainer.train``.

    Keyword arguments are those of ``stabmon.attach``: ``config=`` and any config key.
    """

    def __init__(self, config: ConfigSource = None, **overrides: Any) -> None:
        self._config = config
        self._overrides = overrides
        self._monitor: Monitor | None = None
        self._phase: PhaseSwitch | None = None
        self._awaiting_log = False
        self._batches: EpochBatches | None = None
        self._tokens_at_start = 0  # the Trainer's token count when this training began
        self._tokens_reported = 0  # this rank's share of the tokens since then, observed
        self._losses = ModelLoss()
        self._unwatch: Callable[[], None] | None = None

    @property
    def monitor(self) -> Monitor | None:
        """The attached Monitor, or None outside ``train()``."""
        return self._monitor

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        """Attach to the model and the optimizer; on resume, load the checkpoint's state."""
        self._detach()
        self._batches = None
        self._tokens_at_start, self._tokens_reported = _tokens_seen(state), 0
        if model is None or optimizer is None:
            return
        inner = getattr(optimizer, "optimizer", None)  # Accelerate's AcceleratedOptimizer
        monitor = Monitor(
            model,
            inner if isinstance(inner, torch.optim.Optimizer) else optimizer,
            scaler=getattr(optimizer, "scaler", None),
            config=self._config,
            **self._overrides,
        )
        self._monitor, self._phase = monitor, PhaseSwitch(monitor)
        output_dir = Path(args.output_dir or ".")
        monitor.on_checkpoint_action(_ModelSave(model, output_dir))  # on_anomaly's checkpoint
        self._losses = ModelLoss()
        with monitor.contain():  # without it the logged loss is observed, as before
            self._unwatch = monitor._watch_output(self._losses)
        with monitor.contain():  # an odd loader goes uncounted; training goes on
            self._batches = EpochBatches.of(train_dataloader)
        if state.global_step > 0:
            load_state(monitor, state_file(_checkpoint_folder(args, state), monitor.rank))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._monitor is not None:
            with self._monitor.contain():  # the model's unfiltered loss of the step just taken
                loss = self._losses.take()
                if loss is not None:
                    self._monitor.observe(loss=loss)
            with self._monitor.contain():  # uncounted rather than a stopped training
                self._count_throughput(args, state)
        self._after_training_work(control)

    def _count_throughput(self, args: TrainingArguments, state: TrainerState) -> None:
        """The samples of the optimizer step just taken, and this rank's share of its tokens."""
        monitor, batches = self._monitor, self._batches
        if monitor is None:
            return
        samples = None
        if batches is not None and state.global_step > 0:
            accumulation = max(1, args.gradient_accumulation_steps)
            first, count = 0, accumulation
            if batches.batches:  # each epoch has ceil(batches / accumulation) steps
                steps_per_epoch = -(-batches.batches // accumulation)
                first = (state.global_step - 1) % steps_per_epoch * accumulation
                count = min(accumulation, batches.batches - first)
            samples = batches.samples(first, count)
        tokens = None
        if args.include_num_input_tokens_seen not in ("no", False):
            total = _tokens_seen(state) - self._tokens_at_start
            world, rank = max(1, args.world_size), args.process_index
            share = total // world + (1 if rank < total % world else 0)
            tokens, self._tokens_reported = share - self._tokens_reported, share
        monitor.observe(samples=samples, tokens=tokens)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._monitor is not None:
            self._monitor.epoch_end()
        self._after_training_work(control)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Observe a training log record's ``loss``; evaluation records carry ``eval_loss``."""
        if self._monitor is None or not self._awaiting_log:
            return
        loss = (logs or {}).get("loss")
        if isinstance(loss, int | float) and not self._losses.seen:
            self._monitor.observe(loss=float(loss))
        self._awaiting_log = False
        self._next_phase(control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._phase is not None and self._phase.name == "eval":
            self._next_phase(control, evaluated=True)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Write the Monitor's state into the checkpoint folder the Trainer has just written."""
        monitor = self._monitor
        if monitor is None:
            return
        folder = _checkpoint_folder(args, state)
        save_state(monitor, state_file(folder, monitor.rank))
        if self._phase is not None:  # the save is recorded with its folder (verdict.json)
            self._phase.close(path=folder if self._phase.name == "checkpoint" else None)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._phase is not None:
            self._phase.close()  # in case an expected event never came

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Detach: every hook removed, every thread stopped, the port freed."""
        self._detach()

    def _after_training_work(self, control: TrainerControl) -> None:
        # The Trainer logs, then evaluates, then saves, as the control flags just set say.
        if self._monitor is None:
            return
        self._awaiting_log = bool(control.should_log)
        if not self._awaiting_log:
            self._next_phase(control)

    def _next_phase(self, control: TrainerControl, *, evaluated: bool = False) -> None:
        if self._phase is None:
            return
        if control.should_evaluate and not evaluated:
            self._phase.enter("eval")
        elif control.should_save:
            self._phase.enter("checkpoint")
        else:
            self._phase.close()

    def _detach(self) -> None:
        if self._phase is not None:
            self._phase.close()
        if self._unwatch is not None:
            self._unwatch()
        if self._monitor is not None:
            self._monitor.detach()
        self._monitor, self._phase, self._awaiting_log = None, None, False
        self._unwatch = None


class ModelLoss:
    """The training loss of each optimizer step, from what the model returns, on the device.

    Called after each forward of the model with its keyword arguments and output; a
    forward without gradients (evaluation) is left out. The Trainer reads the loss as
    ``output["loss"]`` (``output[0]`` for a tuple); with ``num_items_in_batch`` among the
    arguments each micro-batch's loss is its share of the step's (summed), otherwise the
    step's loss is the mean over its micro-batches, as the Trainer logs it. Never a sync.
    """

    def __init__(self) -> None:
        self._total: torch.Tensor | None = None
        self._count = 0
        self._shares = False
        #: Whether any forward returned a loss: the logged loss is then not observed.
        self.seen = False

    def __call__(self, kwargs: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if isinstance(output, Mapping):
            loss = output.get("loss")
        elif isinstance(output, tuple | list) and output:
            loss = output[0]
        else:
            return
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.is_complex():
            return
        value = loss.detach().reshape(())
        self._total = value if self._total is None else self._total + value
        self._count += 1
        self._shares = isinstance(kwargs, Mapping) and "num_items_in_batch" in kwargs
        self.seen = True

    def take(self) -> torch.Tensor | None:
        """The loss of the step just taken (None when no forward returned one); starts anew."""
        total, count = self._total, self._count
        self._total, self._count = None, 0
        if total is None:
            return None
        return total if self._shares or count == 1 else total / count


def _tokens_seen(state: TrainerState) -> int:
    seen = state.num_input_tokens_seen
    return int(seen) if isinstance(seen, int | float) else 0


def _checkpoint_folder(args: TrainingArguments, state: TrainerState) -> Path:
    """The folder the Trainer saves the checkpoint of ``state.global_step`` in."""
    return (
        Path(args.output_dir or "trainer_output") / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    )
