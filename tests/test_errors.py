"""stabmon.errors: the exception tree drawn in its docstring, and ConfigError's facts."""

from __future__ import annotations

import pytest

from stabmon import errors
from stabmon.errors import (
    AlreadyAttachedError,
    AnomalyStop,
    ConfigError,
    DeviceMismatchError,
    StabmonError,
    TrainingStalled,
)


@pytest.mark.parametrize(
    ("error", "also"),
    [
        (ConfigError, ValueError),
        (AlreadyAttachedError, Exception),
        (DeviceMismatchError, RuntimeError),
        (TrainingStalled, RuntimeError),
        (AnomalyStop, RuntimeError),
    ],
)
def test_every_error_is_a_stabmon_error_and_the_builtin_its_callers_expect(
    error: type[Exception], also: type[Exception]
) -> None:
    assert issubclass(error, StabmonError)
    assert issubclass(error, also)


def test_the_docstring_tree_names_every_exported_error() -> None:
    doc = errors.__doc__ or ""
    for name in errors.__all__:
        assert name in doc


def test_config_error_reads_key_in_source_colon_problem_and_keeps_the_facts() -> None:
    error = ConfigError("must be >= 0, got -1", key="port", source="overrides", allowed=">= 0")
    assert str(error) == "port in overrides: must be >= 0, got -1"
    assert (error.key, error.source, error.allowed, error.problem) == (
        "port",
        "overrides",
        ">= 0",
        "must be >= 0, got -1",
    )


def test_config_error_without_a_key_names_only_the_source() -> None:
    assert str(ConfigError("not a YAML mapping", key=None, source="/etc/stabmon.yaml")) == (
        "/etc/stabmon.yaml: not a YAML mapping"
    )


def test_training_stalled_says_where_the_evidence_is_by_default() -> None:
    assert "event log" in str(TrainingStalled())
    assert str(TrainingStalled("custom")) == "custom"


def test_anomaly_stop_carries_kind_step_and_rank_and_survives_a_pickle() -> None:
    import pickle

    stop = AnomalyStop("grad_spike", 301, 2, anomaly_step=300)
    copy = pickle.loads(pickle.dumps(stop))

    assert (copy.kind, copy.step, copy.rank, copy.anomaly_step) == ("grad_spike", 301, 2, 300)
    assert "verdict.json" in str(copy) and "on_anomaly.grad_spike" in str(copy)
