"""JSON-lines sink: one strict-JSON object per line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddphooks.sinks.base import Sink


class JsonlSink(Sink):
    """Writes one JSON object per line, flushed after every line.

    The file is created (with its parent folders) on the first write, so a sink handed to every
    rank creates files only where records are written. With ``header``, the first line is
    ``{"header": header}`` (settings, versions), followed by one line per step.

    Args:
        path: file to write; ``{rank}`` in it is replaced by the writing rank's index in the
            data-parallel group, ``{global_rank}`` by its rank in the whole job (needed where the
            model's process group is a subgroup: each group's log rank writes).
        header: optional run description written once, first.
        append: append to an existing file instead of replacing it (a resumed run); the header
            is written only if the file is new or empty.
    """

    def __init__(self, path: str | os.PathLike, header: dict | None = None, append: bool = False) -> None:
        self.path = Path(path)
        self.header = header
        self.append = append
        self._file = None
        self._closed = False

    @property
    def name(self) -> str:
        return f"JsonlSink({str(self.path)!r})"

    def bind_rank(self, rank: int, global_rank: int | None = None) -> None:
        """Called by ``SilentState`` with the writing rank (fills ``{rank}`` and ``{global_rank}`` in the path)."""
        path = str(self.path).replace("{rank}", str(rank))
        if global_rank is not None:
            path = path.replace("{global_rank}", str(global_rank))
        self.path = Path(path)

    def subgroup_problem(self) -> str | None:
        if "{global_rank}" in str(self.path):
            return None
        suggestion = self.path.with_name(f"{self.path.stem}-{{global_rank}}{self.path.suffix}")
        return (
            f"JsonlSink path {str(self.path)!r} has no {{global_rank}}: the model's process group is a subgroup, so the "
            f"log rank of every data-parallel group writes records, and they would overwrite each other in one file; "
            f"use JsonlSink({str(suggestion)!r})"
        )

    def _open(self):
        if self._closed:
            raise ValueError(f"JsonlSink({str(self.path)!r}) is closed")
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            continuing = self.append and self.path.exists() and self.path.stat().st_size > 0
            self._file = open(self.path, "a" if self.append else "w", encoding="utf-8")
            if self.header is not None and not continuing:
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


def drop_records_from(path: Path, step: int) -> None:
    """Remove the records of steps ``>= step`` from the JSON-lines file ``path``, if it exists.

    A run interrupted after its last checkpoint wrote records the resumed run computes again;
    without this they would appear twice. Header lines stay; a torn last line (the interrupted
    write) goes.

    Args:
        path: the JSON-lines record file.
        step: first step to remove (the resumed state's ``step``).

    Example::
        >>> drop_records_from(Path("out/ddphooks/stats.jsonl"), state.step)
    """
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)) or record["step"] < step:
            kept.append(line if line.endswith("\n") else line + "\n")
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept), encoding="utf-8")
    os.replace(partial, path)
