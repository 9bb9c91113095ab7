"""Issue 21, items 2 and 8: the run directory on a node where another user is hostile.

The neighbour is a real second uid (``nobody``, see conftest); the victim is
this test process training with stabmon attached.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from stabmon import contract
from stabmon.shared.own_record import Registration
from stabmon.shared.rundir import ProcessRecord, read_records
from tests.helpers import scrape, tiny_model, train_step, value
from tests.security.conftest import Hostile


def test_training_refuses_a_run_directory_pre_created_by_another_user_with_a_symlinked_log(
    attach, hostile: Hostile, shared: Path, tmp_path: Path
) -> None:
    victim_file = tmp_path / "victims-file"
    victim_file.write_text("precious\n")
    tmp_path.chmod(0o755)  # so the symlink may name it (the link is what matters, not access)
    hostile.run(
        "import os, sys; d = os.path.join(sys.argv[1], 'nightly'); os.mkdir(d); os.chmod(d, 0o777);"
        "os.symlink(sys.argv[2], os.path.join(d, 'rank-0.events.jsonl'))",
        str(shared),
        str(victim_file),
    )
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, run_dir=str(shared), run_id="nightly")
    for _ in range(3):
        train_step(model, optimizer, monitor)  # training goes on
    samples = scrape(monitor.metrics_url)
    assert victim_file.read_text() == "precious\n"
    assert not (shared / "nightly" / "rank-0.json").exists()  # nothing of ours in their directory
    errors = value(samples, contract.INTERNAL_ERRORS.name, component="event_log") or 0.0
    assert errors >= 1.0
    monitor.detach()
    assert victim_file.read_text() == "precious\n"


def test_event_log_is_never_opened_through_a_symlink_in_our_own_directory(tmp_path: Path) -> None:
    from stabmon.shared.safefs import UnsafePathError, open_append

    target = tmp_path / "target"
    target.write_text("")
    (tmp_path / "rank-0.events.jsonl").symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        open_append(tmp_path / "rank-0.events.jsonl")


def test_reading_a_fifo_or_a_symlink_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    from stabmon.shared.safefs import UnsafePathError, read_regular

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to("/etc/hostname")
    with pytest.raises(UnsafePathError, match="regular file"):
        read_regular(tmp_path / "fifo", 100)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        read_regular(tmp_path / "link", 100)


_FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    from stabmon.export.event_log import EventLog
    from stabmon.shared.guard import Guard
    from stabmon.shared.log import LogLimiter

    path = Path(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit then fails like a full disk
    guard = Guard(LogLimiter())
    log = EventLog(path, common={"run": "r"}, guard=guard)
    log.write("attach", note="x" * 50)
    size = path.stat().st_size
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, hard))  # the next record fits in part
    log.write("anomaly", note="y" * 200)
    log.write("anomaly", note="z" * 200)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space again: recovery
    log.write("epoch", note="after")
    log.close()
    print(json.dumps(dict(guard.counts)))
    """
)


def test_a_record_cut_short_by_a_full_disk_never_swallows_the_next_one(tmp_path: Path) -> None:
    path = tmp_path / "run" / "rank-0.events.jsonl"
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(path)], capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout.splitlines()[-1])["event_log"] == 2
    lines = path.read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["attach", "epoch"]


def test_append_all_starts_a_new_line_after_a_half_line_it_could_not_cut_back(
    tmp_path: Path,
) -> None:
    from stabmon.shared.safefs import append_all, open_append

    path = tmp_path / "log"
    path.write_bytes(b'{"event":"a"}\n{"event":"cut sh')
    fd = open_append(path)
    append_all(fd, b'{"event":"b"}\n')
    import os

    os.close(fd)
    assert path.read_bytes().splitlines()[-1] == b'{"event":"b"}'


@pytest.mark.parametrize(
    ("first", "second"), [("a/b", "a_b"), (".", "run"), ("..", "run"), ("a\\b", "a_b")]
)
def test_run_ids_that_clean_to_the_same_name_get_distinct_directories(
    first: str, second: str
) -> None:
    from stabmon.shared.rundir import run_directory_name

    assert run_directory_name(first) != run_directory_name(second)
    for name in (run_directory_name(first), run_directory_name(second)):
        assert "/" not in name and name not in (".", "..") and not name.startswith(".")


