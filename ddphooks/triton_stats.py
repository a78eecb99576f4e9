"""The statistics pass of one bucket as one Triton kernel: ``SilentConfig(stats_kernel="triton")``.

It computes what :class:`ddphooks.sketch.BucketStatsKernel` computes (the squared norm of every
parameter segment and the sketch with the same signs, ``sigma_x = T[x mod M] v[(x div p) mod R]``)
in two kernel launches per bucket, whatever the bucket's size and number of parameters: one to
zero the norms, one for the pass. The torch path needs about five per chunk of 8 M elements.

How the pass works:

1. the bucket is cut into tiles of ``ROWS`` rows of ``p`` elements (a ``ROWS x PB`` block, ``PB``
   the next power of two of ``p``, the columns past ``p`` masked); one program per tile;
2. each program reads its gradient elements once (any floating dtype, summed in fp32), multiplies
   them by their table signs and row signs, and adds its column sums into the sketch (``p``
   atomic adds);
3. it finds the first parameter segment that overlaps the tile by a binary search over the
   segment offsets (``n_segments + 1`` integers per plan, nothing per element), and adds its sum
   of squares restricted to each overlapping segment into that segment's norm (one atomic add per
   segment; a tile of 8 K elements overlaps one or two).

Nothing is kept per element: per plan, the segment offsets on the device; per device, the sign
tables of :class:`~ddphooks.sketch.SignTable`. The sums are taken in another order than the torch
path's, so the results agree to rounding (fp32), not bitwise.

Measured on the CPU only, under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is
imported), where it matches the torch path to 1e-6 (``tests/test_triton_stats.py``); its speed on a
GPU is what ``python benchmarks/triton_sketch.py --time`` measures, and until a GPU has measured it,
the torch path stays the default. triton is imported only when this kernel is chosen.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ddphooks.sketch import ROW_PERIOD, BucketPlan, SignTable

#: Elements per tile (``ROWS`` rows of the next power of two >= ``p``): one program's block.
TILE_ELEMS = 8192


@triton.jit
def _bucket_stats(grad_ptr, table_ptr, rows_ptr, offsets_ptr, sketch_ptr, sq_ptr, numel, table_start, row_start, page, period, p,
                  ROWS: tl.constexpr, PB: tl.constexpr, SEARCH: tl.constexpr):  # fmt: skip
    first_row = tl.program_id(0).to(tl.int64) * ROWS
    rows = first_row + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, PB)[None, :]
    index = rows * p + cols  # the element's offset in the bucket
    inside = (cols < p) & (index < numel)
    g = tl.load(grad_ptr + index, mask=inside, other=0.0).to(tl.float32)
    # The bucket's base enters as its table entry and row sign (base mod page, base row mod period):
    # small numbers, so no product of the base overflows 32 bits at any model size.
    table_sign = tl.load(table_ptr + ((table_start + index) & (page - 1)), mask=inside, other=0).to(tl.float32)
    row_sign = tl.load(rows_ptr + (row_start + rows) % period)
    column = tl.arange(0, PB)
    tl.atomic_add(sketch_ptr + column, tl.sum(g * table_sign * row_sign, axis=0), mask=column < p)
    # The segments that overlap [low, high): offsets[s] <= low < offsets[s + 1] for the first one.
    low = first_row * p
    high = tl.minimum(low + ROWS * p, numel)
    # Binary search over the 2^SEARCH + 1 offsets (padded with numel, which is > low):
    # offsets[left] <= low < offsets[right] throughout; the last of equal offsets (empty segments,
    # whose norms stay 0) is the one kept.
    left = low * 0
    right = left + (1 << SEARCH)
    for _ in tl.static_range(SEARCH):
        middle = (left + right) // 2
        go_right = tl.load(offsets_ptr + middle) <= low
        left = tl.where(go_right, middle, left)
        right = tl.where(go_right, right, middle)
    square = g * g
    segment = left
    begin = tl.load(offsets_ptr + segment)
    while begin < high:
        end = tl.load(offsets_ptr + segment + 1)
        tl.atomic_add(sq_ptr + segment, tl.sum(tl.where((index >= begin) & (index < end), square, 0.0)))
        segment += 1
        begin = end


class TritonBucketStats:
    """Per-parameter squared norms and the sketch of flat buckets, one Triton launch per bucket.

    The same interface as :class:`~ddphooks.sketch.BucketStatsKernel` (``run``, ``forget``,
    ``persistent_bytes``), so the hook and the FSDP2 transport use either.

    Args:
        bins: sketch entries ``p`` (a prime > 0).
        device: where the buckets live: a CUDA device, or the CPU under Triton's interpreter.
        signs: the sign table of ``bins`` bins on ``device``.
    """

    def __init__(self, bins: int, device: torch.device, signs: SignTable) -> None:
        device = torch.device(device)
        check_device(device)
        if bins < 2 or signs is None or signs.bins != bins:
            raise ValueError(f"the Triton kernel needs a sketch (bins={bins}) and a SignTable of as many bins")
        self.bins = bins
        self.device = device
        self.signs = signs
        self.block = triton.next_power_of_2(bins)
        self.rows = max(1, TILE_ELEMS // self.block)
        self._offsets: dict[int, tuple[BucketPlan, torch.Tensor, int]] = {}

    def _prepared(self, plan: BucketPlan) -> tuple[torch.Tensor, int]:
        """The plan's segment offsets padded to a power of two (``2^k + 1`` entries, the padding at
        ``numel``) and ``k``, the binary search's steps."""
        entry = self._offsets.get(id(plan))
        if entry is None or entry[0] is not plan:
            steps = max(1, math.ceil(math.log2(len(plan.lengths) + 1)))
            bounds = [0]
            for length in plan.lengths:
                bounds.append(bounds[-1] + length)
            bounds += [plan.numel] * ((1 << steps) + 1 - len(bounds))
            entry = (plan, torch.tensor(bounds, dtype=torch.int64, device=self.device), steps)
            self._offsets[id(plan)] = entry
        return entry[1], entry[2]

    def run(self, flat: torch.Tensor, plan: BucketPlan, sketch_acc: torch.Tensor | None, sq_norms: torch.Tensor) -> None:
        """Write ``|g_j|^2`` of every segment into ``sq_norms``; add the sketch into ``sketch_acc``."""
        if flat.numel() != plan.numel:
            raise ValueError(f"bucket has {flat.numel()} elements but its plan expects {plan.numel}")
        if plan.bins != self.bins or sketch_acc is None:
            raise ValueError(f"the Triton kernel sketches into {self.bins} bins; got a plan of {plan.bins} and sketch_acc={sketch_acc is not None}")
        offsets, steps = self._prepared(plan)
        sq_norms.zero_()
        if not plan.numel:
            return
        tiles = -(-plan.numel // (self.rows * self.bins))
        _bucket_stats[(tiles,)](
            flat, self.signs.values, self.signs.row_table, offsets, sketch_acc, sq_norms, plan.numel, plan.base % self.signs.page,
            plan.base // self.bins % ROW_PERIOD, self.signs.page, ROW_PERIOD, self.bins, ROWS=self.rows, PB=self.block, SEARCH=steps,
        )  # fmt: skip

    def forget(self, plan: BucketPlan) -> None:
        """Drop the offsets of a plan that is no longer used (after a bucket rebuild)."""
        self._offsets.pop(id(plan), None)

    def persistent_bytes(self) -> int:
        """Bytes kept between calls: the sign tables and each plan's segment offsets."""
        return self.signs.nbytes() + sum(offsets.numel() * 8 for _, offsets, _ in self._offsets.values())


def check_device(device: torch.device) -> None:
    """Refuse a device the kernel cannot run on, naming the fix."""
    if device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return
    raise ValueError(
        f"stats_kernel='triton' runs on CUDA devices (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1, for tests); "
        f"the gradients are on {device}. Use stats_kernel='torch', the default, which runs everywhere"
    )
