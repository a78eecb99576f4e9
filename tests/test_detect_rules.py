"""Each rule without a baseline on its own (``ddphooks.detect.rules``), driven by hand-made
observations: the alerts it raises are the ones the whole ``Detector`` raises of that kind."""

import numpy as np

from ddphooks.detect import Detector, DetectorConfig, Observation
from ddphooks.detect.messages import first_check
from ddphooks.detect.rules.duplicate_data import DuplicateDataRule
from ddphooks.detect.rules.nonfinite import NonfiniteRule
from ddphooks.detect.rules.replica import ReplicaRule

WORLD = 4
NAMES = ["embed.weight", "block.weight", "head.weight"]


def _observations(steps: int, seed: int = 0) -> list[Observation]:
    """A healthy step of ``WORLD`` ranks each: distinct losses, gradient norms and cosines."""
    rng = np.random.default_rng(seed)
    return [
        Observation(
            step=step, world_size=WORLD, losses=2.0 + 0.1 * rng.standard_normal(WORLD), grad_norms=np.exp(0.1 * rng.standard_normal(WORLD)),
            cosine_loo=0.3 + 0.05 * rng.standard_normal(WORLD), cosine_noise=1 / 16,
            cosine_previous=None if step == 0 else 0.15 + 0.1 * rng.standard_normal(WORLD),
            parameter_names=NAMES, parameter_norms=np.exp(0.1 * rng.standard_normal((WORLD, len(NAMES)))),
        )
        for step in range(steps)
    ]  # fmt: skip


def _detector_alerts(observations: list[Observation], kind: str) -> list[dict]:
    detector = Detector()
    for obs in observations:
        detector.update(obs)
    return [alert for alert in detector.alerts if alert["kind"] == kind]


def _rule_alerts(rule, observations: list[Observation]) -> list[dict]:
    """The rule's alerts as the detector gives them: what to check first put before each message."""
    return [first_check(alert) for obs in observations for alert in rule.update(obs)]


def test_the_replica_rule_names_a_rank_each_time_a_check_newly_flags_it():
    observations = _observations(12)
    verdict = {"ranks": [3], "tensors": 1, "parameters": [{"name": "head.weight", "ranks": [3], "relative_difference": 0.02}]}
    for step in (2, 3, 8):  # flagged by the checks of steps 2 and 3, not by the one of step 5, again by step 8's
        observations[step].replicas = verdict
    observations[5].replicas = {"ranks": [], "tensors": 0, "parameters": []}  # every replica the same
    alerts = _rule_alerts(ReplicaRule(DetectorConfig()), observations)
    assert [(a["step"], a["rank"], a["score"], a["parameters"]) for a in alerts] == [(2, 3, 0.02, ["head.weight"]), (8, 3, 0.02, ["head.weight"])]
    assert alerts == _detector_alerts(observations, "replica")


def test_the_nonfinite_rule_names_the_rank_that_went_non_finite_first():
    observations = _observations(20)
    observations[4].grad_norms[1] = np.inf  # rank 1 alone, then every rank (its NaN reached every replica)
    observations[4].nonfinite = {"losses": [], "gradients": [{"rank": 1, "parameter": "block.weight"}]}
    for obs in observations[5:7]:
        obs.grad_norms[:] = np.nan
    alerts = _rule_alerts(NonfiniteRule(DetectorConfig()), observations)
    assert [(a["step"], a["rank"], a["since"], a["parameters"]) for a in alerts] == [(5, 1, 4, ["block.weight"])]
    assert "at step 5 every rank's values are not finite" in alerts[0]["message"]
    assert alerts == _detector_alerts(observations, "nonfinite")


def test_the_duplicate_data_rule_names_ranks_on_the_same_batches():
    observations = _observations(10)
    for obs in observations[2:]:  # ranks 0 and 2 on the same batches from step 2
        for values in (obs.losses, obs.grad_norms, obs.cosine_loo):
            values[2] = values[0]
    alerts = _rule_alerts(DuplicateDataRule(DetectorConfig()), observations)
    assert [(a["step"], a["rank"], a["since"], a["ranks"]) for a in alerts] == [(4, 0, 2, [0, 2])]
    assert alerts == _detector_alerts(observations, "duplicate_data")
