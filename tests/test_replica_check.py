"""``replica_differences`` (vectorised) against a plain per-tensor count, at small W and at W = 4096."""

from collections import Counter

import numpy as np
import pytest

from ddphooks.stats import MAX_REPLICA_DIFFERENCES, NOT_COMPARED, replica_differences


def _reference(fingerprints: np.ndarray, names: list[str]) -> dict:
    """The obvious definition, one tensor at a time: count each rank's (l1, l2) row, the most
    common one (if it is the only one) is the reference, every rank off it is named; a tie names
    every rank, against the median. Rows are tuples of numpy floats, so a row with a NaN equals
    no other row (each NaN is its own object)."""
    world = fingerprints.shape[0]
    differing, bad_ranks, not_compared = [], set(), 0
    for t, name in enumerate(names):
        column = fingerprints[:, t, :]
        if (column == NOT_COMPARED).any():
            not_compared += 1
            continue
        if (column == column[0]).all():
            continue
        keys = [tuple(row) for row in column]
        counts = Counter(keys)
        top = max(counts.values())
        majority = [key for key, count in counts.items() if count == top]
        reference = np.array(majority[0]) if len(majority) == 1 else None
        ranks = [r for r in range(world) if reference is None or keys[r] != tuple(reference)]  # a NaN row: named
        base = reference if reference is not None else np.median(column, axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            relative = np.abs(column[ranks] - base) / np.where(base != 0, np.abs(base), 1.0)
            largest = np.fmax.reduce(relative, axis=None)
        bad_ranks.update(ranks)
        differing.append({"name": name, "ranks": ranks, "relative_difference": float(largest) if np.isfinite(largest) else None})
    differing.sort(key=lambda d: -(d["relative_difference"] or 0.0))
    return {"ranks": sorted(bad_ranks), "tensors": len(differing), "parameters": differing[:MAX_REPLICA_DIFFERENCES], "not_compared": not_compared}


def _agreeing(world: int, tensors: int, seed: int = 0) -> np.ndarray:
    """W x T x 2 fingerprints every rank shares (fp32 values, as they travel in the slots)."""
    rng = np.random.default_rng(seed)
    norms = (rng.random((tensors, 2)) * [1000.0, 10.0] + 1.0).astype(np.float32).astype(np.float64)
    return np.broadcast_to(norms, (world, tensors, 2)).copy()


def test_replica_differences_match_a_plain_count_on_small_worlds():
    rng = np.random.default_rng(1)
    for _ in range(1500):
        world, tensors = int(rng.choice([1, 2, 3, 4, 5, 8, 9, 17])), int(rng.integers(1, 10))
        values = rng.integers(0, 3, size=(world, tensors, 2)) * 0.5  # few values: majorities, ties, all apart
        if rng.random() < 0.6:  # mostly agreeing replicas
            values = np.where(rng.random((world, tensors, 1)) < 0.8, rng.integers(0, 3, size=(tensors, 2)) * 0.5, values)
        draw = rng.random(values.shape)
        values[draw < 0.03] = np.nan
        values[(draw >= 0.03) & (draw < 0.05)] = NOT_COMPARED
        values[(draw >= 0.05) & (draw < 0.06)] = np.inf
        values[(draw >= 0.06) & (draw < 0.08)] = -0.0  # equal to 0.0
        names = [f"p{i}" for i in range(tensors)]
        assert replica_differences(values, names) == _reference(values, names), (world, values.tolist())


@pytest.mark.parametrize("differing", ["rank 0 stale", "three ranks", "a node of 8", "nine ranks of their own"])
def test_replica_differences_at_4096_ranks_name_exactly_the_differing_ranks(differing):
    world, tensors = 4096, 300
    fingerprints = _agreeing(world, tensors)
    names = [f"model.layers.{i // 9}.weight{i % 9}" for i in range(tensors)]
    expected_tensors = set(range(tensors))
    if differing == "rank 0 stale":  # rank 0 kept an old copy of every tensor
        fingerprints[0] *= 1.001
        ranks = [0]
    elif differing == "three ranks":  # different tensors, different sizes of difference
        fingerprints[1, :100] *= 1.01
        fingerprints[2048, 50:150, 1] *= 0.999  # the L2 norm only
        fingerprints[4095, 7] = [np.nan, np.nan]
        ranks, expected_tensors = [1, 2048, 4095], set(range(150))
    elif differing == "a node of 8":  # ranks 0-7 hold the same stale copy
        fingerprints[:8, ::3] *= 1.002
        ranks, expected_tensors = list(range(8)), set(range(0, tensors, 3))
    else:  # ranks 0-8 each hold a copy of their own: the first ranks tried are not the majority, the median is
        for r in range(9):
            fingerprints[r] *= 1 + 1e-3 * (r + 1)
        ranks = list(range(9))
    fingerprints[:, -1] = NOT_COMPARED  # a buffer that moves on each rank by design
    expected_tensors.discard(tensors - 1)
    result = replica_differences(fingerprints, names)
    assert result["ranks"] == ranks
    assert result["tensors"] == len(expected_tensors) and result["not_compared"] == 1
    assert len(result["parameters"]) == MAX_REPLICA_DIFFERENCES
    assert {d["name"] for d in result["parameters"]} <= {names[t] for t in expected_tensors}
    assert all(set(d["ranks"]) <= set(ranks) and d["ranks"] == sorted(d["ranks"]) for d in result["parameters"])
    differences = [d["relative_difference"] or 0.0 for d in result["parameters"]]
    assert differences == sorted(differences, reverse=True)
    # the same as the plain count on a slice of the tensors (the plain count takes seconds on all)
    part = slice(0, 40)
    assert replica_differences(fingerprints[:, part], names[part]) == _reference(fingerprints[:, part], names[part])
