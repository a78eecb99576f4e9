"""SilentStats and SilentConfig in one process: definitions, edge cases, JSON safety, messages."""

import json
import math

import numpy as np
import pytest
import torch

from ddphooks import JsonlSink, SilentConfig, SinkGroup
from ddphooks.stats import BucketLayout, SilentStats, cosine_from_sketches, slot_size, weighted_mean_cosine


def _stats(gradients: list[np.ndarray], losses: list[float | None], bins: int = 0, previous: SilentStats | None = None) -> SilentStats:
    """Build the slots the hook would gather from explicit per-rank gradients (two parameters)."""
    world = len(gradients)
    layout = BucketLayout(0, ("a", "b"), (3, 2))
    rows = []
    for g, loss in zip(gradients, losses):
        sketch = g[:bins] if bins else []  # any vector works as a sketch for these checks
        row = [loss or 0.0, 0.0 if loss is None else 1.0, 0.0, g[:3] @ g[:3], g[3:] @ g[3:], *sketch]
        rows.append(row)
    mean = np.mean(gradients, axis=0)
    reduced = [mean[:3] @ mean[:3], mean[3:] @ mean[3:]]
    gathered = torch.tensor(rows, dtype=torch.float32)
    assert gathered.shape == (world, slot_size(2, bins))
    return SilentStats(7, world, [layout], gathered, torch.tensor(reduced), bins, "piggyback", previous=previous)


def test_dispersion_definitions():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(5) for _ in range(3)]
    record = _stats(grads, [1.0, 2.0, 4.0]).to_dict()
    assert record["losses"] == [1.0, 2.0, 4.0]
    assert record["loss_mean"] == pytest.approx(7 / 3)
    assert record["loss_std"] == pytest.approx(np.std([1, 2, 4]))  # population std, ddof=0
    assert record["loss_range"] == 3.0
    assert record["loss_cv"] == pytest.approx(np.std([1, 2, 4]) / (7 / 3))
    norms = [np.linalg.norm(g) for g in grads]
    assert record["grad_norms"] == pytest.approx(norms, rel=1e-6)
    assert record["grad_norm_std"] == pytest.approx(np.std(norms), rel=1e-5)
    gram = np.array(grads) @ np.array(grads).T
    off = ~np.eye(3, dtype=bool)
    assert record["weighted_mean_cosine"] == pytest.approx(gram[off].sum() / np.outer(norms, norms)[off].sum(), rel=1e-5, abs=1e-6)
    assert record["cosine"] is None and record["mean_cosine"] is None
    assert record["step"] == 7 and record["parameters"][1]["name"] == "b"


def test_identical_gradients_have_weighted_cosine_one_and_opposite_minus_one():
    g = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert _stats([g, g], [1.0, 1.0]).weighted_mean_cosine == pytest.approx(1.0, abs=1e-6)
    assert _stats([g, -g], [1.0, 1.0]).weighted_mean_cosine == pytest.approx(-1.0, abs=1e-6)


def test_cosine_matrix_from_sketches():
    sketches = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    cosine = cosine_from_sketches(sketches)
    assert cosine[0, 1] == pytest.approx(1 / math.sqrt(2))
    assert np.isnan(cosine[0, 2]) and cosine[2, 2] == 1.0  # a zero sketch has no direction


def test_cosine_to_the_previous_step_against_a_loop():
    rng = np.random.default_rng(3)
    before = [rng.standard_normal(5) for _ in range(3)]
    after = [b + 0.5 * rng.standard_normal(5) for b in before]
    earlier = _stats(before, [1.0] * 3, bins=5)
    later = _stats(after, [1.0] * 3, bins=5, previous=earlier)
    assert earlier.cosine_previous is None and earlier.to_dict()["cosine_previous"] is None  # the first step
    expected = [a.astype(np.float32) @ b.astype(np.float32) / (np.linalg.norm(a.astype(np.float32)) * np.linalg.norm(b.astype(np.float32))) for a, b in zip(after, before)]
    assert later.to_dict()["cosine_previous"] == pytest.approx(expected, abs=1e-6)
    # Nothing of the previous step is kept (a reference would chain every step to the one before).
    assert not any(value is earlier for value in vars(later).values())


def test_no_cosine_to_a_previous_step_sketched_with_other_signs():
    rng = np.random.default_rng(4)
    grads = [rng.standard_normal(5) for _ in range(2)]
    other_layout = _stats(grads, [1.0, 1.0], bins=5)
    other_layout.buckets = [BucketLayout(1, ("a", "b"), (3, 2))]  # DDP rebuilt its buckets
    for previous in (None, other_layout, _stats(grads, [1.0, 1.0], bins=3), _stats(grads[:1] * 3, [1.0] * 3, bins=5)):
        assert _stats(grads, [1.0, 1.0], bins=5, previous=previous).cosine_previous is None


