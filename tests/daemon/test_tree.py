"""stabmon.daemon.tree: a rank's descendants from one reading of the node's processes.

Real processes (a shell with two children of its own) where psutil can check the answer;
a fixture ``/proc`` tree for the parsing and the reused-pid rule.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers import wait_until

from stabmon.daemon.tree import ProcessTree


@pytest.fixture
def family() -> Iterator[psutil.Process]:
    """A shell whose two children sleep: a training process and its loader workers."""
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    try:
        process = psutil.Process(shell.pid)
        wait_until(lambda: len(process.children()) == 2, "the shell started its two children")
        yield process
    finally:
        for child in psutil.Process(shell.pid).children(recursive=True):
            child.kill()
        shell.kill()
        shell.wait(10)


@pytest.fixture
def stranger() -> Iterator[psutil.Process]:
    """A process started after ``family``, by this test rather than by the shell."""
    late = subprocess.Popen(["sleep", "60"])
    try:
        yield psutil.Process(late.pid)
    finally:
        late.kill()
        late.wait(10)


def _stat(proc: Path, pid: int, parent: int, command: str = "python") -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({command}) S {parent} {pid} {pid} 0 -1\n")


def test_descendants_are_what_psutil_finds(family: psutil.Process) -> None:
    found = ProcessTree().descendants(family)

    assert len(found) == 2
    assert {p.pid for p in found} == {p.pid for p in family.children(recursive=True)}
    assert {p.pid for p in ProcessTree().descendants(psutil.Process())} >= {
        family.pid,
        *(p.pid for p in found),
    }


def test_one_tree_reads_the_node_once_and_a_new_one_sees_what_started_since(
    family: psutil.Process, request: pytest.FixtureRequest
) -> None:
    tree = ProcessTree()
    assert len(tree.descendants(family)) == 2
    late: psutil.Process = request.getfixturevalue("stranger")  # started after the reading

    assert late.pid not in {p.pid for p in tree.descendants(psutil.Process())}
    assert late.pid in {p.pid for p in ProcessTree().descendants(psutil.Process())}


def test_parents_are_read_past_a_command_name_with_spaces_and_parentheses(
    tmp_path: Path, family: psutil.Process
) -> None:
    # Real pids under a fixture /proc: the names are parsed here, the start times are real.
    (first, second) = family.children()
    _stat(tmp_path, first.pid, family.pid, command="a) (b c")
    _stat(tmp_path, second.pid, family.pid, command=")")
    (tmp_path / "self").mkdir()  # not a pid
    (tmp_path / "999999999").mkdir()  # no stat: gone while being read

    found = ProcessTree(tmp_path).descendants(family)

    assert {p.pid for p in found} == {first.pid, second.pid}


def test_a_reused_pid_older_than_the_process_is_not_its_descendant(
    tmp_path: Path, family: psutil.Process
) -> None:
    (child, _) = family.children()
    # pid 1 started long before the shell: listed as its child, it is a reused pid.
    _stat(tmp_path, 1, family.pid)
    _stat(tmp_path, child.pid, family.pid)

    assert [p.pid for p in ProcessTree(tmp_path).descendants(family)] == [child.pid]


def test_a_pid_whose_parent_changed_since_the_reading_is_not_a_descendant(
    tmp_path: Path, family: psutil.Process, stranger: psutil.Process
) -> None:
    # The reading says the shell started `stranger`; its real parent is this test (the
    # shell's child exited, and its pid went to a process of someone else).
    (child, _) = family.children()
    _stat(tmp_path, child.pid, family.pid)
    _stat(tmp_path, stranger.pid, family.pid)

    assert [p.pid for p in ProcessTree(tmp_path).descendants(family)] == [child.pid]


def test_processes_whose_parent_cannot_be_read_are_counted(
    tmp_path: Path, family: psutil.Process
) -> None:
    (child, _) = family.children()
    _stat(tmp_path, child.pid, family.pid)
    (tmp_path / "77" / "stat").mkdir(parents=True)  # unreadable, as under hidepid
    tree = ProcessTree(tmp_path)

    assert [p.pid for p in tree.descendants(family)] == [child.pid]
    assert tree.unreadable == 1


def test_an_unreadable_proc_has_no_descendants(tmp_path: Path, family: psutil.Process) -> None:
    tree = ProcessTree(tmp_path / "missing")
    assert tree.descendants(family) == []
    assert tree.unreadable == 0
