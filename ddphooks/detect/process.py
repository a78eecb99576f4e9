"""The online detector in a process of its own: the same ``Detector``, fed over a pipe.

Why: the detector is numpy on small arrays, a few milliseconds of Python a step (3.4 ms at W = 2
and 64 parameters on the 2-core CPU machine, 2026-12-07), and a thread of the training process
holds the GIL for all of it. The training thread needs the GIL for every operation it dispatches,
so it waits: on PyTorch's fake process group (``benchmarks/launches.py``) the detector's thread
added as much to each backward as the detector took. In a process of its own the detector's
time leaves the training process; what stays is pickling the step's ``Observation`` and reading
its alerts, on the pipeline thread.

How:

1. at the first step, ``DetectorProcess.update`` starts ``python -c BOOTSTRAP`` (the same
   interpreter), which imports ``ddphooks.detect`` alone (numpy; neither torch nor the rest of
   ddphooks) and builds a ``Detector`` of the same ``DetectorConfig``;
2. each step, one message goes over the child's stdin (8 bytes of length, then a pickle) and the
   step's alerts come back over its stdout, within ``timeout`` seconds;
3. a child that cannot start (no interpreter at ``sys.executable``, a broken install) is said once
   and replaced by a ``Detector`` in this process before it has seen any step: detection goes on
   unchanged; a child that fails later (an exception, exit, or no answer in time: it is killed)
   raises, and the pipeline turns detection off with a warning (``ddphooks.pipeline``): the
   child held the history, and a detector without it would alert on the first steps it sees.

The child reads only its stdin: when the training process ends, however it ends, the child reads
the end of the pipe and exits. The alerts are those of an in-process ``Detector`` fed the same
observations, alert for alert (``tests/test_detect_process.py``).

Example::
    >>> detector = DetectorProcess(DetectorConfig(), warn=print)
    >>> alerts = detector.update(Observation.from_stats(stats))   # a list of alert dicts
    >>> detector.close()
"""

from __future__ import annotations

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
    """A ``Detector`` in a child process, with ``Detector.update``'s interface.

    Args:
        config: the detector's settings (None: the defaults).
        warn: called once with a message where the child cannot start (detection then runs in
            this process).
        timeout: seconds a step's exchange may take before the child is killed.
    """

    def __init__(self, config: DetectorConfig | None = None, warn: Callable[[str], object] = print, timeout: float = UPDATE_TIMEOUT_S) -> None:
        self.config = config
        self.warn = warn
        self.timeout = timeout
        self._child: subprocess.Popen | None = None
        self._local: Detector | None = None  # where the child could not start
        self._finalizer: weakref.finalize | None = None

    @property
    def in_process(self) -> bool:
        """Whether detection runs in this process (the child could not start)."""
        return self._local is not None

    def update(self, observation: Observation) -> list[dict]:
        """The alerts of one step (see ``Detector.update``)."""
        if self._local is not None:
            return self._local.update(observation)
        if self._child is None:
            try:
                self._start()
            except Exception as error:  # before any step: an in-process detector loses nothing
                self.close()
                self._local = Detector(self.config)
                self.warn(f"ddphooks: the detector's process could not start ({type(error).__name__}: {error}); it runs in the training process")
                return self._local.update(observation)
        kind, value = self._exchange(("update", observation), self.timeout)
        if kind != "alerts":
            raise RuntimeError(f"the detector's process failed:\n{value}")
        return value

    def close(self) -> None:
        """End the child now (a later ``update`` starts a new one, with no history). It also ends
        when this object is collected, and when this process ends, however it ends."""
        if self._finalizer is not None:
            self._finalizer()
        self._child = self._finalizer = None

    def _start(self) -> None:
        if os.name != "posix":
            raise OSError(f"pipes with timeouts need a POSIX system, not {os.name!r}")
        root = str(Path(__file__).resolve().parents[2])
        self._child = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self._finalizer = weakref.finalize(self, _end, self._child)
        kind, value = self._exchange(("start", self.config), START_TIMEOUT_S)
        if kind != "ready":
            raise RuntimeError(f"the child answered {kind!r}: {value}")

    def _exchange(self, message: tuple, timeout: float) -> tuple:
        """Send ``message`` and read the answer, within ``timeout`` seconds (else kill the child)."""
        child = self._child
        deadline = time.monotonic() + timeout
        try:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            _write_all(child.stdin.fileno(), _HEADER.pack(len(payload)) + payload, deadline)
            (size,) = _HEADER.unpack(_read_exactly(child.stdout.fileno(), _HEADER.size, deadline))
            return pickle.loads(_read_exactly(child.stdout.fileno(), size, deadline))
        except Exception as error:
            code = child.poll()
            child.kill()
            self.close()
            state = f"exited with code {code}" if code is not None else "killed"
            raise RuntimeError(f"the detector's process gave no answer ({type(error).__name__}: {error}); it {state}") from error


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


def _write_all(fd: int, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([], [fd], [], remaining)[1]:
            raise TimeoutError("writing to the detector's process timed out")
        view = view[os.write(fd, view[: 1 << 16]) :]


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    parts, left = [], size
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError("reading from the detector's process timed out")
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            raise EOFError("the detector's process closed its output")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def serve() -> None:
    """The child's loop: a ``Detector`` fed from stdin, its alerts to stdout (``BOOTSTRAP``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for training: the child ends with its input
    inbox = sys.stdin.buffer
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print goes to stderr, not into the answers
    detector = None
    while True:
        header = inbox.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return  # the training process closed the pipe (or ended)
        (size,) = _HEADER.unpack(header)
        kind, value = pickle.loads(inbox.read(size))
        try:
            if kind == "start":
                detector, answer = Detector(value), ("ready", None)
            else:
                answer = ("alerts", detector.update(value))
        except Exception:
            answer = ("error", traceback.format_exc())
        payload = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        outbox.write(_HEADER.pack(len(payload)) + payload)
        outbox.flush()
