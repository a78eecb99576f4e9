"""The detector in a process of its own (``ddphooks.detect.process``): the same alerts as in the
training process, a child that cannot start replaced before any step, one that dies or hangs
turned into an error (the pipeline turns detection off with it), never a hang."""

import json
import os
import signal
import subprocess
import sys

import pytest
from detect_replays import FIXTURE, _online_observation, replay_records

from ddphooks.detect import Detector, DetectorConfig, Observation
from ddphooks.detect import process as detector_process
from ddphooks.detect.process import DetectorProcess

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
