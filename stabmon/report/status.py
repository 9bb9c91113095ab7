"""``stabmon status``: scrape running exporters and print one line per rank, for people and probes.

Each URL is scraped once over HTTP, or HTTPS with ``--cafile`` and
``--basic-auth-file`` for exporters that serve TLS and basic auth, and parsed
with prometheus-client's parser; metric names come from :mod:`stabmon.contract`.
Without URLs, the ranks registered in the run directory are scraped
(:mod:`stabmon.report.status_targets`): the caller's own runs, or every user's
with ``--all``. A rank is unhealthy when it is stalled, suspected of leaking
memory, has seen a non-finite gradient or loss, or does not answer; ``stabmon
status`` then exits 1, so it serves as a health check in scripts and Kubernetes
probes.

Records in the run directory may be written by any user of the node, so each
row is keyed by its record, never by URL: a record's row shows only what its
exporter says of the record's own run and rank, and two records naming one URL
are two rows. Only ``http``/``https`` URLs are scraped, never a redirect, and
the operator's ``--basic-auth-file`` credentials go only to URLs given on the
command line and to records :func:`~stabmon.report.status_targets.may_authenticate`
allows (the caller's own live process, listening on that port). A record whose
process is gone is not scraped. All scrapes run at once, against one deadline,
``--timeout`` after the start (a server that trickles, or never answers, is
unreachable; twenty of them cost the same ``--timeout`` as one).

The step rate is the steps counted by the step-duration histogram divided by
its sum: steps per second of training time, over the process's life.
"""

from __future__ import annotations

import math
import queue
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from stabmon import contract
from stabmon.errors import StabmonError
from stabmon.export.security import Security
from stabmon.report.status_targets import RegisteredTarget, may_authenticate
from stabmon.shared.safefs import read_regular
from stabmon.shared.threads import start_without_signals

__all__ = [
    "Credentials",
    "MAX_PARALLEL",
    "RankStatus",
    "RegisteredTarget",
    "format_table",
    "require_urls",
    "scrape_status",
]

#: Scrapes in flight at once; the rest start as these end, all within one deadline.
MAX_PARALLEL = 32

_MAX_BYTES = 8 * 2**20
_MAX_CA_BYTES = 2**20
_SCHEMES = ("http", "https")

Samples = list[tuple[str, dict[str, str], float]]


