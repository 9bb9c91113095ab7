"""A poisoned model is one incident, not one record per step; dead branches are anomalies."""

from __future__ import annotations

import torch

from stabmon.detectors.episodes import Episodes
from tests.conftest import MonitorFactory
from tests.helpers import events, scrape, value


class TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        self.aux = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x)) + 0.0 * self.aux(x).detach()


def _step(model: TwoBranches, optimizer: torch.optim.Optimizer, poison: bool) -> None:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    if poison:  # the encoder and the head went non-finite; aux has no gradient at all
        model.encoder.weight.grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
        model.head.bias.grad.fill_(float("inf"))  # type: ignore[union-attr]
    saved = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    if poison:  # undone, as a skipping GradScaler would: the run is clean again afterwards
        with torch.no_grad():
            for param, copy in zip(model.parameters(), saved, strict=True):
                param.copy_(copy)
    optimizer.zero_grad()


def test_a_poisoned_run_records_one_nonfinite_episode_naming_every_module_group(
    attach: MonitorFactory,
) -> None:
    model = TwoBranches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0, spike_episode_gap=5)
    for step in range(40):
        _step(model, optimizer, poison=10 <= step < 30)
    samples = scrape(monitor.metrics_url)
    path = monitor.event_log_path
    monitor.detach()
    records = events(path)
    anomalies = [
        e for e in records if e.get("event") == "anomaly" and e.get("kind") == "nonfinite_grad"
    ]
    assert [(e["step"], e["modules"]) for e in anomalies] == [(10, ["encoder", "head"])]
    (end,) = [e for e in records if e["event"] == "nonfinite_grad_end"]
    assert (end["first_step"], end["last_step"], end["count"]) == (10, 29, 20)
    assert value(samples, "stabmon_nonfinite_grad_steps_total") == 20
    assert value(samples, "stabmon_anomalies_total", kind="nonfinite_grad") == 1


def test_a_dead_branch_is_one_dead_grad_anomaly_naming_its_module_group(
    attach: MonitorFactory,
) -> None:
    model = TwoBranches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, judge_seconds=0, dead_grad_steps=10)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_anomalies_total", kind="dead_grad") == 0  # 0 from the start
    for _ in range(40):
        _step(model, optimizer, poison=False)
    samples = scrape(monitor.metrics_url)
    assert value(samples, "stabmon_anomalies_total", kind="dead_grad") == 1
    (anomaly,) = [e for e in events(monitor.event_log_path) if e.get("kind") == "dead_grad"]
    assert anomaly["modules"] == ["aux"]


def test_episodes_end_after_the_gap_and_a_new_bad_value_starts_another() -> None:
    episodes = Episodes(gap=2)
    values = [1, 1, 0, 1, 0, 0, 1]
    changes = [c for step, bad in enumerate(values) if (c := episodes.update(step, bad=bool(bad)))]
    starts = [c.first_step for c in changes if c.started]
    ends = [(c.first_step, c.count, c.last_step) for c in changes if not c.started]
    assert starts == [0, 6]
    assert ends == [(0, 3, 3)]


def _loss_anomalies(attach: MonitorFactory, losses: list[float]) -> list[tuple[str, int]]:
    model = TwoBranches()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = attach(model, optimizer, judge_seconds=0, spike_warmup_steps=20)
    for loss in losses:
        _step(model, optimizer, poison=False)
        monitor.observe(loss=loss)
    path = monitor.event_log_path
    monitor.detach()
    return [
        (e["kind"], e["step"])
        for e in events(path)
        if e.get("event") == "anomaly" and e.get("kind") == "loss_spike"
    ]


def _noisy(count: int) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    return (0.5 + 0.01 * torch.randn(count, generator=generator)).tolist()


def test_one_hard_batch_a_few_times_the_mean_is_no_loss_spike(attach: MonitorFactory) -> None:
    losses = _noisy(60)
    losses[40] = 2.0  # 4x: a batch full of flipped labels
    assert _loss_anomalies(attach, losses) == []


def test_a_rise_that_persists_is_a_loss_spike_at_its_first_step(attach: MonitorFactory) -> None:
    losses = _noisy(60)
    losses[40] = losses[41] = 2.0
    assert _loss_anomalies(attach, losses) == [("loss_spike", 40)]


def test_a_loss_ten_times_the_mean_is_a_spike_at_once(attach: MonitorFactory) -> None:
    losses = _noisy(60)
    losses[40] = 500.0  # a corrupt batch
    assert _loss_anomalies(attach, losses) == [("loss_spike", 40)]


def test_a_hard_batch_followed_by_an_ordinary_noisy_one_is_no_loss_spike(
    attach: MonitorFactory,
) -> None:
    generator = torch.Generator().manual_seed(1)
    losses = (0.5 + 0.2 * torch.randn(60, generator=generator)).abs().tolist()
    losses[40], losses[41] = 3.0, 0.8  # 0.8 is 1.6x the mean, but within the batch noise
    assert _loss_anomalies(attach, losses) == []
