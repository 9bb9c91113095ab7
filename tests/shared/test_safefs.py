"""stabmon.shared.safefs on real files in tmp_path, hostile ones included.

Every case here is a real file system object: a symlink, a FIFO, a directory, a
file chowned to another uid (only as root, else skipped), and a real short write
under RLIMIT_FSIZE. Nothing is faked.
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from stabmon.shared import safefs
from stabmon.shared.safefs import UnsafePathError

OTHER_UID = 65534  # nobody


def _give_away(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("Requires: root, to chown a file to another user")
    os.chown(path, OTHER_UID, OTHER_UID)


def test_read_regular_returns_the_bytes_of_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    path.write_bytes(b'{"pid": 7}')
    assert safefs.read_regular(path, 100) == b'{"pid": 7}'


def test_read_regular_returns_a_file_of_exactly_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 64)
    assert safefs.read_regular(path, 64) == b"x" * 64


def test_read_regular_rejects_a_file_one_byte_over_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 65)
    with pytest.raises(ValueError, match="larger than 64 bytes"):
        safefs.read_regular(path, 64)


def test_read_regular_refuses_a_symlink_without_following_it(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    target.write_bytes(b"secret")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link; not followed"):
        safefs.read_regular(link, 100)


def test_read_regular_follows_a_symlink_only_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "report-input"
    target.write_bytes(b"named by the user")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert safefs.read_regular(link, 100, follow_symlinks=True) == b"named by the user"


def test_read_regular_refuses_a_fifo_at_once_instead_of_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # No writer ever opens it: a blocking open or read would hang this test forever.
    with pytest.raises(UnsafePathError, match="not a regular file"):
        safefs.read_regular(fifo, 100)


def test_read_regular_refuses_a_directory(tmp_path: Path) -> None:
    with pytest.raises(UnsafePathError, match="not a regular file"):
        safefs.read_regular(tmp_path, 100)


def test_read_regular_refuses_a_character_device_without_reading_it() -> None:
    # /dev/zero never ends: a read up to the limit would pass the size check's loop.
    with pytest.raises(UnsafePathError, match="not a regular file"):
        safefs.read_regular("/dev/zero", 100)


def test_read_regular_with_owner_names_the_owner_of_another_users_file(tmp_path: Path) -> None:
    path = tmp_path / "theirs"
    path.write_bytes(b"data")
    _give_away(path)
    assert safefs.read_regular_with_owner(path, 100) == (b"data", OTHER_UID)


def test_owned_directory_creates_missing_parents_with_mode_0755(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    old = os.umask(0)
    try:
        safefs.owned_directory(path)
    finally:
        os.umask(old)
    assert path.is_dir()
    assert path.stat().st_mode & 0o777 == 0o755


def test_owned_directory_accepts_an_existing_directory_of_ours(tmp_path: Path) -> None:
    safefs.owned_directory(tmp_path, create=False)


def test_owned_directory_refuses_a_symlink_to_a_directory(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        safefs.owned_directory(link)


def test_owned_directory_refuses_a_dangling_symlink_without_creating_its_target(
    tmp_path: Path,
) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "planted")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        safefs.owned_directory(link)
    assert not (tmp_path / "planted").exists()


def test_owned_directory_refuses_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(UnsafePathError, match="is not a directory"):
        safefs.owned_directory(path)


def test_owned_directory_refuses_another_users_directory_and_says_what_to_do(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run"
    path.mkdir()
    _give_away(path)
    with pytest.raises(UnsafePathError, match=f"owned by uid {OTHER_UID}.*another run_id"):
        safefs.owned_directory(path)


def test_open_append_creates_the_file_and_appends_after_what_is_there(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    for record in (b"one\n", b"two\n"):
        fd = safefs.open_append(path)
        try:
            os.write(fd, record)
        finally:
            os.close(fd)
    assert path.read_bytes() == b"one\ntwo\n"


def test_open_append_refuses_a_symlink_and_leaves_its_target_alone(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "events.jsonl"
    link.symlink_to(victim)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        safefs.open_append(link)
    assert victim.read_bytes() == b"precious"


def test_open_append_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "events.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as raised:
        safefs.open_append(fifo)
    # A FIFO opened for writing with O_NONBLOCK and no reader is ENXIO; any other
    # refusal must be ours, never a hang.
    assert isinstance(raised.value, UnsafePathError) or raised.value.errno == 6


def test_open_owned_refuses_a_fifo_that_has_a_reader(tmp_path: Path) -> None:
    fifo = tmp_path / "stack.txt"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(UnsafePathError, match="not a regular file"):
            safefs.open_owned(fifo, os.O_WRONLY)
    finally:
        os.close(reader)


def test_open_append_refuses_another_users_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"theirs\n")
    _give_away(path)
    with pytest.raises(UnsafePathError, match=f"owned by uid {OTHER_UID}"):
        safefs.open_append(path)
    assert path.read_bytes() == b"theirs\n"


@pytest.fixture
def append_fd(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "log.jsonl"
    fd = safefs.open_append(path)
    yield path, fd
    os.close(fd)


def test_append_all_starts_a_new_line_after_a_half_written_record(
    append_fd: tuple[Path, int],
) -> None:
    path, fd = append_fd
    os.write(fd, b'{"a": 1}\n{"b":')  # an earlier record cut short
    safefs.append_all(fd, b'{"c": 3}\n')
    assert path.read_bytes().splitlines()[-1] == b'{"c": 3}'


def test_append_all_adds_no_blank_line_after_a_whole_record(append_fd: tuple[Path, int]) -> None:
    path, fd = append_fd
    safefs.append_all(fd, b"one\n")
    safefs.append_all(fd, b"two\n")
    assert path.read_bytes() == b"one\ntwo\n"


def test_append_all_cuts_a_short_write_back_to_where_the_record_began(
    append_fd: tuple[Path, int],
) -> None:
    path, fd = append_fd
    safefs.append_all(fd, b"kept\n")
    # A real short write: the file size limit lets part of the record in, then EFBIG.
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10, old_limit[1]))
    try:
        with pytest.raises(OSError):
            safefs.append_all(fd, b"a record far longer than the limit\n")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert path.read_bytes() == b"kept\n"
    safefs.append_all(fd, b"next\n")
    assert path.read_bytes() == b"kept\nnext\n"


def test_unsafe_path_error_names_the_path_and_the_reason() -> None:
    error = UnsafePathError(0, "is a symbolic link", "/var/tmp/stabmon/x")
    assert str(error) == "/var/tmp/stabmon/x: is a symbolic link"
    assert isinstance(error, OSError)


def test_read_at_most_stops_one_byte_past_the_limit_of_an_endless_source() -> None:
    """A pipe that never ends (a file still growing): one byte more than the limit tells
    the caller it is too large, without reading the rest."""
    from stabmon.shared.safefs import read_at_most

    reader, writer = os.pipe()
    try:
        os.write(writer, b"x" * 100)
        assert read_at_most(reader, 10) == b"x" * 11
        os.close(writer)
        writer = -1
        assert read_at_most(reader, 1000) == b"x" * 89  # to the end, under the limit
    finally:
        os.close(reader)
        if writer >= 0:
            os.close(writer)
