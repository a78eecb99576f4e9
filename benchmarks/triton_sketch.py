"""The statistics pass of one bucket as one Triton kernel: a candidate for GPUs, not shipped yet.

What BucketStatsKernel computes (per-parameter squared norms and the sketch with the shipped signs,
sigma_x = T[x mod 2^23] v[(x div p) mod 65521]), in one launch per bucket plus one to zero the norms,
whatever the bucket's size and number of parameters. The bucket is cut into work items, each a tile
of ROWS rows of p elements (a [ROWS, 256] block, columns past p masked) restricted to one parameter:
the program reads its gradient elements once, adds its column sums into the sketch (p atomic adds)
and its sum of squares into the parameter's norm (one atomic add).

Measured for correctness only, on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported); its speed waits for a GPU:

    TRITON_INTERPRET=1 python benchmarks/triton_sketch.py      # compares with BucketStatsKernel
"""

import numpy as np
import torch
import triton
import triton.language as tl

from ddphooks.sketch import ROW_PERIOD, BucketPlan, BucketStatsKernel, SignTable

TILE = 8192  # elements per work item's block (rows x the next power of two >= p)


@triton.jit
def _bucket_stats(grad_ptr, table_ptr, rows_ptr, items_ptr, sketch_ptr, sq_ptr, base_row, page, period, p,
                  ROWS: tl.constexpr, PB: tl.constexpr):  # fmt: skip
    item = tl.program_id(0)
    param = tl.load(items_ptr + 4 * item)
    lo = tl.load(items_ptr + 4 * item + 1)  # the parameter's elements [lo, hi) in the bucket
    hi = tl.load(items_ptr + 4 * item + 2)
    row0 = tl.load(items_ptr + 4 * item + 3)  # the tile's first row in the bucket
    rows = row0 + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, PB)[None, :]
    index = rows * p + cols
    mask = (cols < p) & (index >= lo) & (index < hi)
    g = tl.load(grad_ptr + index, mask=mask, other=0.0).to(tl.float32)
    position = base_row * p + index
    t = tl.load(table_ptr + (position & (page - 1)), mask=mask, other=0).to(tl.float32)
    v = tl.load(rows_ptr + (base_row + rows) % period)
    column = tl.arange(0, PB)
    tl.atomic_add(sketch_ptr + column, tl.sum(g * t * v, axis=0), mask=column < p)
    tl.atomic_add(sq_ptr + param, tl.sum(g * g))


def rows_per_item(bins: int) -> int:
    return max(1, TILE // triton.next_power_of_2(bins))


def work_items(plan: BucketPlan, device: torch.device) -> torch.Tensor:
    """(parameter, first element, end, first row) of every tile, int64 on the device."""
    items, start, step = [], 0, rows_per_item(plan.bins)
    for j, length in enumerate(plan.lengths):
        for row in range(start // plan.bins, (start + length - 1) // plan.bins + 1, step):
            items.append((j, start, start + length, row))
        start += length
    return torch.tensor(items, dtype=torch.int64, device=device).flatten()


def bucket_stats(flat: torch.Tensor, plan: BucketPlan, table: SignTable, items: torch.Tensor, sketch_acc: torch.Tensor, sq_norms: torch.Tensor) -> None:
    """Add the bucket's sketch into ``sketch_acc`` and write its squared norms: two launches."""
    sq_norms.zero_()
    block = triton.next_power_of_2(plan.bins)
    _bucket_stats[(items.numel() // 4,)](flat, table.values, table.row_table, items, sketch_acc, sq_norms,
                                          plan.base // plan.bins, table.page, ROW_PERIOD, plan.bins, ROWS=rows_per_item(plan.bins), PB=block)  # fmt: skip


def main() -> None:
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    print(f"{'bins':>5} {'elements':>9} {'params':>6} {'work items':>10} {'max sketch diff':>15} {'max norm diff':>13}")
    cases = ((61, [1000, 70_001, 5, 30_000, 17, 1], 3), (251, [300_000, 251, 4_000], 40_000), (1021, [50_000, 9], 70_000), (13, [3000, 7], 0))
    for bins, lengths, base_rows in cases:
        table = SignTable(3, bins, cpu)
        plan = BucketPlan(lengths, bins, base_rows * bins, cpu, 1 << 16)
        flat = torch.randn(plan.numel, generator=generator)
        expected_sketch, expected_sq = torch.zeros(bins), torch.empty(len(lengths))
        BucketStatsKernel(bins, cpu, table).run(flat, plan, expected_sketch, expected_sq)
        items = work_items(plan, cpu)
        sketch, sq = torch.zeros(bins), torch.empty(len(lengths))
        bucket_stats(flat, plan, table, items, sketch, sq)
        sketch_diff = ((sketch - expected_sketch).abs().max() / expected_sketch.abs().max()).item()
        sq_diff = ((sq - expected_sq).abs() / expected_sq).max().item()
        print(f"{bins:>5} {plan.numel:>9} {len(lengths):>6} {items.numel() // 4:>10} {sketch_diff:15.1e} {sq_diff:13.1e}")
        assert sketch_diff < 1e-5 and sq_diff < 1e-5, "the Triton kernel disagrees with BucketStatsKernel"


if __name__ == "__main__":
    main()
