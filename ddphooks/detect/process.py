"""The online detector in a process of its own: the same ``Detector``, fed over a pipe.

Why: the detector is numpy on small arrays, a few milliseconds of Python a step (3.4 ms at W = 2
and 64 parameters on the 2-core CPU machine, 2026-12-07), and a thread of the training process
holds the GIL for all of it. The training thread needs the GIL for every operation it dispatches,
so it waits: on PyTorch's fake process group (``benchmarks/launches.py``) the detector's thread
added as much to each backward as the detector took. Reading a step into an ``Observation`` is
numpy too (115-270 us a step at W = 2), so that moves to the child as well: what stays in the
training process is pickling the step's slots (``ddphooks.stats.StepSlots``, a few KB at W = 2),
writing them into a pipe and reading the alerts back, which the pipeline does on the training
thread itself (``ddphooks.pipeline``), with no other thread of the process woken for a step but
the sink writer's, whose record the child has built (0.35 ms of numpy and dicts a step at W = 2
on the writer's thread otherwise).

How:

1. at the first step, ``DetectorProcess.send_stats`` starts ``python -c BOOTSTRAP`` (the same
   interpreter), which imports ``ddphooks.detect`` alone (numpy; neither torch nor the rest of
   ddphooks) and builds a ``Detector`` of the same ``DetectorConfig``; nothing waits for it to
   start: its "ready" is read with the first step's alerts;
2. each step, one message goes into the child's stdin (8 bytes of length, then a pickle: the
   step's slots, which the child reads into its ``Observation`` with ``ddphooks.stats``, numpy
   only, or above ``gather_max_world`` the compact wire's buffer, read with
   ``ddphooks.fleet_stats``; the bucket layouts only when they change) and returns at once: the
   pipe is enlarged to ``PIPE_BYTES`` where the system allows, and what it cannot take waits in
   this process and is written while ``receive`` waits;
3. ``receive`` reads the alerts of the oldest step sent, in order, waiting at most ``timeout``
   seconds (the pipeline asks for them a step later, when the child has long answered); on the
   log rank, with them, the step's record, which the child builds from the same slots with a
   copy of the rank's ``RecordBuilder`` (``records``): the sink writer's thread then only adds
   the alerts and writes it;
4. a child that cannot start (no interpreter at ``sys.executable``, a broken install: it never
   says "ready") is said once and replaced by a ``Detector`` in this process, which reads every
   step sent so far: detection goes on unchanged. A child that fails later (an exception, exit,
   or no answer in time: it is killed) raises, and the pipeline turns detection off with a
   warning (``ddphooks.pipeline``): the child held the history, and a detector without it
   would alert on the first steps it sees.

The child reads only its stdin: when the training process ends, however it ends, the child reads
the end of the pipe and exits. It runs at niceness ``CHILD_NICE``: where cores are short, the
training process's threads run first. The alerts are those of an in-process ``Detector`` fed the
same steps, alert for alert (``tests/test_detect_process.py``).

Example::
    >>> detector = DetectorProcess(DetectorConfig(), warn=print)
    >>> detector.send_stats(stats)        # returns at once
    >>> alerts = detector.receive()       # a list of alert dicts
    >>> detector.close()
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path

from .config import DetectorConfig
from .detector import Detector
from .observation import Observation

#: Seconds a step's exchange may take (the detector takes ~0.1 s a step at W = 4096): past it the
#: child is killed and detection is off.
UPDATE_TIMEOUT_S = 60.0
#: Seconds the child may take to start and import the detector.
START_TIMEOUT_S = 60.0
_HEADER = struct.Struct("<Q")
#: Bytes the pipe to the child holds where the system lets it be enlarged (Linux's default
#: ``/proc/sys/fs/pipe-max-size``): a step's message up to this size is written at once, so the
#: training thread never waits for the child to read it.
PIPE_BYTES = 1 << 20
#: The child's niceness: below training on a busy machine (a step behind, training waits for it in
#: ``receive``, and then the child has the core).
CHILD_NICE = 10

#: The child's program: ``ddphooks`` as a bare package (its ``__init__`` imports torch), then the
#: detector's loop. argv[1]: the folder that holds the ``ddphooks`` package.
BOOTSTRAP = """
import sys, types
package = types.ModuleType("ddphooks")
package.__path__ = [sys.argv[1] + "/ddphooks"]
sys.modules["ddphooks"] = package
from ddphooks.detect.process import serve
serve()
"""


class DetectorProcess:
    """A ``Detector`` in a child process: ``send_stats`` hands it a step and returns at once,
    ``receive`` reads the alerts of the oldest step sent (``update``: both, in ``Detector.update``'s
    interface).

    Sending never waits for the child: the message goes into the pipe (enlarged to
    ``PIPE_BYTES`` where the system allows), and what the pipe cannot take yet waits here and is
    written while ``receive`` waits. So the training thread can send a step and read the alerts of
    the step before, and the child's work overlaps training.

    Args:
        config: the detector's settings (None: the defaults).
        warn: called once with a message where the child cannot start (detection then runs in
            this process).
        timeout: seconds ``receive`` may wait for an answer before the child is killed.
        records: this rank's ``ddphooks.records.RecordBuilder`` (the log rank's; None elsewhere):
            the child gets a copy at its start (and its state again after each
            ``load_state_dict``) and builds the record of every step sent as slots, which
            ``receive`` returns with its alerts, for ``RecordBuilder.build(..., built=)``.
    """

    def __init__(
        self, config: DetectorConfig | None = None, warn: Callable[[str], object] = print, timeout: float = UPDATE_TIMEOUT_S, records=None,
    ) -> None:  # fmt: skip
        self.config = config
        self.warn = warn
        self.timeout = timeout
        self.records = records
        self._records_restored = 0  # records.restored as the child last got its state
        self._child: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._local: Detector | None = None  # where the child could not start
        # -- the exchange with the child
        self._outbox = bytearray()  # messages the pipe could not take yet
        self._inbox = bytearray()  # the child's answers as read so far
        self._awaited = 0  # steps sent to the child whose alerts are not received yet
        self._ready = False  # the child has answered "start"
        self._buckets_sent: list | None = None  # the bucket layouts the child holds (StepSlots.buckets)
        # -- where the child never starts: the steps sent so far, run again in this process
        self._unanswered: deque = deque()  # (kind, value) sent before the child was ready
        self._found_here: deque = deque()  # alerts found in this process, not received yet

    @property
    def in_process(self) -> bool:
        """Whether detection runs in this process (the child could not start)."""
        return self._local is not None

    def update(self, observation: Observation) -> list[dict]:
        """The alerts of one step (see ``Detector.update``)."""
        self._send("update", observation)
        return self.receive()[0]

    def send_stats(self, stats) -> None:
        """Hand a live step (``SilentStats``) to the detector; its alerts come from a later
        ``receive``. Its slots travel (``stats.slots()``: a few KB at W = 2, the compact wire's
        buffer above ``gather_max_world``: 122 KB at W = 4096) and the child reads the
        ``Observation`` from them, so that reading the step, numpy on small arrays, takes no
        time of the training process either."""
        self._send("slots", stats.slots())

    def receive(self) -> tuple[list[dict], tuple[dict, dict] | None]:
        """The alerts of the oldest step sent and not received yet, and where the child built its
        record (``records``, a step sent as slots), that record and the builder's state after it
        (else None: the record is built in this process). Waits for them (at most
        ``timeout`` seconds, ``START_TIMEOUT_S`` more for a child that has not started yet),
        writing meanwhile what the pipe could not take before. Raises where the child fails
        (it is killed); a child that never started is replaced by a ``Detector`` in this process,
        which reads every step sent so far: nothing is lost."""
        if self._found_here:
            return self._found_here.popleft()
        if not self._awaited:
            raise RuntimeError("receive() with no step sent and not received")
        try:
            if not self._ready:
                kind, value = self._answer(time.monotonic() + START_TIMEOUT_S)
                if kind != "ready":
                    raise RuntimeError(f"the child answered {kind!r}: {value}")
                self._ready = True
                self._unanswered.clear()
            kind, value = self._answer(time.monotonic() + self.timeout)
        except Exception as error:
            self._failed(error)  # raises, unless the child never started and this process took over
            return self._found_here.popleft()
        self._awaited -= 1
        if kind != "alerts":
            raise RuntimeError(f"the detector's process failed:\n{value}")
        return value

    def close(self) -> None:
        """End the child now (a later ``send`` starts a new one, with no history; the alerts of
        the steps sent are lost). It also ends when this object is collected, and after this
        process ends, however it ends (it reads the end of its input)."""
        if self._finalizer is not None:
            self._finalizer()
        self._child = self._finalizer = None
        self._outbox.clear()
        self._inbox.clear()
        self._awaited, self._ready, self._buckets_sent = 0, False, None
        self._unanswered.clear()

    # -- the exchange ------------------------------------------------------------------------
    def _send(self, kind: str, value) -> None:
        """``value`` (an ``Observation``, or with ``kind="slots"`` a step's ``StepSlots`` or ``FleetSlots``) to the detector."""
        if self._local is None and self._child is None:
            try:
                self._start()
            except Exception as error:  # before any step: a detector in this process loses nothing
                self._take_over(error)
        if self._local is not None:
            self._found_here.append((self._local.update(_observation(kind, value)), None))
            return
        if not self._ready:
            self._unanswered.append((kind, value))
        if kind == "slots":
            if value.buckets != self._buckets_sent:  # the same objects step after step: an identity check each
                self._buckets_sent = value.buckets
            elif self._ready:
                value.buckets = None  # the child keeps them (64 layouts: 42 us of pickling a step)
            else:
                value = dataclasses.replace(value, buckets=None)  # the original kept whole, for _take_over
        self._awaited += 1
        try:
            if self.records is not None and self.records.restored != self._records_restored:  # a checkpoint's state, loaded
                self._post(("records", self.records.state_dict()))  # taken up before the next record; no answer
                self._records_restored = self.records.restored
            self._post((kind, value))
        except Exception as error:  # the child is gone
            self._failed(error)

    def _start(self) -> None:
        """Start the child and send it its configuration; its "ready" is read with the first answer."""
        if os.name != "posix":
            raise OSError(f"pipes with timeouts need a POSIX system, not {os.name!r}")
        root = str(Path(__file__).resolve().parents[2])
        self._child = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._finalizer = weakref.finalize(self, _end, self._child)
        # Not at interpreter exit: a state's close() runs then and still reads the last alerts (the
        # newest finalizer would run first); the child ends anyway, reading the end of its input.
        self._finalizer.atexit = False
        for pipe in (self._child.stdin, self._child.stdout):  # a step's slots, its record (115 KB detailed at W = 8)
            _enlarge(pipe.fileno())
        os.set_blocking(self._child.stdin.fileno(), False)
        os.set_blocking(self._child.stdout.fileno(), False)
        self._records_restored = 0 if self.records is None else self.records.restored
        self._post(("start", (self.config, self.records)))

    def _post(self, message: tuple) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._outbox += _HEADER.pack(len(payload))
        self._outbox += payload
        self._write_some()

    def _write_some(self) -> None:
        """Write what the pipe takes now, without waiting."""
        while self._outbox:
            try:
                written = os.write(self._child.stdin.fileno(), self._outbox)
            except BlockingIOError:
                return
            del self._outbox[:written]

    def _answer(self, deadline: float) -> tuple:
        """The child's next answer, waited for until ``deadline``; the outbox is written as the
        pipe drains."""
        reading, writing = self._child.stdout.fileno(), self._child.stdin.fileno()
        while True:
            if len(self._inbox) >= _HEADER.size:
                end = _HEADER.size + _HEADER.unpack_from(self._inbox)[0]
                if len(self._inbox) >= end:
                    answer = pickle.loads(bytes(self._inbox[_HEADER.size : end]))
                    del self._inbox[:end]
                    return answer
            if not self._outbox:  # the usual case: the answer is there already, one system call
                try:
                    self._read_some(reading)
                    continue
                except BlockingIOError:
                    pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("reading from the detector's process timed out")
            readable, writable, _ = select.select([reading], [writing] if self._outbox else [], [], remaining)
            if writable:
                self._write_some()
            if readable:
                self._read_some(reading)

    def _read_some(self, fd: int) -> None:
        part = os.read(fd, 1 << 20)
        if not part:
            raise EOFError("the detector's process closed its output")
        self._inbox += part

    def _failed(self, error: Exception) -> None:
        """Kill the child after ``error``; raise, unless it never started: then this process takes
        over the steps sent so far (``receive`` returns their alerts)."""
        child = self._child
        try:
            code = child.wait(timeout=0.2)  # an exit on its way (its output closed first): its code
        except subprocess.TimeoutExpired:
            code = None
        child.kill()
        ready, unanswered = self._ready, list(self._unanswered)
        self.close()
        state = f"exited with code {code}" if code is not None else "was killed"
        failure = RuntimeError(f"the detector's process gave no answer ({type(error).__name__}: {error}); it {state}")
        if ready:
            raise failure from error
        self._take_over(failure, unanswered)

    def _take_over(self, error: Exception, unanswered: list[tuple] = ()) -> None:
        """Detection in this process from now on, from the first step: the child could not start."""
        self.close()
        self._local = Detector(self.config)
        self.warn(f"ddphooks: the detector's process could not start ({type(error).__name__}: {error}); it runs in the training process")
        for kind, value in unanswered:
            self._found_here.append((self._local.update(_observation(kind, value)), None))


def _enlarge(fd: int) -> None:
    """Make the pipe ``fd`` hold ``PIPE_BYTES`` where the system allows (Linux; elsewhere it keeps
    its size: a step larger than it waits in ``DetectorProcess``'s outbox, an answer larger than
    it in the child until ``receive`` reads it)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass


def _end(child: subprocess.Popen) -> None:
    """Close the child's input (it reads the end and exits) and reap it."""
    for stream in (child.stdin, child.stdout):
        try:
            stream.close()
        except OSError:
            pass
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _observation(kind: str, value) -> Observation:
    """The step's ``Observation``: ``value`` itself, or read from its slots (``kind="slots"``:
    unpickling them imports ``ddphooks.stats`` or ``ddphooks.fleet_stats``, numpy only)."""
    return Observation.from_stats(value.stats()) if kind == "slots" else value


def serve() -> None:
    """The child's loop: a ``Detector`` fed from stdin, its alerts to stdout (``BOOTSTRAP``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for training: the child ends with its input
    try:  # where cores are short, training's threads come first: a step behind, training waits on it
        os.nice(CHILD_NICE)
    except OSError:
        pass
    inbox = sys.stdin.buffer
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print goes to stderr, not into the answers
    detector = buckets = records = None
    while True:
        header = inbox.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return  # the training process closed the pipe (or ended)
        (size,) = _HEADER.unpack(header)
        kind, value = pickle.loads(inbox.read(size))
        if kind == "records":  # a checkpoint's state for the record builder: no answer
            records.load_state_dict(value)
            continue
        try:
            if kind == "start":
                config, records = value
                detector, answer = Detector(config), ("ready", None)
            else:
                if kind == "slots":  # layouts come when they change (DetectorProcess._send)
                    buckets = value.buckets = value.buckets if value.buckets is not None else buckets
                stats = value.stats() if kind == "slots" else None
                alerts = detector.update(value if stats is None else Observation.from_stats(stats))
                answer = ("alerts", (alerts, None if stats is None or records is None else _built(records, stats)))
        except Exception:
            answer = ("error", traceback.format_exc())
        payload = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        outbox.write(_HEADER.pack(len(payload)) + payload)
        outbox.flush()


def _built(records, stats) -> tuple[dict, dict] | None:
    """The step's record (alerts left to the training process) and the builder's state after it;
    None where building failed: the training process builds it then, and says what failed."""
    try:
        return records.build(stats), records.state_dict()
    except Exception:
        return None