@dataclass(frozen=True)
class RankStatus:
    """What one exporter says about its rank (``error`` set when it could not be scraped)."""

    url: str
    run: str = "?"
    rank: str = "?"
    steps: float | None = None
    step_rate: float | None = None
    last_step_age: float | None = None
    grad_norm: float | None = None
    nonfinite: float = 0.0
    memory_bytes: float | None = None
    memory_device: str = ""
    drift: float | None = None
    stalled: bool = False
    leaking: tuple[str, ...] = ()
    anomalies: float = 0.0
    #: Replica checks that found the data-parallel replicas' parameters different.
    replica_mismatches: float = 0.0
    error: str | None = None
    #: Hang evidence: the loop phase now, the stalled state (None unless stalled), collectives.
    phase: str = ""
    hang_state: str | None = None
    collectives: float = 0.0

    @property
    def problems(self) -> list[str]:
        found = []
        if self.error is not None:
            found.append("unreachable")
        if self.stalled:
            found.append("stalled")
        if self.leaking:
            found.append(f"leak on {','.join(self.leaking)}")
        if self.nonfinite:
            found.append("non-finite")
        if self.replica_mismatches:
            found.append("replicas differ (silent data corruption)")
        return found

    @property
    def healthy(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Credentials:
    """How to reach exporters served with ``tls_certfile`` and ``basic_auth_file``."""

    #: Trusts these certificates (the ranks' own ``tls_certfile`` when it is self-signed).
    tls: ssl.SSLContext | None = None
    #: The ``Authorization`` header value for basic auth.
    authorization: bytes | None = None

    @classmethod
    def from_files(cls, cafile: str | None, basic_auth_file: str | None) -> Credentials:
        """Read both files up front; raises :class:`StabmonError` naming the file and option."""
        tls = None
        if cafile is not None:
            try:  # read first, never blocking: a FIFO named as --cafile is an error, not a hang
                pem = read_regular(cafile, _MAX_CA_BYTES).decode("ascii")
                tls = ssl.create_default_context(cadata=pem)
            except (OSError, ValueError, ssl.SSLError) as error:
                raise StabmonError(
                    f"--cafile {cafile}: not a PEM certificate file that can be read ({error})"
                ) from error
        authorization = None
        if basic_auth_file is not None:
            try:
                authorization = Security(basic_auth_file=basic_auth_file).expected_authorization()
            except (OSError, ValueError) as error:
                raise StabmonError(f"--basic-auth-file: {error}") from error
        return cls(tls=tls, authorization=authorization)


def scrape_status(
    targets: Sequence[str | RegisteredTarget],
    *,
    timeout: float = 5.0,
    credentials: Credentials = Credentials(),  # noqa: B008 - frozen, so one shared default is safe
    clock: Callable[[], float] = time.time,
    authenticate: Callable[[RegisteredTarget], bool] = may_authenticate,
) -> list[RankStatus]:
    """The statuses of ``targets``, in their order: URLs (given on the command line) or records.

    A URL's statuses are what its exporter says (one per rank it serves) and get the
    credentials. A record's status is what its exporter says of the record's own run and
    rank only; it gets the credentials only when ``authenticate(record)`` allows it, and
    a record whose process is gone is not scraped. Only http and https are scraped.
    Scrapes run in parallel (at most :data:`MAX_PARALLEL` at once) and every one ends
    within ``timeout`` seconds of the call, in all.
    """
    deadline = time.monotonic() + timeout
    plans = [_plan(target, credentials, authenticate) for target in targets]
    outcomes = _scrape_all(
        [(url, sent) for url, sent, _ in plans if sent is not None], deadline, timeout
    )
    statuses: list[RankStatus] = []
    for (url, sent, early), target in zip(plans, targets, strict=True):
        if sent is None:
            assert early is not None
            statuses.append(early)
            continue
        outcome = outcomes.pop(0)
        run, rank = ("?", "?") if isinstance(target, str) else (target.run, target.rank)
        if isinstance(outcome, BaseException):
            problem = _problem(outcome, timeout)
            statuses.append(RankStatus(url=url, run=run, rank=rank, error=problem))
            continue
        found = _statuses(url, outcome, clock())
        if isinstance(target, str):
            statuses.extend(found)
            continue
        own = [status for status in found if (status.run, status.rank) == (run, rank)]
        if not own:
            served = ", ".join(f"{s.run}/{s.rank}" for s in found if s.error is None)
            failure = next((s.error for s in found if s.error is not None), None)
            if served or failure is None:
                failure = f"does not serve rank {rank} of run {run} (it serves {served[:200]})"
            own = [RankStatus(url=url, run=run, rank=rank, error=failure)]
        statuses.extend(own)
    return statuses


def _plan(
    target: str | RegisteredTarget,
    credentials: Credentials,
    authenticate: Callable[[RegisteredTarget], bool],
) -> tuple[str, Credentials | None, RankStatus | None]:
    """(url, the credentials to send, None) to scrape; (url, None, status) when not."""
    url = target if isinstance(target, str) else target.url
    run, rank = ("?", "?") if isinstance(target, str) else (target.run, target.rank)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in _SCHEMES:
        refused = f"not scraped: {scheme or 'no'} scheme; stabmon status reads only http(s)"
        return url, None, RankStatus(url=url, run=run, rank=rank, error=refused + ":// URLs")
    if isinstance(target, str):
        return url, credentials, None
    if not target.alive:
        gone = (f"not scraped: process {target.pid} is not running (killed or crashed; its "
                "record remains, and its port may be anyone's now)")  # fmt: skip
        return url, None, RankStatus(url=url, run=run, rank=rank, error=gone)
    if credentials.authorization is not None and not authenticate(target):
        return url, Credentials(tls=credentials.tls), None
    return url, credentials, None


def _problem(error: BaseException, timeout: float) -> str:
    if isinstance(error, urllib.error.HTTPError):  # before URLError, its base class
        hint = " (see --basic-auth-file)" if error.code == 401 else ""
        return f"HTTP {error.code} {error.reason}{hint}"
    reason = getattr(error, "reason", None) or error
    if isinstance(reason, TimeoutError):  # the deadline, or a read's own timeout just before it
        return f"no whole answer within {timeout:g} s (see --timeout)"
    return f"{type(error).__name__}: {reason}"


def format_table(statuses: Sequence[RankStatus]) -> str:
    """The compact table ``stabmon status`` prints, one line per rank."""
    header = ("run", "rank", "steps", "steps/s", "step age", "grad norm", "nonfinite",
              "memory", "drift", "stalled", "leak", "anomalies", "health")  # fmt: skip
    rows = [header]
    for status in statuses:
        if status.error is not None:
            rows.append((status.run, status.rank, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                         f"UNREACHABLE {status.url}: {status.error}"))  # fmt: skip
            continue
        rows.append((
            status.run,
            status.rank,
            _count(status.steps),
            "-" if status.step_rate is None else f"{status.step_rate:.3g}",
            "-" if status.last_step_age is None else f"{status.last_step_age:.1f}s",
            "-" if status.grad_norm is None else f"{status.grad_norm:.4g}",
            _count(status.nonfinite),
            _memory(status),
            "-" if status.drift is None else f"{status.drift:+.1%}",
            "yes" if status.stalled else "no",
            ",".join(status.leaking) or "no",
            _count(status.anomalies),
            "ok" if status.healthy else "UNHEALTHY: " + ", ".join(status.problems),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows if i < len(row) - 1) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True))
        + "  "
        + row[-1]
        for row in rows
    )


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: following it would carry the credentials to another URL."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _scrape_all(
    jobs: Sequence[tuple[str, Credentials]], deadline: float, timeout: float
) -> list[Samples | BaseException]:
    """Each job's samples or error, scraped by up to :data:`MAX_PARALLEL` threads, given up
    at ``deadline`` (``time.monotonic``).

    Socket timeouts bound each read, not a request: a server that sends one byte a second
    would hold a plain read for ever, so the caller waits on the deadline, not on the
    threads. They are daemons and hold nothing: any still working end with the command.
    """
    results: list[Samples | BaseException | None] = [None] * len(jobs)
    pending: queue.Queue[int] = queue.Queue()
    for index in range(len(jobs)):
        pending.put(index)
    done = threading.Semaphore(0)

    def work() -> None:
        while time.monotonic() < deadline:
            try:
                index = pending.get_nowait()
            except queue.Empty:
                return
            url, sent = jobs[index]
            try:
                results[index] = _scrape(url, max(deadline - time.monotonic(), 0.001), sent)
            except BaseException as error:  # handed to the caller, who reports it
                if isinstance(error, urllib.error.HTTPError):
                    error.close()  # its response's socket: the status line is all we keep
                results[index] = error
            done.release()

    for _ in range(min(len(jobs), MAX_PARALLEL)):
        start_without_signals(
            threading.Thread(target=work, name="stabmon-status-scrape", daemon=True)
        )
    for _ in jobs:
        if not done.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            break
    late = TimeoutError(f"no whole answer within {timeout:g} s (see --timeout)")
    return [late if result is None else result for result in results]


