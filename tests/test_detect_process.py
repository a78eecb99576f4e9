"""The detector in a process of its own (``ddphooks.detect.process``): the same alerts as in the
training process, a step read there from its slots (``StepSlots``, or the compact wire's
``FleetSlots``, without torch) as it reads here, sending that never waits for the child, a child that cannot start replaced before any
step, one that dies or hangs turned into an error (the pipeline turns detection off with it),
never a hang."""

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from detect_replays import FIXTURE, _online_observation, replay_records

from ddphooks.detect import Detector, DetectorConfig, Observation
from ddphooks.detect import process as detector_process
from ddphooks.detect.process import DetectorProcess
from ddphooks.records import RecordBuilder
from ddphooks.stats import ABSENT, FINGERPRINT_WIDTH, BucketLayout, SilentStats

REPLAYS = json.loads(FIXTURE.read_text())["replays"]
# The online replays at W = 2, 4 and 8 with faults: every statistical kind, the split and the mirror.
ONLINE = [run["spec"] for run in REPLAYS if run["spec"].get("feed") == "online" and run["alerts"]][:6]


@pytest.mark.parametrize("spec", ONLINE, ids=[spec["name"] for spec in ONLINE])
def test_the_process_raises_the_alerts_of_the_detector_in_this_process(spec):
    config = DetectorConfig(**spec.get("config", {}))
    local, remote, said = Detector(config), DetectorProcess(config, warn=pytest.fail), []
    try:
        for record in replay_records(spec):
            observation = _online_observation(record)
            said.append((local.update(observation), remote.update(observation)))
        assert not remote.in_process
    finally:
        remote.close()
    assert [a for a, _ in said] == [b for _, b in said] and any(a for a, _ in said)


def _observations(count: int) -> list[Observation]:
    spec = next(run["spec"] for run in REPLAYS if run["spec"].get("world") == 2 and run["spec"].get("feed") == "online")
    return [_online_observation(record) for record in replay_records(spec)[:count]]


def test_a_child_that_cannot_start_is_replaced_in_this_process_before_any_step(monkeypatch):
    monkeypatch.setattr(detector_process.sys, "executable", "/nonexistent/python")
    said = []
    detector = DetectorProcess(warn=said.append)
    observations = _observations(30)
    alerts = [detector.update(observation) for observation in observations]
    assert detector.in_process and len(said) == 1 and "could not start" in said[0] and "/nonexistent/python" in said[0]
    reference = Detector()
    assert alerts == [reference.update(observation) for observation in observations]


def test_a_child_that_dies_is_an_error_that_names_its_exit():
    detector = DetectorProcess(warn=pytest.fail)
    observations = _observations(3)
    detector.update(observations[0])
    detector._child.kill()
    detector._child.wait()
    with pytest.raises(RuntimeError, match=r"gave no answer .*exited with code -9"):
        detector.update(observations[1])


def test_a_child_that_hangs_is_killed_after_the_timeout():
    detector = DetectorProcess(warn=pytest.fail, timeout=1.0)
    observations = _observations(3)
    detector.update(observations[0])
    child = detector._child
    os.kill(child.pid, signal.SIGSTOP)  # no answer, ever
    with pytest.raises(RuntimeError, match=r"gave no answer \(TimeoutError"):
        detector.update(observations[1])
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_the_child_imports_no_torch_and_ends_with_its_input():
    root = str(detector_process.Path(detector_process.__file__).resolve().parents[2])
    probe = detector_process.BOOTSTRAP.replace("serve()", "import sys; print(sorted(m for m in sys.modules if m == 'torch' or (m.startswith('ddphooks') and not m.startswith('ddphooks.detect') and m != 'ddphooks')))")
    result = subprocess.run([sys.executable, "-c", probe, root], capture_output=True, text=True, timeout=60)
    # ddphooks.detect and its offline reader's rank table (ddphooks.identity, torch-free) only
    assert result.returncode == 0 and result.stdout.strip() == "['ddphooks.identity']", result.stderr
    detector = DetectorProcess(warn=pytest.fail)
    detector.update(_observations(1)[0])
    child = detector._child
    detector.close()
    assert child.returncode == 0


