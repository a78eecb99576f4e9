"""The sketch and norm kernel in one process: exactness against direct formulas, and accuracy."""

import math

import numpy as np
import pytest
import torch

from ddphooks.sketch import (
    BucketPlan,
    BucketStatsKernel,
    largest_prime_at_most,
    random_signs,
    sketch_bins,
    squared_norms,
)
from ddphooks.stats import cosine_from_sketches

CPU = torch.device("cpu")


def _reference_sketch(flat: torch.Tensor, plan: BucketPlan) -> torch.Tensor:
    """s[c] = sum over i with i mod p == c of sigma_i * g_i, in float64."""
    signed = flat.double() * plan.signs.double()
    bins = torch.arange(flat.numel()) % plan.bins
    return torch.zeros(plan.bins, dtype=torch.float64).index_add_(0, bins, signed)


def test_largest_prime_at_most():
    assert [largest_prime_at_most(n) for n in (2, 3, 4, 64, 256, 1024)] == [2, 3, 3, 61, 251, 1021]
    assert sketch_bins(0) == 0
    with pytest.raises(ValueError, match="no prime <= 1"):
        largest_prime_at_most(1)


def test_signs_are_deterministic_balanced_and_leave_global_rngs_alone():
    torch_state, numpy_state = torch.random.get_rng_state(), np.random.get_state()
    a = random_signs(100_000, (7, 1, 100_000), CPU)
    b = random_signs(100_000, (7, 1, 100_000), CPU)
    c = random_signs(100_000, (8, 1, 100_000), CPU)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])
    assert a.dtype == torch.int8 and set(a.unique().tolist()) == {-1, 1}
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(a.float().mean().item()) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sketch_dim", [0, 16, 256])
@pytest.mark.parametrize("chunk_elems", [1024, 1 << 16])
@pytest.mark.parametrize("fused", [False, True], ids=["dots", "fused"])
def test_kernel_matches_direct_formulas(dtype, sketch_dim, chunk_elems, fused):
    # Segment lengths that straddle chunk boundaries, tiny segments and a ragged last row.
    lengths = [1000, 70_001, 5, 30_000, 17, 1]
    generator = torch.Generator().manual_seed(1)
    flat = torch.randn(sum(lengths), generator=generator).to(dtype)
    bins = sketch_bins(sketch_dim)
    plan = BucketPlan(lengths, bins, (3, 4), CPU, chunk_elems)
    kernel = BucketStatsKernel(bins, CPU, fused=fused)  # fused: the accelerator path, run on the CPU
    sketch = torch.zeros(max(bins, 1))
    sq = torch.empty(len(lengths))
    before = flat.clone()
    for _ in range(2):  # the second run reuses the prepared views and must give the same
        sketch.zero_()
        kernel.run(flat, plan, sketch if bins else None, sq)
        expected = torch.stack([part.double().pow(2).sum() for part in flat.split(lengths)])
        torch.testing.assert_close(sq.double(), expected, rtol=1e-5, atol=0)
        if bins:
            torch.testing.assert_close(sketch.double(), _reference_sketch(flat, plan), rtol=1e-4, atol=1e-4)
    assert torch.equal(flat, before), "the kernel must not modify the gradient"


def test_kernel_shares_scratch_between_plans_of_different_sizes():
    kernel = BucketStatsKernel(61, CPU)
    small = BucketPlan([10, 20], 61, (0, 0), CPU, 1024)
    large = BucketPlan([50_000, 3], 61, (0, 1), CPU, 1 << 14)
    for plan in (small, large, small):
        flat = torch.randn(plan.numel)
        sketch, sq = torch.zeros(61), torch.empty(len(plan.lengths))
        kernel.run(flat, plan, sketch, sq)
        torch.testing.assert_close(sketch.double(), _reference_sketch(flat, plan), rtol=1e-4, atol=1e-4)


def test_kernel_rejects_a_buffer_of_the_wrong_size():
    plan = BucketPlan([10, 20], 61, (0, 0), CPU, 1024)
    with pytest.raises(ValueError, match="bucket has 31 elements but its plan expects 30"):
        BucketStatsKernel(61, CPU).run(torch.randn(31), plan, torch.zeros(61), torch.empty(2))


