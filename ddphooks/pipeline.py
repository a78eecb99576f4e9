"""What happens to a step's statistics once they are complete: detection, alerts, records.

A step completes in a communication callback (possibly on a gloo thread); the pipeline only
queues it there. The queued steps are *processed* on the training thread, at a point every rank
reaches in the same order: the first bucket of the next step (inside backward), or ``flush()`` /
``close()``. Processing a step:

0. links it to the step processed before it (``SilentStats.follow``), for each rank's cosine to
   its own previous gradient; steps are processed in order, so that is the previous step;
1. runs the detector (``ddphooks.detect``) on it, the same on every rank, so every rank sees the
   same alerts; a detector error is reported once and never reaches training;
2. logs one ``logging`` warning per new alert (logger ``"ddphooks"``) on the log rank;
3. hands the statistics, alerts attached, to the record writer (log rank only);
4. calls ``on_alert(alert)`` for each new alert, on every rank. It may raise to stop training
   (to abort or checkpoint): every rank raises at the same point, before the next step's first
   collective, so no rank is left waiting in a collective.

By then an accelerator's asynchronous copy of the step's statistics has long finished, so
reading them here does not stall the device queue.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ddphooks.detect import Detector, Observation
from ddphooks.writer import RecordWriter

logger = logging.getLogger("ddphooks")


class StepPipeline:
    """Detection and record writing for one ``SilentState``.

    Args:
        detector: the online detector, or None (``detect=False``).
        writer: the record writer on the log rank, None elsewhere.
        on_alert: called with each new alert dict on every rank (None: nothing).
        warns: whether this rank logs the alerts (the log rank).

    Example::
        >>> pipeline = StepPipeline(Detector(), writer, on_alert=None, warns=True)
        >>> pipeline.complete(stats)   # communication thread
        >>> pipeline.process()         # training thread, next step
    """

    def __init__(self, detector: Detector | None, writer: RecordWriter | None, on_alert: Callable[[dict], object] | None, warns: bool) -> None:
        self.detector = detector
        self.writer = writer
        self.on_alert = on_alert
        self.warns = warns
        self.alerts: list[dict] = []
        self._pending: deque = deque()
        self._lock = threading.Lock()
        self._detector_failed = False
        self._previous = None  # the last processed step, for SilentStats.follow
        self._link_failed = False

    def complete(self, stats) -> None:
        """Queue a complete step (any thread)."""
        with self._lock:
            self._pending.append(stats)

    def process(self, call_on_alert: bool = True) -> None:
        """Detect, log and write every queued step, then run ``on_alert`` (training thread)."""
        with self._lock:
            steps = list(self._pending)
            self._pending.clear()
        raised = []
        for stats in steps:
            if self.detector is not None or self.writer is not None:  # somebody reads cosine_previous
                self._link(stats)
            stats.alerts = self._detect(stats)
            self.alerts.extend(stats.alerts)
            if self.warns:
                for alert in stats.alerts:
                    logger.warning("ddphooks alert: %s", alert["message"])
            if self.writer is not None:
                self.writer.submit(stats)
            raised.extend(stats.alerts)
        if call_on_alert and self.on_alert is not None:
            for alert in raised:
                self.on_alert(alert)

    def _link(self, stats) -> None:
        try:
            stats.follow(self._previous)
        except Exception as error:  # like a detector error: reported once, never raised into backward
            if not self._link_failed:
                logger.warning("ddphooks: step %d could not be linked to the previous step (no cosine_previous): %s: %s", stats.step, type(error).__name__, error)
            self._link_failed = True
        self._previous = stats

    def _detect(self, stats) -> list[dict]:
        if self.detector is None or self._detector_failed:
            return []
        try:
            return self.detector.update(Observation.from_stats(stats))
        except Exception as error:  # a detector bug must never stop training
            self._detector_failed = True
            logger.warning("ddphooks: the detector failed at step %d and is off from now on: %s: %s", stats.step, type(error).__name__, error)
            return []

    def flush(self, timeout: float) -> bool:
        self.process()
        return self.writer is None or self.writer.flush(timeout)

    def close(self, timeout: float, call_on_alert: bool = True) -> bool:
        try:
            self.process(call_on_alert)
        finally:  # an on_alert that raises still gets the records written
            closed = self.writer is None or self.writer.close(timeout)
        return closed
