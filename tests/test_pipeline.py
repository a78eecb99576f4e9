"""StepPipeline in one process: steps processed in order on a background thread, alerts collected one
step later on the training thread, monitoring errors logged once and never raised."""

import logging
import threading
import time

import numpy as np
import pytest
from test_detect_process import _faulty_steps
from test_stats import _stats

from ddphooks import JsonlSink
from ddphooks.detect import Detector
from ddphooks.detect import process as detector_process
from ddphooks.detect.process import DetectorProcess
from ddphooks.identity import RankIdentity, RankTable
from ddphooks.pipeline import StepPipeline
from ddphooks.records import RecordBuilder
from ddphooks.writer import RecordWriter


class _Writer:
    def __init__(self) -> None:
        self.submitted = []  # the steps, in order
        self.alerts = []  # the alerts each step's record carries
        self.built = []

    def submit(self, item) -> None:
        stats, alerts, built = item  # built: the record as the detector's process built it, or None
        self.submitted.append(stats)
        self.alerts.append(alerts)
        self.built.append(built)

    def flush(self, timeout: float) -> bool:
        return True

    def close(self, timeout: float) -> bool:
        return True


def _steps(count: int, world: int = 3) -> list:
    rng = np.random.default_rng(0)
    steps = [_stats([rng.standard_normal(5) for _ in range(world)], [1.0] * world, bins=5) for _ in range(count)]
    for number, stats in enumerate(steps):
        stats.step = number
    return steps


def test_a_failing_detector_is_turned_off_with_one_warning(caplog):
    class _Broken(Detector):
        def update(self, obs):
            raise RuntimeError("detector bug")

    writer, steps = _Writer(), _steps(3)
    pipeline = StepPipeline(_Broken(), writer, on_alert=pytest.fail, warns=True)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        for stats in steps:
            pipeline.complete(stats)
            pipeline.process()
    pipeline.flush(5.0)
    assert writer.submitted == steps and pipeline.alerts == []
    failed = [r.getMessage() for r in caplog.records if "detector failed" in r.getMessage()]
    assert len(failed) == 1 and "RuntimeError: detector bug" in failed[0]


