"""The detector raises the alerts it raised before it was split into a package (issue 58), run by
run: the replays of ``tests/detect_replays.py`` (seeded runs at W = 2 to 32 with faults of every
alert kind, the compact wire, the workload zoo's recorded domain mixture) against the alerts the
single-module detector raised on them, kept in ``tests/data/detect-replays.json``."""

import json

import pytest
from detect_replays import FIXTURE, replay

REPLAYS = json.loads(FIXTURE.read_text())["replays"]


def _same_numbers(now: list[float], before: list[float]) -> bool:
    return len(now) == len(before) and all(a == pytest.approx(b, rel=1e-12, abs=1e-12) for a, b in zip(now, before))


@pytest.mark.parametrize("expected", REPLAYS, ids=[run["spec"]["name"] for run in REPLAYS])
def test_a_replay_raises_the_alerts_it_raised_before_the_split(expected):
    result = json.loads(json.dumps(replay(expected["spec"])))  # as the fixture holds them (tuples as lists)
    alerts, before = result["alerts"], expected["alerts"]
    assert [(a["step"], a["rank"], a["kind"]) for a in alerts] == [(a["step"], a["rank"], a["kind"]) for a in before]
    for alert, old in zip(alerts, before):
        assert alert.keys() == old.keys(), (alert, old)
        assert {k: v for k, v in alert.items() if k != "score"} == {k: v for k, v in old.items() if k != "score"}
        assert alert["score"] == pytest.approx(old["score"], rel=1e-12, abs=1e-12), (alert, old)
    assert result.get("fired") == expected.get("fired")
    assert _same_numbers(result.get("evidence", []), expected.get("evidence", [])), (result.get("evidence"), expected.get("evidence"))


def test_the_replays_cover_every_alert_kind_and_world_size():
    kinds = {alert["kind"] for run in REPLAYS for alert in run["alerts"]}
    assert kinds == {"layer", "cosine_previous", "combined", "loss", "grad_norm", "cosine", "replica", "nonfinite", "duplicate_data"}
    worlds = {run["spec"].get("world", 8) for run in REPLAYS}
    assert {2, 4, 8, 16, 32} <= worlds
    assert any(run["spec"].get("sampled") for run in REPLAYS) and any(run["spec"].get("feed") == "online" for run in REPLAYS)