LAYOUT = BucketLayout(0, ("a", "b", "c"), (50, 30, 20))


def _faulty_steps(count: int = 60, world: int = 4, bins: int = 16, fault_from: int = 40, seed: int = 0) -> list[SilentStats]:
    """Steps as the hook hands them over (fp32 slots, each given the step before, for
    ``cosine_previous``): every rank's gradient a shared direction plus noise, rank W - 1's loss
    3x and its gradient unrelated from ``fault_from`` on (a loss alert at W = 4 a step later)."""
    rng = np.random.default_rng(seed)
    direction, steps, previous = rng.standard_normal(100), [], None
    for step in range(count):
        rows, gradients = [], []
        for rank in range(world):
            gradient = direction * (1 + 0.01 * step) + 0.3 * rng.standard_normal(100)
            loss = 2.0 - 0.01 * step + 0.02 * rng.standard_normal()
            if rank == world - 1 and step >= fault_from:
                loss, gradient = 3.0 * loss, rng.standard_normal(100)
            sketch = np.zeros(bins)
            np.add.at(sketch, np.arange(100) % bins, gradient)
            rows.append([loss, 1.0, 0.0, gradient[:50] @ gradient[:50], gradient[50:80] @ gradient[50:80], gradient[80:] @ gradient[80:], *sketch])
            gradients.append(gradient)
        mean = np.mean(gradients, axis=0)
        reduced = torch.tensor([mean[:50] @ mean[:50], mean[50:80] @ mean[50:80], mean[80:] @ mean[80:]], dtype=torch.float32)
        previous = SilentStats(step, world, [LAYOUT], torch.tensor(rows, dtype=torch.float32), reduced, bins, "piggyback", previous=previous)
        steps.append(previous)
    return steps


def _unusual_step(case: str) -> SilentStats:
    """One step of four ranks with what the slots carry beyond the plain case."""
    world, bins, rng = 4, 8, np.random.default_rng(1)
    names = ["a", "b", "c"] if case == "replica check" else []
    rows = np.zeros((world, 3 + 3 + bins + FINGERPRINT_WIDTH * len(names)), dtype=np.float32)
    rows[:, 0], rows[:, 1], rows[:, 3:] = rng.uniform(1, 2, world), 1.0, rng.uniform(0.1, 1, (world, rows.shape[1] - 3))
    groups = None
    if case == "absent rank":
        rows[1], rows[1, 2] = 0.0, ABSENT
    if case == "non-finite":
        rows[2, 4], rows[3, 0] = np.inf, np.nan
    if case == "replica check":
        rows[:, -FINGERPRINT_WIDTH * len(names) :] = rows[0, -FINGERPRINT_WIDTH * len(names) :]
        rows[3, -1] *= 1.5  # rank 3's last tensor differs from its replica's, rank 1 (group [1, 3])
        groups = [[0, 2], [1, 3]]
    reduced = torch.tensor(rng.uniform(0.1, 1, 3), dtype=torch.float32)
    return SilentStats(5, world, [LAYOUT], torch.from_numpy(rows), reduced, bins, "separate", names, replica_groups=groups, divided_by_present=case == "absent rank")


STEP_CASES = ["with its previous step", "absent rank", "non-finite", "replica check"]


def _step(case: str) -> SilentStats:
    return _faulty_steps(count=42)[-1] if case == "with its previous step" else _unusual_step(case)


