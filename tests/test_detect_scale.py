"""The detector at large world sizes (issue 42): a faulty rank among 1024 is named, and the
vectorised baselines and selections give the same numbers as the plain definitions."""

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from ddphooks import detect
from ddphooks.detect import SIGNALS, Detector, DetectorConfig, Observation, detect_run
from ddphooks.detect.signals import cross_deviations, signal_values
from tests.test_detect import NAMES, _stream

WORLD = 1024


@pytest.mark.parametrize("kind, fault_rank", [("labels", 517), ("sdc", 1000)])
def test_one_faulty_rank_among_1024_is_named_and_no_other(kind, fault_rank):
    records = _stream(WORLD, 48, seed=42, fault_rank=fault_rank, fault_step=30, kind=kind)
    alerts = detect_run(records)
    assert alerts, f"the {kind} fault on rank {fault_rank} raised no alert"
    assert {alert["rank"] for alert in alerts} == {fault_rank}, alerts
    assert 30 <= alerts[0]["step"] <= 40 and alerts[0]["since"] >= 28
    if kind == "sdc":
        assert alerts[0]["parameters"][0] == NAMES[3]


def test_a_healthy_stream_of_1024_ranks_stays_silent():
    assert detect_run(_stream(WORLD, 48, seed=43)) == []


def _reference_baselines(detector: Detector, deviations: dict, levels: np.ndarray) -> tuple:
    """The detector's baselines as first written: every window stacked as steps x W and each
    statistic of its definition computed apart (``_robust``, ``_shoulders``, ``_growth``).
    ``levels``: every rank's log gradient norm less the median rank's on the window's steps
    (steps x W, oldest first), which the level's spread across ranks reads, its held ranks too."""
    config = detector.config
    recent, quantile = config.recent, config.scale_quantile
    own = np.stack([detector.baselines.raw[name].values for name in SIGNALS] + [detector.baselines.level.values])  # signals and the level x steps x W
    own_median, own_scale = detect._robust(own.transpose(1, 0, 2).reshape(own.shape[1], -1))
    own_median, own_scale = own_median.reshape(len(own), -1), own_scale.reshape(len(own), -1)
    own_scale = np.maximum(own_scale, detect._shoulders(own, own_median, quantile)[:, None])
    own_median[np.sum(np.isfinite(own), axis=1) < detect.MIN_BASELINE_STEPS] = np.nan
    if detector.world >= 3:
        across = own.copy()
        across[-1] = levels
        own_scale = own_scale * detect._growth(across - own_median[:, None, :], recent)[:, None]
    crossed = [name for name in SIGNALS if name in deviations]
    cross = np.stack([detector.baselines.cross[name].values for name in crossed])
    cross_median, cross_scale = detect._robust(cross.reshape(len(crossed), -1).T)
    cross_scale = np.maximum(cross_scale, detect._shoulders(cross, cross_median[:, None], quantile))
    cross_median[np.sum(np.isfinite(cross), axis=(1, 2)) < detect.MIN_BASELINE_STEPS] = np.nan
    growth = detect._growth(cross, recent) if detector.world >= 3 else 1.0
    return own_median, own_scale, cross_median, cross_scale, growth


