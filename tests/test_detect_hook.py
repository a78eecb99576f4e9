"""Detection inside training on gloo: alerts name the faulty rank, replicas are compared (stopping on an alert: tests/test_operations.py)."""

import logging
import socket
import threading
import time

import pytest
import torch
from test_hook import TIMEOUT, _batch, _loss, _make_ddp, _Net, _spawn_cases

import ddphooks
import ddphooks.hook as hook_module
from ddphooks.detect import DetectorConfig, detect_run
from ddphooks.experiment.report import read_run
from ddphooks.launch import spawn
from ddphooks.stats import SilentStats

FAULT_STEP = 30


def _train_with_fault(rank: int, world: int, steps: int, fault_rank: int, on_alert=None, lr_fault: bool = False, stuck: bool = False, **settings):
    """SGD on rank-dependent data; from FAULT_STEP, ``fault_rank`` gets targets of the wrong sign
    (a silent data fault), or with ``lr_fault`` a different learning rate (a replica fault), or
    with ``stuck`` the batch of FAULT_STEP over and over (a stuck data loader)."""
    model = _make_ddp()
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ddphooks").addHandler(handler)
    state = ddphooks.attach(model, sketch_dim=256, on_alert=on_alert, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    for step in range(steps):
        faulty = rank == fault_rank and step >= FAULT_STEP
        x, y = _batch(rank, FAULT_STEP if faulty and stuck else step)
        if faulty and not (lr_fault or stuck):
            y = -3 * y
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        if faulty and lr_fault:
            for group in optimizer.param_groups:
                group["lr"] = 0.05
        optimizer.step()
        optimizer.zero_grad()
    state.close()
    logging.getLogger("ddphooks").removeHandler(handler)
    return state.alerts, [w for w in warnings if w.startswith("ddphooks alert")], state.latest.replicas


def _check_detection(rank: int, world: int) -> tuple:
    return _train_with_fault(rank, world, 45, fault_rank=2, check_replicas_every=0)


def _check_replicas(rank: int, world: int, lr_fault: bool) -> tuple:
    return _train_with_fault(rank, world, FAULT_STEP + 7, fault_rank=1, lr_fault=lr_fault, check_replicas_every=4, detect=DetectorConfig(warmup=200))


@pytest.fixture(scope="module")
def three_rank_faults() -> dict:
    """The three-rank runs that end normally, in one spawn: the silent data fault, and the replica
    check of a healthy run and of one with a replica fault. (The runs that abort on purpose, and
    the one that makes subgroups, keep spawns of their own.)"""
    return _spawn_cases(3, [
        ("detection", _check_detection, ()),
        ("healthy", _check_replicas, (False,)),
        ("lr_fault", _check_replicas, (True,)),
    ], TIMEOUT)  # fmt: skip


@pytest.fixture(scope="module")
def two_rank_faults(tmp_path_factory) -> dict:
    """The stuck loader and the non-finite loss on two ranks, in one spawn; the non-finite run's
    file in the folder under "non_finite_folder"."""
    folder = tmp_path_factory.mktemp("non_finite")
    runs = _spawn_cases(2, [("stuck", _check_stuck, ()), ("non_finite", _check_non_finite, (str(folder),))], TIMEOUT)
    return {**runs, "non_finite_folder": folder}


def test_the_hook_names_the_faulty_rank_on_every_rank_and_warns_once_per_alert(three_rank_faults):
    results = three_rank_faults["detection"]
    alerts, warnings, _ = results[0]
    assert alerts, "no alert for a rank whose targets flipped sign"
    assert alerts[0]["rank"] == 2 and FAULT_STEP <= alerts[0]["step"] <= FAULT_STEP + 5
    assert all(result[0] == alerts for result in results)  # the same alerts on every rank
    assert len(warnings) == len(alerts) and warnings[0].endswith(alerts[0]["message"])
    assert results[1][1] == [] and results[2][1] == []  # only the log rank warns


def _check_stuck(rank: int, world: int) -> tuple:
    return _train_with_fault(rank, world, 45, fault_rank=1, stuck=True, check_replicas_every=0)


def test_a_stuck_loader_is_named_at_two_ranks_from_the_cosine_to_the_previous_step(two_rank_faults):
    alerts, _, _ = two_rank_faults["stuck"][0]
    assert alerts, "no alert for a rank that trains on the same batch over and over"
    assert {a["rank"] for a in alerts} == {1} and FAULT_STEP <= alerts[0]["step"] <= FAULT_STEP + 8, alerts
    assert any(signal.startswith("cosine_previous") for signal in alerts[0]["signals"]), alerts[0]


def test_replica_check_flags_the_drifting_rank_and_never_identical_replicas(three_rank_faults):
    healthy = three_rank_faults["healthy"][0]
    assert healthy[0] == [] and healthy[2] == {"ranks": [], "tensors": 0, "parameters": [], "not_compared": 0}, healthy
    alerts, _, replicas = three_rank_faults["lr_fault"][0]
    # The optimizer of rank 1 runs with another learning rate from step 30: its parameters
    # differ from step 31 on, and step 32 is the first check after that.
    assert [(a["step"], a["rank"], a["kind"]) for a in alerts] == [(32, 1, "replica")]
    assert replicas["ranks"] == [1] and replicas["tensors"] == 6
    assert {p["name"] for p in replicas["parameters"]} == {n for n, _ in _Net().named_parameters()}


def _check_non_finite(rank: int, world: int, folder: str) -> list:
    """On rank 1 the loss overflows to Inf at step 3, under a loss scaler (``torch.amp.GradScaler``)
    that skips that step on every rank; then, without the scaler, the loss turns NaN at step 10
    and the averaged gradient makes every replica NaN from step 11 on."""
    model = _make_ddp()
    state = ddphooks.attach(model, sketch_dim=64, check_replicas_every=0, sinks=[ddphooks.JsonlSink(f"{folder}/run.jsonl")])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    for step in range(14):
        x, y = _batch(rank, step)
        loss = _loss(model, x, y)
        if rank == 1 and step in (3, 10):
            loss = loss * float("inf" if step == 3 else "nan")
        state.observe_loss(loss)
        if step < 8:
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped where the averaged gradient is not finite
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
    state.close()
    return state.alerts, scaler.get_scale()


def test_the_rank_whose_loss_went_nan_first_is_named_on_every_rank_and_a_skipped_overflow_never(two_rank_faults):
    results, tmp_path = two_rank_faults["non_finite"], two_rank_faults["non_finite_folder"]
    assert len(results) == 2
    # Offline, on the run file (where Inf and NaN are null), the same detector finds the same alerts.
    assert detect_run(read_run(str(tmp_path / "run.jsonl")).records) == results[0][0]
    for alerts, scale in results:
        assert scale == 8.0  # the scaler saw the overflow of step 3 and skipped that step
        assert [(a["step"], a["rank"], a["kind"], a["since"]) for a in alerts] == [(11, 1, "nonfinite", 10)], alerts
        where = f"global rank 1 on {socket.gethostname()}, cpu"  # named with the host and device
        assert alerts[0]["message"].startswith(f"{where}: check that rank's batch at step 10 first: rank 1's loss and local gradient went non-finite (NaN or Inf) at step 10 while rank(s) 0 had")
        assert set(alerts[0]["parameters"]) <= {name for name, _ in _Net().named_parameters()} and alerts[0]["parameters"]


class _FailsAtStep6(SilentStats):
    """The statistics of step 6 fail to compute (a planted bug)."""

    def __init__(self, step: int, *args, **kwargs) -> None:
        if step == 6:
            raise RuntimeError("planted statistics failure")
        super().__init__(step, *args, **kwargs)


def _raising_loss_from(module, args, kwargs, output):
    raise KeyError("no loss in this output")


def _train_drifting_replica(rank: int, model, state, after_step=None) -> float:
    """12 steps on which rank 1's optimizer runs with another learning rate from step 2, so its
    replica drifts from the others'; ``after_step(step, x, y)`` after each. Returns the longest
    step's seconds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    longest = 0.0
    for step in range(12):
        started = time.monotonic()
        if rank == 1 and step == 2:
            optimizer.param_groups[0]["lr"] = 0.05
        x, y = _batch(rank, step)
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step, x, y)
        longest = max(longest, time.monotonic() - started)
    return longest


def _check_stalled_handler(rank: int, world: int) -> tuple:
    """Rank 1's replica drifts from step 2, so the log rank warns of an alert, into a logging
    handler that blocks (a stalled stderr pipe) until the run is over. Every one-off warning the
    hook raises inside forward and backward goes to the same handler: the loss capture fails on
    every forward, the statistics of step 6 fail, and a second model's state has no model to
    fingerprint for its replica check."""
    released, emitted = threading.Event(), []

    class _Stalled(logging.Handler):
        def emit(self, record) -> None:
            released.wait(timeout=30.0)
            emitted.append(record.getMessage())

    handler = _Stalled(level=logging.WARNING)
    logging.getLogger("ddphooks").addHandler(handler)
    hook_module.SilentStats = _FailsAtStep6
    model = _make_ddp()
    state = ddphooks.attach(model, sketch_dim=64, check_replicas_every=1, detect=DetectorConfig(warmup=200), loss_from=_raising_loss_from)
    unfingerprinted = _make_ddp()
    plain = ddphooks.SilentState(check_replicas_every=1, detect=False)
    unfingerprinted.register_comm_hook(plain, ddphooks.silent_hook)

    def unfingerprinted_step(step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        if step < 2:
            _loss(unfingerprinted, x, y).backward()

    longest = _train_drifting_replica(rank, model, state, unfingerprinted_step)
    started = time.monotonic()
    state.flush(timeout=1.0)
    flush_s = time.monotonic() - started
    alerts = state.alerts
    released.set()
    state.close()
    plain.close()
    logging.getLogger("ddphooks").removeHandler(handler)
    return alerts, emitted, longest, flush_s


def test_a_logging_handler_that_blocks_never_slows_training():
    alerts, emitted, longest, flush_s = spawn(_check_stalled_handler, 2, timeout=TIMEOUT)[0]
    assert alerts and alerts[0]["kind"] == "replica", alerts
    assert longest < 5.0 and flush_s < 5.0, (longest, flush_s)  # the handler held its first message for 30 s
    assert [m for m in emitted if m.startswith("ddphooks alert")] == [f"ddphooks alert: {a['message']}" for a in alerts]
    assert "ddphooks: flush() gave up after 1 s: a sink or a logging handler is still busy" in emitted
    one_off = [m for m in emitted if not m.startswith(("ddphooks alert", "ddphooks: flush()"))]
    assert sorted(one_off) == sorted([  # two states, two warnings threads: in no set order
        "ddphooks: loss capture failed (KeyError: 'no loss in this output'); no loss is recorded for such forwards",
        "ddphooks: the replica check (check_replicas_every=1) needs the DDP model to fingerprint its parameters and buffers; "
        "it is off for this state: use ddphooks.attach(model, ...), SilentState(model=...) or check_replicas_every=0",
        "ddphooks: statistics of step 6 failed: RuntimeError('planted statistics failure')",
        # the second state's loop records no loss (its model returns no loss, nothing observed)
        "ddphooks: no loss was recorded for step 0 on rank 0, so its records hold no loss (null) and the detector has no loss "
        "signal: no training forward output reached ddphooks' loss capture (it is installed by attach, not by "
        "register_comm_hook). Add one line before backward(): state.observe_loss(loss), with the unscaled loss (not "
        "loss / accumulation_steps); or pass attach(model, loss_from=lambda module, args, kwargs, output: <the loss>). "
        "Said once.",
    ]), one_off


def _replica_run(rank: int, folder: str, name: str) -> list[dict]:
    """The drifting replica's run (a ``replica`` alert at step 2), records written to ``folder/name``."""
    model = _make_ddp()
    state = ddphooks.attach(model, sketch_dim=64, check_replicas_every=1, detect=DetectorConfig(warmup=200), sinks=[ddphooks.JsonlSink(f"{folder}/{name}")])
    _train_drifting_replica(rank, model, state)
    state.close()
    return state.alerts


def _check_without_threads(rank: int, world: int, folder: str) -> tuple:
    """The same run with threads, then with none of ddphooks' threads able to start (as out of
    threads or memory): the writer's and the warnings' (and the pipeline's, were one asked for)."""
    reference = _replica_run(rank, folder, "threads.jsonl")
    start, messages = threading.Thread.start, []

    def refuse(thread):
        if thread.name.startswith("ddphooks-"):
            raise RuntimeError("can't start new thread")
        start(thread)

    class _Collect(logging.Handler):
        def emit(self, record) -> None:
            messages.append(record.getMessage())

    handler = _Collect(level=logging.WARNING)
    logging.getLogger("ddphooks").addHandler(handler)
    threading.Thread.start = refuse
    try:
        alerts = _replica_run(rank, folder, "no-threads.jsonl")
    finally:
        threading.Thread.start = start
        logging.getLogger("ddphooks").removeHandler(handler)
    return reference, alerts, messages


def test_a_run_where_no_thread_can_start_trains_and_alerts_as_with_threads(tmp_path):
    results = spawn(_check_without_threads, 2, args=(str(tmp_path),), timeout=TIMEOUT)
    for rank, (reference, alerts, messages) in enumerate(results):
        assert reference and reference[0]["kind"] == "replica" and alerts == reference
        # No pipeline thread is asked for: the training thread feeds the detector's process itself
        # (the refused pipeline thread of an in-process detector: tests/test_pipeline.py).
        assert not [m for m in messages if "pipeline thread could not start" in m]
        writer = [m for m in messages if "the writer thread could not start" in m]
        assert len(writer) == (1 if rank == 0 else 0), messages  # said once; the records wait for close()
        # The log rank's alert warnings were logged on the training thread: none lost.
        assert [m for m in messages if m.startswith("ddphooks alert")] == ([f"ddphooks alert: {a['message']}" for a in alerts] if rank == 0 else [])
    with_threads, without = (read_run(str(tmp_path / name)).records for name in ("threads.jsonl", "no-threads.jsonl"))
    assert [r["step"] for r in without] == [r["step"] for r in with_threads] == list(range(12))
    assert [r["alerts"] for r in without] == [r["alerts"] for r in with_threads]


def test_detection_settings_are_validated():
    with pytest.raises(ValueError, match=r"check_replicas_every=-1 must be >= 0"):
        ddphooks.SilentState(check_replicas_every=-1)
    with pytest.raises(TypeError, match=r"on_alert must be a function taking the alert dict, got str"):
        ddphooks.SilentState(on_alert="print")
    with pytest.raises(TypeError, match=r"detect must be True, False or a ddphooks.detect.DetectorConfig"):
        ddphooks.SilentState(detect="yes")


def _duplicate_run(rank: int, same: bool, **ddp_kwargs) -> list[dict]:
    """6 SGD steps of a fresh DDP model, with ``same`` the batch of rank 0 on every rank (a
    sampler without the rank), else each rank its own; the alerts every rank's detector found."""
    model = _make_ddp(**ddp_kwargs)
    state = ddphooks.attach(model, sketch_dim=64, check_replicas_every=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    for step in range(6):
        x, y = _batch(0 if same else rank, step)
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state.close()
    return state.alerts


def _check_duplicate_data(rank: int, world: int) -> tuple:
    """Three runs in one process group of 3: the same data on every rank, distinct data, and the
    same data on a DDP model over ranks 0 and 1 only (W = 2; rank 2 sits it out)."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])  # a collective: every rank creates it
    same, distinct = _duplicate_run(rank, True), _duplicate_run(rank, False)
    same_pair = _duplicate_run(rank, True, process_group=pair) if rank < 2 else None
    return same, distinct, same_pair


def test_ranks_that_draw_the_same_batches_are_named_on_every_rank_at_two_and_three_ranks():
    results = spawn(_check_duplicate_data, 3, timeout=TIMEOUT)
    for rank, (same, distinct, same_pair) in enumerate(results):
        duplicate = [a for a in same if a["kind"] == "duplicate_data"]
        assert [(a["step"], a["since"], a["ranks"]) for a in duplicate] == [(2, 0, [0, 1, 2])], (rank, same)
        expected = f"global ranks 0, 1, 2 on {socket.gethostname()}: check the data sampler's rank first: every rank (all 3) computed the same loss and gradient on every step since step 0"
        assert duplicate[0]["message"].startswith(expected), duplicate[0]
        assert same == results[0][0]  # the same alerts on every rank
        assert [a for a in distinct if a["kind"] == "duplicate_data"] == [], (rank, distinct)
        if rank < 2:
            assert [(a["step"], a["ranks"]) for a in same_pair if a["kind"] == "duplicate_data"] == [(2, [0, 1])], (rank, same_pair)


EXIT_WITHOUT_CLOSE = """
import sys, torch, torch.distributed as dist, ddphooks
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
state = ddphooks.attach(model, sinks=[ddphooks.JsonlSink(sys.argv[2])])
for step in range(5):
    loss = model(torch.randn(4, 8)).square().mean()
    state.observe_loss(loss)
    loss.backward()
"""  # and no state.close(): the interpreter's exit closes the state


def test_a_run_that_exits_without_close_writes_every_step_and_warns_of_nothing(tmp_path):
    import subprocess
    import sys

    records = tmp_path / "run.jsonl"
    result = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path / "store"), str(records)], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    # The detector's process outlives the exit's close of the state, which reads its last alerts.
    assert "ddphooks:" not in result.stderr, result.stderr
    assert [r["step"] for r in read_run(str(records)).records] == list(range(5))
