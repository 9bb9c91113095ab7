"""What a rank does once it stalls: record its hang evidence, judge its node, act on request.

Design
------
The stall watchdog calls :meth:`StallResponder.stalled` at the edge, in its own
thread. The responder records the evidence (the watchdog's stall event already
holds every thread's stack; this adds the main thread's state from
:func:`stabmon.detectors.hang.classify`, the collectives issued and the step),
writes it into the rank's registration record so the other ranks of the node
see it, and, for ``stall_action: dump``, a stall file beside the event log.

:meth:`StallResponder.poll` runs in its own periodic thread: while stalled it
refreshes the state, reads the records of this run on this node, judges them
(:func:`stabmon.detectors.hang.judge`) and writes each new verdict to the event
log once; after the grace period it ends the process for ``stall_action:
exit`` with :data:`STALL_EXIT_CODE`. ``raise`` asks the interpreter to raise
:class:`stabmon.TrainingStalled` in the main thread at its next Python
instruction. A stall that ends before the grace period cancels the exit. The exit
deadline is set first at the stall and checked first at each poll, and
nothing on that path can block: NCCL's flight recorder, whose dump takes a
C++ lock a hung collective can hold for ever, is read in a thread of its own
(at most one at a time; the stall's evidence waits for it at most
:data:`FLIGHT_WAIT_SECONDS`).

Neither thread can run while a C call holds the GIL; the node daemon's
heartbeat age covers that case from outside the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from stabmon.detectors.hang import Verdict, classify, judge
from stabmon.detectors.stall import Heartbeat, PeerPhase, StallReport
from stabmon.errors import TrainingStalled
from stabmon.pipeline.recorder import Recorder
from stabmon.probes.collectives import CollectiveCounter
from stabmon.probes.flight_recorder import FlightRecorder
from stabmon.probes.loader import WorkerWatch
from stabmon.probes.worker_stacks import WorkerStack, WorkerStacks
from stabmon.shared.own_record import Registration
from stabmon.shared.rundir import write_atomic
from stabmon.shared.threads import start_without_signals
from stabmon.wiring.node_peers import NodePeers

__all__ = ["STALL_ACTIONS", "STALL_EXIT_CODE", "StallResponder"]

LOGGER = logging.getLogger("stabmon")

STALL_ACTIONS: tuple[str, ...] = ("none", "dump", "raise", "exit")
#: Exit status of ``stall_action: exit``: EX_TEMPFAIL (sysexits.h), "try again later", so a
#: scheduler or torchrun's ``--max-restarts`` restarts the job instead of idling its GPUs.
STALL_EXIT_CODE = 75
#: While stalled, the flight recorder is read at most this often (its dump takes a C++ lock).
FLIGHT_READ_SECONDS = 5.0
#: At the stall's edge, how long the evidence waits for the flight recorder's first read.
FLIGHT_WAIT_SECONDS = 1.0


class StallResponder:
    """Hang evidence, node verdict and the configured stall action of one rank."""

    def __init__(
        self,
        *,
        action: str,
        grace_seconds: float,
        rank: int,
        run: str,
        recorder: Recorder,
        heartbeat: Heartbeat,
        collectives: CollectiveCounter,
        registration: Registration | None,
        run_directory: Path,
        root: Path,
        clock: Callable[[], float] = time.monotonic,
        end_process: Callable[[int], None] = os._exit,
        worker_stacks: WorkerStacks | None = None,
        workers: WorkerWatch | None = None,
        flight_recorder: FlightRecorder | None = None,
    ) -> None:
        self._action = action
        self._grace = grace_seconds
        self._rank = rank
        self._run = run
        self._recorder = recorder
        self._heartbeat = heartbeat
        self._collectives = collectives
        self._registration = registration
        self._run_directory = run_directory
        self._root = root
        self._peers = NodePeers(run_directory, run=run, rank=rank, clock=clock)
        self._clock = clock
        self._end_process = end_process
        self._worker_stacks = worker_stacks
        self._flight_reads = _FlightReads(
            flight_recorder if flight_recorder is not None else FlightRecorder(), clock
        )
        #: While stalled: the flight recorder's (enqueued, started, completed), where available.
        self.flight: tuple[int, int, int] | None = None
        self._workers = workers
        #: While stalled in data_wait: the blocking frame of the loader worker it waits on.
        self._worker_where = ""
        self._main = threading.main_thread().ident
        #: While stalled: the main thread's state (``HANG_STATES``) and where; else None.
        self.state: str | None = None
        self.where = ""
        self._exit_at: float | None = None
        self._written_collectives = -1
        #: (culprits, reason) of the last verdict written: each is written once per stall.
        self._last_verdict: tuple[tuple[int, ...], str] | None = None
        self._lock = threading.Lock()

    # --- watchdog thread ----------------------------------------------------------------------

    def stalled(self, report: StallReport) -> None:
        """The watchdog declared a stall: record the evidence, then act as configured."""
        if self._action == "exit":
            with self._lock:  # first: nothing below (a record written to a hung mount, say)
                self._exit_at = self._clock() + self._grace  # may delay the exit it schedules
        self._recorder.stalled(report)
        # Outside the lock, waiting a bounded time: an NCCL hang can hold the dump's lock.
        self._flight_reads.read(wait=FLIGHT_WAIT_SECONDS)
        with self._lock:
            stack = report.stacks.get(self._main_key(report.stacks))
            state, _ = classify(stack or [], phase=report.phase,
                                collective=self._collectives.current)  # fmt: skip
            # Before the record is written: the node's verdict names the worker's frame.
            workers = self._capture_workers() if state == "data_wait" else []
            self._refresh(stack)
            self._recorder.write(
                "hang_evidence",
                step=self._recorder.global_step,
                phase=report.phase,
                state=self.state,
                where=self.where,
                collectives=self._collectives.issued,
                collective=self._collectives.current,
                flight=list(self.flight) if self.flight is not None else None,
                stall_action=self._action,
                # DataLoader workers are other processes: their stacks come from their own
                # faulthandler dump (stabmon.probes.worker_stacks), when track() installed it.
                worker_stacks=[
                    {"worker": s.worker, "pid": s.pid, "where": s.where, "stack": s.stack}
                    for s in workers
                ],
            )
            if self._action == "dump":
                self._dump(report)
            if self._action == "raise":
                self._raise_in_main()
            if self._action == "exit":
                LOGGER.error(
                    "stabmon: stalled; the process exits with status %d in %.0f s unless a "
                    "step completes (stall_action: exit)",
                    STALL_EXIT_CODE,
                    self._grace,
                )

    def resumed(self, lasted: float) -> None:
        self._recorder.resumed(lasted)
        with self._lock:
            self.state = None
            self.where = ""
            self.flight = None
            self._flight_reads.reset()
            self._worker_where = ""
            self._exit_at = None
            self._last_verdict = None
            self._write_record()

    # --- responder thread ---------------------------------------------------------------------

    def poll(self) -> None:
        """While stalled: refresh the evidence, judge the node, end the process when due."""
        with self._lock:
            # First, and never behind anything that can block (the flight recorder's read,
            # done in a thread of its own): a hung NCCL call must not keep the process alive.
            if self._exit_at is not None and self._clock() >= self._exit_at:
                self._exit()
                return
            if self.state is None:
                return
            self._refresh(None)
            verdict = self.node_verdict()
            if verdict is not None and (verdict.culprits, verdict.reason) != self._last_verdict:
                self._last_verdict = (verdict.culprits, verdict.reason)
                self._recorder.write(
                    "hang_verdict",
                    step=self._recorder.global_step,
                    culprits=list(verdict.culprits),
                    reason=verdict.reason,
                    world=verdict.world,
                    detail=verdict.message,
                )
                LOGGER.error("stabmon: hang verdict: %s", verdict.message)

    def node_verdict(self) -> Verdict | None:
        """The verdict over the records of this run on this node (this rank's own included).

        Only our own user's records (:class:`~stabmon.wiring.node_peers.NodePeers`): a record
        another local user wrote must not name a culprit.
        """
        evidence = self._peers.evidence()
        if not any(item.rank == self._rank for item in evidence):
            return None
        return judge(evidence)

    def peer_phase(self) -> PeerPhase:
        """Whether another rank of this run on this node holds a named phase.

        The watchdog asks once half its own limit has passed: this rank may wait on that
        one (a barrier while rank 0 saves alone), and the phase's limit applies to it too.
        """
        return self._peers.peer_phase()

    def _refresh(self, stack: list[str] | None) -> None:
        if stack is None:
            frame = sys._current_frames().get(self._main or -1)
            stack = (
                []
                if frame is None
                else [line.rstrip("\n") for line in traceback.format_stack(frame)]
            )
            del frame  # a frame pins its locals (tensors)
        before = (self.state, self.where, self._written_collectives, self.flight)
        self.flight = self._flight_reads.read(wait=0.0)  # the latest read; never waits
        self.state, self.where = classify(
            stack, phase=self._heartbeat.phase, collective=self._collectives.current
        )
        if self.state == "data_wait" and self._worker_where:
            self.where = self._worker_where  # where the loop's data actually is stuck
        if (self.state, self.where, self._collectives.issued, self.flight) != before:
            self._write_record()  # only a change: a long stall rewrites nothing

    def _capture_workers(self) -> list[WorkerStack]:
        """The stacks of the loader workers the main thread waits on (at most a second)."""
        if self._worker_stacks is None or self._workers is None:
            return []
        iterator = self._workers.iterator()
        if iterator is None:
            return []
        stacks = self._worker_stacks.capture(iterator)
        busy = [stack for stack in stacks if not stack.idle and stack.where] or [
            stack for stack in stacks if stack.where
        ]
        if busy:
            self._worker_where = f"{busy[0].where} (loader worker {busy[0].worker})"
        return stacks

    def _write_record(self) -> None:
        self._written_collectives = self._collectives.issued
        if self._registration is not None:
            self._registration.hang(
                state=self.state,
                where=self.where or None,
                collectives=self._collectives.issued,
                now=time.time(),
                flight=self.flight,
            )

    def _main_key(self, stacks: dict[str, list[str]]) -> str:
        suffix = f"({self._main})"
        return next((key for key in stacks if key.endswith(suffix)), "")

    def _dump(self, report: StallReport) -> None:
        lines = [
            f"stabmon stall dump: run {self._run} rank {self._rank} pid {os.getpid()}",
            f"phase {report.phase}; step {self._recorder.global_step}; silent "
            f"{report.silent_seconds:.1f} s (limit {report.limit_seconds:.1f} s)",
            f"state {self.state} at {self.where}; collectives issued {self._collectives.issued}"
            + (f"; inside {self._collectives.current}" if self._collectives.current else ""),
            "",
        ]
        for thread, stack in report.stacks.items():
            lines.append(f"--- thread {thread}")
            lines.extend(stack)
        path = self._run_directory / f"rank-{self._rank}.stall.txt"
        write_atomic(path, ("\n".join(lines) + "\n").encode("utf-8", "replace"))

    def _raise_in_main(self) -> None:
        if self._main is None:
            return
        # Delivered at the main thread's next Python instruction (not inside a blocking C call).
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(self._main), ctypes.py_object(TrainingStalled)
        )

    def _exit(self) -> None:
        self._recorder.write(
            "stall_exit",
            step=self._recorder.global_step,
            exit_code=STALL_EXIT_CODE,
            grace_seconds=self._grace,
            state=self.state,
            where=self.where,
        )
        LOGGER.error("stabmon: still stalled after the grace period; exiting with status %d",
                     STALL_EXIT_CODE)  # fmt: skip
        if self._registration is not None:
            self._registration.exited("exception", time.time())
        sys.stderr.flush()
        self._end_process(STALL_EXIT_CODE)


class _FlightReads:
    """The flight recorder read in a thread of its own, at most one at a time.

    Its dump takes a lock in C++ that a hung NCCL call can hold for ever: a read that
    never returns leaves one blocked daemon thread, and the callers keep the last value.
    """

    def __init__(self, recorder: FlightRecorder, clock: Callable[[], float]) -> None:
        self._recorder = recorder
        self._clock = clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._read_at: float | None = None
        self._generation = 0
        self._latest: tuple[int, int, int] | None = None

    def read(self, *, wait: float) -> tuple[int, int, int] | None:
        """Start a read when one is due and none is running; the latest result."""
        with self._lock:
            now = self._clock()
            due = self._read_at is None or now - self._read_at >= FLIGHT_READ_SECONDS
            if due and (self._thread is None or not self._thread.is_alive()):
                self._read_at = now
                self._thread = threading.Thread(
                    target=self._read, args=(self._generation,), daemon=True,
                    name="stabmon-flight-recorder",
                )  # fmt: skip
                start_without_signals(self._thread)
            thread = self._thread
        if wait > 0 and thread is not None:
            thread.join(wait)
        return self._latest

    def reset(self) -> None:
        """The stall ended: forget the numbers (a read still running is dropped)."""
        with self._lock:
            self._generation += 1
            self._read_at = None
            self._latest = None

    def _read(self, generation: int) -> None:
        progress = self._recorder.progress()  # never raises
        with self._lock:
            if generation == self._generation:
                self._latest = progress