def test_kernel_reports_non_finite_values_in_their_segment_only():
    plan = BucketPlan([100, 100, 100], 61, (0, 0), CPU, 1024)
    flat = torch.randn(300)
    flat[150] = float("nan")
    flat[250] = float("inf")
    sq = torch.empty(3)
    BucketStatsKernel(61, CPU).run(flat, plan, torch.zeros(61), sq)
    assert math.isfinite(sq[0]) and math.isnan(sq[1]) and math.isinf(sq[2])


def test_squared_norms_of_reduced_buckets():
    lengths = [5, 200_000, 3]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        flat = torch.randn(sum(lengths)).to(dtype)
        expected = torch.stack([p.double().pow(2).sum() for p in flat.split(lengths)])
        for fused in (False, True):  # the CPU path and the accelerator path
            out = torch.empty(3)
            squared_norms(flat, lengths, out, fused=fused)
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0)


# -- accuracy of the sketched cosine --------------------------------------------------------------
# A 256 KB bucket. The structured families put more elements than sketch bins into their support,
# so they are not trivially exact: a run of 8192 elements, or one column of a 1024 x 64 matrix.
DIM = 1 << 16
RUN = 8192
COLUMNS = 64
SKETCH_DIMS = (64, 256, 1024)
SEEDS = 50


def _pair(family: str, cosine: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two gradients with exactly the given cosine, with all their energy where `family` says."""
    if family == "dense":
        x, w = rng.standard_normal(DIM), rng.standard_normal(DIM)
    elif family == "constant":  # a large constant component plus noise
        x, w = 3.0 + rng.standard_normal(DIM), 3.0 + rng.standard_normal(DIM)
    else:
        support = np.zeros(DIM, dtype=bool)
        if family == "contiguous":  # one contiguous run, e.g. one small parameter
            start = int(rng.integers(0, DIM - RUN))
            support[start : start + RUN] = True
        elif family == "column":  # one column of a row-major matrix: a power-of-two stride
            support.reshape(-1, COLUMNS)[:, int(rng.integers(0, COLUMNS))] = True
        x, w = np.zeros(DIM), np.zeros(DIM)
        x[support], w[support] = rng.standard_normal((2, int(support.sum())))
    x_hat = x / np.linalg.norm(x)
    y = w - (w @ x_hat) * x_hat
    return x, cosine * x_hat + math.sqrt(1 - cosine**2) * y / np.linalg.norm(y)


def test_sketched_cosine_rms_error_within_bound():
    """RMS error of the estimated cosine <= 1.25 / sqrt(sketch_dim) for sketch_dim 64, 256, 1024,
    over 50 seeds (projection and gradients), for four families of gradients and true cosines
    -0.5, 0, 0.5, 0.9."""
    kernels = {k: BucketStatsKernel(sketch_bins(k), CPU) for k in SKETCH_DIMS}
    squared = {}
    for family in ("dense", "contiguous", "column", "constant"):
        for cosine in (-0.5, 0.0, 0.5, 0.9):
            for seed in range(SEEDS):
                rng = np.random.default_rng([seed, int(cosine * 10) + 10, len(family)])
                pair = [torch.from_numpy(v).float() for v in _pair(family, cosine, rng)]
                for k, kernel in kernels.items():
                    plan = BucketPlan([DIM], kernel.bins, (seed, 0, DIM), CPU, 1 << 16)
                    sketches = np.zeros((2, kernel.bins))
                    for row, vector in enumerate(pair):
                        acc = torch.zeros(kernel.bins)
                        kernel.run(vector, plan, acc, torch.empty(1))
                        sketches[row] = acc.double().numpy()
                    kernel.forget(plan)
                    error = cosine_from_sketches(sketches)[0, 1] - cosine
                    squared.setdefault((k, family, cosine), []).append(error**2)
    rms = {key: math.sqrt(sum(v) / len(v)) for key, v in squared.items()}
    failures = {key: round(v, 4) for key, v in rms.items() if v > 1.25 / math.sqrt(key[0])}
    assert not failures, f"RMS errors above 1.25/sqrt(sketch_dim): {failures}"
    # The bound is not vacuous: dense gradients at cosine 0 really have an error near 1/sqrt(p).
    for k in SKETCH_DIMS:
        assert rms[(k, "dense", 0.0)] > 0.5 / math.sqrt(k)
