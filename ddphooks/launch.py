"""Spawn a gloo process group on this machine and run one function on every rank.

Used by the demo, the experiment, the benchmarks and the tests. Ranks rendezvous through a
file (no TCP port to collide on), every rank's result or traceback comes back to the caller, and
a deadline kills all workers instead of hanging when one of them dies or blocks.

Workers are forked from a server process that imported torch once (``forkserver``, where the
platform has it; ``spawn`` elsewhere): a fresh interpreter would import torch in every worker of
every call, 2 s each on a 2-core machine. The server has run no torch operation, so no thread pool
is forked; each worker takes the caller's environment variables as they are at the call (a fork
server keeps those it started with), and a module that reads one when imported (triton) is not
preloaded.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


#: Seconds to keep collecting reports from the other ranks once one rank has failed.
FAILURE_GRACE_S = 5.0
#: Start method of the workers, and what the fork server imports once for all of them.
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
#: Not ``torch._dynamo``: it imports triton, which reads ``TRITON_INTERPRET`` when imported.
PRELOAD = ["torch", "torch.distributed", "ddphooks"]


class WorkerError(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def _worker(fn: Callable, rank: int, world: int, init_file: str, threads: int, timeout: float, args: tuple, results, environment: dict) -> None:
    os.environ.clear()
    os.environ.update(environment)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world, *args)
            # No rank closes its connections before every rank is through: gloo connects the
            # ranks pair by pair, and a rank that finished a short fn and left while a peer was
            # still connecting made that peer fail with "Connection closed by peer".
            dist.barrier()
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def spawn(fn: Callable, world: int, args: tuple = (), timeout: float = 300.0, threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes joined by a gloo group.

    Args:
        fn: a module-level function (it is pickled by reference into each process).
        world: number of ranks.
        args: extra picklable arguments.
        timeout: seconds before every worker is killed and ``TimeoutError`` is raised; also the
            process group's own timeout, so a stuck collective fails instead of waiting forever.
        threads: torch intra-op threads per rank (None: the cores shared out, at least 1).

    Returns the value each rank returned, indexed by rank. Raises ``WorkerError`` with the
    tracebacks of every rank that failed.
    """
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world)  # ranks x threads <= cores
    context = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        context.set_forkserver_preload(PRELOAD)
    results = context.Queue()
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="ddphooks-") as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_worker, args=(fn, rank, world, init_file, threads, timeout, args, results, environment), daemon=True)
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            while len(values) + len(failures) < world:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if failures:
                        break
                    raise TimeoutError(f"{world - len(values)} of {world} ranks did not finish within {timeout:.0f} s")
                if failures:
                    # One rank failed: the others usually fail right after (a peer closed the
                    # connection); collect them briefly so the report shows the root cause too.
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    for rank, process in enumerate(processes):
                        if process.exitcode not in (None, 0) and rank not in failures and results.empty():
                            failures[rank] = f"exited with code {process.exitcode}{_signal_name(process.exitcode)} without reporting"
                    continue
                if ok:
                    values[rank] = value
                else:
                    failures[rank] = value
        finally:
            for process in processes:
                if failures or len(values) < world:
                    process.kill()
                process.join(timeout=10)
        if failures:
            raise WorkerError("\n".join(f"rank {rank} failed:\n{text}" for rank, text in sorted(failures.items())))
    return [values[rank] for rank in range(world)]


def _signal_name(exitcode: int) -> str:
    """`` (SIGSEGV)`` for a process killed by a signal (a negative exit code), else empty."""
    try:
        return f" ({signal.Signals(-exitcode).name})" if exitcode < 0 else ""
    except ValueError:
        return ""
