"""The sketch and norm kernel in one process: exactness against direct formulas, and accuracy."""

import functools
import math

import numpy as np
import pytest
import torch

from ddphooks.sketch import (
    ACCELERATOR_CHUNK_ELEMS,
    ROW_PERIOD,
    SIGN_PAGE,
    BucketPlan,
    BucketStatsKernel,
    SignTable,
    largest_prime_at_most,
    random_signs,
    sketch_bins,
    squared_norms,
    squared_norms_of_buffers,
)
from ddphooks.stats import cosine_from_sketches
from torch.utils._python_dispatch import TorchDispatchMode

CPU = torch.device("cpu")
_TABLES: dict[tuple[int, int, int], SignTable] = {}


def _table(seed: int, bins: int, page: int = SIGN_PAGE) -> SignTable:
    """One table per (seed, bins, page) for the whole module: a full-size table takes ~0.1 s to draw."""
    if (seed, bins, page) not in _TABLES:
        _TABLES[seed, bins, page] = SignTable(seed, bins, CPU, page)
    return _TABLES[seed, bins, page]


def _definition_signs(table: SignTable, begin: int, end: int) -> torch.Tensor:
    """sigma_x = T[x mod M] * v[(x div p) mod R], position by position (the slow, obvious way)."""
    t, v = table.values[: table.page].tolist(), table.row_table.tolist()
    return torch.tensor([t[x % table.page] * int(v[(x // table.bins) % ROW_PERIOD]) for x in range(begin, end)])


def _reference_sketch(flat: torch.Tensor, plan: BucketPlan, table: SignTable) -> torch.Tensor:
    """s[c] = sum over positions x of the bucket with x mod p == c of sigma_x * g_x, in float64."""
    signed = flat.double() * _definition_signs(table, plan.base, plan.base + plan.numel).double()
    bins = (plan.base + torch.arange(flat.numel())) % plan.bins
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
    tables = [SignTable(7, 61, CPU, page=1 << 16), SignTable(7, 61, CPU, page=1 << 16), SignTable(8, 61, CPU, page=1 << 16)]
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])
    assert a.dtype == torch.int8 and set(a.unique().tolist()) == {-1, 1}
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(a.float().mean().item()) < 0.02
    assert torch.equal(tables[0].values, tables[1].values) and not torch.equal(tables[0].values, tables[2].values)
    assert torch.equal(tables[0].row_table, tables[1].row_table) and not torch.equal(tables[0].row_table, tables[2].row_table)
    assert torch.equal(tables[0].values[1 << 16 :], tables[0].values[: 1 << 16])  # T stored twice
    assert abs(tables[0].row_table.mean().item()) < 0.02


def test_sign_table_memory_is_fixed():
    table = SignTable(0, 251, CPU, window=1 << 17)
    assert table.nbytes() < 2**20  # the row signs: the int8 table is made at its first use (never, with the Triton kernel)
    kernel = BucketStatsKernel(251, CPU, table)
    for numel in (10**6, 4 * 10**6):  # twice the bucket, the same memory: nothing per element
        plan = BucketPlan([numel // 2, numel - numel // 2], 251, 0, CPU, 1 << 17)
        kernel.run(torch.randn(numel), plan, torch.zeros(251), torch.empty(2))
        assert SIGN_PAGE + (1 << 17) <= table.nbytes() < SIGN_PAGE + (1 << 17) + 2**20  # T and one chunk's window again
        assert kernel.persistent_bytes() < table.nbytes() + 2**20 and plan.persistent_bytes() < 0.001 * numel
    with pytest.raises(ValueError, match="exceed the sign table's window of 131072"):
        kernel.run(torch.randn(1 << 19), BucketPlan([1 << 19], 251, 0, CPU, 1 << 18), torch.zeros(251), torch.empty(1))


def test_sign_table_slices_follow_the_definition():
    table = SignTable(5, 13, CPU, page=64)
    for begin, end in ((0, 64), (10, 20), (60, 124), (128, 129), (3, 67)):
        # the kernel's slice of T for a run of at most one table length: T is stored twice
        t = table.values[begin % 64 : begin % 64 + end - begin].long()
        assert torch.equal(t, table.values[torch.arange(begin, end) % 64].long())
    wide = SignTable(5, 13, CPU, page=64, window=100)  # a window longer than the page: T, then T and part of it again
    for begin, end in ((0, 100), (63, 163), (10, 20)):
        t = wide.values[begin % 64 : begin % 64 + end - begin].long()
        assert torch.equal(t, table.values[torch.arange(begin, end) % 64].long())
    assert wide.values.numel() == 164
    with pytest.raises(ValueError, match="window=129 must be between 1 and twice the page"):
        SignTable(0, 13, CPU, page=64, window=129)
    for begin, end in ((0, 64), (10, 20), (60, 200), (128, 129), (3, 64 * 40 + 7)):
        assert torch.equal(table.signs(begin, end).long(), _definition_signs(table, begin, end))
    rows = table.row_signs(ROW_PERIOD - 3, 10)  # wraps around the row table
    assert torch.equal(rows, table.row_table[torch.arange(ROW_PERIOD - 3, ROW_PERIOD + 7) % ROW_PERIOD])
    assert table.signs(5, 5).numel() == 0
    with pytest.raises(ValueError, match="page=100 must be a power of two"):
        SignTable(0, 13, CPU, page=100)


def test_plan_positions():
    plan = BucketPlan([100, 50], 61, 122, CPU, 1024)
    assert plan.end == 305  # 122 + 150 rounded up to a multiple of 61
    with pytest.raises(ValueError, match="base=100 must be a non-negative multiple of bins=61"):
        BucketPlan([10], 61, 100, CPU, 1024)
    with pytest.raises(ValueError, match="a kernel with a sketch of 61 bins needs a SignTable of 61 bins"):
        BucketStatsKernel(61, CPU)
    with pytest.raises(ValueError, match="needs a SignTable of 61 bins"):
        BucketStatsKernel(61, CPU, _table(0, 13, 64))
    kernel = BucketStatsKernel(61, CPU, _table(0, 61, 1024))
    with pytest.raises(ValueError, match="chunks of 1952 elements exceed the sign table's window of 1024; use chunk_elems <= 1024"):
        kernel.run(torch.randn(5000), BucketPlan([5000], 61, 0, CPU, 2000), torch.zeros(61), torch.empty(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sketch_dim", [0, 16, 256])
@pytest.mark.parametrize("chunk_elems", [1024, 1 << 16])
@pytest.mark.parametrize("fused", [False, True], ids=["dots", "fused"])
@pytest.mark.parametrize("page", [SIGN_PAGE, 1 << 16], ids=["page", "small-pages"])
def test_kernel_matches_direct_formulas(dtype, sketch_dim, chunk_elems, fused, page):
    # Segment lengths that straddle chunk boundaries, tiny segments and a ragged last row; with a
    # small table, the bucket wraps around it and rows around the row table.
    lengths = [1000, 70_001, 5, 30_000, 17, 1]
    generator = torch.Generator().manual_seed(1)
    flat = torch.randn(sum(lengths), generator=generator).to(dtype)
    bins = sketch_bins(sketch_dim)
    table = _table(3, bins, page) if bins else None
    plan = BucketPlan(lengths, bins, 7 * bins, CPU, chunk_elems)
    kernel = BucketStatsKernel(bins, CPU, table, fused=fused)  # fused: the accelerator path, run on the CPU
    sketch = torch.zeros(max(bins, 1))
    sq = torch.empty(len(lengths))
    before = flat.clone()
    for _ in range(2):  # the second run reuses the prepared views and must give the same
        sketch.zero_()
        kernel.run(flat, plan, sketch if bins else None, sq)
        expected = torch.stack([part.double().pow(2).sum() for part in flat.split(lengths)])
        torch.testing.assert_close(sq.double(), expected, rtol=1e-5, atol=0)
        if bins:
            torch.testing.assert_close(sketch.double(), _reference_sketch(flat, plan, table), rtol=1e-4, atol=1e-4)
    assert torch.equal(flat, before), "the kernel must not modify the gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sketch_dim", [0, 256])
@pytest.mark.parametrize("fused", [False, True], ids=["cpu", "fused"])
@pytest.mark.parametrize(
    ("rows", "params", "chunk_elems", "by_column"),
    [(8, 5, 1 << 16, False), (50, 65, 1024, False), (50, 65, 2600, True), (50, 65, 1 << 16, True), (1024, 4, 1 << 17, True), (1024, 4, 7000, True)],
)
def test_row_plans_take_each_parameters_norm_over_its_rows(dtype, sketch_dim, fused, rows, params, chunk_elems, by_column):
    # FSDP2's reduce-scatter input: rows of the same layout (an empty parameter and one element
    # among them). Few segments (8 x 5), or rows wider than a chunk (2,308 > 1024): one segment per
    # parameter and row. More than COLUMN_SEGMENTS in narrower rows: by column, with chunks of parts
    # of two rows only (2600), of many rows, one chunk for everything, and chunks that start and end
    # mid-row. The norms against float64
    # sums over each parameter's columns, the sketch against the definition, position by position.
    lengths = ([300, 7, 0, 1, 2000] + [3] * 60)[:params] if params != 4 else [36, 96, 1, 2]
    flat = torch.randn(rows * sum(lengths), generator=torch.Generator().manual_seed(2)).to(dtype)
    bins = sketch_bins(sketch_dim)
    table = _table(3, bins, 1 << 17) if bins else None
    plan = BucketPlan(lengths, bins, 3 * bins, CPU, chunk_elems, rows=rows)
    assert plan.by_column == by_column
    kernel = BucketStatsKernel(bins, CPU, table, fused=fused)
    columns = flat.double().view(rows, -1).pow(2).sum(dim=0)
    expected = torch.stack([part.sum() for part in columns.split(lengths)])
    for _ in range(2):  # the second run reuses the prepared views
        sketch, sq = torch.zeros(max(bins, 1)), torch.full((len(lengths),), 7.0)
        kernel.run(flat, plan, sketch if bins else None, sq)
        torch.testing.assert_close(sq.double(), expected, rtol=1e-5, atol=0)
        if bins:
            torch.testing.assert_close(sketch.double(), _reference_sketch(flat, plan, table), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="rows=0 must be at least 1"):
        BucketPlan(lengths, bins, 0, CPU, chunk_elems, rows=0)


@pytest.mark.parametrize("fused", [False, True], ids=["cpu", "fused"])
@pytest.mark.parametrize(("rows", "chunk_elems", "by_column"), [(1, 1024, False), (40, 1 << 14, False), (300, 1 << 14, True)])
def test_a_band_read_through_the_row_stride_equals_its_copy(fused, rows, chunk_elems, by_column):
    # FSDP2's band of rows (the columns of the parameters that still hold gradient): read through
    # the row stride of the whole input, the same values bit for bit as the band copied out; one row
    # of several chunks, rows in one chunk by parameter and row, and by column
    lengths = [30, 0, 7, 1] if rows > 1 else [3000, 7]
    whole = torch.randn(rows, sum(lengths) + 50, generator=torch.Generator().manual_seed(3))
    band = whole[:, 20 : 20 + sum(lengths)]
    table = _table(1, 61, 1 << 17)
    plan = BucketPlan(lengths, 61, 2 * 61, CPU, chunk_elems, rows=rows)
    assert plan.by_column == by_column and (plan.n_chunks > 1) == (rows == 1)
    kernel = BucketStatsKernel(61, CPU, table, fused=fused)
    got, copied = (torch.zeros(61), torch.empty(len(lengths))), (torch.zeros(61), torch.empty(len(lengths)))
    kernel.run(band, plan, *got)
    kernel.run(band.contiguous().view(-1), plan, *copied)
    assert all(torch.equal(a, b) for a, b in zip(got, copied))
    with pytest.raises(ValueError, match="a band of several rows must be one chunk"):
        kernel.run(torch.randn(3, 4000)[:, :3007], BucketPlan([3000, 7], 61, 0, CPU, 1024, rows=3), *got)


class _DispatchedOps(TorchDispatchMode):
    """Operations that run a kernel (not views), dispatched on this thread while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_bucket_at_ddps_default_cap_is_one_chunk_of_four_ops_in_any_dtype():
    # Issue 59: a 25 MB bf16 bucket (DDP's default cap) is 13.1 M elements. The torch path as it runs
    # on accelerators (fused) takes it in one chunk: 4 dispatched operations with several
    # parameters, as for a small bucket; its statistics are those of a run in CPU-sized chunks.
    numel, bins = 25 * 2**20 // 2, 251
    lengths = [numel // 4] * 3 + [numel - 3 * (numel // 4)]
    kernel = BucketStatsKernel(bins, CPU, SignTable(0, bins, CPU, window=ACCELERATOR_CHUNK_ELEMS), fused=True)
    plan = BucketPlan(lengths, bins, 0, CPU, ACCELERATOR_CHUNK_ELEMS)
    assert plan.n_chunks == 1
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(0)).bfloat16()
    sketch, norms = torch.zeros(bins), torch.empty(len(lengths))
    kernel.accumulate(flat, plan, sketch, norms)  # the first run makes the plan's views
    sketch.zero_()
    with _DispatchedOps() as ops:
        kernel.accumulate(flat, plan, sketch, norms)
    assert len(ops.names) <= 4, ops.names
    reference_sketch, reference_sq = torch.zeros(bins), torch.empty(len(lengths))
    BucketStatsKernel(bins, CPU, _table(0, bins)).run(flat, BucketPlan(lengths, bins, 0, CPU, 1 << 17), reference_sketch, reference_sq)
    direct = torch.stack([segment.double().square().sum() for segment in flat.split(lengths)])
    torch.testing.assert_close(reference_sq.double(), direct, rtol=1e-5, atol=0)
    # The CPU's fp32 vector norm of 3.3 M elements is off by ~1.3e-4 (its reduction, not the
    # kernel's: an accelerator's is a tree); the sketch sums 52 K products a bin.
    torch.testing.assert_close(norms.square().double(), direct, rtol=5e-4, atol=0)
    torch.testing.assert_close(sketch, reference_sketch, rtol=1e-4, atol=1e-4 * reference_sketch.abs().max().item())


@pytest.mark.parametrize(("lengths", "budget"), [([500], 3), ([300, 7, 1, 200], 5)], ids=["one-parameter", "four-parameters"])
def test_an_fsdp2_band_of_one_chunk_takes_few_ops_whatever_its_rows(lengths, budget):
    # FSDP2's reduce-scatter input, 16 rows (shards) in one chunk, as the torch path runs it on
    # accelerators: the multiply, the matrix-vector product into the bins, and the parameters'
    # squared norms over the rows (one dot; or the segments' norms, their stack and one batched dot,
    # or without the batched dot the norms by row).
    rows, bins = 16, 61
    flat = torch.randn(rows, sum(lengths), generator=torch.Generator().manual_seed(5))
    table = _table(3, bins, 1 << 17)
    plan = BucketPlan(lengths, bins, 0, CPU, 1 << 16, rows=rows)
    kernel = BucketStatsKernel(bins, CPU, table, fused=True)
    sketch, sq = torch.zeros(bins), torch.empty(len(lengths))
    kernel.run(flat, plan, sketch, sq)  # the first run makes the plan's views
    sketch.zero_()
    with _DispatchedOps() as ops:
        kernel.run(flat, plan, sketch, sq)
    assert len(ops.names) <= budget, ops.names
    expected = torch.stack([part.double().square().sum() for part in flat.split(lengths, dim=1)])
    torch.testing.assert_close(sq.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(sketch.double(), _reference_sketch(flat.view(-1), plan, table), rtol=1e-4, atol=1e-4)
    assert kernel.takes_row_norms(plan) == (len(lengths) > 1)
    if len(lengths) == 1:
        with pytest.raises(ValueError, match="a plan of 16 rows, 1 parameters and 1 chunks has no norms by row"):
            kernel.run(flat, plan, sketch, sq, row_norms=torch.empty(rows))
        return
    # By row (FSDP2 sums them with the step's other norms): four operations, each parameter's norm
    # in each row, parameter by parameter, and the same sketch; sq_norms left alone
    row_norms, untouched = torch.empty(len(lengths) * rows), torch.full((len(lengths),), 7.0)
    sketch.zero_()
    with _DispatchedOps() as ops:
        kernel.run(flat, plan, sketch, untouched, row_norms=row_norms)
    assert len(ops.names) <= 4, ops.names
    by_row = torch.stack([part.double().norm(dim=1) for part in flat.split(lengths, dim=1)]).view(-1)
    torch.testing.assert_close(row_norms.double(), by_row, rtol=1e-5, atol=0)
    torch.testing.assert_close(sketch.double(), _reference_sketch(flat.view(-1), plan, table), rtol=1e-4, atol=1e-4)
    assert (untouched == 7.0).all()


def test_kernel_shares_scratch_between_plans_of_different_sizes():
    table = _table(0, 61, 1 << 14)
    kernel = BucketStatsKernel(61, CPU, table)
    small = BucketPlan([10, 20], 61, 0, CPU, 1024)
    large = BucketPlan([50_000, 3], 61, small.end, CPU, 1 << 14)
    for plan in (small, large, small):
        flat = torch.randn(plan.numel)
        sketch, sq = torch.zeros(61), torch.empty(len(plan.lengths))
        kernel.run(flat, plan, sketch, sq)
        torch.testing.assert_close(sketch.double(), _reference_sketch(flat, plan, table), rtol=1e-4, atol=1e-4)


def test_kernel_rejects_a_buffer_of_the_wrong_size():
    plan = BucketPlan([10, 20], 61, 0, CPU, 1024)
    with pytest.raises(ValueError, match="bucket has 31 elements but its plan expects 30"):
        BucketStatsKernel(61, CPU, _table(0, 61, 1 << 12)).run(torch.randn(31), plan, torch.zeros(61), torch.empty(2))


def test_kernel_reports_non_finite_values_in_their_segment_only():
    plan = BucketPlan([100, 100, 100], 61, 0, CPU, 1024)
    flat = torch.randn(300)
    flat[150] = float("nan")
    flat[250] = float("inf")
    sq = torch.empty(3)
    BucketStatsKernel(61, CPU, _table(0, 61, 1 << 12)).run(flat, plan, torch.zeros(61), sq)
    assert math.isfinite(sq[0]) and math.isnan(sq[1]) and math.isinf(sq[2])
    rows = BucketPlan([50, 50, 50], 61, 0, CPU, 1024, rows=2)  # the same values as 2 rows of 3 parameters
    BucketStatsKernel(61, CPU, _table(0, 61, 1 << 12)).run(flat, rows, torch.zeros(61), sq)
    assert math.isnan(sq[0]) and math.isfinite(sq[1]) and math.isinf(sq[2])  # columns 0 and 100 of row 1


@pytest.mark.parametrize("chunk_elems", [1024, 1 << 17], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("fused", [False, True], ids=["cpu", "fused"])
def test_a_step_of_buckets_writes_its_sketch_over_the_one_before(chunk_elems, fused):
    # The DDP hook's form: start_step does not zero the sketch, the step's first bucket writes over
    # it (a NaN left there must not leak), the others add; finish_step returns the squares of the
    # norms the buckets left, and those norms. Against each bucket run alone into a zero sketch.
    bins = sketch_bins(64)
    table = _table(3, bins, SIGN_PAGE)
    generator = torch.Generator().manual_seed(2)
    buckets = [[3000, 17], [40_000], [5, 6000, 1]]
    plans, base = [], 0
    for lengths in buckets:
        plans.append(BucketPlan(lengths, bins, base, CPU, chunk_elems))
        base = plans[-1].end
    kernel = BucketStatsKernel(bins, CPU, table, fused=fused)
    for step in range(2):  # the second step runs the prepared one-chunk views
        flats = [torch.randn(sum(lengths), generator=generator) for lengths in buckets]
        sketch = torch.full((bins,), math.nan if step == 0 else 1e6)
        norms = [torch.empty(len(lengths)) for lengths in buckets]
        kernel.start_step(sketch, norms)
        for flat, plan, out in zip(flats, plans, norms):
            kernel.accumulate(flat, plan, sketch, out)
        squares, roots = kernel.finish_step(sketch, norms)
        expected_sketch = torch.zeros(bins)
        for flat, plan, lengths, square, root in zip(flats, plans, buckets, squares, roots):
            alone, expected_sq = torch.zeros(bins), torch.empty(len(lengths))
            BucketStatsKernel(bins, CPU, table, fused=fused).run(flat, plan, alone, expected_sq)
            expected_sketch += alone
            torch.testing.assert_close(square, expected_sq, rtol=1e-6, atol=0)
            torch.testing.assert_close(root, expected_sq.sqrt(), rtol=1e-6, atol=0)
        torch.testing.assert_close(sketch, expected_sketch, rtol=1e-5, atol=1e-5)


def test_the_reduced_norms_unsquared_are_the_roots_of_the_squared():
    lengths = [[5, 200_000, 3], [7], [1000, 1]]
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        buffers = [torch.randn(sum(sizes), generator=generator).to(dtype) for sizes in lengths]
        squared, norms = torch.empty(6), torch.empty(6)
        squared_norms_of_buffers(buffers, lengths, squared)
        squared_norms_of_buffers(buffers, lengths, norms, squared=False)
        expected = torch.stack([p.double().pow(2).sum() for b, sizes in zip(buffers, lengths) for p in b.split(sizes)])
        torch.testing.assert_close(squared.double(), expected, rtol=1e-5, atol=0)
        torch.testing.assert_close(norms.double(), expected.sqrt(), rtol=1e-5, atol=0)


def test_squared_norms_of_reduced_buckets():
    lengths = [5, 200_000, 3]
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        flat = torch.randn(sum(lengths), generator=generator).to(dtype)
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


@functools.lru_cache(maxsize=8)
def _projection(scheme: str, seed: int, bins: int, numel: int):
    """What sketches ``numel`` elements under ``scheme`` and ``seed``: independent signs with each
    element's bin, or the kernel with its table and plan (kept for the next vectors of that seed)."""
    if scheme == "independent":
        return random_signs(numel, (seed, 99), CPU).double(), torch.arange(numel) % bins
    page = int(scheme.split()[-1])  # "table, pages of N"
    return BucketStatsKernel(bins, CPU, SignTable(seed, bins, CPU, page)), BucketPlan([numel], bins, 0, CPU, min(1 << 16, page))


def _sketch(vector: torch.Tensor, scheme: str, seed: int, bins: int) -> np.ndarray:
    """The sketch of one 1-D gradient: with independent signs per element (the reference: the
    int8 cache ddphooks kept before the table), or through the kernel with table signs."""
    if scheme == "independent":
        signs, bins_of = _projection(scheme, seed, bins, vector.numel())
        return torch.zeros(bins, dtype=torch.float64).index_add_(0, bins_of, vector.double() * signs).numpy()
    kernel, plan = _projection(scheme, seed, bins, vector.numel())
    acc = torch.zeros(bins)
    kernel.run(vector, plan, acc, torch.empty(1))
    return acc.double().numpy()


# Tables of 1024 entries (a table holds at least one row of p <= 1021 bins): every entry is reused
# 64 times in a gradient, so a constant gradient repeats every pair of signs 64 times unless the
# row signs decorrelate them. (A gradient within one table length, 8 M positions by default, sees
# no repeat at all.)
SCHEMES = ("independent", "table, pages of 1024", "table, pages of 4096")


def test_sketched_cosine_rms_error_within_bound():
    """RMS error of the estimated cosine <= 1.25 / sqrt(sketch_dim) for sketch_dim 64, 256, 1024,
    over 50 seeds (projection and gradients) and the true cosines -0.5, 0, 0.5, 0.9, for four
    families of gradients; with table signs no more than 1.3 times the error with independent
    signs."""
    squared = {}
    # One torch thread: numpy's BLAS threads (the dot products of _pair) still spin when torch's
    # start, and on a 2-core machine the two pools fought over the cores (the loop ran 3x slower).
    # Every sketch is the same at any thread count (bitwise: the element-wise reference, and the
    # kernel, see test_sketch_is_the_same_in_another_process_with_other_threads_and_chunks).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for seed in range(SEEDS):  # outermost: each seed's projections are made once (_projection)
            for family in ("dense", "contiguous", "column", "constant"):
                for cosine in (-0.5, 0.0, 0.5, 0.9):
                    rng = np.random.default_rng([seed, int(cosine * 10) + 10, len(family)])
                    pair = [torch.from_numpy(v).float() for v in _pair(family, cosine, rng)]
                    for k in SKETCH_DIMS:
                        for scheme in SCHEMES[:2]:
                            sketches = np.stack([_sketch(vector, scheme, seed, sketch_bins(k)) for vector in pair])
                            error = cosine_from_sketches(sketches)[0, 1] - cosine
                            squared.setdefault((scheme, k, family, cosine), []).append(error**2)
    finally:
        torch.set_num_threads(threads)
    rms = {}
    for (scheme, k, family, _), errors in squared.items():
        rms.setdefault((scheme, k, family), []).extend(errors)
    rms = {key: math.sqrt(sum(v) / len(v)) for key, v in rms.items()}
    failures = {key: round(v, 4) for key, v in rms.items() if v > 1.25 / math.sqrt(key[1])}
    assert not failures, f"RMS errors above 1.25/sqrt(sketch_dim): {failures}"
    for k in SKETCH_DIMS:
        # The bound is not vacuous: dense gradients really have an error near 1/sqrt(p).
        assert rms[(SCHEMES[1], k, "dense")] > 0.5 / math.sqrt(k)
        for family in ("dense", "contiguous", "column", "constant"):
            assert rms[(SCHEMES[1], k, family)] <= 1.3 * rms[(SCHEMES[0], k, family)], (k, family, rms)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sketched_inner_product_is_unbiased(scheme):
    """Over 300 seeds, <s_a, s_b> / <a, b> has mean 1 (within 4 standard errors) for two gradients
    with a large common constant part, the case where reused signs would add up coherently;
    its spread with table signs is within 1.3 times that with independent signs."""
    rng = np.random.default_rng(0)
    a, b = (torch.from_numpy(3.0 + rng.standard_normal(DIM)).float() for _ in range(2))
    exact = float(a.double() @ b.double())
    bins = sketch_bins(64)
    ratios = np.array([_sketch(a, scheme, seed, bins) @ _sketch(b, scheme, seed, bins) / exact for seed in range(300)])
    standard_error = ratios.std() / math.sqrt(len(ratios))
    assert abs(ratios.mean() - 1) < 4 * standard_error, (ratios.mean(), standard_error)
    # the error of independent signs for this pair: |a||b| / <a, b> * sqrt(2 / p) roughly
    reference = math.sqrt(2 / bins) * float(a.norm() * b.norm()) / exact
    assert 0.5 * reference < ratios.std() < 1.3 * reference, (ratios.std(), reference)


_OTHER_PROCESS = """
import sys, torch
from ddphooks.sketch import BucketPlan, BucketStatsKernel, SignTable
torch.set_num_threads(1)
flat = torch.load(sys.argv[1])
table = SignTable(11, 251, torch.device("cpu"))
plan = BucketPlan([1000, flat.numel() - 1000], 251, 251 * 32_000, torch.device("cpu"), 4099)
acc = torch.zeros(251)
BucketStatsKernel(251, torch.device("cpu"), table, fused=True).run(flat, plan, acc, torch.empty(2))
torch.save(acc, sys.argv[2])
"""


def test_sketch_is_the_same_in_another_process_with_other_threads_and_chunks(tmp_path):
    """One gradient straddling a page boundary, sketched here (all threads, the CPU path, chunks of
    64 K) and in a fresh process (one thread, the accelerator path, chunks of 4099): the same."""
    flat = torch.randn(3 * 2**20, generator=torch.Generator().manual_seed(3))
    torch.save(flat, tmp_path / "flat.pt")
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(tmp_path / "flat.pt"), str(tmp_path / "acc.pt")], check=True, timeout=120)
    table = _table(11, 251)
    plan = BucketPlan([1000, flat.numel() - 1000], 251, 251 * 32_000, CPU, 1 << 16)
    assert plan.base < SIGN_PAGE < plan.base + plan.numel  # wraps around the table
    acc = torch.zeros(251)
    BucketStatsKernel(251, CPU, table).run(flat, plan, acc, torch.empty(2))
    scale = acc.abs().max().item()  # fp32 sums of 12 K terms per bin, in another order
    torch.testing.assert_close(acc, torch.load(tmp_path / "acc.pt"), rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(acc.double(), _reference_sketch(flat, plan, table), rtol=1e-5, atol=1e-5 * scale)
