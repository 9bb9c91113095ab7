"""Everything a Monitor holds that outlives a call, and its one bounded shutdown.

Closed once: by ``Monitor.detach()`` or, for a Monitor dropped without it, by its
finalizer. Nothing here refers back to the Monitor, so a dropped Monitor can be
collected while its threads still run.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stabmon.export.event_log import EventLog
from stabmon.export.exporter import Exporter
from stabmon.probes.collectives import CollectiveCounter
from stabmon.probes.worker_stacks import WorkerStacks
from stabmon.shared.background import PeriodicThread
from stabmon.shared.exit_signals import SigtermRecorder
from stabmon.shared.own_record import Registration
from stabmon.shared.wrapping import Hold
from stabmon.wiring.hooks import HookSet

__all__ = ["SHUTDOWN_SECONDS", "Resources"]

#: All threads together get this long to stop (however many hang).
SHUTDOWN_SECONDS = 1.0


@dataclass
class Resources:
    """Everything that outlives a call: closed once, by ``detach()`` or by garbage collection."""

    hooks: HookSet | None = None
    threads: list[PeriodicThread] = field(default_factory=list)
    exporter: Exporter | None = None
    events: EventLog | None = None
    registration: Registration | None = None
    at_exit: Callable[[], None] | None = None
    #: Writes "signal"/SIGTERM into the record when SIGTERM ends the process (None: not ours).
    sigterm: SigtermRecorder | None = None
    #: At interpreter exit, judge the results still waiting: the last steps before a crash
    #: are the ones that explain it.
    judge_at_exit: Callable[[], None] | None = None
    #: The torch.distributed wrappers that count collectives (hang evidence).
    collectives: CollectiveCounter | None = None
    #: The chained ``worker_init_fn`` of tracked loaders (worker stacks on a stall).
    worker_stacks: WorkerStacks | None = None
    #: This Monitor's hold on the sys.excepthook/sys.exit observers (ExitWatch).
    exit_watch: Hold[object] | None = None

    def close(self, deadline: float | None = None) -> None:
        """Release everything; threads are waited for until ``deadline`` (``time.monotonic``).

        Every thread is asked to stop first and then joined against the one deadline, so
        closing costs the slowest thread's stop, not the sum of them, and never more than
        ``SHUTDOWN_SECONDS`` however many threads hang.
        """
        if deadline is None:
            deadline = time.monotonic() + SHUTDOWN_SECONDS
        for hook in (self.at_exit, self.judge_at_exit):
            if hook is not None:
                atexit.unregister(hook)
        if self.sigterm is not None:
            self.sigterm.uninstall()
            self.sigterm = None
        if self.hooks is not None:
            self.hooks.remove()
        if self.collectives is not None:
            self.collectives.uninstall()
        if self.worker_stacks is not None:
            self.worker_stacks.uninstall()
        if self.exit_watch is not None:
            self.exit_watch.release()
        for thread in self.threads:
            thread.request_stop()
        if self.registration is not None:
            try:
                self.registration.remove()
            except OSError:
                pass  # the daemon reports a record whose process is gone as down
        if self.exporter is not None:
            try:
                self.exporter.stop(deadline - time.monotonic())
            except OSError:
                pass  # the socket is gone either way
        for thread in self.threads:
            thread.join(deadline - time.monotonic())
        if self.events is not None:
            self.events.close()
