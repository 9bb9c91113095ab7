"""stabmon.daemon.trust on a fixture /proc tree: which ports a record may advertise.

The tables are written in the kernel's ``/proc/<pid>/net/tcp`` format (hex
``address:port``, state ``0A`` for LISTEN, the owner's uid in column 8), as
client_python's tests stand a fixture tree in for ``/proc``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stabmon.daemon import trust
from stabmon.daemon.trust import ListeningSockets, owner_may_speak_for, record_port

_HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt"
    "   uid  timeout inode\n"
)


def _row(slot: int, port: int, state: str, uid: int) -> str:
    return (
        f"   {slot}: 0100007F:{port:04X} 00000000:0000 {state} 00000000:00000000 "
        f"00:00000000 00000000  {uid}        0 {1000 + slot} 1 0000000000000000 100 0 0 10 0\n"
    )


def _proc(
    tmp_path: Path,
    pid: int,
    tcp: str | None,
    tcp6: str | None = None,
    *,
    namespace: str | None = None,
) -> Path:
    net = tmp_path / str(pid) / "net"
    net.mkdir(parents=True)
    if tcp is not None:
        (net / "tcp").write_text(_HEADER + tcp)
    if tcp6 is not None:
        (net / "tcp6").write_text(_HEADER + tcp6)
    if namespace is not None:  # the kernel's link names the namespace, e.g. net:[4026531840]
        (tmp_path / str(pid) / "ns").mkdir()
        (tmp_path / str(pid) / "ns" / "net").symlink_to(namespace)
    return tmp_path


@pytest.mark.parametrize(
    ("url", "port"),
    [
        ("http://gpu-node-3:9400/metrics", 9400),
        ("https://[::1]:9401/metrics", 9401),
        ("http://gpu-node-3/metrics", None),  # no port written: nothing to verify
        ("http://gpu-node-3:99999/metrics", None),
        ("http://gpu-node-3:0/metrics", None),
        ("http://gpu-node-3:abc/metrics", None),
        ("http://[::1:9400/metrics", None),  # a broken IPv6 bracket
        ("", None),
        (None, None),
    ],
)
def test_record_port_takes_only_a_valid_explicit_port(url: str | None, port: int | None) -> None:
    assert record_port(url) == port


def test_listening_sockets_reads_listen_rows_of_both_tables_and_skips_the_rest(
    tmp_path: Path,
) -> None:
    tcp = (
        _row(0, 9400, "0A", 1000)
        + _row(1, 9500, "01", 1000)  # ESTABLISHED: a client, not a listener
        + "   2: garbage\n"
        + "   3: 0100007F:ZZZZ 00000000:0000 0A 0:0 0:0 0 1000 0 1\n"  # port not hex
    )
    proc = _proc(tmp_path, 42, tcp, tcp6=_row(0, 9401, "0A", 0))

    assert ListeningSockets(proc).of(42) == {(9400, 1000), (9401, 0)}


def test_listening_sockets_is_empty_when_the_process_has_no_tables(tmp_path: Path) -> None:
    assert ListeningSockets(tmp_path).of(7) == set()


def test_listening_sockets_does_not_follow_a_symlinked_table(tmp_path: Path) -> None:
    elsewhere = tmp_path / "planted"
    elsewhere.write_text(_HEADER + _row(0, 9400, "0A", 1000))
    proc = _proc(tmp_path, 42, tcp=None)
    (proc / "42" / "net" / "tcp").symlink_to(elsewhere)

    assert ListeningSockets(proc).of(42) == set()


def test_verified_port_needs_the_port_listening_as_the_same_uid(tmp_path: Path) -> None:
    sockets = ListeningSockets(
        _proc(tmp_path, 42, _row(0, 9400, "0A", 1000) + _row(1, 9402, "0A", 2000))
    )

    assert sockets.verified_port(42, 1000, "http://gpu-node-3:9400/metrics") == 9400
    # Another user's listener on the advertised port proves nothing for this record.
    assert sockets.verified_port(42, 1000, "http://gpu-node-3:9402/metrics") is None
    assert sockets.verified_port(42, 1000, "http://gpu-node-3:9404/metrics") is None
    assert sockets.verified_port(42, 1000, None) is None


def test_listening_sockets_reads_the_tables_of_a_namespace_once_for_all_its_processes(
    tmp_path: Path,
) -> None:
    # Ranks 42 and 43 share a namespace; 44 has its own; 45's link cannot be read (another
    # user's process, to a daemon without ptrace access).
    _proc(tmp_path, 42, _row(0, 9400, "0A", 1000), "", namespace="net:[4026531840]")
    _proc(tmp_path, 43, _row(0, 9400, "0A", 1000), "", namespace="net:[4026531840]")
    _proc(tmp_path, 44, _row(0, 9500, "0A", 1000), "", namespace="net:[4026532999]")
    _proc(tmp_path, 45, _row(0, 9600, "0A", 1000), "")
    sockets = ListeningSockets(tmp_path)

    assert sockets.verified_port(42, 1000, "http://node:9400/metrics") == 9400
    for pid in (42, 43, 44, 45):  # what the next read would see, if there were one
        (tmp_path / str(pid) / "net" / "tcp").write_text(_HEADER + _row(0, 9401, "0A", 1000))
    assert sockets.verified_port(43, 1000, "http://node:9400/metrics") == 9400  # not read again
    assert sockets.verified_port(43, 1000, "http://node:9401/metrics") is None
    # Another namespace, and a pid whose namespace is unknown, are read for themselves.
    assert sockets.of(44) == {(9401, 1000)}
    assert sockets.of(45) == {(9401, 1000)}
    # A new poll reads again.
    assert ListeningSockets(tmp_path).verified_port(43, 1000, "http://node:9401/metrics") == 9401


def test_tables_read_while_a_process_left_its_namespace_are_not_lent_to_the_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Process 42 unshares a namespace of its own while its tables are read, and listens there
    # on a port that, in the namespace it left, another user's process holds.
    _proc(tmp_path, 42, _row(0, 9400, "0A", 1000), "", namespace="net:[4026531840]")
    _proc(tmp_path, 43, _row(0, 9400, "0A", 2000), "", namespace="net:[4026531840]")
    read = trust._read_listening

    def moving(pid: int, proc: Path) -> tuple[frozenset[tuple[int, int]], bool]:
        found = read(pid, proc)
        if pid == 42:
            (proc / "42" / "ns" / "net").unlink()
            (proc / "42" / "ns" / "net").symlink_to("net:[4026533000]")
        return found

    monkeypatch.setattr(trust, "_read_listening", moving)
    sockets = ListeningSockets(tmp_path)

    assert sockets.of(42) == {(9400, 1000)}  # what 42 itself has, this once
    assert sockets.of(43) == {(9400, 2000)}  # the namespace it left, read for itself


def test_tables_read_in_part_are_not_lent_to_the_namespace(tmp_path: Path) -> None:
    # No tcp6 table (IPv6 off, or the process exiting as it was read): used, not shared.
    _proc(tmp_path, 42, _row(0, 9400, "0A", 1000), namespace="net:[4026531840]")
    _proc(tmp_path, 43, _row(0, 9401, "0A", 1000), "", namespace="net:[4026531840]")
    sockets = ListeningSockets(tmp_path)

    assert sockets.of(42) == {(9400, 1000)}
    assert sockets.of(43) == {(9401, 1000)}


def test_owner_may_speak_only_for_processes_of_its_own_uid() -> None:
    assert owner_may_speak_for(1000, 1000, pid=42)
    assert not owner_may_speak_for(1000, 0, pid=42)
    assert not owner_may_speak_for(0, 1000, pid=42)
