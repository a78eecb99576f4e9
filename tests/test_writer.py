"""Sinks that fail or stall never reach training: the writer thread, in one process and on gloo."""

import logging
import threading
import time

import pytest
import torch
from test_hook import TIMEOUT, _make_ddp, _train
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddphooks import SilentState, Sink, silent_hook
from ddphooks.launch import spawn
from ddphooks.writer import RecordWriter


class _Collect(Sink):
    """Keeps every record it is given."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)


class _DiskFull(_Collect):
    """Raises OSError on its ``fail_at``-th write (1-based), like a full disk."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def write(self, record: dict) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError(28, "No space left on device")
        super().write(record)


class _Slow(_Collect):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def write(self, record: dict) -> None:
        time.sleep(self.seconds)
        super().write(record)


class _Stuck(Sink):
    """Never returns from write (until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def write(self, record: dict) -> None:
        self.release.wait()


def _build(item: int) -> dict:
    return {"step": item}


def test_a_raising_sink_is_reported_once_counted_and_the_others_go_on(caplog):
    failing, healthy = _DiskFull(fail_at=3), _Collect()
    writer = RecordWriter([failing, healthy], _build, max_pending=100)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        for step in range(6):
            writer.submit(step)
        assert writer.close(timeout=10)
    assert [r["step"] for r in healthy.records] == list(range(6))
    assert [r["step"] for r in failing.records] == [0, 1, 3, 4, 5]
    assert writer.dropped == {"_DiskFull": 1}
    assert failing.records[2]["dropped_records"] == {"_DiskFull": 1}  # the next record that got through says so
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "_DiskFull failed to write a record: OSError" in warnings[0] and "No space left" in warnings[0]


def test_a_slow_sink_drops_the_oldest_records_and_counts_them():
    slow = _Slow(0.05)
    writer = RecordWriter([slow], _build, max_pending=3)
    started = time.perf_counter()
    for step in range(40):
        writer.submit(step)
    submit_seconds = time.perf_counter() - started
    assert writer.close(timeout=10)
    written = [r["step"] for r in slow.records]
    assert submit_seconds < 1.0  # 40 writes would take 2 s: submit never waited for them
    assert written[-1] == 39 and written == sorted(written)
    assert len(written) + writer.dropped["queue"] == 40
    assert slow.records[-1]["dropped_records"]["queue"] == writer.dropped["queue"]


def test_close_never_hangs_on_a_stuck_sink(caplog):
    stuck = _Stuck()
    writer = RecordWriter([stuck], _build, max_pending=10)
    writer.submit(0)
    writer.submit(1)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        started = time.perf_counter()
        assert writer.flush(timeout=0.3) is False
        assert writer.close(timeout=0.3) is False
        assert time.perf_counter() - started < 2.0
    assert "did not finish within 0.3 s of close(); 2 record(s) may not have been written" in caplog.text
    stuck.release.set()


def test_a_failing_record_builder_is_counted_for_every_sink(caplog):
    sinks = [_Collect(), _Collect()]

    def build(item: int) -> dict:
        if item == 1:
            raise ValueError("bad statistics")
        return {"step": item}

    writer = RecordWriter(sinks, build, max_pending=10)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        for step in range(3):
            writer.submit(step)
        writer.close(timeout=10)
    assert [r["step"] for r in sinks[0].records] == [0, 2]
    assert writer.dropped == {"_Collect#0": 1, "_Collect#1": 1}
    assert "record builder failed to write a record: ValueError: bad statistics" in caplog.text


# -- in a real 2-rank run ---------------------------------------------------------------------------
def _check_failing_sinks_in_training(rank: int, world: int) -> dict:
    plain = _make_ddp()
    plain.register_comm_hook(None, allreduce_hook)
    expected = _train(rank, plain, 8)
    model = _make_ddp()
    failing, slow, healthy = _DiskFull(fail_at=3), _Slow(0.3), _Collect()
    state = SilentState(model=model, sketch_dim=64, sinks=[failing, slow, healthy], max_pending_records=2)
    model.register_comm_hook(state, silent_hook)
    started = time.perf_counter()
    got = _train(rank, model, 8, state=state)
    seconds = time.perf_counter() - started
    state.close()
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(expected, got)),
        "seconds": seconds,
        "healthy": [r["step"] for r in healthy.records],
        "failing": [r["step"] for r in failing.records],
        "slow": len(slow.records),
        "dropped": state.dropped_records,
    }


def test_failing_and_slow_sinks_in_a_two_rank_run_change_nothing():
    result = spawn(_check_failing_sinks_in_training, 2, timeout=TIMEOUT)[0]
    assert result["bitwise"]
    queue = result["dropped"].get("queue", 0)
    # The slow sink (0.3 s a write) makes the queue of 2 overflow: every sink loses those records
    # alike, the raising sink one more; nothing else is lost.
    assert queue > 0 and result["dropped"]["_DiskFull"] == 1
    assert len(result["healthy"]) == 8 - queue == result["slow"]
    assert len(result["failing"]) == len(result["healthy"]) - 1
    assert result["healthy"][-1] == 7
    assert result["seconds"] < 8 * 0.3  # training never waited for the slow sink


@pytest.mark.parametrize("bad", [{"max_pending_records": 0}, {"detail_every": -1}, {"detail_max_world": 0}])
def test_writer_settings_are_validated(bad):
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=rf"{name}={value} must be >= "):
        SilentState(**bad)


def test_jsonl_sink_appends_without_a_second_header(tmp_path):
    from ddphooks import JsonlSink

    for step in range(2):
        sink = JsonlSink(tmp_path / "run.jsonl", header={"h": 1}, append=True)
        sink.write({"step": step})
        sink.close()
    assert (tmp_path / "run.jsonl").read_text().splitlines() == ['{"header": {"h": 1}}', '{"step": 0}', '{"step": 1}']



def test_records_wait_for_a_writer_thread_that_cannot_start_and_none_is_lost(monkeypatch):
    start, allowed = threading.Thread.start, threading.Event()

    def refuse(self):  # as CPython does out of threads or memory, until the test allows it
        if self.name == "ddphooks-writer" and not allowed.is_set():
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    sink = _Collect()
    writer = RecordWriter([sink], build=lambda item: {"step": item}, max_pending=8)
    with pytest.raises(RuntimeError, match=r"the writer thread could not start \(can't start new thread\); records stay queued"):
        writer.submit(0)  # the pipeline reports this once; the record stays queued
    assert not writer.flush(1.0)  # nothing written yet, and flush says so
    allowed.set()
    writer.submit(1)  # this one's thread writes both
    assert writer.flush(5.0)
    assert [r["step"] for r in sink.records] == [0, 1]
    allowed.clear()
    late = RecordWriter([sink], build=lambda item: {"step": item}, max_pending=8)
    with pytest.raises(RuntimeError):
        late.submit(3)
    assert late.close(5.0)  # no thread ever: close() writes the queued record itself
    assert [r["step"] for r in sink.records] == [0, 1, 3] and writer.close(5.0)
