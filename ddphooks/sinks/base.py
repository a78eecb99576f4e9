"""The sink interface and the fan-out container.

A sink receives step records (``dict``, strict JSON) in step order. ``SilentState`` hands them to
its sinks only on the ranks named by its ``log_rank`` (rank 0 by default), from a background
writer thread (``ddphooks.writer``): a slow or failing sink never blocks or breaks training.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable


class Sink:
    """Base sink: accepts records and does nothing with them.

    Subclasses override ``write`` (and ``flush`` / ``close`` when they buffer or hold a
    resource). They may raise: the writer reports the error once and counts the lost records.
    """

    @property
    def name(self) -> str:
        """How warnings and drop counts refer to this sink."""
        return type(self).__name__

    def write(self, record: dict) -> None:
        """Take one step record (a JSON-serialisable dict)."""

    def flush(self) -> None:
        """Push buffered records to their destination."""

    def close(self) -> None:
        """Flush and release resources; later writes are errors."""


class SinkGroup(Sink):
    """Fans every call out to several sinks, in order."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)
        for sink in self.sinks:
            if not isinstance(sink, Sink):
                raise TypeError(f"sinks must be ddphooks.Sink instances, got {type(sink).__name__}")

    def bind_rank(self, rank: int, group_rank: int | None = None) -> None:
        for sink in self.sinks:
            bind_sink(sink, rank if group_rank is None else group_rank, rank)

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def bind_sink(sink: Sink, group_rank: int, global_rank: int) -> None:
    """Tell ``sink`` the process that writes to it, where the sink takes it (``bind_rank``): its
    rank in the whole job (``bind_rank(rank)``, one per process in every topology) and, where
    ``bind_rank`` takes ``group_rank``, its rank in the model's data-parallel group."""
    bind = getattr(sink, "bind_rank", None)
    if bind is None:
        return
    if "group_rank" in inspect.signature(bind).parameters:
        bind(global_rank, group_rank=group_rank)
    else:  # a sink whose bind_rank takes the rank alone
        bind(global_rank)
