"""StepPipeline in one process: steps linked in order, monitoring errors logged once and never raised."""

import logging

import numpy as np
import pytest
from test_stats import _stats

from ddphooks.detect import Detector
from ddphooks.pipeline import StepPipeline
from ddphooks.stats import cosine_to_previous


class _Writer:
    def __init__(self) -> None:
        self.submitted = []

    def submit(self, stats) -> None:
        self.submitted.append(stats)


def _steps(count: int, world: int = 3) -> list:
    rng = np.random.default_rng(0)
    return [_stats([rng.standard_normal(5) for _ in range(world)], [1.0] * world, bins=5) for _ in range(count)]


def test_each_step_is_linked_to_the_one_processed_before_it():
    writer, steps = _Writer(), _steps(3)
    pipeline = StepPipeline(None, writer, on_alert=None, warns=True)
    pipeline.complete(steps[0])
    pipeline.process()
    for stats in steps[1:]:  # queued together, processed in order
        pipeline.complete(stats)
    pipeline.process()
    assert writer.submitted == steps
    assert steps[0].cosine_previous is None
    for earlier, later in zip(steps, steps[1:]):
        np.testing.assert_allclose(later.cosine_previous, cosine_to_previous(later._sketches, earlier._sketches))


def test_a_step_that_cannot_be_linked_is_logged_once_and_still_written(caplog, monkeypatch):
    writer, steps = _Writer(), _steps(4)

    def broken(self, previous):
        raise ValueError("bad slots")

    monkeypatch.setattr(type(steps[0]), "follow", broken)
    pipeline = StepPipeline(Detector(), writer, on_alert=None, warns=True)
    with caplog.at_level(logging.WARNING, logger="ddphooks"):
        for stats in steps:
            pipeline.complete(stats)
            pipeline.process()  # must not raise: it runs inside backward
    assert writer.submitted == steps
    linked = [r.getMessage() for r in caplog.records if "could not be linked" in r.getMessage()]
    assert len(linked) == 1 and "ValueError: bad slots" in linked[0]


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
    assert writer.submitted == steps and pipeline.alerts == []
    failed = [r.getMessage() for r in caplog.records if "detector failed" in r.getMessage()]
    assert len(failed) == 1 and "RuntimeError: detector bug" in failed[0]
