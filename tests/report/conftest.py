"""The faulty run the report tests share: trained once per session (a few seconds)."""

from __future__ import annotations

import pytest
from report_helpers import FaultyRun, train_with_faults


@pytest.fixture(scope="session")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> FaultyRun:
    return train_with_faults(tmp_path_factory.mktemp("runs"))
