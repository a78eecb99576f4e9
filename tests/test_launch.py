"""``ddphooks.launch.spawn``: a worker killed by a signal is named with the signal."""

import os
import signal

import pytest

from ddphooks.launch import WorkerError, spawn


def _crash_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # what a crash in native code does to the process
    return rank


def test_a_rank_killed_by_a_signal_is_named_with_it():
    with pytest.raises(WorkerError) as caught:
        spawn(_crash_on_rank_1, 2, timeout=60)
    assert "rank 1 failed" in str(caught.value) and "exited with code -11 (SIGSEGV) without reporting" in str(caught.value)
