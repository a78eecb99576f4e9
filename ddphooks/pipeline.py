"""What happens to a step's statistics once they are complete: detection, alerts, records.

A step completes in a communication callback (possibly on a gloo thread); the pipeline only
queues it there. The training thread hands the queued steps over at a point every rank reaches in
the same order: the first bucket of the next step (inside backward), or ``flush()`` / ``close()``.
Each step, in order:

1. goes to the detector (``ddphooks.detect``), the same on every rank, so every rank finds the
   same alerts. The state gives the pipeline a ``DetectorProcess``, which runs the detector in a
   process of its own; the training thread itself sends the step's slots there (``slots()``:
   the whole slots, or the compact wire's buffer above ``gather_max_world``), which returns at
   once, and at the next hand-over reads back the alerts of the steps handed over before (the
   child has long answered them): no other thread of this process runs Python for a step,
   where it would hold the GIL the training thread needs. Where the detector runs in this
   process (the child could not start, or the caller gave a ``Detector``) a daemon thread,
   started with the first step, runs it. A detector error is
   reported once and never reaches training; each alert is named with the group's
   ``RankTable`` (global rank, host, device: ``ddphooks.identity``);
2. per new alert, one ``logging`` warning (logger ``"ddphooks"``, log rank only) and one call of
   ``on_alert(alert)`` (every rank) are queued, each on a thread of its own: a logging handler
   that blocks (a stalled stderr pipe) or an ``on_alert`` that pages over a slow network holds
   up nothing but its own queue, and an exception in ``on_alert`` is logged, never raised;
3. the statistics and their alerts (with any alert raised outside the detector since the last
   record: the synchronisation watchdog's) go to the record writer (log rank only), whose
   thread builds the record (where the detector's process has not built it from the step's
   slots already: then it only adds the alerts) and writes it. Nothing is added to the ``SilentStats`` itself:
   ``state.latest`` is final when its step completes.

At the same point of the following step the training thread collects the alerts of the steps it
handed over before (waiting only if the detector is more than a step behind, so it costs the
training thread nothing while it keeps up) into ``SilentState.alerts``. Every rank collects the
same steps at the same point, so an alert of step ``s`` is in ``alerts`` on every rank from the
first bucket of step ``s + 2`` on (at once on ``flush()`` and ``close()``): that is what lets every
rank stop at the same step (``stop_on``, ``SilentState.should_stop``) without a collective of its
own.

If the system cannot start a thread (out of threads or memory), nothing raises into backward and
nothing is lost: the steps are processed on the training thread, and the warnings logged there,
until a thread starts again (one warning says so).

By then an accelerator's asynchronous copy of the step's statistics has long finished, so
reading them does not stall the device queue.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

from ddphooks.detect import Detector, Observation
from ddphooks.detect.process import DetectorProcess
from ddphooks.identity import RankTable
from ddphooks.writer import RecordWriter

logger = logging.getLogger("ddphooks")


class _Serial:
    """Calls run in order on a daemon thread of their own, started when one is queued and ended
    when none is left: a call that blocks (a logging handler on a stalled pipe, a user's
    ``on_alert`` that pages over the network) holds up only the calls queued after it. A call that
    raises is handed to ``failed`` with its traceback (by default printed to stderr, as logging's
    ``handleError`` does) and the next one goes on.

    Example::
        >>> calls = _Serial("ddphooks-warnings")
        >>> calls.submit(logger.warning, "ddphooks alert: %s", "rank 3 ...")   # returns at once
        >>> calls.drain(5.0)                                                    # True once it ran
    """

    def __init__(self, name: str, failed: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.failed = failed or (lambda trace: sys.stderr.write(trace))  # the stderr of the time, as pytest swaps it
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self._queued = 0
        self._done = 0
        self._thread: threading.Thread | None = None

    def submit(self, call: Callable, *args) -> None:
        with self._cond:
            self._queue.append((call, args))
            self._queued += 1
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            try:
                self._thread.start()
                return
            except RuntimeError:  # "can't start new thread" (out of threads or memory)
                self._thread = None  # the next submit tries again
        # Run here, on the caller's thread, rather than lost or raised into backward.
        self._run(on_thread=False)

    def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every call queued so far has run."""
        with self._cond:
            wanted = self._queued
            return self._cond.wait_for(lambda: self._done >= wanted, max(timeout, 0.0))

    def _run(self, on_thread: bool = True) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    if on_thread:
                        self._thread = None  # the next submit starts another
                    return
                call, args = self._queue.popleft()
            try:
                call(*args)
            except Exception:  # a logging filter that raises, a user's on_alert that fails: said, and the next goes on
                try:
                    self.failed(traceback.format_exc())
                except Exception:
                    traceback.print_exc()
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()


