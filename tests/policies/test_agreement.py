"""stabmon.policies.agreement: one process agrees with itself; the copy reads what was
agreed. Real gloo ranks agreeing are in tests/integration/test_policies_ddp.py."""

from __future__ import annotations

import torch

from stabmon.policies.agreement import HostCopy, agree, world_size


def test_a_single_process_agrees_with_itself_and_has_a_world_of_one() -> None:
    flags = torch.tensor([0.0, 21.0], dtype=torch.float64)

    assert world_size() == 1
    assert agree(flags) is flags and flags.tolist() == [0.0, 21.0]


def test_the_host_copy_is_taken_when_queued_and_later_changes_do_not_reach_it() -> None:
    flags = torch.tensor([0.0, 301.0], dtype=torch.float64)
    copy = HostCopy()
    copy.start(flags, step=300)
    flags.zero_()
    copy.start(flags, step=301)

    assert copy.take(wait=False) == [(300, [0.0, 301.0]), (301, [0.0, 0.0])]
    assert copy.take(wait=True) == []  # each taken once