def _assert_same(observed: Observation, expected: Observation) -> None:
    for field in dataclasses.fields(Observation):
        got, wanted = getattr(observed, field.name), getattr(expected, field.name)
        if isinstance(wanted, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == wanted.dtype and np.array_equal(got, wanted, equal_nan=True), field.name
        elif isinstance(wanted, float) and np.isnan(wanted):
            assert np.isnan(got), field.name
        else:
            assert got == wanted, field.name


@pytest.mark.parametrize("case", STEP_CASES)
def test_a_step_rebuilt_from_its_slots_reads_as_the_same_observation_and_record(case):
    stats = _step(case)
    rebuilt = pickle.loads(pickle.dumps(stats.slots())).stats()
    _assert_same(Observation.from_stats(rebuilt), Observation.from_stats(stats))
    assert json.dumps(rebuilt.to_dict()) == json.dumps(stats.to_dict())
    assert (rebuilt.cosine_previous is None) == (case != "with its previous step")
    assert (rebuilt.replicas or {}).get("ranks") == ([1, 3] if case == "replica check" else None)  # 2 replicas: either may be wrong


def test_a_deepspeed_step_carries_its_record_field_in_its_slots():
    from ddphooks.deepspeed import DeepSpeedStats

    plain = _faulty_steps(count=1)[0]
    stats = DeepSpeedStats(0, 4, [LAYOUT], torch.from_numpy(plain.slots().gathered), torch.from_numpy(plain.slots().reduced_sq), 16, "deepspeed-zero2", accumulation="micro_batch_norms")
    record = pickle.loads(pickle.dumps(stats.slots())).stats().to_dict()
    assert record["accumulation"] == "micro_batch_norms" and json.dumps(record) == json.dumps(stats.to_dict())


def test_a_step_is_read_and_its_record_built_from_its_slots_in_a_process_that_cannot_import_torch(tmp_path):
    from test_fleet import _compact_steps

    steps = [_step(case) for case in STEP_CASES] + _compact_steps()  # whole slots, and the compact wire's buffers
    (tmp_path / "slots.pkl").write_bytes(pickle.dumps([stats.slots() for stats in steps]))
    root = str(detector_process.Path(detector_process.__file__).resolve().parents[2])
    program = detector_process.BOOTSTRAP.replace("from ddphooks.detect.process import serve\nserve()", (
        "sys.modules['torch'] = None  # any import of torch raises\n"
        "import pickle\nfrom ddphooks.detect import Observation\nfrom ddphooks.records import RecordBuilder\n"
        "slots = pickle.loads(open(sys.argv[2], 'rb').read())\n"
        "read = [(Observation.from_stats(s.stats()), RecordBuilder(1, 10, 256).build(s.stats())) for s in slots]\n"
        "open(sys.argv[3], 'wb').write(pickle.dumps(read))\n"
    ))  # fmt: skip
    result = subprocess.run([sys.executable, "-c", program, root, str(tmp_path / "slots.pkl"), str(tmp_path / "read.pkl")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for (observed, record), stats in zip(pickle.loads((tmp_path / "read.pkl").read_bytes()), steps):
        _assert_same(observed, Observation.from_stats(stats))
        assert json.dumps(record) == json.dumps(RecordBuilder(1, 10, 256).build(stats))


def test_sending_never_waits_for_a_busy_child_and_the_alerts_come_back_in_order():
    # 4 ranks x (6 + 100,000) fp32 and the step before: 3.2 MB a step, beyond what the pipe holds.
    steps = _faulty_steps(count=50, bins=100_000)
    reference = Detector()
    expected = [reference.update(Observation.from_stats(stats)) for stats in steps]
    assert any(expected)
    detector = DetectorProcess(warn=pytest.fail)
    try:
        detector.send_stats(steps[0])
        received = [detector.receive()[0]]  # the child is ready
        os.kill(detector._child.pid, signal.SIGSTOP)  # busy: it reads nothing
        sender = threading.Thread(target=lambda: [detector.send_stats(stats) for stats in steps[1:]], daemon=True)
        sender.start()
        sender.join(timeout=60)
        assert not sender.is_alive(), "send_stats waited for the child"
        assert len(detector._outbox) > detector_process.PIPE_BYTES  # what the pipe could not take waits here
        os.kill(detector._child.pid, signal.SIGCONT)
        received += [detector.receive()[0] for _ in steps[1:]]
    finally:
        detector.close()
    assert received == expected
