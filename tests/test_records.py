"""Records: compact and detailed contents, the O(W k) cosines and the noise scale, against slow references."""

import json
import math

import numpy as np
import pytest
import torch

from ddphooks.records import NOISE_SCALE_DECAY, RecordBuilder
from ddphooks import stats as stats_module
from ddphooks.stats import BucketLayout, SilentStats, slot_size

SUMMARY_KEYS = {
    "step", "world_size", "absent", "transport", "sketch_dim", "cosine_noise", "losses", "loss_mean", "loss_std", "loss_range", "loss_cv",
    "grad_norms", "grad_norm_mean", "grad_norm_std", "grad_norm_cv", "reduced_grad_norm", "cosine_to_others", "mean_cosine",
    "weighted_mean_cosine", "noise_scale", "nonfinite", "detail", "cosine_loo", "cosine_previous", "replicas", "alerts", "per_rank",
}  # fmt: skip


def _stats_from_gradients(gradients: np.ndarray, step: int = 0, bins: int = 0, names: int = 4) -> SilentStats:
    """The slots the hook would gather for explicit W x D gradients cut into ``names`` parameters;
    the 'sketch' is the first ``bins`` entries of each gradient, so cosines of sketches are
    cosines of those vectors."""
    world, dim = gradients.shape
    bounds = np.linspace(0, dim, names + 1).astype(int)
    layout = BucketLayout(0, tuple(f"p{j}" for j in range(names)), tuple(np.diff(bounds).tolist()))
    rows = []
    for rank, g in enumerate(gradients):
        sq = [g[a:b] @ g[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        rows.append([1.0 + rank, 1.0, 0.0, *sq, *(g[:bins] if bins else [])])
    mean = gradients.mean(axis=0)
    reduced = [mean[a:b] @ mean[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    gathered = torch.tensor(rows, dtype=torch.float64)
    assert gathered.shape == (world, slot_size(names, bins))
    return SilentStats(step, world, [layout], gathered, torch.tensor(reduced, dtype=torch.float64), bins, "piggyback")


def _reference_noise_scale(gradients: np.ndarray) -> tuple[float, float]:
    """McCandlish et al. (2018), appendix A, with B_small = 1 (one rank) and B_big = W."""
    world = len(gradients)
    small = np.mean([g @ g for g in gradients])  # E|G_small|^2
    gbar = gradients.mean(axis=0)
    big = gbar @ gbar  # |G_big|^2
    signal = (world * big - 1 * small) / (world - 1)
    trace = (small - big) / (1 / 1 - 1 / world)
    return trace, signal


def test_noise_scale_matches_the_definition():
    rng = np.random.default_rng(0)
    for world in (2, 4, 8):
        gradients = rng.standard_normal((world, 40)) + 0.8  # a shared component: |G|^2 > 0
        trace, signal = _reference_noise_scale(gradients)
        stats = _stats_from_gradients(gradients)
        assert stats.noise_scale_terms == pytest.approx((trace, signal), rel=1e-9)
        assert stats.noise_scale == pytest.approx(trace / signal, rel=1e-9)
        # The closed form: W (|G_s|^2 - |G_b|^2) / (W |G_b|^2 - |G_s|^2).
        small, big = np.mean((gradients**2).sum(axis=1)), (gradients.mean(axis=0) ** 2).sum()
        assert stats.noise_scale == pytest.approx(world * (small - big) / (world * big - small), rel=1e-9)


def test_smoothed_noise_scale_divides_separate_moving_averages():
    rng = np.random.default_rng(1)
    builder = RecordBuilder(every=1, detail_every=0, detail_max_world=64)
    trace_avg = signal_avg = 0.0
    for step in range(12):
        gradients = rng.standard_normal((4, 30)) * (1 + step % 3) + 0.5
        trace, signal = _reference_noise_scale(gradients)
        trace_avg = NOISE_SCALE_DECAY * trace_avg + (1 - NOISE_SCALE_DECAY) * trace
        signal_avg = NOISE_SCALE_DECAY * signal_avg + (1 - NOISE_SCALE_DECAY) * signal
        record = builder.build(_stats_from_gradients(gradients, step))
        assert record["noise_scale_smoothed"] == pytest.approx(trace_avg / signal_avg, rel=1e-9)
        # One step's |G|^2 estimate can come out negative (noise dominates): no noise scale then.
        assert record["noise_scale"] == (pytest.approx(trace / signal, rel=1e-9) if signal > 0 else None)


def test_noise_scale_is_undefined_for_one_rank():
    assert math.isnan(_stats_from_gradients(np.ones((1, 8))).noise_scale)


def test_cosine_to_others_and_mean_cosine_equal_the_matrix_computation():
    rng = np.random.default_rng(2)
    for world in (2, 3, 7):
        gradients = rng.standard_normal((world, 64)) + 0.3
        stats = _stats_from_gradients(gradients, bins=64)
        units = gradients / np.linalg.norm(gradients, axis=1, keepdims=True)
        matrix = units @ units.T
        off = ~np.eye(world, dtype=bool)
        expected = [matrix[i][off[i]].mean() for i in range(world)]
        np.testing.assert_allclose(stats.cosine_to_others, expected, rtol=1e-9, atol=1e-12)
        assert stats.mean_cosine == pytest.approx(matrix[off].mean(), rel=1e-9, abs=1e-12)
        np.testing.assert_allclose(stats.cosine, matrix, rtol=1e-9, atol=1e-12)
        for i in range(world):  # leave-one-out: the rank against the sum of the others
            others = gradients.sum(axis=0) - gradients[i]
            loo = gradients[i] @ others / (np.linalg.norm(gradients[i]) * np.linalg.norm(others))
            assert stats.cosine_loo[i] == pytest.approx(loo, rel=1e-9, abs=1e-12)


def test_a_zero_or_non_finite_sketch_gives_nan_where_the_slow_computation_does():
    rng = np.random.default_rng(5)
    for bad in (0.0, np.nan, np.inf):
        sketches = rng.standard_normal((4, 16)) + 0.2
        previous = rng.standard_normal((4, 16))
        sketches[2] = bad
        with np.errstate(invalid="ignore", divide="ignore"):
            units = sketches / np.linalg.norm(sketches, axis=1, keepdims=True)
            matrix = units @ units.T
            others = sketches.sum(axis=0) - sketches
            loo = np.array([sketches[i] @ others[i] / (np.linalg.norm(sketches[i]) * np.linalg.norm(others[i])) for i in range(4)])
            to_previous = np.array([sketches[i] @ previous[i] / (np.linalg.norm(sketches[i]) * np.linalg.norm(previous[i])) for i in range(4)])
        off = ~np.eye(4, dtype=bool)
        slow = {
            "to_others": np.array([matrix[i][off[i]].mean() for i in range(4)]),
            "loo": np.where(np.isfinite(loo), loo, np.nan),
            "to_previous": np.where(np.isfinite(to_previous), to_previous, np.nan),
        }
        fast = {
            "to_others": stats_module.cosine_to_others(sketches),
            "loo": stats_module.cosine_leave_one_out(sketches),
            "to_previous": stats_module.cosine_to_previous(sketches, previous),
        }
        for name in slow:
            np.testing.assert_array_equal(np.isnan(fast[name]), np.isnan(slow[name]), err_msg=f"{name}, sketch of rank 2 = {bad}")
            np.testing.assert_allclose(fast[name], slow[name], rtol=1e-9, atol=1e-12, err_msg=f"{name}, sketch of rank 2 = {bad}")
        assert np.isnan(fast["to_others"]).all() and np.isnan(fast["loo"][2]) and np.isnan(fast["to_previous"][2])


def test_compact_record_has_the_summary_and_per_rank_vectors_only():
    gradients = np.random.default_rng(3).standard_normal((4, 40))
    stats = _stats_from_gradients(gradients, bins=16)
    record = stats.to_dict(detail=False)
    assert set(record) == SUMMARY_KEYS
    assert record["detail"] is False and len(record["cosine_to_others"]) == 4 and record["losses"] == [1.0, 2.0, 3.0, 4.0]
    assert record["cosine_noise"] == pytest.approx(1 / math.sqrt(16))
    full = stats.to_dict()
    assert set(full) == SUMMARY_KEYS | {"cosine", "buckets", "parameters"}
    assert {k: full[k] for k in SUMMARY_KEYS - {"detail"}} == {k: record[k] for k in SUMMARY_KEYS - {"detail"}}
    json.dumps(full, allow_nan=False)


def test_detail_cadence_follows_instrumented_steps_and_survives_renumbering():
    builder = RecordBuilder(every=5, detail_every=3, detail_max_world=64)
    detailed = [step for step in range(0, 100, 5) if builder.is_detailed(step)]
    assert detailed == [0, 15, 30, 45, 60, 75, 90]
    assert not any(RecordBuilder(every=1, detail_every=0, detail_max_world=64).is_detailed(s) for s in range(10))


def test_detail_above_detail_max_world_keeps_summaries_over_ranks():
    gradients = np.random.default_rng(4).standard_normal((5, 40))
    gradients[3, :10] *= 50  # rank 3 dominates parameter p0
    record = _stats_from_gradients(gradients, bins=16).to_dict(detail=True, detail_max_world=4)
    assert record["cosine"] is None
    first = record["parameters"][0]
    assert "grad_norms" not in first and first["grad_norm_argmax"] == 3
    assert first["grad_norm_max"] == pytest.approx(np.linalg.norm(gradients[3, :10]), rel=1e-9)
    assert first["grad_norm_mean"] == pytest.approx(np.mean(np.linalg.norm(gradients[:, :10], axis=1)), rel=1e-9)


def test_record_sizes_stay_small_at_large_world_sizes():
    # The goals: <= 16 KB at W = 8 with 272 parameters, <= 256 KB at W = 1024 (compact records).
    rng = np.random.default_rng(5)
    for world, limit in ((8, 16 * 1024), (1024, 256 * 1024)):
        bins, names = 251, 272
        world_rows = rng.standard_normal((world, 3 + names + bins))
        world_rows[:, 1], world_rows[:, 2] = 1.0, 0.0
        world_rows[:, 3 : 3 + names] = world_rows[:, 3 : 3 + names] ** 2
        layout = BucketLayout(0, tuple(f"model.layers.{j}.weight" for j in range(names)), (100,) * names)
        stats = SilentStats(0, world, [layout], torch.tensor(world_rows), torch.rand(names, dtype=torch.float64), bins, "piggyback")
        size = len(json.dumps(stats.to_dict(detail=False)))
        assert size <= limit, (world, size)


def _large_world_stats(world: int, step: int = 1, names: int = 272, bins: int = 251) -> SilentStats:
    rng = np.random.default_rng(world)
    rows = rng.standard_normal((world, 3 + names + bins))
    rows[:, 0], rows[:, 1], rows[:, 2] = 2.0 + 0.1 * rng.standard_normal(world), 1.0, 0.0
    rows[:, 3 : 3 + names] = rows[:, 3 : 3 + names] ** 2
    rows[7, 0] = 9.0  # rank 7's loss stands out
    rows[11, 1] = 0.0  # rank 11 recorded no loss
    layout = BucketLayout(0, tuple(f"model.layers.{j}.weight" for j in range(names)), (100,) * names)
    return SilentStats(step, world, [layout], torch.tensor(rows), torch.rand(names, dtype=torch.float64), bins, "piggyback")


def _slow_over_ranks(values: np.ndarray) -> dict:
    """The aggregate the obvious way: known values, numpy's quantiles one by one, and every rank
    sorted by its distance to the median (ties: lower rank first)."""
    known = {rank: value for rank, value in enumerate(values) if math.isfinite(value)}
    kept = np.array(list(known.values()))
    median = float(np.median(kept))
    order = sorted(known, key=lambda rank: (-abs(known[rank] - median), rank))
    return {
        "known": len(known),
        "quantiles": {name: float(np.quantile(kept, q)) for name, q in stats_module.OVER_RANKS_QUANTILES.items()},
        "outliers": [[rank, known[rank]] for rank in order[: stats_module.OVER_RANKS_OUTLIERS]],
    }


def test_compact_records_above_per_rank_max_world_summarise_each_signal_over_the_ranks():
    world = 4096
    stats = _large_world_stats(world)
    builder = RecordBuilder(every=1, detail_every=100, detail_max_world=64)  # per_rank_max_world: the default, 256
    compact = builder.build(stats)
    assert compact["detail"] is False and compact["per_rank"] is False
    assert not set(stats_module.PER_RANK_KEYS) & set(compact)
    for key in stats_module.PER_RANK_KEYS:
        values = getattr(stats, key)
        got, expected = compact[f"{key}_over_ranks"], None if values is None else _slow_over_ranks(values)
        if expected is None:
            assert got is None, key
            continue
        assert got["known"] == expected["known"] and got["outliers"] == expected["outliers"], key
        assert got["quantiles"] == pytest.approx(expected["quantiles"], rel=1e-12), key
    losses = compact["losses_over_ranks"]
    assert losses["known"] == world - 1 and losses["outliers"][0] == [7, 9.0]  # rank 11 had no loss
    size = len(json.dumps(compact, allow_nan=False)) + 1
    assert size <= 64 * 1024, size  # issue 42's goal; 410 KB with one value per rank
    # Detail records keep every rank's values, and so does every record up to the limit.
    detailed = RecordBuilder(every=1, detail_every=1, detail_max_world=64).build(stats)
    assert detailed["per_rank"] is True and len(detailed["losses"]) == world and "losses_over_ranks" not in detailed
    small = RecordBuilder(every=1, detail_every=100, detail_max_world=64).build(_large_world_stats(256))
    assert small["per_rank"] is True and len(small["grad_norms"]) == 256
    assert RecordBuilder(1, 100, 64, per_rank_max_world=4096).build(stats)["per_rank"] is True


def test_offline_detection_refuses_records_summarised_over_ranks():
    from ddphooks.detect import detect_run

    record = RecordBuilder(every=1, detail_every=100, detail_max_world=64).build(_large_world_stats(300))
    with pytest.raises(ValueError, match=r"step 1 .* W = 300 .*per_rank_max_world >= 300"):
        detect_run([record])


def test_summarised_records_give_the_quantiles_as_scalars():
    from ddphooks.sinks.scalars import record_scalars

    record = RecordBuilder(every=1, detail_every=100, detail_max_world=64).build(_large_world_stats(300))
    scalars = record_scalars(record)
    assert scalars["ddphooks/over_ranks/loss/max"] == 9.0
    assert scalars["ddphooks/over_ranks/grad_norm/median"] == record["grad_norms_over_ranks"]["quantiles"]["median"]
    assert not any("/rank" in tag for tag in scalars)  # no per-rank values to give