class StepPipeline:
    """Detection and record writing for one ``SilentState``: from the training thread to a
    ``DetectorProcess``, or on a daemon thread started with the first step (see the module).

    Args:
        detector: the online detector, or None (``detect=False``).
        writer: the record writer on the log rank, None elsewhere.
        on_alert: called with each new alert dict on every rank, off the training thread (None: nothing).
        warns: whether this rank logs the alerts (the log rank).
        ranks: the group's ``RankTable``: every alert is named with it (host, device, global rank).
        stop_on: the alert kinds that stop training (``should_stop``).

    Example::
        >>> pipeline = StepPipeline(Detector(), writer, on_alert=None, warns=True)
        >>> pipeline.complete(stats)   # communication thread
        >>> pipeline.process()         # training thread, next step: hands it over
        >>> pipeline.process()         # the step after: its alerts
    """

    def __init__(
        self,
        detector: Detector | None,
        writer: RecordWriter | None,
        on_alert: Callable[[dict], object] | None,
        warns: bool,
        ranks: RankTable | None = None,
        stop_on: frozenset[str] = frozenset(),
    ) -> None:
        self.detector = detector
        self.writer = writer
        self.on_alert = on_alert
        self.warns = warns
        self.ranks = ranks
        self.stop_on = stop_on
        self.alerts: list[dict] = []
        self.stopping: dict | None = None  # the first collected detector alert of a kind in stop_on
        self._cond = threading.Condition()
        self._processing = threading.Lock()  # process() on one thread at a time
        self._pending: deque = deque()  # complete steps, not yet handed over
        self._work: deque = deque()  # handed over, not yet taken by the background thread
        self._sent: deque = deque()  # (hand-over number, stats, sent to the detector's process), not finished yet
        self._handed = 0  # steps handed over so far
        self._done = 0  # steps finished (by the background thread, or inline)
        self._found: deque = deque()  # (step number in hand-over order, its alerts), not yet collected
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._detector_failed = False
        self._said_not_measured = False
        self._output_failed = False
        self._start_failed = False
        self._carried: list[dict] = []  # alerts raised outside the detector, for the next record
        self._warnings = _Serial("ddphooks-warnings")
        self._callbacks = _Serial("ddphooks-on-alert", lambda trace: self.warn("ddphooks: on_alert raised; training goes on:\n%s", trace))

    def complete(self, stats) -> None:
        """Queue a complete step (any thread)."""
        with self._cond:
            self._pending.append(stats)

    def process(self, wait: bool = False) -> None:
        """Hand the queued steps over and collect the alerts of the steps handed over before (of
        every step with ``wait``) into ``alerts`` (training thread).

        With no detector in this process (none, or a ``DetectorProcess`` whose
        child runs), this thread itself sends each step's slots to the detector's process and
        finishes the steps due with the alerts read back: no other thread of this process runs
        Python for a step (it would hold the GIL this thread needs: on a GPU host, the GIL every
        launch needs). Otherwise the background thread does the work.

        One call at a time: a ``flush()`` from another thread while backward hands a step over
        waits for it (the detector's process is one pipe, read in order)."""
        with self._processing:
            with self._cond:
                due = self._handed  # the same steps on every rank: those handed over at earlier calls
                steps = list(self._pending) if self.detector is not None or self.writer is not None else []
                first = self._handed
                self._handed += len(steps)
                self._pending.clear()
                if wait:
                    due = self._handed
            for number, stats in enumerate(steps, first):
                self._hand_over(number, stats)
            self._finish_sent(due)
            with self._cond:
                self._cond.wait_for(lambda: self._done >= due)
                found = []
                while self._found and self._found[0][0] < due:
                    found.extend(self._found.popleft()[1])
            self.alerts.extend(found)
            if self.stopping is None:
                # Collected at the same point on every rank, from the same statistics: every rank
                # decides to stop at the same step (see ``BaseSilentState.should_stop``).
                self.stopping = next((alert for alert in found if alert["kind"] in self.stop_on), None)
                if self.stopping is not None and self.warns:
                    self.warn("ddphooks: training stops now (stop_on=%s): %s", sorted(self.stop_on), self.stopping["message"])

    def _inline(self) -> bool:
        """Whether steps are finished on the training thread: no detector runs in this process
        (none, or a ``DetectorProcess`` whose child runs)."""
        detector = self.detector
        return detector is None or (isinstance(detector, DetectorProcess) and not detector.in_process)

    def _hand_over(self, number: int, stats) -> None:
        """Step ``number`` (in hand-over order) to the detector's process (``_sent``), or to the
        background thread where the detector runs in this process."""
        if self._inline():
            sent = self.detector is not None and not self._detector_failed and self._send(stats)
            self._sent.append((number, stats, sent))
            return
        self._finish_sent(number)  # a child that never started: its steps first, in order
        with self._cond:
            self._work.append(stats)
            started = self._start()
            self._cond.notify_all()
        if not started:
            # No thread to spare: this rank's steps are processed here, on the training thread, so
            # they are neither lost nor waited for forever, and every rank collects the same alerts.
            self._run(on_thread=False)

    def _send(self, stats) -> bool:
        """Send ``stats`` to the detector's process (returns at once); False if it failed, or the
        step is not measured (``_process`` says so)."""
        try:
            if stats.failed_ranks:  # inside the guard: this runs inside backward
                return False
            self.detector.send_stats(stats)
            return True
        except Exception as error:  # a detector bug must never stop training
            self._detector_off(stats.step, error)
            return False

    def _finish_sent(self, due: int) -> None:
        """Finish the steps sent before hand-over number ``due``, in order, with the alerts the
        detector's process found on them (waiting for those it has not answered yet)."""
        while self._sent and self._sent[0][0] < due:
            _, stats, sent = self._sent.popleft()
            found, built = [], None
            if sent and not self._detector_failed:
                try:
                    alerts, built = self.detector.receive()
                    found = [self._named(alert) for alert in alerts]
                except Exception as error:
                    self._detector_off(stats.step, error)
            self._process(stats, found, built)

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
                self.warn("ddphooks: the pipeline thread could not start (%s: %s); steps are processed on the training thread until it can", type(error).__name__, error)
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

    def _process(self, stats, found: list[dict] | None = None, built: tuple | None = None) -> None:
        """One step, in order: its alerts (``found``, read from the detector's process; None: run
        the detector here), announced and written with the step (``built``: its record as the
        detector's process built it, see ``RecordBuilder.build``)."""
        try:
            if stats.failed_ranks:  # a rank's statistics failed (a bug): the step is not measured
                if not self._said_not_measured:
                    self._said_not_measured = True
                    self.warn(
                        "ddphooks: step %d is not measured: the statistics of rank(s) %s failed there (their log says why); "
                        "training is unchanged (said once)", stats.step, stats.failed_ranks,
                    )  # fmt: skip
                return
            found = self._detect(stats) if found is None else found
            for alert in found:
                self._announce(alert)
            if self.writer is not None:
                with self._cond:
                    carried, self._carried = self._carried, []
                self.writer.submit((stats, carried + found, built))
        except Exception as error:  # reported once; the thread lives on, the training thread waits for its count
            if not self._output_failed:
                self.warn("ddphooks: step %d could not be written: %s: %s", stats.step, type(error).__name__, error)
            self._output_failed = True
        finally:
            with self._cond:
                self._found.append((self._done, found or []))
                self._done += 1
                self._cond.notify_all()

    def _detect(self, stats) -> list[dict]:
        if self.detector is None or self._detector_failed:
            return []
        try:
            alerts = self.detector.update(Observation.from_stats(stats))
        except Exception as error:  # a detector bug must never stop training
            self._detector_off(stats.step, error)
            return []
        return [self._named(alert) for alert in alerts]

    def _detector_off(self, step: int, error: Exception) -> None:
        self._detector_failed = True
        self.warn("ddphooks: the detector failed at step %d and is off from now on: %s: %s", step, type(error).__name__, error)

    def _named(self, alert: dict) -> dict:
        return alert if self.ranks is None else self.ranks.name_alert(alert)

    def _announce(self, alert: dict) -> None:
        """Log ``alert`` (log rank) and queue ``on_alert(alert)``, both on threads of their own."""
        if self.warns:
            self.warn("ddphooks alert: %s", alert["message"])
        if self.on_alert is not None:
            self._callbacks.submit(self.on_alert, alert)

    def warn(self, message: str, *args) -> None:
        """A ``logging`` warning on the pipeline's warnings thread (returns at once, any thread)."""
        self._warnings.submit(logger.warning, message, *args)

    def raise_alert(self, alert: dict) -> None:
        """An alert found outside the detector (the synchronisation watchdog), where it was found:
        it joins ``alerts`` at once, is logged (log rank), goes with the next record written, and
        reaches ``on_alert``. It never stops training (``stop_on``): the rank that found it may be
        the only one that did."""
        alert = self._named(alert)
        with self._cond:
            self.alerts.append(alert)
            if self.writer is not None:  # only the log rank writes records: elsewhere nothing carries it
                self._carried.append(alert)
        self._announce(alert)

    # -- the end ---------------------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Process every completed step, then wait (``timeout`` seconds in all) for its warnings
        to be logged, its ``on_alert`` calls made and its records written; False if a logging
        handler, ``on_alert`` or a sink is still busy."""
        self.process(wait=True)
        return self._drain(time.monotonic() + timeout, None if self.writer is None else self.writer.flush)

    def close(self, timeout: float) -> bool:
        self.process(wait=True)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        if self._thread is not None:  # every step is done: it ends at once
            self._thread.join(timeout)
        return self._drain(deadline, None if self.writer is None else self.writer.close)

    def _drain(self, deadline: float, finish_writer) -> bool:
        logged = self._warnings.drain(deadline - time.monotonic())
        called = self._callbacks.drain(deadline - time.monotonic())
        written = finish_writer is None or finish_writer(max(deadline - time.monotonic(), 0.0))
        return logged and called and written
