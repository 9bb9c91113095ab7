"""Loops written the way real projects write them, trained on CPU with faults injected.

Each loop is a small model with its project's habits, not stabmon's:

- ``gpt``: a nanoGPT-style decoder, AdamW, ``get_batch()`` instead of a DataLoader,
  gradient accumulation (4 micro-batches), ``clip_grad_norm_(..., 1.0)``, one endless
  epoch, an evaluation every ``eval_every`` steps under ``torch.no_grad()`` (no ``mon.phase``);
- ``lstm``: pytorch/examples' word language model: an LSTM LM, plain SGD at lr 20,
  ``clip_grad_norm_(..., 0.25)``, ``get_batch(source, i)`` over BPTT windows, epochs marked
  by ``epoch_end()``;
- ``cnn``: a CNN classifier with a ``DataLoader`` through ``mon.track()``, SGD with
  momentum, no clipping;
- ``lightning``: a ``pytorch_lightning.Trainer`` with ``gradient_clip_val=0.5`` and
  ``accumulate_grad_batches=2``, monitored by stabmon's ``StabmonCallback``
  (stabmon/integrations/pytorch_lightning.py), epochs of 128 steps;
- ``hf``: the Hugging Face ``transformers.Trainer`` with ``max_grad_norm=0.5`` and
  ``gradient_accumulation_steps=2``, monitored by stabmon's ``StabmonCallback``
  (stabmon/integrations/huggingface.py), a loss logged every 50 steps.

- ``vae``: pytorch/examples' VAE: an MLP encoder and decoder, Adam, a ``DataLoader`` through
  ``mon.track()``, ``BCE + KLD`` summed over the batch, ``train_loss += loss.item()``; its
  runs are short (``--vae-steps``, 300 by default), as the seed's VAE was;
- ``lbfgs``: pytorch/examples' time-sequence prediction: two ``LSTMCell`` s and a linear head
  fit to sine waves with ``LBFGS(lr=0.8)`` and ``optimizer.step(closure)`` (up to 25 forward
  and backward passes a step), a prediction under ``torch.no_grad()`` after each step; its
  runs are ``--lbfgs-steps`` (15) steps, as the example's.

The two trainer loops train a small MLP regressor (32 -> 256 -> 256 -> 1, batches of
32): the faults are injected through the trainers' own callback hooks.

Faults, each at ``fault_step``:

- ``lr_blowup``: the learning rate is multiplied by 1,000 for one step, as a bad
  schedule or a unit mistake does; expected: a ``grad_spike`` within 2 steps;
- ``leak``: the classic ``total_loss += loss`` (the tensor, graph and all) from then on;
  expected: a ``memory_leak`` within 2,000 steps;
- ``starve`` (the loops with a ``DataLoader``: ``cnn``, ``vae``): from then on, for
  ``STARVE_SECONDS`` of real time, every fourth batch waits ``STUTTER_SECONDS`` for its
  data (a starved worker pool); expected: an ``input_starvation`` within 60 s of its start;
- ``nan_grad`` (every loop but ``lbfgs``): a NaN in one inner parameter's gradient, put there
  by a gradient hook during the fault step's backward (a bad kernel, once); expected: a
  ``nonfinite_grad`` at that very step naming that parameter's module group alone
  (:data:`NAN_TARGETS`: ``blocks.1``, ``rnn.l1``, ``features``, ``model.net.2`` under both
  trainers, ``fc3``) and the parameter first; the provenance watch after it finds every
  step clean ("not reproduced");
- ``nan_backward`` (the same loops): that NaN at every backward from the fault step on (a
  broken kernel); expected: the same anomaly, and a provenance placing it in the backward
  pass at the parameter's module;
- ``nan_forward`` (not ``vae``, whose ``binary_cross_entropy`` raises on a NaN in its
  input, nor ``lbfgs``): the forward of one module (``blocks.1.mlp.0``, the ``rnn``,
  ``features.3``, ``model.net.2``) returns the log of its output from the fault step on;
  expected: a non-finite gradient and loss at that step, and a provenance naming that
  module as the producer, in the forward pass. The NaN runs end :data:`NAN_TAIL` steps after
  the fault and skip non-finite steps (see :data:`NAN_FAULTS`);
- ``clean``: nothing; expected: no anomaly of any kind.

The table gives the step of the first matching anomaly and the seconds from the fault's
first injection to it (wall time: these loops run on the real clock).
A NaN fault's cell gives the module groups its first ``nonfinite_grad`` names (and, for
the gradient faults, the first parameter) and the provenance verdict.

Usage::

    python bench/corpus.py [--steps 20000] [--fault-steps 3000] [--json out.json]

prints the detection table (fault x loop: the step of the first matching anomaly
after the fault, or ``missed``) and the false-positive count (anomalies in the clean
runs, and anomalies of another kind or before the fault in the faulty ones).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import stabmon

LOOPS = ("gpt", "lstm", "cnn", "lightning", "hf", "vae", "lbfgs")
FAULTS = ("clean", "lr_blowup", "leak", "starve")
#: The NaN faults (LOOP_FAULTS says which loops carry them): a NaN planted in one inner
#: parameter's gradient during backward at the fault step (``nan_grad``: one bad backward),
#: the same at every step from then on (``nan_backward``: a broken backward kernel), and a
#: layer whose forward takes the log of its activation, some of it zero or below, from then
#: on (``nan_forward``).
#: Their runs end :data:`NAN_TAIL` steps after the fault (every later step would be the
#: same skipped step), judge each step at the next (``judge_seconds: 0``, so the provenance
#: watch fits in that tail) and hold non-finite steps back (``on_anomaly: {nonfinite_grad:
#: skip}``), as docs/policies.md advises: applied, a NaN step puts NaN in every weight that
#: clipping touches, and the forward watched after it starts at the first layer.
NAN_FAULTS = ("nan_grad", "nan_backward", "nan_forward")
NAN_TAIL = 8
#: Which faults each loop can carry (starve needs a DataLoader; LBFGS keeps no loss; a NaN
#: in the VAE's forward stops it at once, in binary_cross_entropy's range check, and LBFGS
#: spreads a NaN gradient into every weight within its step, before any hook sees it).
LOOP_FAULTS = {
    "gpt": ("clean", "lr_blowup", "leak", *NAN_FAULTS),
    "lstm": ("clean", "lr_blowup", "leak", *NAN_FAULTS),
    "cnn": (*FAULTS, *NAN_FAULTS),
    "lightning": ("clean", "lr_blowup", "leak", *NAN_FAULTS),
    "hf": ("clean", "lr_blowup", "leak", *NAN_FAULTS),
    "vae": ("clean", "leak", "starve", "nan_grad", "nan_backward"),
    "lbfgs": ("clean", "lr_blowup"),
}
#: Steps of each run of the loops whose real runs are short (``--vae-steps``, ``--lbfgs-steps``).
SHORT_RUNS = {"vae": 300, "lbfgs": 15}
#: Where their faults are injected (a short run's leak starts early).
SHORT_FAULT_STEP = {"vae": 30, "lbfgs": 8}
#: The starving loader: every fourth batch waits this long, for this much real time.
STUTTER_SECONDS, STARVE_SECONDS = 0.4, 45.0
#: Where each loop plants its NaN faults, by the names in the user's model: the parameter
#: whose gradient ``nan_grad`` and ``nan_backward`` poison, the module whose forward
#: ``nan_forward`` breaks, and the module group (stabmon's default) the parameter is in.
NAN_TARGETS = {
    "gpt": ("blocks.1.mlp.0.weight", "blocks.1.mlp.0", "blocks.1"),
    "lstm": ("rnn.weight_hh_l1", "rnn", "rnn.l1"),
    "cnn": ("features.3.weight", "features.3", "features"),
    "lightning": ("model.net.2.weight", "model.net.2", "model.net.2"),
    "hf": ("model.net.2.weight", "model.net.2", "model.net.2"),
    "vae": ("fc3.weight", "fc22", "fc3"),
}
#: The anomaly kind each fault must raise (a NaN fault: a non-finite gradient or loss).
EXPECTED = {"lr_blowup": "grad_spike", "leak": "memory_leak", "nan_grad": "nonfinite_grad",
            "nan_backward": "nonfinite_grad", "nan_forward": "nonfinite_grad",
            "starve": "input_starvation"}  # fmt: skip
#: How many steps after the fault the detection may come.
DEADLINE = {"lr_blowup": 2, "leak": 2000, "nan_grad": 0, "nan_backward": 0, "nan_forward": 0,
            "starve": 10**9}  # fmt: skip
#: How many seconds after the fault the detection may come, where that is the limit.
DEADLINE_SECONDS = {"starve": 60.0}


@dataclass
class Outcome:
    loop: str
    fault: str
    steps: int
    fault_step: int | None
    detected_at: int | None
    false_positives: list[dict[str, Any]] = field(default_factory=list)
    #: The module groups and parameters the first nonfinite_grad anomaly names.
    named_modules: list[str] = field(default_factory=list)
    named_parameters: list[str] = field(default_factory=list)
    #: What the first matching anomaly says (its event's detail, the log line's text).
    message: str | None = None
    #: The first ``provenance`` event's verdict: the producer module (None: not reproduced),
    #: its direction ("forward", "backward") and the step it was watched at.
    producer: str | None = None
    direction: str | None = None
    provenance_step: int | None = None
    seconds: float = 0.0
    #: Seconds from the fault's first injection to the first matching anomaly.
    detected_seconds: float | None = None
    last_preclip_norm: float | None = None
    exported_grad_norm: float | None = None

    @property
    def ok(self) -> bool:
        if self.false_positives:
            return False
        if self.fault == "clean":
            return True
        return self.found and self.named_right

    @property
    def found(self) -> bool:
        """Whether the fault's anomaly came in time."""
        return (
            self.detected_at is not None
            and self.fault_step is not None
            and (self.detected_at - self.fault_step <= DEADLINE[self.fault])
            and (self.detected_seconds or 0.0) <= DEADLINE_SECONDS.get(self.fault, math.inf)
        )

    @property
    def named_right(self) -> bool:
        """Whether a NaN fault's messages say where it is: a gradient fault's anomaly names
        the planted parameter's group alone and that parameter first, and its provenance finds
        nothing in the steps after (``nan_grad``: it was one backward's) or names the
        parameter's module in the backward pass (``nan_backward``); ``nan_forward``'s
        provenance names the broken module, in the forward pass."""
        if self.fault not in NAN_FAULTS:
            return True
        param, module, group = NAN_TARGETS[self.loop]
        if self.fault == "nan_forward":
            return self.producer == module and self.direction == "forward"
        verdict = (
            (None, None) if self.fault == "nan_grad" else (param.rpartition(".")[0], "backward")
        )
        return (
            self.named_modules == [group]
            and self.named_parameters[:1] == [param]
            and self.provenance_step is not None
            and (self.producer, self.direction) == verdict
        )