def test_a_second_live_process_with_the_same_run_id_and_rank_is_warned_about_and_counted(
    attach, tmp_path: Path
) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        other = ProcessRecord(
            pid=sleeper.pid,
            create_time=psutil.Process(sleeper.pid).create_time(),
            run="shared-id",
            rank=0,
        )
        (tmp_path / "shared-id").mkdir()
        (tmp_path / "shared-id" / "rank-0.json").write_bytes(other.to_json())
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = attach(model, optimizer, run_id="shared-id")
        samples = scrape(monitor.metrics_url)
        assert (value(samples, contract.INTERNAL_ERRORS.name, component="rundir") or 0.0) >= 1.0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_registration_in_another_users_run_directory_is_refused(
    hostile: Hostile, shared: Path
) -> None:
    hostile.run("import os, sys; os.mkdir(os.path.join(sys.argv[1], 'theirs'), 0o777)", str(shared))
    from stabmon.shared.safefs import UnsafePathError

    record = ProcessRecord(pid=1, create_time=0.0, run="theirs", rank=0)
    registration = Registration(shared, shared / "theirs" / "rank-0.json", record)
    with pytest.raises(UnsafePathError, match="owned by uid 65534"):
        registration.write(last_step_unix=None, steps=0, now=0.0)
    assert read_records(shared) == ([], [])


# Issue 40: the root itself. Any name under /tmp that does not exist yet is anyone's to create.


@pytest.mark.parametrize("planted", ["owned", "symlink"])
def test_training_writes_nothing_into_a_root_another_user_created_or_symlinked(
    attach, hostile: Hostile, shared: Path, planted: str
) -> None:
    theirs = shared / "their-dir"
    root = shared / "stabmon-root"
    if planted == "owned":  # their directory, mode 1777 as a root should be: still theirs
        hostile.run("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o1777)",
                    str(root))  # fmt: skip
    else:  # a root that is a link to a directory they own
        hostile.run("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o1777);"
                    "os.symlink(sys.argv[1], sys.argv[2])", str(theirs), str(root))  # fmt: skip
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, run_dir=str(root), run_id="victim")
    for _ in range(3):
        train_step(model, optimizer, monitor)  # training goes on
    samples = scrape(monitor.metrics_url)
    monitor.detach()
    written = list((theirs if planted == "symlink" else root).rglob("*"))
    assert written == []  # no record, no event log in a directory they control
    assert (value(samples, contract.INTERNAL_ERRORS.name, component="event_log") or 0.0) >= 1.0


def test_the_daemon_refuses_a_root_another_user_owns_with_one_line(
    hostile: Hostile, shared: Path
) -> None:
    root = shared / "stabmon-root"
    hostile.run("import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o1777)", str(root))
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from stabmon.cli import main; sys.exit(main())",
         "daemon", "--run-dir", str(root), "--port", "0", "--address", "127.0.0.1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "owned by uid 65534" in result.stderr


def test_a_world_writable_root_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    import os

    from stabmon.shared.rundir import check_root
    from stabmon.shared.safefs import UnsafePathError

    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafePathError, match="sticky"):
        check_root(root)
    os.chmod(root, 0o1777)
    check_root(root)


def test_the_daemon_counts_and_logs_a_root_swapped_for_a_symlink(
    hostile: Hostile, shared: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stabmon.daemon.processes import ProcessTable
    from stabmon.shared.log import LogLimiter

    theirs = shared / "theirs"
    hostile.run("import os, sys; os.mkdir(sys.argv[1])", str(theirs))
    root = shared / "root"
    root.symlink_to(theirs)
    refused: list[int] = []
    table = ProcessTable(root, limiter=LogLimiter(), on_refused=refused.append)
    assert table.poll() == []
    assert refused == [1]
    assert "symbolic link" in caplog.text


def test_a_run_directory_deleted_while_training_loses_no_later_event(
    attach, tmp_path: Path
) -> None:
    import shutil

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = attach(model, optimizer, run_dir=str(tmp_path), run_id="cleaned", judge_seconds=0)
    for _ in range(3):
        train_step(model, optimizer, monitor)
    log_path = monitor.event_log_path
    assert log_path is not None
    shutil.rmtree(log_path.parent)  # a cleanup job that thought the run was over
    for step in range(3):
        train_step(model, optimizer, monitor, nan_grad=step == 1)
    samples = scrape(monitor.metrics_url)
    monitor.detach()
    kinds = [json.loads(line).get("kind") for line in log_path.read_text().splitlines()]
    assert "nonfinite_grad" in kinds  # in the new file, not an unlinked one
    assert (value(samples, contract.INTERNAL_ERRORS.name, component="event_log") or 0.0) >= 1.0
