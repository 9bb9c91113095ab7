"""This process in the run directory, for the node daemon: its record, and how the run ended.

:func:`register` writes the record at attach (atomically, see :mod:`stabmon.shared.rundir`)
and arranges that it says how the process ended: ``clean``/``exception`` at
interpreter exit (:class:`~stabmon.shared.rundir.ExitWatch`), ``signal`` on SIGTERM. A
duplicate record (another live process with this run id and rank) is logged once and
counted. Also here: the attach-time identity checks that report as anomalies
(``LOCAL_RANK`` naming no device, parameters on the wrong device).

Nothing registered holds the Monitor: the atexit and signal hooks hold the
registration weakly, so a dropped Monitor can be collected.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import socket
import time
import weakref
from collections.abc import Sequence

import psutil
import torch

from stabmon.pipeline.recorder import Recorder
from stabmon.probes.identity import local_rank_problem, torch_device_uuids
from stabmon.probes.placement import Misplaced
from stabmon.shared.exit_signals import SigtermRecorder
from stabmon.shared.guard import Guard
from stabmon.shared.log import LogLimiter
from stabmon.shared.own_record import ExitWatch, Registration
from stabmon.shared.rundir import ProcessRecord, RunPaths, boot_id, pid_namespace
from stabmon.wiring.resources import Resources

__all__ = ["check_local_rank", "register", "report_misplaced"]


def register(
    resources: Resources,
    paths: RunPaths,
    *,
    run_id: str,
    local_rank: int,
    devices: Sequence[torch.device],
    metrics_url: str | None,
    stall_seconds: float | None,
    steps: int,
    guard: Guard,
    limiter: LogLimiter,
) -> None:
    """Register this process in the run directory (never raises); fills ``resources``.

    A first write that fails (say the run directory is not yet writable) is retried by
    the heartbeat thread; at interpreter exit the record says whether the run ended
    cleanly or on an uncaught exception.
    """
    with guard.contain("rundir"):
        registration = Registration(
            paths.root,
            paths.record,
            ProcessRecord(
                pid=os.getpid(),
                create_time=psutil.Process().create_time(),
                run=run_id,
                rank=paths.rank,
                local_rank=local_rank,
                hostname=socket.gethostname(),
                gpu_uuids=tuple(torch_device_uuids(devices)),
                cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                metrics_url=metrics_url,
                attached_unix=time.time(),
                stall_seconds=stall_seconds,
                boot_id=boot_id(),
                pid_namespace=pid_namespace(),
            ),
            on_duplicate=functools.partial(_report_duplicate, paths, guard, limiter),
        )
        resources.registration = registration
        resources.exit_watch = ExitWatch.install()
        resources.at_exit = functools.partial(_record_exit, weakref.ref(registration))
        atexit.register(resources.at_exit)
        resources.sigterm = SigtermRecorder.install(
            functools.partial(_record_sigterm, weakref.ref(registration))
        )
        registration.write(last_step_unix=None, steps=steps, now=time.time())


def _report_duplicate(
    paths: RunPaths, guard: Guard, limiter: LogLimiter, other: ProcessRecord
) -> None:
    """Another live process already registered this run id and rank: say so, count it."""
    guard.count("rundir")
    limiter.once(
        "rundir:duplicate",
        logging.WARNING,
        "stabmon: process %d already registered run %r rank %d in %s; this process (%d) "
        "takes its record over and both append to one event log. Give each run its own "
        "run_id (or STABMON_RUN_ID), or each process its own RANK",
        other.pid,
        paths.run_id,
        paths.rank,
        paths.record,
        os.getpid(),
    )


def _record_exit(registration: weakref.ref[Registration]) -> None:
    """atexit: mark the record "clean" or "exception" so the daemon can tell a crash from an end."""
    target = registration()
    if target is not None:
        try:
            target.exited(ExitWatch.status(), time.time(), signal_name=ExitWatch.signal_name())
        except OSError:
            pass  # the daemon then sees a process that vanished: reported as down


def _record_sigterm(registration: weakref.ref[Registration]) -> None:
    """SIGTERM is ending the process: say so in the record, so no one is paged for a crash."""
    target = registration()
    if target is not None:
        target.exited("signal", time.time(), signal_name="SIGTERM")


def check_local_rank(recorder: Recorder, guard: Guard) -> None:
    """cuda:LOCAL_RANK must exist: say so in words, not as "invalid device ordinal"."""
    with guard.contain("hooks"):
        if torch.cuda.is_available():
            problem = local_rank_problem(os.environ, torch.cuda.device_count())
            if problem is not None:
                recorder.anomaly("device_mismatch", 0, problem, what="LOCAL_RANK")


def report_misplaced(recorder: Recorder, finding: Misplaced) -> None:
    """A parameter, input or optimizer state on the wrong device: a device_mismatch anomaly."""
    recorder.anomaly(
        "device_mismatch",
        recorder.global_step,
        f"{finding.message()} (device_check: raise makes this an error)",
        what=finding.what,
        device=finding.device,
        expected=finding.expected,
        names=list(finding.names[:20]),
    )
