"""Robust statistics of the baselines, NaN-aware and vectorised over signals and ranks: quantiles
by one sort or by selection, medians, the scaled MAD, the shoulders of the noise and the growth of
the spread across ranks.

The definitions (``_robust``, ``_shoulders``, ``_growth``), each computed apart, are what
``tests/test_detect_scale.py`` checks the detector's batched baselines against
(``ddphooks.detect.baselines``):

1. median and MAD: per column, ``m = median(x)``, ``sigma_MAD = 1.4826 * median(|x - m|)``;
2. shoulders: each rank's ``q`` quantile of ``|x - m|`` over the window, over a normal's
   (``Phi^-1(0.5 + q / 2)``, 1.6449 at 0.9), and of those the median rank's (the smaller of the
   two at W = 2): the one rank that is off cannot move it;
3. growth: each step's spread across ranks (its MAD), the median of the last ``recent`` steps'
   spreads over the median of all, never below 1.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

MAD_TO_STD = 1.4826


def _column_quantiles(values: np.ndarray, q: float) -> np.ndarray:
    """The ``q`` quantile of each column of a 2-D array (linear interpolation between the two
    nearest values, as ``np.nanquantile``), ignoring NaN (NaN for an all-NaN column).

    One sort instead of ``np.nanquantile``, whose masked-array path costs a millisecond a call on
    the small arrays the detector has (the detector runs on every step of every rank). For rows,
    and for long columns, ``_sorted_quantiles`` and ``_select_quantiles`` give the same numbers.
    """
    ordered = np.sort(values, axis=0)  # NaN sorts last
    count = np.sum(~np.isnan(values), axis=0)
    return _sorted_quantiles(ordered.T, count, q)


def _sorted_quantiles(ordered: np.ndarray, count: np.ndarray, q: float) -> np.ndarray:
    """The ``q`` quantile of each row of ``ordered`` (rows sorted, NaN last), of whose values
    ``count`` per row are known: ``_column_quantiles`` on rows (several quantiles from one sort)."""
    rows = np.arange(ordered.shape[0])
    position = q * np.maximum(count - 1, 0)
    low = np.floor(position).astype(int)
    high = np.minimum(low + 1, np.maximum(count - 1, 0))
    with np.errstate(invalid="ignore"):
        quantile = ordered[rows, low] + (position - low) * (ordered[rows, high] - ordered[rows, low])
    return np.where(count > 0, quantile, np.nan)


def _select_quantiles(work: np.ndarray, q: float, count: np.ndarray | None = None) -> np.ndarray:
    """The ``q`` quantile of each row of ``work`` (rows x n, C-contiguous), ignoring NaN: the same
    numbers as ``_column_quantiles(work.T, q)``, the two order statistics it interpolates found
    by a selection (``np.partition``, O(n)) instead of a sort, per number of known values a row
    has (one or a few). Reorders each row of ``work`` in place (its values stay in it).
    ``count``: how many values each row has that are not NaN, where the caller knows it (no
    pass to count them)."""
    rows, n = work.shape
    if count is None:
        count = n - np.count_nonzero(np.isnan(work), axis=1)
    result = np.full(rows, np.nan, dtype=np.result_type(work, np.float32))  # float32 stays float32
    for known in np.unique(count).tolist():
        if known == 0:
            continue
        select = count == known
        block = work if select.all() else work[select]  # the few rows with another count: a copy
        position = q * (known - 1)
        low = math.floor(position)
        high = min(low + 1, known - 1)
        block.partition(high, axis=1)  # NaN sorts last: the known values come first
        upper = block[:, high]
        lower = block[:, :high].max(axis=1) if high > low else upper  # the low-th: the largest before
        with np.errstate(invalid="ignore"):
            result[select] = lower + (position - low) * (upper - lower)
    return result


#: Rows copied at a time by ``_transposed``.
TRANSPOSE_BLOCK = 256


def _transposed(values: np.ndarray, ufunc: np.ufunc | None = None) -> np.ndarray:
    """A C-ordered copy of ``values.T`` (2-D; with ``ufunc``, of ``ufunc(values).T``), copied a
    block of rows at a time: a plain copy of a transpose reads memory a row apart for every
    element, three times slower on a W x P array (4096 x 273)."""
    out = np.empty(values.shape[::-1], dtype=values.dtype)
    for start in range(0, values.shape[0], TRANSPOSE_BLOCK):
        block = values[start : start + TRANSPOSE_BLOCK].T
        if ufunc is None:
            out[:, start : start + TRANSPOSE_BLOCK] = block
        else:
            ufunc(block, out=out[:, start : start + TRANSPOSE_BLOCK])
    return out


def _spreads(work: np.ndarray, infinite: bool = True) -> np.ndarray:
    """Per row (a signal on a step, across W ranks), its MAD, ignoring NaN: the spread that
    ``_growth`` compares. ``work`` (rows x W, C-contiguous) is overwritten. ``infinite=False``:
    the caller knows ``work`` holds no infinity (the distances to the median are NaN where the
    values are: not counted again)."""
    count = len(work[0]) - np.count_nonzero(np.isnan(work), axis=1) if len(work) else None
    median = _select_quantiles(work, 0.5, count)
    with np.errstate(invalid="ignore"):
        np.abs(work - median[:, None], out=work)  # each row's values, in another order: the same multiset
    return _select_quantiles(work, 0.5, None if infinite else count)


def _column_medians(values: np.ndarray) -> np.ndarray:
    """Median of each column of a 2-D array, ignoring NaN (NaN for an all-NaN column)."""
    return _column_quantiles(values, 0.5)


def _robust(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column of a 2-D array, the median and ``1.4826 * MAD``, ignoring NaN. With
    ``_shoulders`` and ``_growth``, the definition of the baselines: the detector computes the
    same numbers from its ring buffers (``Baselines.own_baselines``, ``cross_baselines``;
    tests/test_detect_scale.py compares them step by step)."""
    median = _column_medians(values)
    mad = _column_medians(np.abs(values - median))
    return median, MAD_TO_STD * np.nan_to_num(mad, nan=0.0)