class _Gated(Detector):
    """One alert per step, found only once the test opens the gate, on whatever thread runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.threads: set[int] = set()
        self.waited: list[bool] = []

    def update(self, obs):
        self.threads.add(threading.get_ident())
        self.waited.append(self.gate.wait(timeout=10.0))  # False if the caller blocked on it for 10 s
        alert = {"step": obs.step, "rank": 0, "kind": "loss", "message": f"step {obs.step}"}
        self.alerts.append(alert)
        return [alert]


def test_the_detector_runs_off_the_training_thread_and_alerts_are_collected_at_the_next_step():
    detector, writer, steps = _Gated(), _Writer(), _steps(3)
    called = []
    pipeline = StepPipeline(detector, writer, on_alert=lambda alert: called.append((alert["step"], threading.get_ident())), warns=False)
    pipeline.complete(steps[0])
    pipeline.process()  # returns while the detector still waits at the gate: it is not on this thread
    assert pipeline.alerts == [] and called == []
    detector.gate.set()
    pipeline.complete(steps[1])
    pipeline.process()  # the step after: step 0's alert is collected here; step 1's not yet
    assert [a["step"] for a in pipeline.alerts] == [steps[0].step]
    pipeline.complete(steps[2])
    assert pipeline.close(5.0)  # everything: steps 1 and 2, their on_alert calls made
    assert [a["step"] for a in pipeline.alerts] == [s.step for s in steps] and [c[0] for c in called] == [s.step for s in steps]
    assert threading.get_ident() not in {thread for _, thread in called}  # on_alert never runs on the training thread
    assert detector.waited == [True, True, True] and threading.get_ident() not in detector.threads
    assert writer.submitted == steps and writer.alerts == [[a] for a in pipeline.alerts]


def test_on_alert_that_raises_or_blocks_never_reaches_the_training_thread(caplog):
    release, called = threading.Event(), []

    def on_alert(alert: dict) -> None:
        called.append(alert["step"])
        if alert["step"] == 0:
            raise RuntimeError("pager down")
        release.wait(timeout=10.0)  # a pager that hangs on its network

    detector, writer, steps = _Gated(), _Writer(), _steps(5)
    detector.gate.set()
    pipeline = StepPipeline(detector, writer, on_alert=on_alert, warns=True)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        for stats in steps:
            pipeline.complete(stats)
            pipeline.process()  # neither the exception nor the hanging call reaches it
        pipeline.process(wait=True)
        assert time.monotonic() - started < 5.0 and [a["step"] for a in pipeline.alerts] == [s.step for s in steps]
        assert not pipeline.flush(0.2)  # says on_alert is still busy
        release.set()
        assert pipeline.close(5.0)
    assert called == [s.step for s in steps] and writer.submitted == steps
    failures = [r.getMessage() for r in caplog.records if "on_alert raised" in r.getMessage()]
    assert len(failures) == 1 and "RuntimeError: pager down" in failures[0]


class _Kinds(Detector):
    """One alert of the kind ``kinds[step]`` (None: none) per step."""

    def __init__(self, kinds: list) -> None:
        super().__init__()
        self.kinds = kinds

    def update(self, obs):
        kind = self.kinds[obs.step]
        return [] if kind is None else [{"step": obs.step, "rank": 1, "kind": kind, "message": f"{kind} at step {obs.step}"}]


@pytest.mark.parametrize("stop_on, stops_at", [(frozenset({"layer"}), 5), (frozenset({"loss", "layer"}), 4), (frozenset(), None)])
def test_a_stopping_alert_of_step_s_is_collected_at_step_s_plus_2(stop_on, stops_at):
    # Kinds by step: a loss alert at step 2, a layer alert at step 3. The pipeline collects step s's
    # alerts at the process() of step s + 2 (a point every rank reaches alike), waiting for a late
    # detector there: a slow detector must not move the step that stops.
    detector = _Kinds([None, None, "loss", "layer", None, None, None, None])
    update = detector.update
    detector.update = lambda obs: (time.sleep(0.05), update(obs))[1]
    pipeline, stopped = StepPipeline(detector, None, on_alert=None, warns=False, stop_on=stop_on), None
    for stats in _steps(8):
        pipeline.complete(stats)  # the end of backward of step stats.step
        pipeline.process()  # the first bucket of the next step
        if stopped is None and pipeline.stopping is not None:
            stopped = stats.step + 1
    assert stopped == stops_at
    if stops_at is not None:
        assert pipeline.stopping["kind"] in stop_on and pipeline.stopping["step"] == stops_at - 2
    pipeline.close(5.0)


def test_a_writer_that_raises_is_logged_once_and_alerts_still_arrive(caplog):
    class _Raising(_Writer):
        def submit(self, stats) -> None:
            raise OSError("disk full")

    detector, steps = _Gated(), _steps(3)
    detector.gate.set()
    pipeline = StepPipeline(detector, _Raising(), on_alert=None, warns=True)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        for stats in steps:
            pipeline.complete(stats)
            pipeline.process()
        pipeline.flush(5.0)
    assert [a["step"] for a in pipeline.alerts] == [s.step for s in steps]
    failed = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(failed) == 1 and "OSError: disk full" in failed[0]


def test_a_logging_handler_that_blocks_never_holds_up_the_steps():
    # A handler stuck on I/O (a stalled stderr pipe): the pipeline thread, which the training
    # thread waits on when it falls behind, must not wait for it.
    released, emitted = threading.Event(), []

    class _Stalled(logging.Handler):
        def emit(self, record) -> None:
            released.wait(timeout=10.0)
            emitted.append(record.getMessage())

    detector, writer, steps = _Gated(), _Writer(), _steps(6)
    detector.gate.set()
    handler = _Stalled(level=logging.WARNING)
    logging.getLogger("ddphooks").addHandler(handler)
    try:
        pipeline = StepPipeline(detector, writer, on_alert=None, warns=True)
        started = time.monotonic()
        for stats in steps:
            pipeline.complete(stats)
            pipeline.process()
        pipeline.process(wait=True)  # every step detected while the first warning is still stuck
        assert time.monotonic() - started < 5.0
        assert [a["step"] for a in pipeline.alerts] == [s.step for s in steps] and emitted == []
        assert not pipeline.flush(0.2)  # says the handler is still busy, after 0.2 s
        released.set()
        assert pipeline.close(5.0)
    finally:
        logging.getLogger("ddphooks").removeHandler(handler)
    assert emitted == [f"ddphooks alert: step {s.step}" for s in steps]  # all of them, in order
    assert writer.submitted == steps


def test_a_logging_filter_that_raises_loses_only_its_own_message(capsys):
    emitted = []

    class _Recorder(logging.Handler):
        def emit(self, record) -> None:
            emitted.append(record.getMessage())

    def filter_(record):
        if record.getMessage().endswith("step 0"):
            raise RuntimeError("broken filter")
        return True

    detector, steps = _Gated(), _steps(3)
    detector.gate.set()
    handler, log = _Recorder(level=logging.WARNING), logging.getLogger("ddphooks")
    log.addHandler(handler)
    log.addFilter(filter_)
    try:
        pipeline = StepPipeline(detector, None, on_alert=None, warns=True)
        for stats in steps:
            pipeline.complete(stats)
            pipeline.process()
        assert pipeline.close(5.0)
    finally:
        log.removeFilter(filter_)
        log.removeHandler(handler)
    assert emitted == ["ddphooks alert: step 1", "ddphooks alert: step 2"]
    assert "RuntimeError: broken filter" in capsys.readouterr().err


def test_steps_completed_after_close_are_still_processed():
    detector, writer, steps = _Gated(), _Writer(), _steps(3)
    detector.gate.set()
    pipeline = StepPipeline(detector, writer, on_alert=None, warns=False)
    pipeline.complete(steps[0])
    assert pipeline.close(5.0)
    assert not pipeline._thread.is_alive()  # close() ended its thread

    def train_on():  # a run that goes on after close(): its steps must not wait for a stopped thread
        for stats in steps[1:]:
            pipeline.complete(stats)
            pipeline.process()
        pipeline.flush(5.0)

    worker = threading.Thread(target=train_on, daemon=True)
    worker.start()
    worker.join(timeout=10.0)
    assert not worker.is_alive(), "process() waited for steps no thread will take"
    assert [a["step"] for a in pipeline.alerts] == [s.step for s in steps] and writer.submitted == steps


def _threads_cannot_start(monkeypatch, names: set[str]) -> None:
    """``Thread.start`` raises as CPython does out of threads or memory, for the threads named in
    ``names`` (the set may be emptied later, to let them start again)."""
    start = threading.Thread.start

    def refuse(self):
        if self.name in names:
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse)


def test_steps_are_processed_on_the_training_thread_while_no_thread_can_start(caplog, monkeypatch):
    blocked = {"ddphooks-pipeline", "ddphooks-warnings", "ddphooks-on-alert"}
    _threads_cannot_start(monkeypatch, blocked)
    detector, writer, steps = _Gated(), _Writer(), _steps(5)
    detector.gate.set()
    called = []
    pipeline = StepPipeline(detector, writer, on_alert=lambda alert: called.append(alert["step"]), warns=True)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        for stats in steps[:3]:
            pipeline.complete(stats)
            pipeline.process()  # must not raise: it runs inside backward
        # Collected one step later, as with the thread: every rank collects them at the same point.
        assert [a["step"] for a in pipeline.alerts] == [steps[0].step, steps[1].step]
        assert called == [s.step for s in steps[:3]]  # on_alert ran on the training thread too, with the detector
        assert detector.threads == {threading.get_ident()}
        blocked.clear()  # threads again: the next steps leave the training thread
        for stats in steps[3:]:
            pipeline.complete(stats)
            pipeline.process()
        assert pipeline.close(5.0)
    assert called == [s.step for s in steps] and writer.submitted == steps
    assert len(detector.threads) == 2
    messages = [(r.getMessage(), r.thread) for r in caplog.records]
    refused = [m for m in messages if "pipeline thread could not start" in m[0]]
    assert len(refused) == 1 and "RuntimeError: can't start new thread" in refused[0][0]
    # The warnings of the first steps were logged on the training thread, none lost.
    assert [m for m, _ in messages if m.startswith("ddphooks alert")] == [f"ddphooks alert: step {s.step}" for s in steps]
    assert refused[0][1] == threading.get_ident()


def test_an_alert_raised_outside_the_detector_is_logged_called_and_goes_with_the_next_record(caplog):
    writer, steps, called = _Writer(), _steps(3), []
    pipeline = StepPipeline(None, writer, on_alert=called.append, warns=True)
    pipeline.complete(steps[0])
    pipeline.process()
    assert pipeline.flush(5.0)  # step 0's record is written before the alert
    alert = {"step": 1, "rank": 0, "kind": "unsynchronised", "message": "rank 0: not synchronised"}
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        pipeline.raise_alert(alert)  # the watchdog, between two steps
        assert pipeline.alerts == [alert]  # at once, not a step later
        assert pipeline._callbacks.drain(5.0) and called == [alert]  # on_alert's own thread, at once
        for stats in steps[1:]:
            pipeline.complete(stats)
            pipeline.process()
        assert pipeline.flush(5.0)
    assert writer.alerts == [[], [alert], []]  # the first record written after it, once
    assert pipeline.alerts == [alert] and called == [alert]  # not collected again from the record
    assert [r.getMessage() for r in caplog.records] == ["ddphooks alert: rank 0: not synchronised"]


def test_an_alert_raised_outside_the_detector_is_not_kept_where_no_records_are_written():
    pipeline = StepPipeline(None, None, on_alert=None, warns=False)  # a rank that writes no records
    for step in range(3):
        pipeline.raise_alert({"step": step, "rank": 1, "kind": "unsynchronised", "message": "rank 1: not synchronised"})
    assert len(pipeline.alerts) == 3 and pipeline._carried == []  # nothing waits for a record that never comes


def _collected(pipeline: StepPipeline, steps: list) -> list[list[int]]:
    """Run ``steps`` through ``pipeline`` as the hook does; per ``process()`` call, the steps of
    the alerts collected there (then ``close()``'s)."""
    calls, seen = [], 0
    for stats in steps:
        pipeline.complete(stats)
        pipeline.process()
        calls.append([a["step"] for a in pipeline.alerts[seen:]])
        seen = len(pipeline.alerts)
    assert pipeline.close(10.0)
    return calls + [[a["step"] for a in pipeline.alerts[seen:]]]


def test_the_training_thread_feeds_the_detectors_process_and_collects_its_alerts_as_a_thread_would():
    steps = _faulty_steps()
    reference_writer, writer = _Writer(), _Writer()
    reference = _collected(StepPipeline(Detector(), reference_writer, on_alert=None, warns=False), steps)
    detector = DetectorProcess(warn=pytest.fail)
    pipeline = StepPipeline(detector, writer, on_alert=None, warns=False)
    try:
        assert _collected(pipeline, steps) == reference and any(reference)
    finally:
        detector.close()
    assert pipeline._thread is None  # no thread of this process ran a step
    assert writer.submitted == reference_writer.submitted == steps and writer.alerts == reference_writer.alerts


@pytest.mark.parametrize("executable", ["/nonexistent/python", "/bin/false"], ids=["cannot start", "exits at once"])
def test_a_detectors_process_that_never_starts_is_replaced_with_no_step_lost(monkeypatch, executable):
    monkeypatch.setattr(detector_process.sys, "executable", executable)
    steps, said = _faulty_steps(), []
    reference = _collected(StepPipeline(Detector(), _Writer(), on_alert=None, warns=False), steps)
    writer, detector = _Writer(), DetectorProcess(warn=said.append)
    pipeline = StepPipeline(detector, writer, on_alert=None, warns=False)
    assert _collected(pipeline, steps) == reference and any(reference)
    assert detector.in_process and len(said) == 1 and "could not start" in said[0]
    assert pipeline._thread is not None  # from then on the detector runs on the pipeline's thread
    assert writer.submitted == steps


def test_a_detectors_process_that_dies_turns_detection_off_and_every_step_is_still_written(caplog):
    steps, writer = _faulty_steps(count=12), _Writer()
    detector = DetectorProcess(warn=pytest.fail)
    pipeline = StepPipeline(detector, writer, on_alert=None, warns=True)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        for index, stats in enumerate(steps):
            if index == 6:
                detector._child.kill()
            pipeline.complete(stats)
            pipeline.process()
        assert pipeline.close(10.0)
    failed = [r.getMessage() for r in caplog.records if "detector failed" in r.getMessage()]
    assert len(failed) == 1 and "gave no answer" in failed[0] and "exited with code -9" in failed[0]
    assert writer.submitted == steps and pipeline.alerts == []


def _records_of(tmp_path, name: str, steps: list, in_child: bool, restore_at: int) -> tuple[list[str], list]:
    """The JSONL lines a log rank's pipeline writes for ``steps`` (detailed every 10th, the rank
    table in the first), the builder's state loaded from a checkpoint before step
    ``restore_at`` (the child takes it up before its next record); with ``in_child`` the
    detector's process builds the records."""
    hosts = ["node0", "node0", "node1", "node1"]
    ranks = RankTable([RankIdentity(r, r, hosts[r], r % 2, 1000 + r, "cpu") for r in range(4)], subgroup=False)
    records, sink = RecordBuilder(1, 10, 256, ranks=ranks), JsonlSink(tmp_path / f"{name}.jsonl")
    writer = RecordWriter([sink], lambda item: records.build(*item), 64)
    detector = DetectorProcess(warn=pytest.fail, records=records) if in_child else Detector()
    pipeline = StepPipeline(detector, writer, on_alert=None, warns=False)
    try:
        for stats in steps:
            if stats.step == restore_at:  # a checkpoint's state, loaded between steps (the records before it written)
                assert pipeline.flush(10.0)
                records.load_state_dict({"trace_average": 0.5, "signal_average": 2.0})
            pipeline.complete(stats)
            pipeline.process()
        assert pipeline.close(10.0)
    finally:
        if in_child:
            detector.close()
    return sink.path.read_text().splitlines(), pipeline.alerts


def test_the_detectors_process_builds_the_records_the_writer_would_have(tmp_path, monkeypatch):
    steps = _faulty_steps()
    built, build = [], RecordBuilder.build

    def counted(self, stats, alerts=(), record=None):
        built.append(record is not None)  # the writer got the record from the detector's process
        return build(self, stats, alerts, record)

    monkeypatch.setattr(RecordBuilder, "build", counted)
    expected, expected_alerts = _records_of(tmp_path, "thread", steps, in_child=False, restore_at=25)
    assert not any(built)
    built.clear()
    lines, alerts = _records_of(tmp_path, "child", steps, in_child=True, restore_at=25)
    assert lines == expected and alerts == expected_alerts and any(alerts)
    assert all(built) and len(built) == len(steps)  # every record came built from the detector's process
    assert '"identity"' in lines[0] and '"identity"' in lines[10] and '"identity"' not in lines[1]


def test_a_flush_from_another_thread_while_steps_are_handed_over_loses_nothing():
    steps, writer = _faulty_steps(), _Writer()
    reference = _collected(StepPipeline(Detector(), _Writer(), on_alert=None, warns=False), steps)
    detector = DetectorProcess(warn=pytest.fail)
    pipeline = StepPipeline(detector, writer, on_alert=None, warns=False)
    done, failures = threading.Event(), []

    def flush_often():  # a monitoring thread's flush() at any moment
        while not done.is_set():
            try:
                pipeline.flush(10.0)
            except Exception as error:  # pragma: no cover - what the test looks for
                failures.append(error)

    flusher = threading.Thread(target=flush_often, daemon=True)
    flusher.start()
    try:
        for stats in steps:
            pipeline.complete(stats)
            pipeline.process()
    finally:
        done.set()
        flusher.join(timeout=30)
    assert pipeline.close(10.0)
    detector.close()
    assert not failures and not flusher.is_alive()
    assert writer.submitted == steps and [a["step"] for a in pipeline.alerts] == [s for call in reference for s in call]