def test_single_rank_has_no_pairwise_statistics():
    record = _stats([np.ones(5)], [0.5], bins=2).to_dict()
    assert record["weighted_mean_cosine"] is None and record["mean_cosine"] is None
    assert record["cosine"] == [[1.0]] and record["loss_std"] == 0.0
    assert weighted_mean_cosine(np.array([[4.0]]), 4.0) != weighted_mean_cosine(np.array([[4.0]]), 4.0)  # NaN


def test_missing_and_non_finite_values_become_null_and_are_located():
    g = np.arange(5.0)
    bad = g.copy()
    bad[4] = np.inf
    stats = _stats([g, bad, g], [1.0, float("nan"), None])
    record = stats.to_dict()
    text = json.dumps(record, allow_nan=False)  # strict JSON
    assert json.loads(text)["losses"] == [1.0, None, None]
    assert record["loss_mean"] is None
    assert record["nonfinite"] == {"losses": [1], "gradients": [{"rank": 1, "bucket": 0, "parameter": "b"}], "gradient_count": 1}
    assert record["grad_norms"][1] is None


def test_dispersion_of_infinite_norms_is_nan_without_a_warning():
    import warnings

    from ddphooks.stats import _dispersion

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inf - inf in the range: no RuntimeWarning printed into a user's log
        spread = _dispersion(np.array([np.inf, np.inf]))
    assert spread["mean"] == np.inf and all(math.isnan(spread[key]) for key in ("std", "range", "cv"))


def test_no_loss_observed_gives_null_losses():
    record = _stats([np.ones(5), np.ones(5)], [None, None]).to_dict()
    assert record["losses"] is None and record["loss_std"] is None


def test_a_slot_of_the_wrong_shape_is_rejected():
    stats = SilentStats(0, 2, [BucketLayout(0, ("a",), (3,))], torch.zeros(2, 5), torch.zeros(1), 0, "separate")
    with pytest.raises(ValueError, match=r"gathered slots have shape \(2, 5\), expected \(2, 4\)"):
        stats.to_dict()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"sketch_dim": -1}, ValueError, r"sketch_dim=-1 is negative; use 0 to turn the sketch off"),
        ({"sketch_dim": 4}, ValueError, r"sketch_dim=4 is too small.*at least 16"),
        ({"sketch_dim": 10**6}, ValueError, r"sketch_dim=1000000 is larger than 65536"),
        ({"sketch_dim": 2.5}, TypeError, r"sketch_dim must be an int, got 2.5"),
        ({"every": 0}, ValueError, r"every=0 must be >= 1"),
        ({"every": True}, TypeError, r"every must be an int, got True"),
        ({"seed": -3}, ValueError, r"seed=-3 must be >= 0"),
        ({"transport": "udp"}, ValueError, r"transport='udp' is not one of 'auto', 'piggyback', 'separate'"),
        ({"log_rank": -1}, ValueError, r"log_rank=-1 must be a rank"),
        ({"piggyback_limit_mb": -1}, ValueError, r"piggyback_limit_mb=-1 must be a number of megabytes >= 0"),
        ({"chunk_elems": 10}, ValueError, r"chunk_elems=10 must be between 1024 and 16777216, or None for the default"),
        ({"chunk_elems": 1 << 25}, ValueError, r"chunk_elems=33554432 must be between 1024 and 16777216"),
        ({"per_rank_max_world": 0}, ValueError, r"per_rank_max_world=0 must be >= 1 \(256 is the default\)"),
        ({"per_rank_max_world": 2.0}, TypeError, r"per_rank_max_world must be an int, got 2.0"),
    ],
)
def test_config_rejects_bad_values_with_the_value_and_the_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        SilentConfig(**kwargs)


def test_config_defaults():
    config = SilentConfig()
    assert (config.sketch_dim, config.every, config.transport, config.log_rank) == (256, 1, "auto", 0)


def test_jsonl_sink_header_strict_json_and_close(tmp_path):
    path = tmp_path / "sub" / "run-{rank}.jsonl"
    sink = JsonlSink(path, header={"model": "x"})
    group = SinkGroup([sink])
    group.bind_rank(3)
    group.write({"step": 0, "value": None})
    target = tmp_path / "sub" / "run-3.jsonl"
    assert target.read_text().splitlines() == ['{"header": {"model": "x"}}', '{"step": 0, "value": null}']
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        group.write({"bad": float("nan")})
    group.close()
    with pytest.raises(ValueError, match="is closed"):
        sink.write({"step": 1})
    with pytest.raises(TypeError, match="sinks must be ddphooks.Sink instances, got str"):
        SinkGroup(["stats.jsonl"])