def _typical_shoulder(per_rank: np.ndarray, quantile: float) -> np.ndarray:
    """From each rank's ``quantile`` of its absolute deviations (signals x W), the standard
    deviation ``_shoulders`` returns: the median rank's (the smaller at W = 2) over a normal's."""
    # No majority at W = 2: the smaller of the two, as the rank that is off raises its own.
    typical = _column_medians(per_rank.T) if per_rank.shape[1] >= 3 else np.fmin(per_rank[:, 0], per_rank[:, 1])
    return np.nan_to_num(typical, nan=0.0) / NormalDist().inv_cdf(0.5 + quantile / 2)


def _shoulders(values: np.ndarray, center: np.ndarray, quantile: float) -> np.ndarray:
    """Per signal, a standard deviation from the shoulders of its noise (see
    ``DetectorConfig.scale_quantile``): each rank's ``quantile`` of ``|value - center|`` over the
    window, over a normal's, and of those the median rank's, which the one rank that is off
    cannot move (W >= 3; the smaller at W = 2). ``values`` is signals x steps x W, ``center`` signals x W (or x 1);
    zeros at ``quantile`` 0.5 (the MAD alone)."""
    signals, steps, world = values.shape
    if quantile <= 0.5:
        return np.zeros(signals)
    distance = np.abs(values - center[:, None, :]).transpose(1, 0, 2).reshape(steps, signals * world)
    return _typical_shoulder(_column_quantiles(distance, quantile).reshape(signals, world), quantile)


def _growth_ratio(per_step: np.ndarray, recent: np.ndarray) -> np.ndarray:
    """Per signal, the median of its ``recent`` steps' spreads (``per_step`` signals x steps;
    ``recent`` the indices of those steps) over the median of all, never below 1."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = _column_medians(per_step[:, recent].T) / _column_medians(per_step.T)
    return np.fmax(1.0, np.nan_to_num(ratio, nan=1.0, posinf=1.0))


def _growth(deviations: np.ndarray, recent: int) -> np.ndarray:
    """How much the spread across ranks grew lately, per signal (W >= 3). ``deviations`` is
    signals x steps x W; each step's spread is its MAD across ranks, which the one rank that is
    off cannot move (at W = 3 it is the smaller of the two gaps to the middle rank); the result is
    the median of the last ``recent`` steps' spreads over the median of all, never below 1 (a
    spread that shrinks keeps the window's scale)."""
    signals, steps, world = deviations.shape
    per_step = _spreads(np.array(deviations, dtype=float).reshape(signals * steps, world)).reshape(signals, steps)
    return _growth_ratio(per_step, np.arange(max(steps - recent, 0), steps))

