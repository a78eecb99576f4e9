"""Where step records go: one small interface, a JSON-lines file, and a fan-out container.

A sink receives ``SilentStats.to_dict()`` records in step order. ``SilentState`` calls sinks only
on the ranks named by its ``log_rank`` (rank 0 by default), from the training thread, never from
a communication callback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path


class Sink:
    """Base sink: accepts records and does nothing with them."""

    def write(self, record: dict) -> None:
        """Take one step record (a JSON-serialisable dict)."""

    def flush(self) -> None:
        """Push buffered records to their destination."""

    def close(self) -> None:
        """Flush and release resources; later writes are errors."""


class JsonlSink(Sink):
    """Writes one JSON object per line, flushed after every line.

    The file is created (with its parent folders) on the first write, so a sink handed to every
    rank creates files only where records are written. With ``header``, the first line is
    ``{"header": header}`` (settings, versions), followed by one line per step.

    Args:
        path: file to write; ``{rank}`` in it is replaced by the writing rank's index.
        header: optional run description written once, first.
        append: append to an existing file instead of replacing it.
    """

    def __init__(self, path: str | os.PathLike, header: dict | None = None, append: bool = False) -> None:
        self.path = Path(path)
        self.header = header
        self.append = append
        self._file = None
        self._closed = False

    def bind_rank(self, rank: int) -> None:
        """Called by ``SilentState`` with the writing rank (fills ``{rank}`` in the path)."""
        self.path = Path(str(self.path).replace("{rank}", str(rank)))

    def _open(self):
        if self._closed:
            raise ValueError(f"JsonlSink({str(self.path)!r}) is closed")
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if self.append else "w", encoding="utf-8")
            if self.header is not None:
                self._line({"header": self.header})
        return self._file

    def _line(self, obj: dict) -> None:
        # allow_nan=False: records are strict JSON (non-finite values are already null).
        self._file.write(json.dumps(obj, allow_nan=False) + "\n")
        self._file.flush()

    def write(self, record: dict) -> None:
        self._open()
        self._line(record)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True


class SinkGroup(Sink):
    """Fans every call out to several sinks, in order."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)
        for sink in self.sinks:
            if not isinstance(sink, Sink):
                raise TypeError(f"sinks must be ddphooks.Sink instances, got {type(sink).__name__}")

    def bind_rank(self, rank: int) -> None:
        for sink in self.sinks:
            bind = getattr(sink, "bind_rank", None)
            if bind is not None:
                bind(rank)

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
