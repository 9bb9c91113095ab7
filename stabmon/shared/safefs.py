"""Files on a shared node, opened as if every other user were hostile.

A run directory such as ``/var/tmp/stabmon`` is writable by every user of the
node (sticky, like ``/tmp``). Anything under it that stabmon did not create
itself may be a trap: a symlink to a file the victim can write, a FIFO that
blocks ``open`` or ``read`` forever, a directory another user pre-created so
the victim writes into it. The helpers here are the only way stabmon opens
such paths:

- :func:`read_regular` opens without following a final symlink and without
  blocking (``O_NOFOLLOW | O_NONBLOCK``), refuses anything but a regular file,
  and reads at most a bound: a FIFO, a device or ``/dev/zero`` is an error,
  never a hang;
- :func:`owned_directory` creates a directory (mode 0755) or checks one that
  exists: it must be a real directory (no symlink) owned by this process's
  effective uid, else :class:`UnsafePathError`;
- :func:`open_append` opens a file for appending without following symlinks
  and checks that it is a regular file owned by us;
- :func:`append_all` writes a whole record or nothing: a short write (a full
  disk) is cut back, so the next record never lands on a half line.

Ownership is checked on the open file descriptor (``fstat``), not on the path,
so a rename between check and use changes nothing.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = [
    "UnsafePathError",
    "append_all",
    "open_append",
    "owned_directory",
    "read_at_most",
    "read_regular",
    "read_regular_with_owner",
]


class UnsafePathError(OSError):
    """A path that stabmon will not use: a symlink, a special file, or another user's."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def open_regular(
    path: str | os.PathLike[str], flags: int, *, follow_symlinks: bool = False, mode: int = 0o600
) -> tuple[int, os.stat_result]:
    """A descriptor for ``path`` opened with ``flags`` (never blocking, closed on exec) and
    its stat; raises :class:`UnsafePathError` for a symlink (unless ``follow_symlinks``: a
    path the user named), FIFO, device or directory, leaving nothing open."""
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:  # the final component is a symlink
            raise UnsafePathError(
                error.errno, "is a symbolic link; not followed", str(path)
            ) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(0, "not a regular file (a FIFO, device or directory)", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def read_regular(
    path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = False
) -> bytes:
    """At most ``limit`` bytes of a regular file; anything else raises, never waits."""
    return read_regular_with_owner(path, limit, follow_symlinks=follow_symlinks)[0]


def read_regular_with_owner(
    path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = False
) -> tuple[bytes, int]:
    """The bytes of a regular file (at most ``limit``, else ValueError) and its owner's uid.

    Raises :class:`UnsafePathError` for a symlink (unless ``follow_symlinks``: a
    path the user named, such as a report's input), FIFO, device or directory,
    and ValueError for a file over ``limit``; never blocks on a special file.
    """
    fd, info = open_regular(path, os.O_RDONLY, follow_symlinks=follow_symlinks)
    try:
        data = read_at_most(fd, limit)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    return data, info.st_uid


def owned_directory(path: Path, *, create: bool = True) -> None:
    """Make sure ``path`` is a real directory owned by this process's effective uid.

    Creates it (and missing parents) with mode 0755 when ``create``; raises
    :class:`UnsafePathError` naming the owner when it is a symlink, not a
    directory, or another user's (who could then swap, read or plant its files).
    """
    if create:
        try:
            path.mkdir(mode=0o755, parents=True, exist_ok=True)
        except FileExistsError:
            pass  # a dangling symlink or a file: lstat below says which
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(0, "is a symbolic link; refusing to write through it", str(path))
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(0, "is not a directory", str(path))
    mine = os.geteuid()
    if info.st_uid != mine:
        raise UnsafePathError(
            0,
            f"is owned by uid {info.st_uid}, not by this process (uid {mine}); another user "
            "created it first. Use another run_id or run_dir",
            str(path),
        )


def open_owned(path: Path, flags: int, mode: int = 0o600) -> int:
    """A descriptor for ``path`` opened with ``flags``, never through a symlink, never
    blocking: it must be a regular file owned by this process's effective uid."""
    fd, info = open_regular(path, flags, mode=mode)
    if info.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafePathError(0, f"is owned by uid {info.st_uid}, not by us", str(path))
    return fd


def open_append(path: Path, mode: int = 0o644) -> int:
    """A descriptor for appending to ``path`` (created if missing): see :func:`open_owned`."""
    return open_owned(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, mode)


def append_all(fd: int, data: bytes) -> None:
    """Append ``data`` (one line) whole, or raise leaving no half line for the next to join.

    ``write`` may write part of ``data`` (a disk that fills up mid-record). The
    rest is retried; when it fails, the file is cut back to where the record
    began. Should even that fail, the next call sees a last byte that is not a
    newline and starts its record on a new line, so one lost record never takes
    the next with it (one writer per file, which is how stabmon names its logs).
    """
    start = os.fstat(fd).st_size
    if start and os.pread(fd, 1, start - 1) != b"\n":
        data = b"\n" + data  # a line left unfinished by an earlier failure: close it
    written = 0
    try:
        while written < len(data):
            count = os.write(fd, data[written:])
            if count <= 0:
                raise OSError(28, "no space left: the record was written in part")
            written += count
    except BaseException:
        if written:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # cannot cut back either: the next record starts a new line
        raise


def read_at_most(fd: int, limit: int) -> bytes:
    """Read ``fd`` to its end, but no more than ``limit + 1`` bytes: a result longer than
    ``limit`` tells the caller the file is too large (it may have grown since a stat)."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
