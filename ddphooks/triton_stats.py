"""The statistics pass of one bucket as one Triton kernel: ``SilentConfig(stats_kernel="triton")``.

It computes what :class:`ddphooks.sketch.BucketStatsKernel` computes (the squared norm of every
parameter segment and the sketch with the same signs, ``sigma_x = T[x mod M] v[(x div p) mod R]``)
in one kernel launch per bucket under DDP, whatever the bucket's size and number of parameters
(``accumulate``): the zeroing of the norms and of the sketch copies, and the copies' sum into the
sketch, are done once a step for all buckets (``start_step``, ``finish_step``). ``run``, for one
bucket on its own (FSDP2's bands), zeroes and sums around its launch. The pass can also divide the
bucket by W (``divide_by``: the division ``allreduce_hook`` launches before its all-reduce,
saved), so under DDP a bucket costs no more launches than ``allreduce_hook`` alone. The table signs
``T`` are computed in the kernel from each element's position (``sketch.table_sign_hash``): the
pass reads the gradient's own bytes and a row sign per row of ``p`` elements, no table per element.

How the pass works:

1. the bucket is cut into tiles of ``ROWS`` rows of ``p`` elements (a ``ROWS x PB`` block, ``PB``
   the next power of two of ``p``, the columns past ``p`` masked); one program per tile. Tiles
   are small (``TILE_ELEMS``) so that many programs fit on each multiprocessor: a program is a
   chain of dependent memory reads (its gradient, the segment search) whose latency only other
   programs hide. (8 K-element tiles read 120-180 GB/s on an H200, 2026-12-04; that smaller ones
   do better is the hypothesis the next device run tests.)
2. each program reads its gradient elements once (any floating dtype, summed in fp32), multiplies
   them by their table signs (hashed from the position) and row signs, and adds its column sums into one of ``COPIES``
   copies of the sketch (``p`` atomic adds; copy ``program mod COPIES``, so that the thousands of
   programs of a large bucket do not queue on the same ``p`` addresses); one column sum of the
   copies then adds the bucket's sketch into the step's;
3. it finds the first parameter segment that overlaps the tile by a binary search over the
   segment offsets (``n_segments + 1`` integers per plan, nothing per element), and adds its sum
   of squares restricted to each overlapping segment into that segment's norm (one atomic add per
   segment; a tile overlaps one or two);
4. with ``DIVIDE`` it writes the quotient back in place, in the gradient's dtype, computed the way
   ``torch.div`` computes it on this device, so the average is bitwise what ``allreduce_hook``
   gives: on CUDA torch multiplies by the fp32 reciprocal of a scalar divisor (``a * (1 / W)``,
   one rounding more than a division), on the CPU it divides. Which one, and whether the kernel
   matches it bit for bit, is not assumed: ``divides_like_torch`` compares both with
   ``torch.div`` once per dtype and W on the device (Triton's interpreter rounds fp32 to bf16 by
   truncation, so there bf16 is not divided in the pass), and the hook divides with torch where
   the kernel does not match.

Offsets inside a tile are 32-bit (the tile's first element, a 64-bit number, is added to the
pointer once), so no per-element 64-bit arithmetic. Nothing is kept per element: per plan, the
segment offsets on the device; per kernel, the row signs of :class:`~ddphooks.sketch.SignTable`
and the sketch copies (``COPIES x PB`` fp32). The sums are taken in another order than the torch
path's, so the results agree to rounding (fp32), not bitwise.

Tested on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is
imported), where it matches the torch path to 1e-6 (``tests/test_triton_stats.py``); its speed on a
GPU is what ``benchmarks/device_check.py`` measures (``benchmarks/README.md``, "Device check").
triton is imported only when this kernel is chosen.
"""

from __future__ import annotations

import logging
import math
import os
import threading

import torch
import triton
import triton.language as tl

from ddphooks.sketch import ROW_PERIOD, BucketPlan, BucketStatsKernel, SignTable

logger = logging.getLogger("ddphooks")

