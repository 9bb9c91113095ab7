"""A replica mismatch's message says where (groups, ranks, hosts and GPUs) and what to do;
the local-norm outlier rule names a rank only when it stands far out."""

from __future__ import annotations

from stabmon.detectors.replica import (
    ReplicaVerdict,
    grad_outliers,
    mismatch_message,
    outlier_message,
)


def test_the_message_names_the_culprit_its_gpu_and_its_group_and_says_what_to_do() -> None:
    verdict = ReplicaVerdict(
        step=59, groups=["blocks.1"], majority=True, culprits={2: "blocks.1"},
        where={2: "node-7 GPU-1234"}, replicas=4, how="DDP",
    )  # fmt: skip
    message = mismatch_message(verdict, rank=0)
    assert "after step 59" in message and "blocks.1" in message
    assert "rank 2 (node-7 GPU-1234, first in blocks.1)" in message
    assert "before the next checkpoint save" in message and "drain that node" in message


def test_without_a_majority_the_message_says_no_culprit_can_be_named() -> None:
    verdict = ReplicaVerdict(step=9, groups=["head"], majority=False, replicas=2, how="DDP")
    message = mismatch_message(verdict, rank=1)
    assert "no majority" in message and "either one may be wrong" in message


def test_the_message_names_the_last_step_the_replicas_agreed_not_the_step_of_the_check() -> None:
    # Checked every 10 steps: the replicas parted somewhere in steps 50..59, so a checkpoint
    # of step 55 ("before step 59") may hold the corrupted replica; resume from 49 or older.
    verdict = ReplicaVerdict(step=59, groups=["head"], majority=False, replicas=2, how="DDP",
                             every=10)  # fmt: skip
    message = mismatch_message(verdict, rank=0)
    assert "saved at or before step 49" in message and "before step 59" not in message


# --- the weaker signal: local (pre-reduce) gradient norms --------------------------------


def test_a_rank_whose_local_norm_is_orders_above_the_others_is_named() -> None:
    found = grad_outliers((0, 1, 2, 3), [1.1, 0.9, 4.0e6, 1.3], step=59, how="DDP", every=10)
    assert found is not None and list(found.outliers) == [2]
    message = outlier_message(found, rank=0, where={2: "node-7 GPU-1234"})
    assert "rank 2 (node-7 GPU-1234)" in message and "up to step 59" in message
    assert "before the all-reduce" in message and "loss over steps 50..59" in message
    assert "drain that node" in message


def test_a_nan_on_one_rank_alone_is_named_and_nans_on_most_are_not() -> None:
    nan = float("nan")
    found = grad_outliers((0, 1, 2, 3), [1.0, nan, 1.2, 0.8], step=9, how="DDP", every=10)
    assert found is not None and list(found.outliers) == [1]
    # NaN everywhere (it came through the data or the model, on every rank): no culprit.
    assert grad_outliers((0, 1, 2, 3), [nan, nan, nan, 1.0], step=9, how="DDP", every=10) is None


def test_ordinary_spread_and_two_replicas_name_nobody() -> None:
    # Batches differ: healthy replicas' interval maxima differ by a few times at most.
    assert grad_outliers((0, 1, 2, 3), [1.0, 9.0, 0.2, 3.0], step=9, how="DDP", every=10) is None
    # Two replicas: the median is either one, so neither can be told from the other.
    assert grad_outliers((0, 1), [1.0, 1.0e9], step=9, how="DDP", every=10) is None
    # All zero (no gradient at all in the interval): nothing to compare.
    assert grad_outliers((0, 1, 2), [0.0, 0.0, 0.0], step=9, how="DDP", every=10) is None
