"""Where a run's files live, and reading the registration records the node daemon reads.

Layout::

    <run_dir>/<run_id>/rank-<rank>.json          registration + heartbeat (this module)
    <run_dir>/<run_id>/rank-<rank>.events.jsonl  event log (stabmon.export.event_log)

The default root is ``/var/tmp/stabmon``: node-wide, so the daemon finds every
run without configuration, and, unlike ``/tmp``, kept across reboots, so an
event log outlives a crashed machine. ``run_dir`` in the config (or
``STABMON_DIR``) moves it.

A training process writes its record at attach, rewrites it from its sampler
thread (the heartbeat: ``last_step_unix``) and removes it at detach
(:mod:`stabmon.shared.own_record`). Records
are written atomically (write, then rename) so a reader sees the old record or
the new one, never half. Run subdirectories are created by the process that
writes in them and refused when another user owns them (:mod:`stabmon.shared.safefs`);
nothing is opened through a symlink. Readers tolerate what a crash, a disk or a person can
leave behind (partial, stale, malformed files, a vanished directory) and skip
such files with a reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stabmon.shared.safefs import UnsafePathError, owned_directory, read_regular_with_owner

__all__ = [
    "DEFAULT_RUN_DIR",
    "MAX_FILES_PER_OWNER",
    "MAX_RECORDS",
    "READ_SECONDS",
    "ReadBudget",
    "OwnedRecord",
    "RECORD_VERSION",
    "RUN_ID_PATTERN",
    "ProcessRecord",
    "RecordProblem",
    "RunPaths",
    "boot_id",
    "check_root",
    "pid_namespace",
    "prepare_run_directory",
    "read_owned_records",
    "read_records",
    "read_run_records",
    "run_directory_name",
    "safe_component",
    "write_atomic",
]

DEFAULT_RUN_DIR = Path("/var/tmp/stabmon")
RECORD_VERSION = 1
#: Records larger than this are not records (a person's file, a corrupted disk).
MAX_RECORD_BYTES = 64 * 1024
#: Records read from one run-directory root at most per owner uid: the rest are problems,
#: not records (every user of the node can write there; the daemon's memory and series stay
#: bounded, and one user's records never push out another's).
MAX_RECORDS = 512
#: Files opened per owner uid in one read (records or not): 20,000 junk files of one user
#: cost a bounded read, and the other users' files are read first or between them.
MAX_FILES_PER_OWNER = 1024
#: Entries listed per directory (the root, and each run's directory) in one read.
MAX_ENTRIES = 65536
#: Seconds one read of a root may take; the files left are read at the next one.
READ_SECONDS = 1.0
#: Files of each owner read whatever the time: a slow disk or a loaded node never leaves
#: a user with nothing read.
MIN_FILES_PER_OWNER = 16

#: The run ids used as directory names as they are: letters, digits, ``.``, ``_`` and ``-``,
#: 1 to 128 characters, not starting with a dot (so never ``.`` or ``..``).
RUN_ID_PATTERN = r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}"
_SAFE_RUN_ID = re.compile(RUN_ID_PATTERN)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_UUID = re.compile(r"[A-Za-z0-9/_.:-]{1,128}")


def safe_component(value: str) -> str:
    """``value`` made safe as one path component (run ids come from users)."""
    cleaned = _UNSAFE.sub("_", value)[:128].lstrip(".")
    return cleaned or "run"


def run_directory_name(run_id: str) -> str:
    """The directory name of run ``run_id``: itself when it is in :data:`RUN_ID_PATTERN`.

    Any other id (one from a launcher's environment: ``a/b``, ``..``) is cleaned
    and given a hash of the original after a ``~``, a character no safe id has,
    so two different ids never share a directory (``a/b`` and ``a_b`` differ).
    """
    if _SAFE_RUN_ID.fullmatch(run_id):
        return run_id
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{safe_component(run_id)[:100]}~{digest}"


@dataclass(frozen=True)
class RunPaths:
    """Paths of one process's files in the run directory."""

    root: Path
    run_id: str
    rank: int

    @property
    def run_directory(self) -> Path:
        return self.root / run_directory_name(self.run_id)

    @property
    def events(self) -> Path:
        return self.run_directory / f"rank-{self.rank}.events.jsonl"

    @property
    def record(self) -> Path:
        return self.run_directory / f"rank-{self.rank}.json"


@dataclass(frozen=True)
class ProcessRecord:
    """One training process, as it registers itself for the node daemon."""

    pid: int
    #: psutil's create time of ``pid``: tells a live process from a reused pid.
    create_time: float
    run: str
    rank: int
    local_rank: int = 0
    hostname: str = ""
    #: Physical GPUs the process declared it uses, as NVML spells them (``GPU-...``, ``MIG-...``).
    gpu_uuids: tuple[str, ...] = ()
    cuda_visible_devices: str | None = None
    metrics_url: str | None = None
    attached_unix: float = 0.0
    #: Unix time of the last completed optimizer step (the heartbeat); None before the first.
    last_step_unix: float | None = None
    steps: int = 0
    #: When the record was last written (the sampler rewrites it every ``sample_seconds``).
    updated_unix: float = 0.0
    #: The process's configured stall limit, for readers such as ``stabmon status``.
    stall_seconds: float | None = None
    #: The kernel's boot id: a record from another boot (or another host) is not this node's.
    boot_id: str = ""
    #: The PID namespace ``pid`` belongs to (``pid:[4026532178]``): in a container it is not
    #: the daemon's, which maps ``pid`` to its own view (:mod:`stabmon.daemon.pidns`).
    pid_namespace: str = ""
    #: Set at interpreter exit: when, and "clean", "exception" (an uncaught error) or
    #: "signal" (ended by the signal in ``exit_signal``, such as SIGINT).
    exited_unix: float | None = None
    exit_status: str | None = None
    #: The loop phase at the last heartbeat (``forward``, ``eval``, ``startup``...).
    phase: str | None = None
    #: The stall limit that applied at the last heartbeat (the phase's): the daemon judges a
    #: frozen process, whose watchdog cannot run, against it.
    stall_limit_seconds: float | None = None
    #: With ``exit_status == "signal"``: the signal's name (``SIGINT``, ``SIGTERM``).
    exit_signal: str | None = None
    #: While stalled: what the main thread is doing (``stabmon.contract.HANG_STATES``), where
    #: (``loader.py:42 in fetch``) and the collectives issued, for the node's hang verdict.
    hang_state: str | None = None
    hang_where: str | None = None
    collectives: int = 0
    #: While stalled, with torch's flight recorder available: the default process group's last
    #: enqueued, started (-1: not timed) and completed collective sequence numbers
    #: (``stabmon.probes.flight_recorder``); else None.
    flight: tuple[int, int, int] | None = None
    version: int = field(default=RECORD_VERSION)

    def to_json(self) -> bytes:
        data = asdict(self)
        data["gpu_uuids"] = list(self.gpu_uuids)
        return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ProcessRecord:
        """Validate a parsed record; raises ValueError saying what is wrong."""
        version = data.get("version")
        # Newer writers only add fields: accept them, so library and daemon upgrade independently.
        if not isinstance(version, int) or isinstance(version, bool) or version < RECORD_VERSION:
            raise ValueError(f"unsupported record version {version!r}")
        return cls(
            pid=_int(data, "pid", minimum=1),
            create_time=_number(data, "create_time"),
            run=_text(data, "run"),
            rank=_int(data, "rank", minimum=0),
            local_rank=_int(data, "local_rank", minimum=0, default=0),
            hostname=_text(data, "hostname", default=""),
            gpu_uuids=tuple(_uuid_list(data.get("gpu_uuids", []))),
            cuda_visible_devices=_optional_text(data, "cuda_visible_devices"),
            metrics_url=_optional_text(data, "metrics_url"),
            attached_unix=_number(data, "attached_unix", default=0.0),
            last_step_unix=_optional_number(data, "last_step_unix"),
            steps=_int(data, "steps", minimum=0, default=0),
            updated_unix=_number(data, "updated_unix", default=0.0),
            stall_seconds=_optional_number(data, "stall_seconds"),
            boot_id=_text(data, "boot_id", default=""),
            pid_namespace=_text(data, "pid_namespace", default=""),
            exited_unix=_optional_number(data, "exited_unix"),
            exit_status=_optional_text(data, "exit_status"),
            phase=_optional_text(data, "phase"),
            stall_limit_seconds=_optional_number(data, "stall_limit_seconds"),
            exit_signal=_optional_text(data, "exit_signal"),
            hang_state=_optional_text(data, "hang_state"),
            hang_where=_optional_text(data, "hang_where"),
            collectives=_int(data, "collectives", minimum=0, default=0),
            flight=_flight(data.get("flight")),
        )


@dataclass(frozen=True)
class OwnedRecord:
    """A record as read from disk, with who wrote it: the uid that owns its file."""

    record: ProcessRecord
    path: Path
    owner_uid: int


@dataclass(frozen=True)
class RecordProblem:
    """A file in the run directory that is not a usable record, and why.

    ``refused``: a well-formed record that is not believed, because it names a run that
    belongs to another uid (counted by the daemon as a refusal, not a broken file).
    ``owner_uid`` is the uid that owns the file or directory (None when unknown), so that
    readers can summarise one user's junk without a line per file.
    """

    path: Path
    reason: str
    owner_uid: int | None = None
    refused: bool = False


@dataclass(frozen=True)
class ReadBudget:
    """What one read of a root may cost: files per owner uid, and time on ``clock``."""

    seconds: float = READ_SECONDS
    files_per_owner: int = MAX_FILES_PER_OWNER
    records_per_owner: int = MAX_RECORDS
    clock: Callable[[], float] = time.monotonic


def boot_id() -> str:
    """This boot's id (Linux); empty where the kernel does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace(pid: int | str = "self", proc: Path = Path("/proc")) -> str:
    """The PID namespace of ``pid`` (``pid:[4026531836]``); empty where it cannot be read."""
    try:
        return os.readlink(proc / str(pid) / "ns" / "pid")
    except OSError:
        return ""


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half.

    rename(2) is atomic within a filesystem, so the file is written under a
    temporary name (unique per process and thread) beside it and renamed over
    the target; the temporary file is removed if anything fails. The temporary
    file is created exclusively and never through a symlink (``O_EXCL``), so a
    name planted in advance by someone else fails rather than being written.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(temporary, flags, 0o644)
        with open(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except FileExistsError:
        raise  # not ours to remove: someone else's file of that name
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def prepare_run_directory(run_directory: Path) -> None:
    """Create the run's directory (and the shared root above it) and check that it is ours.

    The root is created world-writable and sticky (like ``/tmp``), so every user
    of a shared node can register under it; the run's own directory must be a
    real directory owned by this process's user, else :class:`UnsafePathError`
    (another user who pre-created it could read, replace or plant its files).
    """
    root = run_directory.parent
    if not os.path.lexists(root):
        root.mkdir(parents=True, exist_ok=True)
        try:
            os.chmod(root, 0o1777)  # shared by every user of the node, like /tmp
        except OSError:
            pass  # someone else created it first, or may not change it: theirs to set
    check_root(root)
    owned_directory(run_directory)


def check_root(root: Path, *, uid: int | None = None) -> None:
    """Raise :class:`UnsafePathError` unless ``root`` is a run-directory root we may trust.

    It must be a real directory (not a symlink, which another user could point anywhere),
    owned by root or by ``uid`` (this process's effective uid): a root another user owns
    (any name under /tmp that did not exist yet) is theirs to empty, swap or read. When
    every user may write it, it must be sticky (mode 1777, like /tmp), so no user can
    rename or remove another's run directory (a group-writable root trusts its group).
    A root that does not exist is no error here.
    """
    mine = os.geteuid() if uid is None else uid
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(
            0, "is a symbolic link; the run-directory root must be a real directory", str(root)
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(0, "is not a directory", str(root))
    if info.st_uid not in (0, mine):
        raise UnsafePathError(
            0,
            f"is owned by uid {info.st_uid}, neither root nor this user (uid {mine}): its owner "
            "could swap or remove every run in it. Create it as root (mode 1777) or use a "
            "run_dir of your own",
            str(root),
        )
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise UnsafePathError(
            0,
            f"is writable by every user (mode {stat.S_IMODE(info.st_mode):o}) without the "
            "sticky bit: any user could rename or remove another's run. chmod 1777 it",
            str(root),
        )


def read_records(
    root: Path, *, budget: ReadBudget | None = None
) -> tuple[list[ProcessRecord], list[RecordProblem]]:
    """Every record under ``root`` (``<run>/rank-*.json``), and the files that are not records.

    Never raises for what is on disk: a missing root is no records; an
    unreadable, oversized, partial or malformed file is a problem, not an error.
    """
    owned, problems = read_owned_records(root, budget=budget)
    return [entry.record for entry in owned], problems


def read_owned_records(
    root: Path, *, budget: ReadBudget | None = None
) -> tuple[list[OwnedRecord], list[RecordProblem]]:
    """:func:`read_records`, each record with its file's path and owner uid.

    Trust by owner: a run's name belongs to the uid that owns its directory
    (``<root>/<run_directory_name(run)>``). A record is believed only in the directory of
    the run it names, and only when its file has the directory's owner; any other is a
    ``refused`` problem (another user's record claiming a victim's run, or planted in
    the victim's name).

    Bounded per owner uid, so no user's files push out another's: at most
    ``budget.records_per_owner`` records and ``budget.files_per_owner`` files are read per
    uid, taking one file of each uid in turn, and the whole read ends after
    ``budget.seconds``, once each uid had :data:`MIN_FILES_PER_OWNER` files read (what is
    left is one summary problem per uid). Run directories
    that are symlinks are not entered, and record files are opened without following
    symlinks or blocking (a FIFO or ``/dev/zero`` under a record's name is a problem,
    never a hang).
    """
    budget = budget or ReadBudget()
    deadline = budget.clock() + budget.seconds
    records: list[OwnedRecord] = []
    problems: list[RecordProblem] = []
    queues = _paths_by_owner(root)
    opened = dict.fromkeys(queues, 0)
    kept = dict.fromkeys(queues, 0)
    left = dict.fromkeys(queues, 0)
    active = [owner for owner in sorted(queues) if queues[owner]]
    while active:
        for owner in list(active):
            paths = queues[owner]
            if not paths:
                active.remove(owner)
                continue
            late = opened[owner] >= MIN_FILES_PER_OWNER and budget.clock() > deadline
            if (
                late
                or opened[owner] >= budget.files_per_owner
                or kept[owner] >= budget.records_per_owner
            ):
                left[owner] += len(paths)
                paths.clear()
                active.remove(owner)
                continue
            directory_owner, path = paths.pop()
            opened[owner] += 1
            if _read_one(path, directory_owner, records, problems):
                kept[owner] += 1
    for owner, count in sorted(left.items()):
        if count:
            problems.append(
                RecordProblem(
                    root,
                    f"{count} more file(s) owned by uid {owner} not read: past the "
                    f"{budget.files_per_owner} files, {budget.records_per_owner} records or "
                    f"{budget.seconds:g} s one read allows each user",
                    owner,
                )
            )
    return records, problems


def read_run_records(run_directory: Path) -> tuple[list[OwnedRecord], list[RecordProblem]]:
    """:func:`read_owned_records` of one run's directory only (not entered through a symlink)."""
    records: list[OwnedRecord] = []
    problems: list[RecordProblem] = []
    try:
        info = os.lstat(run_directory)
    except OSError:
        return records, problems
    if not stat.S_ISDIR(info.st_mode):
        return records, problems
    for path in _listed(run_directory)[:MAX_RECORDS]:
        _read_one(path, info.st_uid, records, problems)
    return records, problems


def _read_one(
    path: Path, directory_owner: int, records: list[OwnedRecord], problems: list[RecordProblem]
) -> bool:
    """Read ``path`` into ``records`` (True) or ``problems``."""
    owner: int | None = None
    try:
        raw, owner = read_regular_with_owner(path, MAX_RECORD_BYTES)
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        record = ProcessRecord.from_mapping(data)
    except FileNotFoundError:
        return False  # removed at detach between listing and reading: not a problem
    except (OSError, ValueError, RecursionError) as error:
        reason = f"{type(error).__name__}: {_short(error)}"
        problems.append(RecordProblem(path, reason, directory_owner if owner is None else owner))
        return False
    refusal = _refusal(record, path, owner, directory_owner)
    if refusal is not None:
        problems.append(RecordProblem(path, refusal, owner, refused=True))
        return False
    records.append(OwnedRecord(record, path, owner))
    return True


def _refusal(record: ProcessRecord, path: Path, owner: int, directory_owner: int) -> str | None:
    """Why a well-formed record is not believed (trust by owner), or None."""
    if path.name != f"rank-{record.rank}.json":
        return f"ignored: it names rank {record.rank}, whose record is rank-{record.rank}.json"
    expected = run_directory_name(record.run)
    if path.parent.name != expected:
        return (
            f"ignored: it names run {record.run!r}, whose records live in {expected}/ "
            "(a run belongs to the user who owns its directory)"
        )
    if owner != directory_owner:
        return (
            f"ignored: the file belongs to uid {owner} but run {record.run!r} belongs to "
            f"uid {directory_owner}, who owns its directory"
        )
    return None


def _short(error: BaseException) -> str:
    """An error's message cut to a line: a hostile file must not fill the log."""
    text = str(error)
    return text if len(text) <= 200 else text[:197] + "..."


def _paths_by_owner(root: Path) -> dict[int, list[tuple[int, Path]]]:
    """Each owner uid's record paths under ``root``, by run directory, last read first.

    Lists at most :data:`MAX_ENTRIES` entries of the root and of each run directory; never
    enters a symlink (``lstat``, not ``is_dir()``, which follows a link anywhere).
    """
    by_owner: dict[int, list[tuple[int, Path]]] = {}
    try:
        with os.scandir(root) as entries:
            runs = []
            for index, entry in enumerate(entries):
                if index >= MAX_ENTRIES:
                    break
                try:
                    if entry.is_dir(follow_symlinks=False):
                        runs.append((entry.name, entry.stat(follow_symlinks=False).st_uid))
                except OSError:
                    continue
    except OSError:
        return by_owner
    for name, owner in sorted(runs):
        paths = [(owner, path) for path in _listed(root / name)]
        by_owner.setdefault(owner, []).extend(paths)
    for paths in by_owner.values():
        paths.reverse()  # popped from the end: read in name order
    return by_owner


#: A process record's name; the run directory holds other files of a rank's beside it.
_RECORD_NAME = re.compile(r"rank-[0-9]{1,9}\.json")


def _listed(run: Path) -> list[Path]:
    """The ``rank-*.json`` files of one run directory, in name order (bounded)."""
    names: list[str] = []
    try:
        with os.scandir(run) as entries:
            for index, entry in enumerate(entries):
                if index >= MAX_ENTRIES:
                    break
                if _RECORD_NAME.fullmatch(entry.name):  # not rank-N.skip_batches.json and the like
                    names.append(entry.name)
    except OSError:
        return []
    return [run / name for name in sorted(names)]


def _int(data: Mapping[str, Any], key: str, *, minimum: int, default: int | None = None) -> int:
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _number(data: Mapping[str, Any], key: str, *, default: float | None = None) -> float:
    value = data.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def _optional_number(data: Mapping[str, Any], key: str) -> float | None:
    return None if data.get(key) is None else _number(data, key)


def _text(data: Mapping[str, Any], key: str, *, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or len(value) > 256 or not _printable_utf8(value):
        shown = repr(value)[:80]
        raise ValueError(f"{key} must be printable UTF-8 of at most 256 characters, got {shown}")
    return value


def _printable_utf8(value: str) -> bool:
    """Encodable as UTF-8 (no lone surrogate, which breaks every exposition) and no controls."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(ord(character) < 32 or ord(character) == 127 for character in value)


def _flight(value: object) -> tuple[int, int, int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3:
        raise ValueError(f"flight: expected three sequence numbers, got {value!r:.80}")
    numbers = []
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool) or not -1 <= item < 2**63:
            raise ValueError(f"flight: expected sequence numbers >= -1, got {item!r:.40}")
        numbers.append(item)
    return numbers[0], numbers[1], numbers[2]


def _optional_text(data: Mapping[str, Any], key: str) -> str | None:
    return None if data.get(key) is None else _text(data, key)


def _uuid_list(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > 64:
        raise ValueError(f"gpu_uuids must be a list of at most 64 strings, got {value!r:.80}")
    uuids = []
    for item in value:
        if not isinstance(item, str) or len(item) > 128 or not _UUID.fullmatch(item):
            raise ValueError(f"gpu_uuids holds {item!r:.80}, not a UUID string")
        uuids.append(item)
    return uuids