class _Injector:
    """The fault, applied by the loop at each step."""

    def __init__(self, fault: str, fault_step: int) -> None:
        self.fault = fault
        self.fault_step = fault_step
        self.kept: Any = 0.0  # total_loss, as the leaky loop writes it
        #: When the fault was first injected (time.time(), as the event log's records).
        self.injected_at: float | None = None
        self._batches = 0
        #: The optimizer step the loop is in (set by the loop, read by the planted faults).
        self.step = 0

    def plant(self, model: torch.nn.Module, loop: str) -> None:
        """Plant the NaN faults in ``model`` at :data:`NAN_TARGETS`' names (the user's names):
        a gradient hook on the parameter, or the module's own ``forward`` replaced, so that
        every hook (stabmon's too) sees what a real bug would produce."""
        if self.fault not in NAN_FAULTS:
            return
        param_name, module_name, _ = NAN_TARGETS[loop]
        if self.fault in ("nan_grad", "nan_backward"):
            model.get_parameter(param_name).register_hook(self._poison_grad)
            return
        module = model.get_submodule(module_name)
        forward = module.forward

        def log_of_zero(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            if self.step < self.fault_step:
                return out
            self._injected()
            first = out[0] if isinstance(out, tuple) else out
            first = torch.log(first)  # a log of an activation, some of it <= 0: NaN, -inf
            return (first, *out[1:]) if isinstance(out, tuple) else first

        module.forward = log_of_zero

    def _poison_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.step < self.fault_step or (
            self.fault == "nan_grad" and self.step > self.fault_step
        ):
            return None
        self._injected()
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")  # a bad kernel in one block's backward
        return grad

    def _injected(self) -> None:
        if self.injected_at is None:
            self.injected_at = time.time()

    def fetched(self, step: int) -> None:
        """Called by a starving loader's data set for each batch it makes (in the fetch)."""
        if self.fault != "starve" or step < self.fault_step:
            return
        self._injected()
        assert self.injected_at is not None
        self._batches += 1
        if self._batches % 4 == 0 and time.time() - self.injected_at < STARVE_SECONDS:
            time.sleep(STUTTER_SECONDS)  # a starved worker pool: this batch comes late

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Called before ``optimizer.step()``; returns what to call after it."""
        if self.fault == "lr_blowup" and step == self.fault_step:
            self._injected()
            saved = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * 1000.0

            def restore() -> None:
                for group, lr in zip(optimizer.param_groups, saved, strict=True):
                    group["lr"] = lr

            return restore
        return _nothing

    def after_loss(self, step: int, loss: torch.Tensor) -> None:
        """Called after each backward (each micro-batch's, under accumulation)."""
        if self.fault == "leak" and step >= self.fault_step:
            self._injected()
            self.kept = self.kept + loss  # the bug: the graph of every step is kept


def _nothing() -> None:
    return None


# --- gpt: nanoGPT-style ----------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(
        self, vocab: int = 64, width: int = 32, layers: int = 2, context: int = 32
    ) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.Sequential(*[_Block(width, 4) for _ in range(layers)])
        self.ln_f = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _text(vocab: int, length: int, seed: int) -> torch.Tensor:
    """A learnable token stream: a noisy cyclic pattern."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.arange(length) % vocab
    noise = torch.randint(0, vocab, (length,), generator=generator)
    keep = torch.rand(length, generator=generator) < 0.9
    return torch.where(keep, base, noise)


def run_gpt(monitor_config: dict[str, Any], steps: int, injector: _Injector,
            eval_every: int = 500) -> Outcome:  # fmt: skip
    torch.manual_seed(0)
    data = _text(64, 50_000, 0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    mon = stabmon.attach(model, optimizer, **monitor_config)
    generator = torch.Generator().manual_seed(1)
    injector.plant(model, "gpt")

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - 33, (8,), generator=generator)
        x = torch.stack([data[i : i + 32] for i in ix])
        y = torch.stack([data[i + 1 : i + 33] for i in ix])
        return x, y

    accumulation = 4
    with mon.data_wait():
        x, y = get_batch()
    preclip = None
    for step in range(steps):
        injector.step = step
        if step and step % eval_every == 0:
            model.eval()
            with torch.no_grad():  # evaluation without mon.phase, as nanoGPT's estimate_loss
                for _ in range(5):
                    ex, ey = get_batch()
                    model(ex, ey)
            model.train()
        total = torch.zeros(())
        for _ in range(accumulation):
            loss = model(x, y) / accumulation
            with mon.data_wait():  # the next micro-batch, fetched before backward (nanoGPT)
                x, y = get_batch()
            loss.backward()
            total += loss.detach()
            injector.after_loss(step, loss)
        if step == steps - 1:
            preclip = float(torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None]))  # fmt: skip
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        restore = injector.before_step(step, optimizer)
        optimizer.step()
        restore()
        optimizer.zero_grad(set_to_none=True)
        mon.observe(loss=total)
    return _finish(mon, "gpt", steps, injector, preclip)


# --- lstm: pytorch/examples word_language_model ----------------------------------------------


class LSTMLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, width: int = 64) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(vocab, width)
        self.rnn = torch.nn.LSTM(width, width, 2, dropout=0.2)
        self.decoder = torch.nn.Linear(width, vocab)

    def forward(
        self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        output, hidden = self.rnn(self.encoder(x), hidden)
        return self.decoder(output), hidden


def run_lstm(monitor_config: dict[str, Any], steps: int, injector: _Injector) -> Outcome:
    torch.manual_seed(0)
    bptt, batch = 20, 10
    data = _text(64, 40_000, 1)
    source = data[: len(data) // batch * batch].view(batch, -1).t().contiguous()
    model = LSTMLM()
    lr = 20.0
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)  # the example updates by hand
    mon = stabmon.attach(model, optimizer, **monitor_config)
    injector.plant(model, "lstm")

    def get_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = min(bptt, len(source) - 1 - i)
        return source[i : i + length], source[i + 1 : i + 1 + length].reshape(-1)

    step = 0
    preclip = None
    while step < steps:
        hidden = (torch.zeros(2, batch, 64), torch.zeros(2, batch, 64))
        for i in range(0, source.size(0) - 1, bptt):
            if step >= steps:
                break
            injector.step = step
            with mon.data_wait():
                x, y = get_batch(i)
            hidden = (hidden[0].detach(), hidden[1].detach())  # repackage_hidden
            model.zero_grad()
            output, hidden = model(x, hidden)
            loss = F.cross_entropy(output.view(-1, 64), y)
            loss.backward()
            injector.after_loss(step, loss)
            if step == steps - 1:
                preclip = float(torch.nn.utils.get_total_norm(
                    [p.grad for p in model.parameters() if p.grad is not None]))  # fmt: skip
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            restore = injector.before_step(step, optimizer)
            optimizer.step()
            restore()
            mon.observe(loss=loss.detach())
            step += 1
        mon.epoch_end()
    return _finish(mon, "lstm", steps, injector, preclip)


# --- cnn: a classifier with a DataLoader -----------------------------------------------------


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = torch.nn.Linear(16 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def _images(count: int, seed: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (count,), generator=generator)
    images = torch.randn(count, 1, 16, 16, generator=generator)
    for k in range(4):  # a faintly brighter quadrant per class: learnable, never trivially
        rows, cols = divmod(k, 2)
        images[labels == k, :, rows * 8 : rows * 8 + 8, cols * 8 : cols * 8 + 8] += 0.15
    flip = torch.rand(count, generator=generator) < 0.2  # label noise keeps the loss up
    labels = torch.where(flip, torch.randint(0, 4, (count,), generator=generator), labels)
    return torch.utils.data.TensorDataset(images, labels)


def _collate(injector: _Injector, step: list[int]) -> Callable[[list[Any]], Any]:
    """The default collate, with the starving loader's stutter inside the fetch."""

    def collate(batch: list[Any]) -> Any:
        injector.fetched(step[0])
        return torch.utils.data.default_collate(batch)

    return collate


def run_cnn(monitor_config: dict[str, Any], steps: int, injector: _Injector) -> Outcome:
    torch.manual_seed(0)
    at = [0]  # the step the loader fetches for
    loader = torch.utils.data.DataLoader(_images(2048, 2), batch_size=32, shuffle=True,
                                         collate_fn=_collate(injector, at))  # fmt: skip
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mon = stabmon.attach(model, optimizer, **monitor_config)
    injector.plant(model, "cnn")
    step = 0
    preclip = None
    while step < steps:
        model.train()
        at[0] = step
        for images, labels in mon.track(loader):
            if step >= steps:
                break
            injector.step = step
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            injector.after_loss(step, loss)
            if step == steps - 1:
                preclip = float(torch.nn.utils.get_total_norm(
                    [p.grad for p in model.parameters() if p.grad is not None]))  # fmt: skip
            restore = injector.before_step(step, optimizer)
            optimizer.step()
            restore()
            mon.observe(loss=loss.detach())
            step += 1
            at[0] = step
    return _finish(mon, "cnn", steps, injector, preclip)


# --- vae: pytorch/examples' VAE, a short run --------------------------------------------------


class VAE(torch.nn.Module):
    def __init__(self, pixels: int = 784, hidden: int = 400, latent: int = 20) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(pixels, hidden)
        self.fc21, self.fc22 = torch.nn.Linear(hidden, latent), torch.nn.Linear(hidden, latent)
        self.fc3, self.fc4 = torch.nn.Linear(latent, hidden), torch.nn.Linear(hidden, pixels)
        self.pixels = pixels

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h1 = F.relu(self.fc1(x.view(-1, self.pixels)))
        mu, logvar = self.fc21(h1), self.fc22(h1)
        z = mu + torch.randn_like(logvar) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def run_vae(monitor_config: dict[str, Any], steps: int, injector: _Injector) -> Outcome:
    torch.manual_seed(0)
    # 28x28 "digits" in [0, 1]: four blurred strokes, as MNIST's pixels are mostly 0 or near 1.
    generator = torch.Generator().manual_seed(3)
    strokes = torch.rand(4096, 1, 7, 7, generator=generator) < 0.25
    images = F.interpolate(strokes.float(), size=(28, 28), mode="bilinear").clamp(0, 1)
    at = [0]
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(images), batch_size=128, shuffle=True,
        collate_fn=_collate(injector, at),
    )  # fmt: skip
    model = VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    mon = stabmon.attach(model, optimizer, **monitor_config)
    injector.plant(model, "vae")
    step, train_loss = 0, 0.0
    while step < steps:
        model.train()
        at[0] = step
        for (data,) in mon.track(loader):
            if step >= steps:
                break
            injector.step = step
            optimizer.zero_grad()
            recon, mu, logvar = model(data)
            bce = F.binary_cross_entropy(recon, data.view(-1, model.pixels), reduction="sum")
            loss = bce - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
            loss.backward()
            injector.after_loss(step, loss)  # leak: train_loss += loss, the tensor
            train_loss += loss.item()
            restore = injector.before_step(step, optimizer)
            optimizer.step()
            restore()
            mon.observe(loss=loss.detach())
            step += 1
            at[0] = step
    return _finish(mon, "vae", steps, injector, None)


