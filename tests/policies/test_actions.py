"""stabmon.policies.actions: the plan read from on_anomaly, and how each kind reads."""

from __future__ import annotations

import pytest

from stabmon.config import load_config
from stabmon.errors import ConfigError
from stabmon.policies.actions import BEFORE_STEP, OUTCOMES, Plan, outcome


def _plan(**actions: object) -> Plan | None:
    return Plan.from_config(load_config(overrides={"on_anomaly": actions}, env={}).on_anomaly)


def test_no_plan_when_every_action_is_none() -> None:
    assert _plan() is None


def test_the_plan_keeps_acting_kinds_in_one_sorted_order_every_rank_shares() -> None:
    plan = _plan(loss_spike="stop", grad_spike="skip", nonfinite_grad="lr_scale",
                 lr_scale_factor=0.5, lr_scale_steps=7)  # fmt: skip

    assert plan is not None
    assert plan.kinds == ("grad_spike", "loss_spike", "nonfinite_grad")
    assert plan.before_step == ("grad_spike", "nonfinite_grad")
    assert plan.judged_late == ("loss_spike",)
    assert (plan.lr_factor, plan.lr_steps) == (0.5, 7)
    assert plan.slot("loss_spike") == 1 and plan.slot("stall") is None


@pytest.mark.parametrize(
    ("actions", "device_flag", "reads"),
    [
        ({"grad_spike": "skip"}, True, False),  # fused: the flag stays on the device
        ({"grad_spike": "skip"}, False, True),  # the gradients are held back: host decides
        ({"nonfinite_grad": "stop"}, True, True),  # a raise needs the host
        ({"loss_spike": "stop"}, False, False),  # late kinds: read a step later
    ],
)
def test_the_host_reads_every_step_only_where_it_must(
    actions: dict[str, str], device_flag: bool, reads: bool
) -> None:
    plan = _plan(**actions)
    assert plan is not None and plan.reads_every_step(device_flag) is reads


@pytest.mark.parametrize(
    ("kind", "action"),
    [("nonfinite_loss", "skip"), ("replica_mismatch", "checkpoint"), ("stall", "lr_scale"),
     ("loss_spike", "skip")],
)  # fmt: skip
def test_an_action_a_kind_cannot_take_is_a_config_error_naming_what_it_can(
    kind: str, action: str
) -> None:
    with pytest.raises(ConfigError, match=rf"on_anomaly\.{kind} .*expected one of 'none'"):
        _plan(**{kind: action})


def test_replica_mismatch_is_accepted() -> None:
    plan = _plan(replica_mismatch="stop")
    assert plan is not None and plan.actions == {"replica_mismatch": "stop"}


def test_every_kind_reads_in_the_resiliency_vocabulary() -> None:
    for kind, result in OUTCOMES.items():
        assert result.failure_domain in ("workload", "infrastructure", "unknown"), kind
        assert result.on_stop in ("stop", "restart"), kind
    assert outcome("replica_mismatch").failure_domain == "infrastructure"
    assert outcome("someones_own_kind").failure_domain == "unknown"
    assert set(BEFORE_STEP) <= set(OUTCOMES)
