"""JSON-lines sink: one strict-JSON object per line."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ddphooks.sinks.base import Sink

logger = logging.getLogger("ddphooks")


class JsonlSink(Sink):
    """Writes one JSON object per line, flushed after every line.

    The file is created (with its parent folders) on the first write, so a sink handed to every
    rank creates files only where records are written. With ``header``, the first line is
    ``{"header": header}`` (settings, versions), followed by one line per step.

    Two writers at the same time never share a file. On opening, the sink takes an exclusive
    ``flock`` on it (held until ``close``; on NFS, Linux emulates it with a POSIX lock, seen by
    every client). Where another writer holds the path already (another data-parallel group's log rank with the same
    path, a second sink on one path, another job), this sink writes to
    ``<stem>.rank<global rank><suffix>`` beside it instead (adding the process id if that is taken
    too) and logs a warning naming both files: both writers' records are kept, none is refused. A
    writer that opens a path after the last one closed it replaces the file, as a new run does.

    Args:
        path: file to write; ``{rank}`` in it is replaced by the writing process's rank in the
            whole job (one file per process in every topology, with ``log_rank=None``),
            ``{group_rank}`` by its rank in the model's data-parallel group, ``{global_rank}``
            (an older spelling) like ``{rank}``.
        header: optional run description written once, first.
        append: append to an existing file instead of replacing it (a resumed run); the header
            is written only if the file is new or empty.
    """

    def __init__(self, path: str | os.PathLike, header: dict | None = None, append: bool = False) -> None:
        self.path = Path(path)
        self.header = header
        self.append = append
        self._rank: int | None = None
        self._file = None
        self._closed = False

    @property
    def name(self) -> str:
        return f"JsonlSink({str(self.path)!r})"

    def bind_rank(self, rank: int, group_rank: int | None = None) -> None:
        """Called by ``SilentState`` with the writing process's rank in the job and in its group
        (fills ``{rank}``, ``{global_rank}`` and ``{group_rank}`` in the path)."""
        self._rank = rank
        path = str(self.path).replace("{rank}", str(rank)).replace("{global_rank}", str(rank))
        self.path = Path(path.replace("{group_rank}", str(rank if group_rank is None else group_rank)))

    def _open(self):
        if self._closed:
            raise ValueError(f"JsonlSink({str(self.path)!r}) is closed")
        if self._file is None:
            wanted = self.path
            self._file, self.path = _open_alone(wanted, self._rank)
            if self.path != wanted:
                logger.warning(
                    "ddphooks: %s is already being written by another writer (another data-parallel group's log rank with "
                    "the same path, another sink, or another job); this one writes to %s instead, so both keep their records. "
                    "Give each writer its own path ({rank} in it, or one path per group) to choose the names.", wanted, self.path,
                )  # fmt: skip
            continuing = self.append and os.fstat(self._file.fileno()).st_size > 0
            if not self.append:
                self._file.truncate(0)  # only now: the file is ours
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
            self._file.close()  # releases the lock
            self._file = None
        self._closed = True


#: Other names tried for one writer before giving up (each already held by a writer of its own).
_MAX_OTHER_NAMES = 64
_unlockable_said: set[str] = set()


def _open_alone(path: Path, rank: int | None):
    """``path`` opened for appending (not truncated: it may be another writer's) under an
    exclusive lock, or, where another writer holds it, the first free name of
    ``<stem>.rank<rank>[.pid<pid>.<n>]<suffix>`` beside it. Returns the file and its path."""
    tag = f"rank{rank}" if rank is not None else f"pid{os.getpid()}"
    names = [path.name] + [f"{path.stem}.{tag}{path.suffix}"] + [f"{path.stem}.{tag}.pid{os.getpid()}.{n}{path.suffix}" for n in range(_MAX_OTHER_NAMES)]
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        candidate = path.with_name(name)
        file = open(candidate, "a", encoding="utf-8")
        if _lock(file, candidate):
            return file, candidate
        file.close()
    raise OSError(f"JsonlSink: {path} and {len(names) - 1} other names beside it are all held by other writers")


def _lock(file, path: Path) -> bool:
    """Take an exclusive, non-blocking ``flock`` on ``file``: False where another writer holds
    it. Where the file system or platform has no such lock, say so once and go on (True)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        fcntl = None
    try:
        if fcntl is None:
            raise OSError("no fcntl module on this platform")
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:  # ENOLCK, EOPNOTSUPP: a file system without locks
        if str(path.parent) not in _unlockable_said:
            _unlockable_said.add(str(path.parent))
            logger.warning(
                "ddphooks: cannot lock %s (%s), so two writers of one path cannot be told apart there; give each "
                "writer its own path ({rank} in it)", path, error,
            )  # fmt: skip
        return True


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