# --- lbfgs: pytorch/examples' time-sequence prediction ----------------------------------------


class Sequence(torch.nn.Module):
    def __init__(self, width: int = 51) -> None:
        super().__init__()
        self.width = width
        self.lstm1, self.lstm2 = torch.nn.LSTMCell(1, width), torch.nn.LSTMCell(width, width)
        self.linear = torch.nn.Linear(width, 1)

    def forward(self, inputs: torch.Tensor, future: int = 0) -> torch.Tensor:
        outputs = []
        h_t = c_t = h_t2 = c_t2 = torch.zeros(inputs.size(0), self.width, dtype=inputs.dtype)
        output = torch.zeros(inputs.size(0), 1, dtype=inputs.dtype)
        for input_t in inputs.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs.append(output)
        for _ in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs.append(output)
        return torch.cat(outputs, dim=1)


def run_lbfgs(monitor_config: dict[str, Any], steps: int, injector: _Injector) -> Outcome:
    torch.manual_seed(0)
    t = torch.arange(100.0).view(1, 100) + torch.randint(-16, 16, (24, 1)).float()
    wave = torch.sin(t / 5.0)
    inputs, target = wave[3:, :-1], wave[3:, 1:]
    test_input, test_target = wave[:3, :-1], wave[:3, 1:]
    seq = Sequence()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8)
    mon = stabmon.attach(seq, optimizer, **monitor_config)
    injector.plant(seq, "lbfgs")
    for step in range(steps):
        injector.step = step

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.mse_loss(seq(inputs), target)
            loss.backward()
            return loss

        restore = injector.before_step(step, optimizer)
        loss = optimizer.step(closure)
        restore()
        mon.observe(loss=loss)
        with torch.no_grad():  # the example predicts after each step
            future = 20
            pred = seq(test_input, future=future)
            F.mse_loss(pred[:, :-future], test_target)
    return _finish(mon, "lbfgs", steps, injector, None)


