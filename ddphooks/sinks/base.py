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

    def subgroup_problem(self) -> str | None:
        """Why this sink cannot be written from two data-parallel groups of one job (the state's
        process group is a subgroup: every group's log rank writes); None where it can."""
        return None


class SinkGroup(Sink):
    """Fans every call out to several sinks, in order."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)
        for sink in self.sinks:
            if not isinstance(sink, Sink):
                raise TypeError(f"sinks must be ddphooks.Sink instances, got {type(sink).__name__}")

    def bind_rank(self, rank: int, global_rank: int | None = None) -> None:
        for sink in self.sinks:
            bind_sink(sink, rank, global_rank)

    def subgroup_problem(self) -> str | None:
        return next((problem for sink in self.sinks if (problem := sink.subgroup_problem()) is not None), None)

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def bind_sink(sink: Sink, rank: int, global_rank: int) -> None:
    """Tell ``sink`` the rank that writes to it: its rank in the data-parallel group (``{rank}``)
    and in the whole job (``{global_rank}``), where the sink takes them (``bind_rank``)."""
    bind = getattr(sink, "bind_rank", None)
    if bind is None:
        return
    if "global_rank" in inspect.signature(bind).parameters:
        bind(rank, global_rank=global_rank)
    else:  # a sink of its own whose bind_rank takes the rank alone
        bind(rank)
