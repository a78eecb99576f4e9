"""What a fault run's records could tell (ddphooks.experiment.information): the best d' of the
detector's scores and the delay bound it allows, which the report prints for a missed fault."""

import math

import pytest

from ddphooks.experiment import information
from tests.detect_replays import healthy_records


def _shifted(world: int, size: float, fault_step: int = 60, steps: int = 140) -> list[dict]:
    records = healthy_records(world, steps, seed=3)
    for record in records[fault_step:]:
        record["losses"][1] *= math.exp(size)  # a lasting rise of rank 1's loss
    return records


def test_the_bound_is_lordens():
    assert information.bound(2.0) == pytest.approx(math.log(30_000) / 2)
    assert information.bound(0.0) == math.inf


def test_a_clear_lasting_shift_has_a_large_dprime_and_a_short_bound():
    info = information.separation(_shifted(2, 0.5), fault_step=60, rank=1)
    assert info["dprime"] > 3 and info["bound"] < 3 and info["steps_after"] == 80
    assert "could have named it" in information.missed_reason(info) and "a detector could" in information.missed_reason(info)


def test_no_shift_leaves_nothing_to_find_and_says_so():
    info = information.separation(_shifted(2, 0.0), fault_step=60, rank=1)
    assert info["dprime"] < 1 and info["bound"] > 20
    reason = information.missed_reason(info)
    assert reason.startswith("not named: its best score") and "no detector could have named it" in reason


def test_too_few_steps_give_no_reading():
    assert information.separation(_shifted(2, 0.5, fault_step=10, steps=20), fault_step=10, rank=1) is None
    assert information.missed_reason(None).startswith("not named (too few steps")