# --- lightning and hf: the real trainers, through stabmon's adapters --------------------------


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def _regression_data(count: int, seed: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(count, 32, generator=generator)
    noise = 0.1 * torch.randn(count, 1, generator=generator)  # keeps the loss off zero
    return torch.utils.data.TensorDataset(inputs, inputs[:, :8].sum(1, keepdim=True) * 0.3 + noise)


@dataclass
class _Capture:
    """What a trainer loop reads off its Monitor at train end, before the adapter detaches it."""

    exported: float | None = None
    path: Path | None = None
    preclip: float | None = None

    def take(self, mon: stabmon.Monitor | None) -> None:
        if mon is None:
            return
        mon.state_dict()  # judges the results still waiting: the export is the last step's
        self.exported = _exported_grad_norm(mon)
        self.path = mon.event_log_path


def run_lightning(monitor_config: dict[str, Any], steps: int, injector: _Injector) -> Outcome:
    import pytorch_lightning as pl

    from stabmon.integrations.pytorch_lightning import StabmonCallback

    capture = _Capture()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _Regressor()
            self.restore: Callable[[], None] = _nothing
            injector.plant(self, "lightning")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            injector.step = self.trainer.global_step
            inputs, targets = batch
            loss = F.mse_loss(self.model(inputs), targets)
            injector.after_loss(self.trainer.global_step, loss)
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            step = self.trainer.global_step  # Lightning clips after this hook
            if step == steps - 1:
                capture.preclip = float(torch.nn.utils.get_total_norm(
                    [p.grad for p in self.parameters() if p.grad is not None]))  # fmt: skip
            self.restore = injector.before_step(step, optimizer)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.restore()
            self.restore = _nothing

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    callback = StabmonCallback(**monitor_config)

    class Capture(pl.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            capture.take(callback.monitors[0] if callback.monitors else None)

    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, callbacks=[Capture(), callback],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=monitor_config["run_dir"],
        num_sanity_val_steps=0, gradient_clip_val=0.5, accumulate_grad_batches=2,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(_regression_data(8192, 3), batch_size=32, shuffle=True)
    trainer.fit(Module(), loader)
    return _outcome("lightning", steps, injector, capture)


def run_hf(monitor_config: dict[str, Any], steps: int, injector: _Injector) -> Outcome:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from stabmon.integrations.huggingface import StabmonCallback

    capture = _Capture()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = _Regressor()
            injector.plant(self, "hf")

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            loss = F.mse_loss(self.model(x), labels)
            if self.training:
                injector.after_loss(injector.step, loss)
            return {"loss": loss}

    class Dataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self) -> None:
            self.data = _regression_data(8192, 3)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            x, y = self.data[index]
            return {"x": x, "labels": y}

    callback = StabmonCallback(**monitor_config)

    class Probe(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.restore: Callable[[], None] = _nothing

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            injector.step = state.global_step

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.restore = injector.before_step(state.global_step, kw["optimizer"])

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.restore()
            self.restore = _nothing

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "grad_norm" in logs and state.global_step == steps:
                capture.preclip = float(logs["grad_norm"])  # clip_grad_norm_'s total, pre-clip

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            capture.take(callback.monitor)

    logging_steps = 50 if steps % 50 == 0 else steps  # the last step's log holds its norm
    args = transformers.TrainingArguments(
        output_dir=str(Path(monitor_config["run_dir"]) / "hf-out"), max_steps=steps,
        per_device_train_batch_size=32, gradient_accumulation_steps=2, learning_rate=0.01,
        lr_scheduler_type="constant", max_grad_norm=0.5, logging_steps=logging_steps,
        report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no",
        dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=Model(), args=args, train_dataset=Dataset(),
                                   callbacks=[Probe(), callback])  # fmt: skip
    trainer.train()
    return _outcome("hf", steps, injector, capture)


RUNNERS: dict[str, Callable[[dict[str, Any], int, _Injector], Outcome]] = {
    "gpt": run_gpt,
    "lstm": run_lstm,
    "cnn": run_cnn,
    "lightning": run_lightning,
    "hf": run_hf,
    "vae": run_vae,
    "lbfgs": run_lbfgs,
}


def _finish(
    mon: stabmon.Monitor, loop: str, steps: int, injector: _Injector, preclip: float | None
) -> Outcome:
    capture = _Capture(preclip=preclip)
    capture.take(mon)
    mon.detach()
    return _outcome(loop, steps, injector, capture)


def _outcome(loop: str, steps: int, injector: _Injector, capture: _Capture) -> Outcome:
    exported, path, preclip = capture.exported, capture.path, capture.preclip
    fault = injector.fault
    fault_step = None if fault == "clean" else injector.fault_step
    outcome = Outcome(loop, fault, steps, fault_step, None, last_preclip_norm=preclip,
                      exported_grad_norm=exported)  # fmt: skip
    for event in _events(path):
        if event.get("event") == "provenance":
            if outcome.provenance_step is None:
                outcome.producer, outcome.direction = event["producer"], event["direction"]
                outcome.provenance_step = int(event["observed_step"])
            continue
        if event.get("event") != "anomaly":
            continue
        kind, step = event["kind"], int(event["step"])
        expected = {EXPECTED.get(fault), "nonfinite_grad"}
        if fault in NAN_FAULTS:
            expected.add("nonfinite_loss")  # the NaN reaches the loss too: one incident
        if fault_step is not None and kind in expected and step >= fault_step:
            # A blow-up that reaches Inf/NaN at once is reported as non-finite: also found.
            if outcome.detected_at is None:
                outcome.detected_at, outcome.message = step, event.get("detail")
                if injector.injected_at is not None and "time" in event:
                    outcome.detected_seconds = round(event["time"] - injector.injected_at, 1)
            if kind == "nonfinite_grad" and not outcome.named_modules:
                outcome.named_modules = list(event.get("modules") or [])
                outcome.named_parameters = list(event.get("parameters") or [])
            continue
        if (
            fault == "lr_blowup"
            and fault_step is not None
            and step > fault_step
            and kind in ("loss_spike", "nonfinite_loss")
        ):
            continue  # the same incident seen in the loss too
        outcome.false_positives.append({"kind": kind, "step": step, "detail": event.get("detail")})
    return outcome


def _exported_grad_norm(mon: stabmon.Monitor) -> float | None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(mon.registry).decode()
    for family in text_string_to_metric_families(text):
        if family.name == "stabmon_grad_norm":
            return float(family.samples[0].value) if family.samples else None
    return None


def _events(path: Path | None) -> Iterator[dict[str, Any]]:
    if path is None:
        return
    for line in Path(path).read_text().splitlines():
        yield json.loads(line)


def run(loop: str, fault: str, steps: int, fault_step: int, run_dir: str) -> Outcome:
    if fault not in LOOP_FAULTS[loop]:
        raise ValueError(
            f"the {loop} loop carries no {fault} fault (LOOP_FAULTS: {LOOP_FAULTS[loop]})"
        )
    config = {"serve_metrics": False, "run_dir": run_dir, "run_id": f"{loop}-{fault}",
              "judge_seconds": 0.2, "stall_seconds": 120.0}  # fmt: skip
    if fault in NAN_FAULTS:
        config["on_anomaly"] = {"nonfinite_grad": "skip"}  # keeps the NaN out of the weights
        config["judge_seconds"] = 0.0  # each step judged at the next: verdicts in the short tail
    start = time.perf_counter()
    outcome = RUNNERS[loop](config, steps, _Injector(fault, fault_step))
    outcome.seconds = time.perf_counter() - start
    return outcome


def run_alone(
    loop: str, fault: str, steps: int, fault_step: int, timeout: float = 1800.0
) -> Outcome:
    """:func:`run` in a process of its own, as a training script runs: a leak is judged on
    the process's RSS, which memory freed by an earlier run (or a test before it, in a
    pytest worker) would hide until it is used up; detector state cannot carry over."""
    done = subprocess.run(
        [sys.executable, __file__, "--one", loop, fault, str(steps), str(fault_step)],
        capture_output=True, text=True, check=False, timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"corpus run {loop}/{fault} exited {done.returncode}:\n{done.stderr}")
    return Outcome(**json.loads(done.stdout.strip().splitlines()[-1]))


def table(outcomes: list[Outcome]) -> str:
    loops = sorted({o.loop for o in outcomes}, key=lambda name: (LOOPS + (name,)).index(name))
    lines = ["| fault \\ loop | " + " | ".join(loops) + " |",
             "|---" * (len(loops) + 1) + "|"]  # fmt: skip
    for fault in (*FAULTS, *NAN_FAULTS):
        if not any(o.fault == fault for o in outcomes):
            continue  # a fault this run left out: no row
        cells = []
        for loop in loops:
            found = [o for o in outcomes if o.loop == loop and o.fault == fault]
            if not found:
                cells.append("-")
                continue
            o = found[0]
            if fault == "clean":
                cells.append(f"{len(o.false_positives)} anomalies in {o.steps} steps")
            elif o.detected_at is None:
                cells.append(f"missed (fault at {o.fault_step})")
            elif fault in NAN_FAULTS:
                cells.append(_nan_cell(o))
            else:
                assert o.fault_step is not None
                seconds = "" if o.detected_seconds is None else f", {o.detected_seconds:.1f} s"
                cells.append(f"step {o.detected_at} (fault {o.fault_step}, "
                             f"+{o.detected_at - o.fault_step}{seconds})")  # fmt: skip
        lines.append(f"| {fault} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _nan_cell(o: Outcome) -> str:
    """A NaN fault's cell: its step, the group and parameter it names, the producer."""
    assert o.detected_at is not None and o.fault_step is not None
    where = ", ".join(o.named_modules) or "no group"
    first = f" ({o.named_parameters[0]})" if o.fault != "nan_forward" and o.named_parameters else ""
    verdict = "no provenance event"
    if o.producer is not None:
        verdict = f"producer {o.producer} ({o.direction})"
    elif o.provenance_step is not None:
        verdict = "not reproduced"
    return f"step {o.detected_at} (+{o.detected_at - o.fault_step}): {where}{first}; {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20_000, help="steps of each clean run")
    parser.add_argument("--fault-steps", type=int, default=3_000, help="steps of each faulty run")
    parser.add_argument("--fault-step", type=int, default=600)
    parser.add_argument("--vae-steps", type=int, default=SHORT_RUNS["vae"])
    parser.add_argument("--lbfgs-steps", type=int, default=SHORT_RUNS["lbfgs"])
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--faults", default=",".join((*FAULTS, *NAN_FAULTS)))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", nargs=4, metavar=("LOOP", "FAULT", "STEPS", "FAULT_STEP"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.one:  # one run in this process (run_alone), its outcome as JSON on the last line
        loop, fault, steps, fault_step = args.one
        with tempfile.TemporaryDirectory() as run_dir:
            outcome = run(loop, fault, int(steps), int(fault_step), run_dir)
        print(json.dumps(outcome.__dict__))
        return 0
    outcomes: list[Outcome] = []
    for loop in args.loops.split(","):
        for fault in args.faults.split(","):
            if fault not in LOOP_FAULTS.get(loop, ()):
                continue
            steps = args.steps if fault == "clean" else args.fault_steps
            fault_step = args.fault_step
            if loop in SHORT_RUNS:  # runs as short as the real ones
                steps = {"vae": args.vae_steps, "lbfgs": args.lbfgs_steps}[loop]
                fault_step = SHORT_FAULT_STEP[loop]
            if fault in NAN_FAULTS:  # every step after the fault is the same skipped step
                steps = min(steps, fault_step + NAN_TAIL)
            outcome = run_alone(loop, fault, steps, fault_step)
            outcomes.append(outcome)
            print(f"{loop:5s} {fault:9s} {outcome.steps:6d} steps in {outcome.seconds:6.1f} s: "
                  f"detected at {outcome.detected_at} ({outcome.detected_seconds} s), "
                  f"false positives "
                  f"{outcome.false_positives[:3]}, pre-clip {outcome.last_preclip_norm} "
                  f"exported {outcome.exported_grad_norm}", flush=True)  # fmt: skip
    print()
    print(table(outcomes))
    false_positives = sum(len(o.false_positives) for o in outcomes)
    print(f"\nfalse positives: {false_positives} "
          f"(over {sum(o.steps for o in outcomes)} steps)")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps([o.__dict__ for o in outcomes], indent=2, default=str))
    return 0 if all(o.ok for o in outcomes) and not math.isnan(false_positives) else 1


if __name__ == "__main__":
    sys.exit(main())
