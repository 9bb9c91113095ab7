"""stabmon.probes.grad_layout: read-back per-tensor norms summed the way a hand computation
does, NaN kept in its own group, offenders named in model order, both code paths of the
group sums (plain Python for a few tensors, numpy past them)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stabmon.probes.grad_layout import GradLayout


def _layout(groups: tuple[str, ...], group_of: list[int], **kwargs: object) -> GradLayout:
    names = [f"p{i}" for i in range(len(group_of))]
    settings: dict[str, object] = {
        "names": names,
        "model_order": list(range(len(group_of))),
        "empty_shards": (),
    }
    settings.update(kwargs)
    return GradLayout(groups, group_of, None, None, **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("tensors", [4, 200])  # below and above the numpy crossover
def test_grad_layout_group_norms_are_the_l2_norm_of_each_group(tensors: int) -> None:
    group_of = [i % 2 for i in range(tensors)]
    norms = [float(i + 1) for i in range(tensors)]
    layout = _layout(("a", "b"), group_of)
    summary = layout.summarize(norms)
    expected_a = math.sqrt(sum(n * n for n, g in zip(norms, group_of, strict=True) if g == 0))
    expected_b = math.sqrt(sum(n * n for n, g in zip(norms, group_of, strict=True) if g == 1))
    assert summary.group_norms == {
        "a": pytest.approx(expected_a),
        "b": pytest.approx(expected_b),
    }
    assert summary.total_norm == pytest.approx(math.sqrt(sum(n * n for n in norms)))


def test_grad_layout_keeps_a_nan_in_its_own_group_and_names_offenders_in_model_order() -> None:
    layout = _layout(
        ("encoder", "head"), [0, 0, 1], names=["enc.b", "enc.a", "head.w"], model_order=[1, 0, 2]
    )
    summary = layout.summarize([math.nan, math.inf, 2.0])
    assert summary.nonfinite
    assert math.isnan(summary.group_norms["encoder"]) or math.isinf(summary.group_norms["encoder"])
    assert summary.group_norms["head"] == 2.0
    assert layout.nonfinite_offenders(summary) == ["enc.a", "enc.b"]  # model order, not packed


def test_grad_layout_counts_zero_gradients_but_not_empty_shards() -> None:
    layout = _layout(("a",), [0, 0, 0], empty_shards=(2,))
    summary = layout.summarize([0.0, 1.0, 0.0])
    assert summary.zero_grad_params == 1  # position 2 is a shard this rank holds nothing of
    assert not summary.nonfinite


def test_grad_layout_splits_replicated_and_weighted_sharded_squares() -> None:
    layout = GradLayout(
        ("a",), [0, 0], np.array([0, 1], dtype=np.intp), np.array([1.0, 0.5]),
        names=["rep", "shard"], model_order=[0, 1], empty_shards=(),
    )  # fmt: skip
    replicated, sharded = layout.summarize([3.0, 4.0]).placement_squares
    assert (replicated, sharded) == (9.0, 8.0)  # the shard held by two ranks: half of 16
