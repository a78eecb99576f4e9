"""What happens to a step's statistics once they are complete: detection, alerts, records.

A step completes in a communication callback (possibly on a gloo thread); the pipeline only
queues it there. The training thread hands the queued steps to a background thread at a point
every rank reaches in the same order: the first bucket of the next step (inside backward), or
``flush()`` / ``close()``. The background thread, one step at a time and in order:

1. runs the detector (``ddphooks.detect``) on it, the same on every rank, so every rank finds the
   same alerts; a detector error is reported once and never reaches training;
2. queues one ``logging`` warning per new alert (logger ``"ddphooks"``) on the log rank, emitted
   on a thread of its own (as are the pipeline's other warnings): the training thread waits for
   this one when it falls more than a step behind, and a logging handler that blocks (a stalled
   stderr pipe, a slow remote handler) must hold up nothing but its own messages;
3. hands the statistics and their alerts (with any alert raised outside the detector since the
   last record: the synchronisation watchdog's) to the record writer (log rank only). Nothing
   is added to the ``SilentStats`` itself: ``state.latest`` is final when its step completes.

At the same point of the following step the training thread collects the alerts of the steps it
handed over before (waiting only if the background thread is more than a step behind, so the
detector costs the training thread nothing while it keeps up) and calls ``on_alert(alert)`` for
each, on every rank. ``on_alert`` may raise to stop training (to abort or checkpoint): every rank
collects the same steps at the same point, so every rank raises there, before the next step's
first collective, and no rank is left waiting in a collective. An alert therefore reaches
``on_alert`` and ``SilentState.alerts`` when the step after next starts (at once on ``flush()``
and ``close()``); its ``step`` is the step it was found on.

If the system cannot start a thread (out of threads or memory), nothing raises into backward and
nothing is lost: the steps are processed on the training thread, and the warnings logged there,
until a thread starts again (one warning says so).

By then an accelerator's asynchronous copy of the step's statistics has long finished, so
reading them does not stall the device queue.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

from ddphooks.detect import Detector, Observation
from ddphooks.writer import RecordWriter

logger = logging.getLogger("ddphooks")


class _Warnings:
    """``logging`` warnings emitted in order on a daemon thread of their own, started when one is
    queued and ended when none is left: a handler that blocks holds up only that thread.

    Example::
        >>> warnings = _Warnings()
        >>> warnings.warn("ddphooks alert: %s", "rank 3 ...")   # returns at once
        >>> warnings.drain(5.0)                                  # True once it is emitted
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self._queued = 0
        self._emitted = 0
        self._thread: threading.Thread | None = None

    def warn(self, message: str, *args) -> None:
        with self._cond:
            self._queue.append((message, args))
            self._queued += 1
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="ddphooks-warnings", daemon=True)
            try:
                self._thread.start()
                return
            except RuntimeError:  # "can't start new thread" (out of threads or memory)
                self._thread = None  # the next warn() tries again
        # Emitted here, on the caller's thread, rather than lost or raised into backward.
        self._run(on_thread=False)

    def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every warning queued so far is emitted."""
        with self._cond:
            wanted = self._queued
            return self._cond.wait_for(lambda: self._emitted >= wanted, max(timeout, 0.0))

    def _run(self, on_thread: bool = True) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    if on_thread:
                        self._thread = None  # the next warn() starts another
                    return
                message, args = self._queue.popleft()
            try:
                logger.warning(message, *args)  # a handler's own errors go to its handleError
            except Exception:  # a filter or logger class that raises: printed as handleError does, and the next one goes on
                traceback.print_exc()
            finally:
                with self._cond:
                    self._emitted += 1
                    self._cond.notify_all()


class StepPipeline:
    """Detection and record writing for one ``SilentState``, on a daemon thread started with the
    first step.

    Args:
        detector: the online detector, or None (``detect=False``).
        writer: the record writer on the log rank, None elsewhere.
        on_alert: called with each new alert dict on every rank (None: nothing).
        warns: whether this rank logs the alerts (the log rank).

    Example::
        >>> pipeline = StepPipeline(Detector(), writer, on_alert=None, warns=True)
        >>> pipeline.complete(stats)   # communication thread
        >>> pipeline.process()         # training thread, next step: hands it to the background thread
        >>> pipeline.process()         # the step after: its alerts, on_alert
    """

    def __init__(self, detector: Detector | None, writer: RecordWriter | None, on_alert: Callable[[dict], object] | None, warns: bool) -> None:
        self.detector = detector
        self.writer = writer
        self.on_alert = on_alert
        self.warns = warns
        self.alerts: list[dict] = []
        self._cond = threading.Condition()
        self._pending: deque = deque()  # complete steps, not yet handed over
        self._work: deque = deque()  # handed over, not yet taken by the background thread
        self._handed = 0  # steps handed over so far
        self._done = 0  # steps the background thread has finished
        self._found: deque = deque()  # (step number in hand-over order, its alerts), not yet collected
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._detector_failed = False
        self._said_not_measured = False
        self._output_failed = False
        self._start_failed = False
        self._carried: list[dict] = []  # alerts raised outside the detector, for the next record
        self._warnings = _Warnings()

    def complete(self, stats) -> None:
        """Queue a complete step (any thread)."""
        with self._cond:
            self._pending.append(stats)

    def process(self, call_on_alert: bool = True, wait: bool = False) -> None:
        """Hand the queued steps to the background thread, collect the alerts of the steps handed
        over before (of every step with ``wait``), then run ``on_alert`` (training thread)."""
        started = True
        with self._cond:
            due = self._handed  # the same steps on every rank: those handed over at earlier calls
            if self._pending and (self.detector is not None or self.writer is not None):
                self._work.extend(self._pending)
                self._handed += len(self._pending)
                started = self._start()
                self._cond.notify_all()
            self._pending.clear()
            if wait:
                due = self._handed
        if not started:
            # No thread to spare: this rank's steps are processed here, on the training thread, so
            # they are neither lost nor waited for forever, and every rank collects the same alerts.
            self._run(on_thread=False)
        with self._cond:
            self._cond.wait_for(lambda: self._done >= due)
            found = []
            while self._found and self._found[0][0] < due:
                found.extend(self._found.popleft()[1])
        self.alerts.extend(found)
        if call_on_alert and self.on_alert is not None:
            for alert in found:
                self.on_alert(alert)

    def _start(self) -> bool:
        """Start the background thread unless it runs; False if the system cannot start one."""
        # Also after close(): a run that goes on training gets its steps processed, not stranded.
        if self._thread is not None and self._thread.is_alive():
            return True
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ddphooks-pipeline", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as error:  # "can't start new thread" (out of threads or memory); tried again next step
            self._thread = None  # nothing for close() to join
            if not self._start_failed:
                self._warnings.warn(
                    "ddphooks: the pipeline thread could not start (%s: %s); steps are processed on the training thread until it can",
                    type(error).__name__, error,
                )  # fmt: skip
            self._start_failed = True
            return False
        return True

    # -- the background thread -------------------------------------------------------------------
    def _run(self, on_thread: bool = True) -> None:
        """The background thread's loop; with ``on_thread=False``, the steps handed over so far,
        processed on the calling thread (when no background thread could start)."""
        while True:
            with self._cond:
                if on_thread:
                    self._cond.wait_for(lambda: self._work or self._stopping)
                if not self._work:
                    return
                stats = self._work.popleft()
            self._process(stats)

    def _process(self, stats) -> None:
        found: list[dict] = []
        try:
            if stats.failed_ranks:  # a rank's statistics failed (a bug): the step is not measured
                if not self._said_not_measured:
                    self._said_not_measured = True
                    self._warnings.warn(
                        "ddphooks: step %d is not measured: the statistics of rank(s) %s failed there (their log says why); "
                        "training is unchanged (said once)", stats.step, stats.failed_ranks,
                    )  # fmt: skip
                return
            found = self._detect(stats)
            if self.warns:
                for alert in found:
                    self._warnings.warn("ddphooks alert: %s", alert["message"])
            if self.writer is not None:
                with self._cond:
                    carried, self._carried = self._carried, []
                self.writer.submit((stats, carried + found))
        except Exception as error:  # reported once; the thread lives on, the training thread waits for its count
            if not self._output_failed:
                self._warnings.warn("ddphooks: step %d could not be written: %s: %s", stats.step, type(error).__name__, error)
            self._output_failed = True
        finally:
            with self._cond:
                self._found.append((self._done, found))
                self._done += 1
                self._cond.notify_all()

    def _detect(self, stats) -> list[dict]:
        if self.detector is None or self._detector_failed:
            return []
        try:
            return self.detector.update(Observation.from_stats(stats))
        except Exception as error:  # a detector bug must never stop training
            self._detector_failed = True
            self._warnings.warn("ddphooks: the detector failed at step %d and is off from now on: %s: %s", stats.step, type(error).__name__, error)
            return []

    def warn(self, message: str, *args) -> None:
        """A ``logging`` warning on the pipeline's warnings thread (returns at once, any thread)."""
        self._warnings.warn(message, *args)

    def raise_alert(self, alert: dict) -> None:
        """An alert found outside the detector (the synchronisation watchdog), where it was found:
        it joins ``alerts`` at once, is logged (log rank), goes with the next record written, and
        reaches ``on_alert`` (which may raise, to stop training)."""
        with self._cond:
            self.alerts.append(alert)
            if self.writer is not None:  # only the log rank writes records: elsewhere nothing carries it
                self._carried.append(alert)
        if self.warns:
            self._warnings.warn("ddphooks alert: %s", alert["message"])
        if self.on_alert is not None:
            self.on_alert(alert)

    # -- the end ---------------------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Process every completed step, then wait (``timeout`` seconds in all) for its warnings
        to be logged and its records written; False if a logging handler or a sink is still busy."""
        self.process(wait=True)
        deadline = time.monotonic() + timeout
        logged = self._warnings.drain(timeout)
        written = self.writer is None or self.writer.flush(max(deadline - time.monotonic(), 0.0))
        return logged and written

    def close(self, timeout: float, call_on_alert: bool = True) -> bool:
        try:
            self.process(call_on_alert, wait=True)
        finally:  # an on_alert that raises still gets the records written
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            deadline = time.monotonic() + timeout
            if self._thread is not None:  # every step is done: it ends at once
                self._thread.join(timeout)
            logged = self._warnings.drain(max(deadline - time.monotonic(), 0.0))
            closed = self.writer is None or self.writer.close(max(deadline - time.monotonic(), 0.0))
        return logged and closed