def _messy(world: int, steps: int, seed: int) -> list[dict]:
    """A stream with a fault and what the windows must ignore: unknown losses and cosines, a zero
    gradient norm (its log is -inf), a rank absent for a while, a rank suspect for a while."""
    records = _stream(world, steps, seed=seed, fault_rank=1, fault_step=40)
    rng = np.random.default_rng(seed)
    for record in records[5:]:
        for key in ("losses", "cosine_loo", "cosine_previous"):
            if record[key] is not None:
                for rank in rng.choice(world, size=max(1, world // 8), replace=False):
                    record[key][rank] = None
    records[12]["grad_norms"][0] = 0.0
    for record in records[20:26]:
        record["absent"] = [world - 1]
        for key in ("losses", "grad_norms", "cosine_loo", "cosine_previous"):
            if record[key] is not None:
                record[key][world - 1] = None
        for parameter in record["parameters"]:
            parameter["grad_norms"][world - 1] = None
    return records


@pytest.mark.parametrize("world, quantile", [(2, 0.8), (3, 0.8), (5, 0.5), (64, 0.8)])
def test_the_baselines_equal_their_definitions_step_by_step(world, quantile):
    config = DetectorConfig(scale_quantile=quantile, alert_level=1.0)
    detector = Detector(config)
    compared, levels = 0, [np.full(world, np.nan)] * config.window
    for record in _messy(world, 70, seed=world):
        obs = Observation.from_record(record)
        if detector.world is not None and detector.seen >= config.warmup:
            losses = np.where(np.isfinite(obs.losses), obs.losses, np.nan)
            baselines = detector.baselines
            losses = np.log(losses) if baselines.log_losses else losses
            deviations = cross_deviations(signal_values(obs, losses, np.log(obs.grad_norms)))
            crossed = [SIGNALS.index(name) for name in SIGNALS if name in deviations]
            fast = (*baselines.own_baselines(), *baselines.cross_baselines(crossed))
            for index, (got, expected) in enumerate(zip(fast, _reference_baselines(detector, deviations, np.array(levels[-config.window :])))):
                # the own scale's growth at W >= 3 is taken in float32 (see Baselines.own_baselines)
                rtol = 1e-5 if index == 1 and world >= 3 else 1e-12
                np.testing.assert_allclose(got, expected, rtol=rtol, atol=0, equal_nan=True)
            compared += 1
        detector.update(obs)
        with np.errstate(divide="ignore"):  # a zero norm: -inf, as the detector reads it
            levels.append(detect._relative_to_median(np.log(np.where(np.isfinite(obs.grad_norms), obs.grad_norms, np.nan))))
    assert compared >= 40


def test_selections_equal_the_sorted_quantiles():
    rng = np.random.default_rng(3)
    values = rng.standard_normal((40, 257))
    values[rng.random(values.shape) < 0.2] = np.nan
    values[3] = np.nan  # a row with nothing known
    values[4, 1:] = np.nan  # and one with one value
    values[5, :100] = -np.inf  # infinities order as numbers
    values[6, :] = 1.5  # ties
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        expected = detect._column_quantiles(values.T, q)
        np.testing.assert_array_equal(detect._select_quantiles(values.copy(), q), expected)
        ordered = np.sort(values, axis=1)
        np.testing.assert_array_equal(detect._sorted_quantiles(ordered, np.sum(~np.isnan(values), axis=1), q), expected)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy's all-NaN warning
            finite = np.where(np.isinf(values), np.nan, values)
            np.testing.assert_allclose(detect._select_quantiles(finite.copy(), q), np.nanquantile(finite, q, axis=1), equal_nan=True)


def test_the_transposed_copy_and_the_windows_order():
    values = np.arange(600 * 7, dtype=float).reshape(600, 7)
    np.testing.assert_array_equal(detect._transposed(values), values.T)
    np.testing.assert_array_equal(detect._transposed(-values, np.abs), values.T)
    history = detect._History(window=4, world=3, signals=2)
    for step in range(6):
        history.push(np.array([[step, step + 0.5, step], [10 + step] * 3]), np.array([True, True, step != 5]))
    np.testing.assert_array_equal(history.steps(0), [[2, 2.5, 2], [3, 3.5, 3], [4, 4.5, 4], [5, 5.5, np.nan]])
    np.testing.assert_array_equal(history.known, [[4, 4, 3], [4, 4, 3]])
    np.testing.assert_array_equal(history.slots(2), [0, 1])  # the last two steps' slots, oldest first


def test_the_timing_script_prints_its_table():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "detector_scale.py"
    out = subprocess.run([sys.executable, str(script), "--worlds", "8", "--steps", "2", "--parameters", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "| W | P | ms per step, median (IQR) |"
    assert out.stdout.splitlines()[2].startswith("| 8 | 5 | ")