#: Elements per tile (``ROWS`` rows of the next power of two >= ``p``): one program's block.
TILE_ELEMS = 2048
#: Copies of the sketch the programs add into (see step 2 of the module's docstring).
COPIES = 64


@triton.jit
def _bucket_stats(grad_ptr, key, rows_ptr, offsets_ptr, copies_ptr, sq_ptr, numel, table_start, row_start, page, period, p,
                  divisor, ROWS: tl.constexpr, PB: tl.constexpr, SEARCH: tl.constexpr, COPIES: tl.constexpr,
                  SKETCH: tl.constexpr, DIVIDE: tl.constexpr, RECIPROCAL: tl.constexpr):  # fmt: skip
    program = tl.program_id(0)
    first_row = program.to(tl.int64) * ROWS
    low = first_row * p  # the tile's first element: 64-bit, added to the pointers once
    size = tl.minimum(numel - low, ROWS * p).to(tl.int32)  # elements of the tile
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, PB)[None, :]
    local = rows * p + cols  # offset inside the tile (32-bit)
    inside = (cols < p) & (local < size)
    raw = tl.load(grad_ptr + low + local, mask=inside, other=0.0)
    g = raw.to(tl.float32)
    if DIVIDE:  # torch's quotient (see step 4): by the reciprocal, or a correctly rounded division
        quotient = g * divisor if RECIPROCAL else tl.div_rn(g, divisor)
        tl.store(grad_ptr + low + local, quotient.to(raw.dtype), mask=inside)
    if SKETCH:
        # The bucket's base enters as its table entry and row sign (base mod page, base row mod
        # period): small numbers. Each element's entry wraps at the page by itself (the mask).
        # T's sign from the table entry (position mod page): sketch.table_sign_hash, in uint32
        entry = ((table_start + low + local) & (page - 1)).to(tl.uint32)
        h = entry * 0x9E3779B9 + key.to(tl.uint32)  # WEYL
        h ^= h >> 16
        h *= 0x85EBCA6B  # MIX1
        h ^= h >> 13
        h *= 0xC2B2AE35  # MIX2
        table_sign = 1.0 - 2.0 * (h >> 31).to(tl.float32)
        row = ((row_start + first_row) % period).to(tl.int32) + rows
        row_sign = tl.load(rows_ptr + tl.where(row >= period, row - period, row))
        column = tl.arange(0, PB)
        copy = copies_ptr + (program % COPIES) * PB
        tl.atomic_add(copy + column, tl.sum(g * table_sign * row_sign, axis=0), mask=column < p)
    # The segments that overlap the tile: offsets[s] <= low < offsets[s + 1] for the first one.
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
    begin = tl.load(offsets_ptr + segment) - low  # <= 0
    while begin < size:
        end = tl.load(offsets_ptr + segment + 1) - low
        part = (local >= begin.to(tl.int32)) & (local < tl.minimum(end, size).to(tl.int32))
        tl.atomic_add(sq_ptr + segment, tl.sum(tl.where(part, square, 0.0)))
        segment += 1
        begin = end


