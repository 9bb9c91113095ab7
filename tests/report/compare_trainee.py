"""One rank of two multi-rank runs for ``stabmon compare``'s tests, started as its own process.

    RANK=r WORLD_SIZE=n LOCAL_RANK=r LOCAL_WORLD_SIZE=n \\
        python compare_trainee.py RUN_DIR RUN_ID[:FETCH_SLEEP] ...

Trains each named run in turn, as rank ``r`` of it (``FETCH_SLEEP`` seconds slept in each
batch fetch). No process group: each rank trains alone and attaches with torchrun's
variables, so it writes ``RUN_DIR/RUN_ID/rank-<r>.events.jsonl`` as a rank of a real job
does. One process serves both runs: a torch process costs seconds to start.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # compare_helpers, and the helpers it imports

from compare_helpers import train  # noqa: E402

if __name__ == "__main__":
    run_dir = Path(sys.argv[1])
    for spec in sys.argv[2:]:
        run_id, _, sleep = spec.partition(":")
        train(run_dir, run_id, fetch_sleep=float(sleep or 0))
