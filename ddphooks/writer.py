"""The sink writer: records are built and written on a background thread, and sinks cannot hurt training.

Monitoring must never be the reason a run stops or slows down. The step pipeline (see
``ddphooks.pipeline``, on the training thread or its own) only appends the step's ``SilentStats``
to a bounded queue; a daemon thread builds the record and hands it to every sink. So:

1. serialisation and I/O never run on the training thread;
2. a sink that raises is reported once (a ``logging`` warning on the ``"ddphooks"`` logger naming
   the sink and the error), the other sinks go on, and each record it failed to take is counted;
3. a sink slower than training fills the queue; then the *oldest* waiting record is dropped and
   counted (memory stays bounded, the newest state of the run is kept);
4. ``flush`` and ``close`` wait a bounded time, then report what they could not write and return.

Drop counts are per sink label, with ``"queue"`` for records dropped before any sink saw them;
every record carries the counts so far as ``dropped_records``, so a gap in a file is explained by
the next record that reaches it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ddphooks.sinks.base import Sink

logger = logging.getLogger("ddphooks")

QUEUE = "queue"


def sink_labels(sinks: list[Sink]) -> list[str]:
    """A distinct label per sink: its name, with ``#n`` added where names repeat."""
    names = [sink.name for sink in sinks]
    return [name if names.count(name) == 1 else f"{name}#{i}" for i, name in enumerate(names)]


class RecordWriter:
    """Builds and writes records on a daemon thread, started on the first ``submit``.

    Args:
        sinks: where records go, in order.
        build: turns a submitted item into a record dict (runs on the writer thread).
        max_pending: items waiting at most; beyond it the oldest is dropped and counted.

    Example::
        >>> writer = RecordWriter([JsonlSink("stats.jsonl")], builder.build, max_pending=1024)
        >>> writer.submit(stats)          # returns at once
        >>> writer.close(timeout=30.0)    # writes what is left, then closes the sinks
    """

    def __init__(self, sinks: list[Sink], build: Callable[[object], dict], max_pending: int) -> None:
        self.sinks = list(sinks)
        self.labels = sink_labels(self.sinks)
        self.build = build
        self.max_pending = max_pending
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._dropped: dict[str, int] = {}
        self._warned: set[str] = set()
        self._submitted = 0
        self._handled = 0  # items written (or failed) by the thread, or dropped from the queue
        self._flush_requests = 0
        self._flushes_done = 0
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- training side ---------------------------------------------------------------------------
    def submit(self, item: object) -> None:
        """Queue one item for writing; never blocks on the sinks.

        Raises ``RuntimeError`` if the writer thread cannot start (out of threads or memory): the
        item stays queued, for the next submit's thread or for ``close()``.
        """
        with self._cond:
            if self._closing:
                self._count(QUEUE)
                return
            if len(self._queue) >= self.max_pending:
                self._queue.popleft()
                self._handled += 1
                self._count(QUEUE)
            self._queue.append(item)
            self._submitted += 1
            if self._thread is None:
                self._start()
            self._cond.notify_all()

    def _start(self) -> None:
        thread = threading.Thread(target=self._run, name="ddphooks-writer", daemon=True)
        try:
            thread.start()
        except RuntimeError as error:  # "can't start new thread" (out of threads or memory)
            raise RuntimeError(f"the writer thread could not start ({error}); records stay queued until it can, or until close()") from error
        self._thread = thread  # only once it runs: otherwise the next submit tries again

    @property
    def dropped(self) -> dict[str, int]:
        """Records each sink did not get (``"queue"``: dropped before reaching any sink)."""
        with self._cond:
            return dict(self._dropped)

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted so far is written and the sinks are flushed.

        Returns False if that did not happen within ``timeout`` seconds (a stuck sink).
        """
        with self._cond:
            if self._closed or (self._thread is None and not self._queue):
                return True
            if self._thread is None:
                try:
                    self._start()
                except RuntimeError:  # still no thread: the queued items wait for close()
                    return False
            self._flush_requests += 1
            wanted = self._flush_requests
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._flushes_done >= wanted or self._closed, timeout)

    def close(self, timeout: float) -> bool:
        """Write what is queued, flush and close every sink; give up after ``timeout`` seconds.

        Safe to call twice. Returns False (after a warning naming what was lost) if a sink did
        not finish in time; the daemon thread is then abandoned and cannot delay the exit.
        """
        with self._cond:
            if self._closed:
                return True
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:  # never started (or could not start): what is queued is written here
            self._run()
            return True
        thread.join(timeout)
        if thread.is_alive():
            with self._cond:
                waiting = self._submitted - self._handled
            logger.warning(
                "ddphooks: the sinks did not finish within %.1f s of close(); %d record(s) may not have been written "
                "(a sink is stuck: %s)", timeout, waiting, ", ".join(self.labels),
            )  # fmt: skip
            return False
        return True

    # -- writer thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._flush_requests > self._flushes_done or self._closing)
                item = self._queue.popleft() if self._queue else None
                flush_wanted = self._flush_requests
                closing = self._closing and item is None
            if item is not None:
                self._write(item)
                with self._cond:
                    self._handled += 1
                continue
            if closing:
                self._close_sinks()
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            self._call_each("flush")
            with self._cond:
                self._flushes_done = flush_wanted
                self._cond.notify_all()

    def _write(self, item: object) -> None:
        try:
            record = self.build(item)
        except Exception as error:  # a statistics bug must not stop the writer
            self._failed("record builder", error, self.labels)
            return
        with self._cond:
            record["dropped_records"] = dict(self._dropped)
        for sink, label in zip(self.sinks, self.labels):
            try:
                sink.write(record)
            except Exception as error:
                self._failed(label, error, [label])

    def _call_each(self, method: str) -> None:
        for sink, label in zip(self.sinks, self.labels):
            try:
                getattr(sink, method)()
            except Exception as error:
                self._warn_once(label, f"{method}() failed", error)

    def _close_sinks(self) -> None:
        self._call_each("flush")
        self._call_each("close")

    def _failed(self, source: str, error: Exception, lost_for: list[str]) -> None:
        with self._cond:
            for label in lost_for:
                self._count(label)
        self._warn_once(source, "failed to write a record", error)

    def _warn_once(self, source: str, what: str, error: Exception) -> None:
        if source in self._warned:
            return
        self._warned.add(source)
        logger.warning(
            "ddphooks: %s %s: %s: %s (training goes on; further errors from it are counted in dropped_records, not repeated)",
            source, what, type(error).__name__, error,
        )  # fmt: skip

    def _count(self, label: str) -> None:
        self._dropped[label] = self._dropped.get(label, 0) + 1