class TritonBucketStats:
    """Per-parameter squared norms and the sketch of flat buckets, one Triton launch per bucket.

    The same interface as :class:`~ddphooks.sketch.BucketStatsKernel` (``run``, ``forget``,
    ``persistent_bytes``), so the hook and the FSDP2 transport use either; ``run`` can also divide
    the bucket by W in the same pass, and ``norms`` takes the squared norms alone.

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
        if TILE_ELEMS > signs.page:
            raise ValueError(f"tiles of {TILE_ELEMS} elements exceed the sign table's {signs.page} entries")
        self.bins = bins
        self.device = device
        self.signs = signs
        self.block = triton.next_power_of_2(bins)
        self.rows = max(1, TILE_ELEMS // self.block)
        self.copies = COPIES
        # (dtype, W): how the pass divides like torch.div, (by the reciprocal?, the number passed), or None
        self._division: dict[tuple[torch.dtype, int], tuple[bool, float] | None] = {}
        self._offsets: dict[int, tuple[BucketPlan, torch.Tensor, int]] = {}
        self._sketches: torch.Tensor | None = None  # COPIES x PB, made at the first run
        # The reduced norms are taken in communication callbacks, which gloo runs on its own
        # threads while the hook runs the next bucket: one launch at a time (Triton's interpreter
        # keeps the grid in globals, and a first launch compiles).
        self._launching = threading.Lock()

    def _prepared(self, plan: BucketPlan) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """The plan's segment offsets padded to a power of two (``2^k + 1`` entries, the padding at
        ``numel``), ``k``, the binary search's steps, and for a plan of several rows the norms of
        each parameter in each row (its segments here: the search costs ``log2(rows x
        parameters)`` steps, nothing per segment on the host), else None."""
        entry = self._offsets.get(id(plan))
        if entry is None or entry[0] is not plan:
            segments = plan.lengths * plan.rows
            steps = max(1, math.ceil(math.log2(len(segments) + 1)))
            bounds = [0]
            for length in segments:
                bounds.append(bounds[-1] + length)
            bounds += [plan.numel] * ((1 << steps) + 1 - len(bounds))
            row_norms = torch.empty(plan.rows, len(plan.lengths), dtype=torch.float32, device=self.device) if plan.rows > 1 else None
            entry = (plan, torch.tensor(bounds, dtype=torch.int64, device=self.device), steps, row_norms)
            self._offsets[id(plan)] = entry
        return entry[1], entry[2], entry[3]

    def takes_row_norms(self, plan: BucketPlan) -> bool:
        """Never: the launch sums each parameter over its rows itself (``BucketStatsKernel.takes_row_norms``)."""
        return False

    def run(
        self, flat: torch.Tensor, plan: BucketPlan, sketch_acc: torch.Tensor | None, sq_norms: torch.Tensor, divide_by: int | None = None,
        overwrite_sketch: bool = False,
    ) -> None:  # fmt: skip
        """Write ``|g_j|^2`` of every segment into ``sq_norms``; add the sketch into ``sketch_acc``
        (``overwrite_sketch``: write it over ``sketch_acc``); with ``divide_by`` (W), also divide
        ``flat`` by it in place, after reading it, as ``torch.div`` would (only where
        ``divides_like_torch(flat.dtype, W)`` said so)."""
        if plan.bins != self.bins or sketch_acc is None:
            raise ValueError(f"the Triton kernel sketches into {self.bins} bins; got a plan of {plan.bins} and sketch_acc={sketch_acc is not None}")
        division = self._division_of(flat.dtype, divide_by)
        if flat.dim() == 2 and division is None:  # a band of FSDP2's rows (BucketStatsKernel.run): the kernel reads one flat buffer
            flat = flat.reshape(-1)
        if self._sketches is None:
            self._sketches = torch.zeros(self.copies, self.block, dtype=torch.float32, device=self.device)
        else:
            self._sketches.zero_()
        self._launch(flat, plan, sq_norms, self._sketches, division)
        if overwrite_sketch:
            torch.sum(self._sketches[:, : self.bins], dim=0, out=sketch_acc)
        else:
            sketch_acc.add_(self._sketches[:, : self.bins].sum(dim=0))

    # -- a step of buckets (the DDP hook): one launch a bucket, the rest once a step ------------
    def start_step(self, sketch: torch.Tensor, norms: list[torch.Tensor]) -> None:
        """Before a step's first bucket: zero the sketch copies and the buckets' norms from the
        step before (``norms``; a bucket's first norms are allocated zero), in one multi-tensor
        operation: the pass only adds into them."""
        if self._sketches is None:
            self._sketches = torch.zeros(self.copies, self.block, dtype=torch.float32, device=self.device)
        torch._foreach_zero_([self._sketches, *norms])

    def accumulate(self, flat: torch.Tensor, plan: BucketPlan, sketch: torch.Tensor, norms: torch.Tensor, divide_by: int | None = None) -> None:
        """One bucket of the step in one launch: its squared norms added into ``norms`` (zeroed by
        ``start_step``), its sketch into the step's copies; with ``divide_by`` (W) the bucket
        divided in place as ``torch.div`` would (see ``run``)."""
        self._launch(flat, plan, norms, self._sketches, self._division_of(flat.dtype, divide_by), zeroed=True)

    def finish_step(self, sketch: torch.Tensor, norms: list[torch.Tensor]) -> tuple[list[torch.Tensor], None]:
        """After the step's last bucket: the step's sketch, the sum of the copies, into ``sketch``.
        Returns the squared norms (``norms``: squares already) and None (no norms without squares)."""
        torch.sum(self._sketches[:, : self.bins], dim=0, out=sketch)
        return norms, None

    def _division_of(self, dtype: torch.dtype, divide_by: int | None) -> tuple[bool, float] | None:
        """How the pass divides ``dtype`` by ``divide_by`` (None: it does not divide), refusing a
        division it was not found to do as ``torch.div`` does (``divides_like_torch``)."""
        if divide_by is None:
            return None
        division = self._division.get((dtype, divide_by))
        if division is None:
            raise ValueError(f"the Triton kernel does not divide {dtype} by {divide_by} as torch.div does here (divides_like_torch)")
        return division

    def divides_like_torch(self, dtype: torch.dtype, divide_by: int) -> bool:
        """Whether ``run(divide_by=W)`` leaves a bucket of ``dtype`` bitwise equal to
        ``torch.div(bucket, W)`` on this device (``allreduce_hook``'s division). Found once per
        dtype and W, on a probe of 65536 values over every exponent the dtype has, both signs, zeros
        and subnormals: torch's own quotient tells which formula it uses (see the module's step 4),
        and the kernel must then reproduce it on the probe bit for bit. One synchronisation, at the
        first bucket of that dtype."""
        key = (dtype, divide_by)
        if key not in self._division:
            try:
                self._division[key] = self._probe_division(dtype, divide_by)
            except Exception as error:  # never into the backward: the hook then divides with torch
                logger.warning("ddphooks: the Triton kernel's division probe failed (%r); torch divides %s buckets by %d instead", error, dtype, divide_by)
                self._division[key] = None
        return self._division[key] is not None

    def _probe_division(self, dtype: torch.dtype, divide_by: int) -> tuple[bool, float] | None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16) or divide_by < 1:
            return None
        generator = torch.Generator().manual_seed(divide_by)
        info = torch.finfo(dtype)
        exponents = torch.randint(int(math.log2(info.tiny)) - 8, int(math.log2(info.max)) - 3, (1 << 16,), generator=generator)
        probe = torch.randn(1 << 16, generator=generator).mul_(torch.pow(2.0, exponents.float())).to(dtype)
        probe[:4] = torch.tensor([0.0, -0.0, info.tiny, -info.max])
        probe = probe.to(self.device)
        expected = torch.div(probe, divide_by)
        opmath = probe.float()
        reciprocal = float(torch.tensor(1.0, dtype=torch.float32) / divide_by)  # torch's fp32 reciprocal of a scalar divisor
        candidates = {(True, reciprocal): opmath * reciprocal, (False, float(divide_by)): opmath / divide_by}
        plan = BucketPlan([probe.numel()], self.bins, 0, self.device, probe.numel())
        sq, sketches = torch.empty(1, device=self.device), torch.zeros(self.copies, self.block, device=self.device)
        for division, quotient in candidates.items():
            if not torch.equal(quotient.to(dtype), expected):
                continue  # not torch's formula here
            divided = probe.clone()
            self._launch(divided, plan, sq, sketches, division)
            if torch.equal(divided, expected):
                return division
        return None

    def _launch(
        self, flat: torch.Tensor, plan: BucketPlan, sq_norms: torch.Tensor, sketches: torch.Tensor | None, division: tuple[bool, float] | None, zeroed: bool = False
    ) -> None:
        """One pass: the norms into ``sq_norms`` (added to it where ``zeroed`` says it is zero
        already: a plan of one row), the sketch added into ``sketches`` (None: norms only), and
        with ``division`` (by the reciprocal?, the number) the quotient written back."""
        if flat.numel() != plan.numel:
            raise ValueError(f"bucket has {flat.numel()} elements but its plan expects {plan.numel}")
        offsets, steps, row_norms = self._prepared(plan)
        norms = sq_norms if row_norms is None else row_norms.view(-1)  # several rows: a norm per parameter and row
        if not zeroed or row_norms is not None:
            norms.zero_()
        if plan.numel:
            tiles = -(-plan.numel // (self.rows * self.bins))
            reciprocal, divisor = division or (False, 1.0)
            with self._launching:
                _bucket_stats[(tiles,)](
                    flat, self.signs.key, self.signs.row_table, offsets, norms if sketches is None else sketches, norms, plan.numel,
                    plan.base % self.signs.page, plan.base // self.bins % ROW_PERIOD, self.signs.page, ROW_PERIOD, self.bins, divisor,
                    ROWS=self.rows, PB=self.block, SEARCH=steps, COPIES=self.copies, SKETCH=sketches is not None, DIVIDE=division is not None,
                    RECIPROCAL=reciprocal,
                )  # fmt: skip
        if row_norms is not None:
            torch.sum(row_norms, dim=0, out=sq_norms)

    def agrees_with_torch(self) -> str | None:
        """Why this kernel cannot stand in for the torch path on this device, or None where it can.

        ``stats_kernel="auto"`` asks this once per device before it uses the kernel, so that a GPU
        where Triton cannot run (no C compiler for its launcher, an architecture it does not
        build for, a broken install) keeps the torch path instead of failing inside a backward:

        1. a probe bucket of 73,006 fp32 values in three parameters, on the device;
        2. both paths' squared norms and sketch of it (the torch path with a sign table of its own,
           the same signs, freed after: the kernel's own table never makes its int8 signs);
        3. None if every norm agrees to 1e-4 relative and the sketches to 1e-4 of their norm, else
           what differed, or the exception's repr.

        Costs the kernel's compilation and one synchronisation, at the first bucket."""
        try:
            lengths = [3000, 70_001, 5]
            flat = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(0)).to(self.device)
            plan = BucketPlan(lengths, self.bins, 0, self.device, sum(lengths))
            results = []
            probe_signs = SignTable(self.signs.seed, self.bins, self.device, self.signs.page, window=plan.chunk_elems)
            for kernel in (BucketStatsKernel(self.bins, self.device, probe_signs), self):
                sq, sketch = torch.empty(len(lengths), device=self.device), torch.zeros(self.bins, device=self.device)
                kernel.run(flat, plan, sketch, sq)
                results.append((sq.double().cpu(), sketch.double().cpu()))
            self.forget(plan)
        except Exception as error:
            return repr(error)
        (sq, sketch), (got_sq, got_sketch) = results
        norms_off = float(((got_sq - sq).abs() / sq).max())
        sketch_off = float((got_sketch - sketch).norm() / sketch.norm())
        if not (norms_off <= 1e-4 and sketch_off <= 1e-4):  # (NaN fails too)
            return f"on a probe bucket its norms differ from the torch path's by {norms_off:.1e} and its sketch by {sketch_off:.1e} (relative)"
        return None

    def forget(self, plan: BucketPlan) -> None:
        """Drop the offsets of a plan that is no longer used (after a bucket rebuild)."""
        self._offsets.pop(id(plan), None)

    def persistent_bytes(self) -> int:
        """Bytes kept between calls: the sign tables, the sketch copies and each plan's segment offsets."""
        copies = 0 if self._sketches is None else self._sketches.numel() * 4
        rows = sum(r.numel() * 4 for *_, r in self._offsets.values() if r is not None)
        return self.signs.nbytes() + copies + rows + sum(offsets.numel() * 8 for _, offsets, *_ in self._offsets.values())


def check_device(device: torch.device) -> None:
    """Refuse a device the kernel cannot run on, naming the fix."""
    if device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return
    raise ValueError(
        f"stats_kernel='triton' runs on CUDA devices (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1, for tests); "
        f"the gradients are on {device}. Use stats_kernel='torch', the default, which runs everywhere"
    )