def _scrape(url: str, timeout: float, credentials: Credentials) -> Samples:
    request = urllib.request.Request(url)
    if credentials.authorization is not None:
        request.add_header("Authorization", credentials.authorization.decode("ascii"))
    handlers: list[urllib.request.BaseHandler] = [_NoRedirects()]
    if credentials.tls is not None:
        handlers.append(urllib.request.HTTPSHandler(context=credentials.tls))
    opener = urllib.request.build_opener(*handlers)
    with opener.open(request, timeout=timeout) as response:
        body = response.read(_MAX_BYTES + 1)
    if len(body) > _MAX_BYTES:
        raise ValueError(f"more than {_MAX_BYTES} bytes: not a stabmon exporter")
    return [
        (sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(body.decode("utf-8", "replace"))
        for sample in family.samples
    ]


def _statuses(url: str, samples: Samples, now: float) -> list[RankStatus]:
    """One status per (run, rank) found in one scrape (an exporter serves one rank)."""
    keys = sorted({(labels.get("run", "?"), labels.get("rank", "?"))
                   for name, labels, _ in samples if name == contract.STEPS.name})  # fmt: skip
    if not keys:
        return [RankStatus(url=url, error=f"no {contract.STEPS.name}: not a stabmon rank exporter")]
    return [_status(url, run, rank, samples, now) for run, rank in keys]


def _status(url: str, run: str, rank: str, samples: Samples, now: float) -> RankStatus:
    mine = [
        (n, lbl, v) for n, lbl, v in samples if lbl.get("run") == run and lbl.get("rank") == rank
    ]

    def one(name: str) -> float | None:
        values = [v for n, _, v in mine if n == name]
        return values[0] if values else None

    def by(name: str, label: str) -> dict[str, float]:
        return {lbl.get(label, ""): v for n, lbl, v in mine if n == name}

    duration = contract.STEP_DURATION.name
    count, total = one(f"{duration}_count"), one(f"{duration}_sum")
    last_step = one(contract.LAST_STEP_TIMESTAMP.name)
    devices = by(contract.DEVICE_MEMORY_ALLOCATED.name, "device")
    memory_device, memory = max(devices.items(), key=lambda item: item[1], default=("", None))
    if memory is None:
        memory, memory_device = one(contract.HOST_MEMORY_RSS.name), "host"
    drifts = {device: v for device, v in by(contract.MEMORY_DRIFT.name, "device").items()
              if math.isfinite(v)}  # fmt: skip
    leaks = by(contract.MEMORY_LEAK_SUSPECTED.name, "device")
    return RankStatus(
        url=url,
        run=run,
        rank=rank,
        steps=one(contract.STEPS.name),
        step_rate=count / total if count and total else None,
        last_step_age=max(now - last_step, 0.0) if last_step else None,
        grad_norm=one(contract.GRAD_NORM.name),
        nonfinite=(one(contract.NONFINITE_GRAD_STEPS.name) or 0.0)
        + (one(contract.NONFINITE_LOSS.name) or 0.0),
        memory_bytes=memory,
        memory_device=memory_device,
        drift=max(drifts.values(), key=abs) if drifts else None,
        stalled=bool(one(contract.STALLED.name)),
        leaking=tuple(sorted(device for device, v in leaks.items() if v)),
        anomalies=sum(by(contract.ANOMALIES.name, "kind").values()),
        replica_mismatches=one(contract.REPLICA_MISMATCHES.name) or 0.0,
        phase=next((p for p, v in by(contract.LOOP_PHASE.name, "phase").items() if v == 1), ""),
        hang_state=next(
            (state for state, v in by(contract.HANG_STATE.name, "state").items() if v == 1), None
        ),
        collectives=one(contract.COLLECTIVES.name) or 0.0,
    )


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _memory(status: RankStatus) -> str:
    if status.memory_bytes is None:
        return "-"
    return f"{status.memory_bytes / 2**20:,.0f}MiB {status.memory_device}".strip()


def require_urls(urls: Sequence[object], root: Path, others: int = 0) -> None:
    """Raise the one-line error of a run directory with nothing of ours to scrape."""
    if not urls:
        missing = "" if root.exists() else " (it does not exist)"
        hidden = f" for you ({others} rank(s) of other users; --all shows them)" if others else ""
        raise StabmonError(
            f"no running stabmon process is registered under {root}{missing}{hidden}; "
            "pass exporter URLs (stabmon status http://host:9400/metrics) or the --run-dir "
            "the training uses"
        )
