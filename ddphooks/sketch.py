"""Per-bucket local statistics: squared norms per parameter and a random-projection sketch.

This module is the numerical hot path of ddphooks and knows nothing of ``torch.distributed``:
it turns one flat gradient buffer into

* ``sq_norms[j] = |g_j|^2`` for every parameter segment ``j`` of the buffer, and
* a sketch ``s`` of ``bins`` numbers, added into an accumulator, such that for two gradients ``a``
  and ``b`` sketched with the same signs ``E[<s_a, s_b>] = <a, b>``.

The sketch is a CountSketch with deterministic bins:

1. element ``i`` of a bucket goes to bin ``i mod p``, where ``p`` is the largest prime not above
   ``sketch_dim``. A prime period spreads both contiguous runs and power-of-two strides (one
   column of a matrix) over all bins; contiguous blocks or ``i mod 2^m`` do not.
2. element ``i`` is multiplied by a random sign ``sigma_i`` in {-1, +1}. Independent signs make
   ``<s_a, s_b>`` unbiased: cross terms ``sigma_i sigma_j a_i b_j`` with ``i != j`` in one bin have
   mean zero. Signs that repeat (periodic, per row, hashed with weak mixing) add up coherently on
   a constant component and break the estimate. The signs are not stored per element: they come
   from one fixed table indexed by the element's position in the model (:class:`SignTable`), so
   the memory is the same at 135M and at 70B parameters.
3. ``s[c] = sum_{i mod p = c} sigma_i g_i``. Sketches of several buckets add up to the sketch of the
   whole model, because the projection is linear. Bins and signs follow the element's position
   in the model: buckets are laid out one after the other, each starting at a multiple of ``p``.

The cosine between two ranks is then estimated as ``<s_a, s_b> / (|s_a| |s_b|)``; normalising by
the sketched norms has a smaller error, about ``(1 - c^2) / sqrt(p)``, than dividing by the exact
norms.

The work is done in chunks of a few hundred KB so that every temporary lives in the CPU cache:
the gradient is read from memory once, and no bucket-sized temporary is allocated.
"""

from __future__ import annotations

import math
import numpy as np
import torch

#: Largest ``sketch_dim`` accepted: every rank sends ``sketch_dim`` floats per instrumented step
#: and the cosine error is already ~0.004 there.
MAX_SKETCH_DIM = 65536
#: Smallest nonzero ``sketch_dim``: below it the cosine error (~1/sqrt(sketch_dim)) exceeds 0.25.
MIN_SKETCH_DIM = 16
#: Elements per chunk on the CPU: the chunk and its fp32 product stay in a 2 MB L2 cache.
CPU_CHUNK_ELEMS = 1 << 17
#: A plan of rows with more segments (rows x parameters) than this takes its norms by column where a
#: chunk holds whole rows (``BucketPlan.by_column``). Measured on the 16 M tiny Llama's FSDP2 input
#: (``benchmarks/scale.py``, the pass in ms a step on this CPU, interleaved): one segment per
#: parameter and row 18 at 2 shards (rows wider than a chunk), 21-23 at 8 (72 segments a decoder
#: layer), 44 at 1024 with a second read for the columns (800 with one dot per segment); by column
#: 23, 20-22 and 26-29. On accelerators a decoder layer's group is 7 operations by segment at 8
#: shards and 10 by column (21 before at 1024 shards; ``launches`` of ``benchmarks/hook_cost.py``).
COLUMN_SEGMENTS = 256
#: Elements per chunk on accelerators, where each chunk costs kernel launches rather than cache:
#: 16 M, so that a bucket at DDP's default cap (25 MB) is one chunk in any dtype (13.1 M elements
#: of bf16 were two chunks at 8 M: 6 operations instead of 4). The fp32 scratch is sized by the
#: largest chunk used (52 MB for 25 MB bf16 buckets) and the table signs ``T`` held for it are
#: ``SIGN_PAGE`` + 16 M int8 (24 MB); the Triton kernel holds neither.
ACCELERATOR_CHUNK_ELEMS = 1 << 24
#: The largest ``chunk_elems`` (``SilentConfig.chunk_elems``).
MAX_CHUNK_ELEMS = ACCELERATOR_CHUNK_ELEMS


def largest_prime_at_most(n: int) -> int:
    """The largest prime ``p <= n`` (``n >= 2``)."""
    if n < 2:
        raise ValueError(f"there is no prime <= {n}")
    for candidate in range(n, 1, -1):
        if all(candidate % d for d in range(2, math.isqrt(candidate) + 1)):
            return candidate
    raise AssertionError("unreachable: 2 is prime")


def sketch_bins(sketch_dim: int) -> int:
    """Number of sketch entries actually used for a requested ``sketch_dim`` (0 means no sketch)."""
    return 0 if sketch_dim == 0 else largest_prime_at_most(sketch_dim)


#: Signs drawn per numpy call: 32 KB, so every temporary is served from the allocator's heap.
#: (glibc raises its mmap threshold to the size of any freed block it had mapped, up to 32 MB:
#: one 8 MB temporary freed would move every later allocation below 8 MB, the gradients of most
#: models among them, to the heap, where freed memory stays resident; see ``ddphooks.memory``.)
SIGN_DRAW_ELEMS = 1 << 15


def random_signs(numel: int, seed_words: tuple[int, ...], device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """``numel`` independent random signs (int8, -1 or +1), the same on every process for the same
    seed words; written into ``out`` (a CPU int8 tensor of ``numel`` entries) when it is given.

    numpy's PCG64 seeded through a ``SeedSequence`` is used because it is fast (about 5 ns per
    element) and portable; the global torch and numpy generators are never touched. The signs are
    drawn ``SIGN_DRAW_ELEMS`` at a time straight into the result: a draw of ``[0, 2)`` int8 uses one
    byte of the stream per element, so any chunking that is a multiple of 4 gives the same stream
    as one draw, and no table-sized temporary is allocated and freed.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed_words))))
    signs = torch.empty(numel, dtype=torch.int8) if out is None else out
    if signs.numel() != numel or signs.dtype != torch.int8 or signs.device.type != "cpu":
        raise ValueError(f"out must be a CPU int8 tensor of {numel} entries, got {signs.dtype} x {signs.numel()} on {signs.device}")
    bits = signs.numpy()
    for begin in range(0, numel, SIGN_DRAW_ELEMS):
        bits[begin : begin + SIGN_DRAW_ELEMS] = rng.integers(0, 2, size=min(SIGN_DRAW_ELEMS, numel - begin), dtype=np.int8)
    signs.mul_(2).sub_(1)
    return signs.to(device)


_TABLE_WORD, _ROW_WORD = 0x7AB1E, 0x8035  # seed words of the two tables, apart from other uses of the seed
#: The constants of ``table_sign_hash``: a Weyl step (2^32 / golden ratio) and murmur3's fmix32
#: multipliers.
WEYL, MIX1, MIX2 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35


def table_key(seed: int) -> int:
    """The 31-bit key of ``table_sign_hash`` for a projection seed (31 bits: a Triton kernel
    argument then stays a 32-bit integer)."""
    return int(np.random.SeedSequence([seed, _TABLE_WORD]).generate_state(1, np.uint32)[0]) & 0x7FFFFFFF


def table_sign_hash(entries: np.ndarray, key: int) -> np.ndarray:
    """Bit 31 of ``h(i)`` for table entries ``i`` (uint32), 0 or 1, where ``h`` is murmur3's
    finaliser of a Weyl sequence, all mod 2^32::

        h = i * WEYL + key;  h ^= h >> 16;  h *= MIX1;  h ^= h >> 13;  h *= MIX2

    The sign of entry ``i`` of the table ``T`` is ``1 - 2 * bit``. The Triton kernel computes the
    same bits from each element's position, so it reads no table (``ddphooks.triton_stats``)."""
    h = entries.astype(np.uint32) * np.uint32(WEYL) + np.uint32(key)
    h ^= h >> np.uint32(16)
    h *= np.uint32(MIX1)
    h ^= h >> np.uint32(13)
    h *= np.uint32(MIX2)
    return h >> np.uint32(31)


def hashed_signs(numel: int, key: int, out: torch.Tensor) -> torch.Tensor:
    """The signs ``T[0 .. numel)`` of ``table_sign_hash`` (int8, -1 or +1) into the CPU int8 ``out``,
    ``SIGN_DRAW_ELEMS`` at a time (no table-sized temporary, see ``SIGN_DRAW_ELEMS``)."""
    bits = out.numpy()
    for begin in range(0, numel, SIGN_DRAW_ELEMS):
        entries = np.arange(begin, min(begin + SIGN_DRAW_ELEMS, numel), dtype=np.uint32)
        bits[begin : begin + entries.size] = 1 - 2 * table_sign_hash(entries, key).astype(np.int8)
    return out


#: ``M``, entries of the sign table: 8 M int8 signs, and again the first ``window`` of them (the
#: longest run a chunk reads as one slice): 8.1 MB on the CPU, 24 MB on accelerators, whatever the
#: size of the model, on each device that sketches with torch operations (the Triton kernel
#: computes them and holds no table).
SIGN_PAGE = 1 << 23
#: ``R``, entries of the table of row signs (a prime: rows R apart are far from pages apart).
ROW_PERIOD = 65521


class SignTable:
    """Random signs for every position of the model, in fixed memory.

    Each gradient element has a position ``x`` in the model (``BucketPlan.base`` plus its offset
    in the bucket); it goes to bin ``x mod p`` of row ``x div p``, and its sign is::

        sigma_x = T[x mod M] * v[(x div p) mod R]

    with ``T`` a table of ``M = 2^23`` pseudo-random signs and ``v`` a table of ``R = 65521``
    random row signs. ``T[i]`` is a hash of ``i`` and the seed (``table_sign_hash``: the Triton
    kernel computes it from the position and reads no table), ``v`` is drawn from the seed and
    ``p`` (PCG64): every rank and every device (CPU, CUDA, NPU) gets the same signs. Why this
    sketches like independent signs:

    1. Unbiased: two positions ``x != y`` in one bin lie in different rows, ``m != 0`` rows
       apart. Their signs are independent unless they share both the table entry (``M | m p``,
       so ``M | m``: p is odd) and the row sign (``R | m``), i.e. unless they are ``M R p``
       (about 10^14) positions apart. So ``E[sigma_x sigma_y] = 0``.
    2. The same error: the error of ``<s_a, s_b>`` is a sum of products ``sigma_x sigma_y`` over
       pairs in one bin. A periodic table alone repeats those products page after page (a pair
       and its copy ``M`` positions on carry the same ``T`` entries), which doubles the error on
       a gradient that repeats with period ``M``, such as a constant; the row signs of a pair and
       of its copy are four different entries of ``v``, so the copies are uncorrelated again.
       Measured against independent signs in ``tests/test_sketch.py`` and
       ``benchmarks/sign_accuracy.py``.

    In the kernel, ``T`` multiplies the gradient element by element (the int8 table holds ``T``
    and then its first ``window`` entries again, so any run of up to ``window`` positions is one
    slice) and ``v`` weights the rows when they are summed into bins (``s = v_rows^T G``, a
    matrix-vector product that costs what the plain row sum did). The int8 table is made at its
    first use: the Triton kernel computes ``T`` and never asks for it.

    Args:
        seed: the projection's seed (``SilentConfig.seed``), identical on every rank.
        bins: ``p``, the sketch's bins (a prime; rows are ``p`` positions long).
        device: where the tables live (the device of the buckets they sign).
        page: ``M``, entries of ``T`` (smaller only in tests).
        window: the longest run of positions ``values`` gives as one slice (the kernel's chunk;
            None: ``page``), at most ``page * 2``.
    """

    def __init__(self, seed: int, bins: int, device: torch.device, page: int = SIGN_PAGE, window: int | None = None) -> None:
        if page < 2 or page & (page - 1):
            raise ValueError(f"page={page} must be a power of two >= 2")
        if bins < 2:
            raise ValueError(f"bins={bins} must be a prime >= 2")
        window = page if window is None else window
        if not 1 <= window <= 2 * page:
            raise ValueError(f"window={window} must be between 1 and twice the page ({2 * page})")
        self.seed = seed
        self.bins = bins
        self.page = page
        self.window = window
        self.device = torch.device(device)
        self.key = table_key(seed)
        self._values: torch.Tensor | None = None
        self.row_table = random_signs(ROW_PERIOD, (seed, _ROW_WORD, bins), torch.device("cpu")).float().to(self.device)
        self._row_tiles = self.row_table  # v repeated, so that any run of rows is one slice

    @property
    def values(self) -> torch.Tensor:
        """``T[0 .. M)`` then ``T[0 .. window)`` (int8), so that ``values[x mod M : x mod M + n]``
        is ``T`` of positions ``x .. x + n - 1`` for any ``n <= window``; made at the first call."""
        if self._values is None:
            values = torch.empty(self.page + self.window, dtype=torch.int8)
            hashed_signs(self.page, self.key, values[: self.page])
            for begin in range(self.page, self.page + self.window, self.page):  # T again, up to the window
                count = min(self.page, self.page + self.window - begin)
                values[begin : begin + count].copy_(values[:count])
            self._values = values.to(self.device)
        return self._values

    def row_signs(self, first_row: int, count: int) -> torch.Tensor:
        """``v`` of rows ``first_row, ..., first_row + count - 1``, one fp32 view."""
        start = first_row % ROW_PERIOD
        if start + count > self._row_tiles.numel():
            repeats = -(-(ROW_PERIOD + count) // ROW_PERIOD)
            self._row_tiles = self.row_table.repeat(repeats)
        return self._row_tiles[start : start + count]

    def signs(self, begin: int, end: int) -> torch.Tensor:
        """``sigma`` of positions ``[begin, end)`` as one int8 tensor (for tests and references)."""
        positions = torch.arange(begin, end, device=self.device)
        table = self.values[positions % self.page]
        return table * self.row_table[(positions // self.bins) % ROW_PERIOD].to(torch.int8)

    def nbytes(self) -> int:
        """Bytes the tables keep on their device (the int8 table once it is made)."""
        table = 0 if self._values is None else self._values.numel()
        return table + self._row_tiles.numel() * 4


class BucketPlan:
    """How one bucket layout is cut into chunks, and where it lies in the model.

    A plan is built once per bucket layout (DDP rebuilds its buckets once, after the first
    iteration) and reused on every step. It keeps nothing per element: the signs come from the
    kernel's :class:`SignTable` at positions ``base, base + 1, ...``, and the chunks are kept as
    a few integers each in numpy arrays (chunk ``c`` covers ``[c * chunk_elems, ...)``).

    A plan of ``rows`` rows is FSDP2's reduce-scatter input: ``rows`` rows of ``sum(lengths)``
    elements, each holding every parameter's part (one shard) in the same columns. Parameter
    ``j``'s squared norm sums its segment in every row, or, above ``COLUMN_SEGMENTS`` segments
    in rows that a chunk holds whole, its columns (``by_column``: no segments, however many rows).

    Args:
        lengths: number of elements of each parameter, in bucket order (segments are contiguous);
            with ``rows``, of each parameter in one row.
        bins: sketch entries ``p`` (a prime), or 0 for norms only.
        base: position of the bucket's first element in the model, a multiple of ``bins``
            (identical on every rank: the buckets laid out one after the other).
        device: where the bucket lives.
        chunk_elems: elements per chunk (rounded to a multiple of ``bins``).
        rows: how many times the layout ``lengths`` repeats (1: a DDP or DeepSpeed bucket).
    """

    def __init__(self, lengths: list[int], bins: int, base: int, device: torch.device, chunk_elems: int, rows: int = 1) -> None:
        if base < 0 or (bins and base % bins):
            raise ValueError(f"base={base} must be a non-negative multiple of bins={bins}")
        if rows < 1:
            raise ValueError(f"rows={rows} must be at least 1")
        self.lengths = list(lengths)
        self.rows = rows
        self.row_width = sum(self.lengths)
        self.numel = rows * self.row_width
        self.device = torch.device(device)
        self.bins = bins
        self.base = base
        if bins:
            # A chunk holds whole rows of `bins` elements, so every chunk starts at bin 0.
            chunk_elems = max(bins, chunk_elems // bins * bins)
        self.chunk_elems = min(chunk_elems, max(self.numel, 1))
        self.n_chunks = -(-self.numel // self.chunk_elems)
        # The segments (the part of one parameter in one chunk), chunk by chunk: chunk c holds
        # segments segment_start[c] .. segment_start[c + 1] - 1, at [segment_begin, segment_end)
        # inside the chunk. A parameter of many chunks adds one segment per chunk.
        # Many segments in rows that a chunk holds whole: the norms by column (no segments; the
        # columns' scratch is no larger than a chunk). A chunk of wider rows holds at most two
        # segments of each parameter.
        self.by_column = rows > 1 and rows * len(self.lengths) > COLUMN_SEGMENTS and self.row_width <= self.chunk_elems
        owner, begin, end, per_chunk = [], [], [], np.zeros(self.n_chunks + 1, dtype=np.int64)
        offset = 0
        for j, length in [] if self.by_column else [(j, length) for _ in range(rows) for j, length in enumerate(self.lengths)]:
            for chunk in range(offset // self.chunk_elems, -(-(offset + length) // self.chunk_elems)):
                first = chunk * self.chunk_elems
                owner.append(j)
                begin.append(max(offset, first) - first)
                end.append(min(offset + length, first + self.chunk_elems) - first)
                per_chunk[chunk + 1] += 1
            offset += length
        self.segment_start = np.cumsum(per_chunk)
        self.segment_begin = np.array(begin, dtype=np.int64)
        self.segment_end = np.array(end, dtype=np.int64)
        self.n_segments = len(owner)
        self.segment_owner = torch.tensor(owner, dtype=torch.long, device=device)
        # By column: each column's parameter, so that the parameters' norms are one index_add over
        # the columns (one sum per parameter, 333 a step, were 2 ms of the pass at 4096 shards on the CPU).
        self.column_owner = None  # int32: 4 B a column (index_add_ takes it)
        if self.by_column:
            self.column_owner = torch.arange(len(self.lengths), dtype=torch.int32).repeat_interleave(torch.tensor(self.lengths)).to(device)

    @property
    def end(self) -> int:
        """The first position after this bucket where the next one may start (a multiple of ``bins``)."""
        step = self.bins or 1
        return -(-(self.base + self.numel) // step) * step

    def persistent_bytes(self) -> int:
        """Bytes this plan keeps alive between steps (its segment arrays)."""
        arrays = (self.segment_start, self.segment_begin, self.segment_end)
        columns = 4 * self.column_owner.numel() if self.column_owner is not None else 0
        return self.segment_owner.numel() * 8 + columns + sum(a.nbytes for a in arrays)


class BucketStatsKernel:
    """Per-parameter squared norms and the sketch of flat buckets, in one chunked pass.

    Per chunk (512 KB of fp32 on the CPU, so the work stays in the L2 cache):

    1. copy the chunk's table signs ``T`` (one slice of the int8 sign table) into an fp32 scratch
       buffer and multiply it in place by the gradient chunk (the only read from memory);
       half-precision gradients are promoted to fp32 by the multiply itself;
    2. add the product's rows, weighted by their row signs ``v``, into the sketch: one
       matrix-vector product ``s += rows^T v``;
    3. take the squared norm of each parameter segment from the product (``sigma^2 = 1``, so
       ``|sigma g|^2 = |g|^2``).

    Without a sketch (``bins == 0``) the kernel only takes one squared norm per parameter
    (``squared_norms``).

    A plan of many narrow rows (FSDP2's reduce-scatter input at many shards, ``by_column``) takes
    its norms by column instead of step 3, still from the chunk in cache: the squares are added
    into one fp32 vector of a row's width (the rows the chunk holds whole in one matrix-vector
    product, the partial rows at its ends as slices), and each parameter's norm is the sum of its
    columns. The operations per chunk do not depend on the number of rows or parameters. (A second
    read of the rows for their columns cost 20 of 44 ms a step for the 16 M tiny Llama at 1024
    shards on this CPU; one dot per parameter and row, 800.)

    The scratch is shared by all buckets: DDP calls the hook for one bucket after the other on
    one thread, so it is never used concurrently. A plan keeps a few integers per chunk, and the
    views into the scratch are shared by all its chunks, so its memory stays small at any size.

    On accelerators, where each op costs a kernel launch rather than bytes, a chunk is up to 16 M
    elements (a bucket at DDP's default 25 MB cap is one chunk in any dtype). A bucket of one
    chunk (every bucket there up to 16 M elements, and buckets of up to 512 KB on the CPU) takes
    three operations, four with several parameters,
    whatever its size and dtype: the table signs multiply the gradient (``int8 * float``, one
    operation), one matrix-vector product sums the rows into the bins (the last, partial row
    padded with zeros in the scratch, so it needs no operation of its own), and one norm, or one
    fused multi-tensor norm (``torch._foreach_norm``, the kernel ``clip_grad_norm_`` uses) and its
    stack, takes the parameters' norms. The DDP hook leaves them unsquared and squares the norms
    of all its buckets in one operation a step (``start_step``, ``accumulate``, ``finish_step``).
    (``torch.segment_reduce`` would be one launch too, but its kernels sum each segment
    sequentially, slow on a GPU and less accurate in fp32.)

    Args:
        bins: sketch entries ``p`` of every plan this kernel runs (0 for norms only).
        device: where the buckets live.
        signs: the sign table of ``bins`` bins on ``device`` (required when ``bins > 0``).
        fused: use the fused multi-tensor norm (None: on every device but the CPU).
    """

    def __init__(self, bins: int, device: torch.device, signs: SignTable | None = None, fused: bool | None = None) -> None:
        if bins and (signs is None or signs.bins != bins):
            raise ValueError(f"a kernel with a sketch of {bins} bins needs a SignTable of {bins} bins")
        self.bins = bins
        self.device = torch.device(device)
        self.signs = signs
        self.fused = self.device.type != "cpu" if fused is None else fused
        self._scratch_elems = 0
        self._partials: torch.Tensor | None = None
        self._columns = torch.empty(0, dtype=torch.float32, device=self.device)  # squares by column (by_column plans)
        self._ones = torch.empty(0, dtype=torch.float32, device=self.device)  # weights of the rows a chunk holds whole
        self._prepared: dict[int, tuple] = {}
        self._one_chunk: dict[int, tuple] = {}  # plans of one chunk and one row: (plan, their views and signs)
        self._sketch_to_overwrite: torch.Tensor | None = None  # the step's sketch, before its first bucket (start_step)

    def _allocate(self, plans: list[BucketPlan]) -> None:
        """Size the scratch for the largest plan and prepare the views of every live plan.

        The scratch only grows, and on the CPU it starts at a full default chunk: a bucket
        rebuild or a new plan reuses it rather than freeing one buffer for another (a freed
        block of the host allocator moves later allocations of its size to the heap, see
        ``ddphooks.memory``). ``plans[-1]`` is the plan being added: the others keep their
        prepared views unless the scratch or the row-sign tiles had to grow (one preparation per
        new plan, not one of every plan: DeepSpeed adds its per-parameter plans one by one)."""
        f32 = dict(dtype=torch.float32, device=self.device)
        # On the CPU a full chunk (CPU_CHUNK_ELEMS rounded down to whole rows) fills the scratch
        # exactly: written at the scratch's start, aligned for vector loads (see _prepare).
        floor = (CPU_CHUNK_ELEMS // self.bins * self.bins if self.bins else CPU_CHUNK_ELEMS) if self.device.type == "cpu" else 0
        needed = max(floor, *(plan.chunk_elems for plan in plans))
        grew = False
        if needed > self._scratch_elems:
            self._scratch_elems = needed
            # sign * gradient, one chunk, written to end at `needed`; the `bins` zeros after it are
            # never written, so a chunk that ends inside a row is the rows of a padded matrix (see _prepare)
            self._product = torch.zeros(needed + self.bins, **f32)
            grew = True
        segments = max(plan.n_segments for plan in plans)
        if self._partials is None or segments > self._partials.numel():
            self._partials = torch.empty(segments, **f32)
            grew = True
        row_plans = [plan for plan in plans if plan.by_column]
        width = max((plan.row_width for plan in row_plans), default=0)  # no more than a chunk
        if width > self._columns.numel():
            self._columns = torch.empty(width, **f32)
            grew = True
        whole_rows = max((plan.chunk_elems // max(plan.row_width, 1) for plan in row_plans), default=0)
        if whole_rows > self._ones.numel():
            self._ones = torch.ones(whole_rows, **f32)
            grew = True
        if self.signs is not None:
            tiles = self.signs._row_tiles
            self.signs.row_signs(ROW_PERIOD - 1, -(-needed // self.bins))  # tiles the row signs for any chunk, once
            grew = grew or self.signs._row_tiles is not tiles
        self._one_chunk.clear()  # views of the scratch and tables: made again by run() where they moved
        if grew or len(plans) == 1:
            self._prepared = {id(plan): (plan, *self._prepare(plan)) for plan in plans}
        else:
            self._prepared[id(plans[-1])] = (plans[-1], *self._prepare(plans[-1]))

    def _prepare(self, plan: BucketPlan) -> tuple:
        """What a plan's run needs beyond its arrays, all views of the kernel's scratch and tables
        made once (none of them per element): for a full and for the last chunk, the scratch's
        view where its product is written and the ``p x rows`` view of that product's rows; whether
        norms can go straight to the output (one chunk, segment j is parameter j); and for a plan
        of one chunk, its table signs and row signs (None for more chunks, whose signs are sliced
        per chunk: a plan keeps nothing per chunk).

        A chunk is written so that it ends where the scratch's zeros begin: a chunk that ends in
        the middle of a row (the bucket's last, partial row) is then the first rows of a matrix
        whose last row is padded with zeros, and the partial row takes its row sign in the same
        matrix-vector product as the others (no operation of its own)."""
        views = {}
        last_length = plan.numel - (plan.n_chunks - 1) * plan.chunk_elems
        end = self._scratch_elems
        if self.signs is None:  # a plan of rows without a sketch: the product is the gradient in fp32
            return {length: (self._product[end - length : end], None) for length in {plan.chunk_elems, last_length}}, False, None, {}
        if plan.chunk_elems > self.signs.window:
            raise ValueError(f"chunks of {plan.chunk_elems} elements exceed the sign table's window of {self.signs.window}; use chunk_elems <= {self.signs.window}")
        for length in {plan.chunk_elems, last_length}:
            padded = -(-length // self.bins) * self.bins
            views[length] = (self._product[end - length : end], self._product[end - length : end - length + padded].view(-1, self.bins).t())
        self.signs.row_signs(ROW_PERIOD - 1, -(-plan.chunk_elems // self.bins))  # tiles the row signs for any chunk, once
        direct = plan.rows == 1 and plan.n_chunks == 1 and plan.n_segments == len(plan.lengths)  # segment j is parameter j
        one_chunk = None
        if plan.n_chunks == 1:
            start = plan.base % self.signs.page
            one_chunk = (self.signs.values[start : start + plan.numel], self.signs.row_signs(plan.base // self.bins, views[plan.numel][1].shape[1]))
        # The segment views of the chunks that hold more than one segment (or part of one), made at
        # their first run: a bucket of many small parameters slices and views once, not every step.
        return views, direct, one_chunk, {}

    def _column_parts(self, plan: BucketPlan, product: torch.Tensor, begin: int, end: int) -> tuple[list, tuple | None]:
        """How chunk ``[begin, end)`` of a row plan adds its squares into the columns: the
        (columns, squares) slices of the partial rows at its ends, and the (rows^T, ones) of the
        rows it holds whole, or None. Views of the kernel's scratch, made at the chunk's first run."""
        width, length = plan.row_width, end - begin
        first = begin % width
        head = min((width - first) % width, length)  # the end of a row begun in the previous chunk
        whole = (length - head) // width
        rest = length - head - whole * width  # the start of a row that goes on in the next chunk
        adds = []
        if head:
            adds.append((self._columns[first : first + head], product[:head]))
        if rest:
            adds.append((self._columns[:rest], product[length - rest : length]))
        rows = (product[head : head + whole * width].view(whole, width).t(), self._ones[:whole]) if whole else None
        return adds, rows

    def persistent_bytes(self) -> int:
        """Bytes kept between calls: the scratch and the sign tables (fixed, whatever the model)."""
        table = self.signs.nbytes() if self.signs is not None else 0
        if not self._scratch_elems:
            return table
        return table + 4 * (self._scratch_elems + self.bins + self._partials.numel() + self._columns.numel() + self._ones.numel())

    def forget(self, plan: BucketPlan) -> None:
        """Drop the prepared views of a plan that is no longer used (after a bucket rebuild)."""
        self._prepared.pop(id(plan), None)
        self._one_chunk.pop(id(plan), None)

    # -- a step of buckets (the DDP hook): the work that is the same for every bucket, once a step --
    def start_step(self, sketch: torch.Tensor | None, norms: list[torch.Tensor]) -> None:
        """Before a step's first bucket: its ``accumulate`` writes the step's sketch over the one
        before instead of adding into it (no zeroing: one operation a step fewer); ``norms``, the
        buckets' outputs, are overwritten by ``accumulate``."""
        self._sketch_to_overwrite = sketch

    def accumulate(self, flat: torch.Tensor, plan: BucketPlan, sketch: torch.Tensor | None, norms: torch.Tensor, divide_by: int | None = None) -> None:
        """One bucket of the step: its sketch added into ``sketch``, its parameters' norms
        (unsquared until ``finish_step``) written into ``norms``. ``divide_by`` is refused: torch
        divides the bucket (``divides_like_torch`` is the Triton kernel's)."""
        if divide_by is not None:
            raise ValueError("the torch path does not divide buckets in its pass; allreduce_hook divides them")
        overwrite = sketch is not None and sketch is self._sketch_to_overwrite
        self._sketch_to_overwrite = None
        one_chunk = self._one_chunk.get(id(plan))
        if one_chunk is not None and one_chunk[0] is plan and sketch is not None and flat.dim() == 1 and flat.numel() == plan.numel:
            # run()'s one-chunk path, its checks and lookups skipped (on a GPU host every us of Python counts)
            self._pass_one_chunk(one_chunk, flat, sketch, norms, squared=False, overwrite_sketch=overwrite)
            return
        if overwrite and plan.numel == 0:  # no chunk to write it
            sketch.zero_()
        self.run(flat, plan, sketch, norms, squared=False, overwrite_sketch=overwrite)

    @staticmethod
    def _pass_one_chunk(one_chunk: tuple, flat: torch.Tensor, sketch: torch.Tensor, norms: torch.Tensor, squared: bool, overwrite_sketch: bool = False) -> None:
        """A bucket of one chunk, its views made once (``_one_chunk``): three operations, four with
        several parameters, one more to square several parameters' norms."""
        _, product, rows_t, signs, row_signs, segments = one_chunk
        torch.mul(signs, flat, out=product)  # sign * gradient, promoted to fp32
        _into_bins(sketch, rows_t, row_signs, overwrite_sketch)
        if segments is None and squared:  # one parameter: its squared norm is one dot
            torch.dot(product, product, out=norms[0])
        elif segments is None:  # its norm, written as a 1-element tensor (no view to make)
            torch.linalg.vector_norm(product, dim=0, keepdim=True, out=norms)
        else:
            torch.stack(torch._foreach_norm(segments, 2), out=norms)
            if squared:
                norms.square_()

    def finish_step(self, sketch: torch.Tensor | None, norms: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """After the step's last bucket: every bucket's norms squared at once, into new tensors
        (one multi-tensor operation a step instead of one a bucket). Returns the squares and the
        norms themselves, which the compact wire sends too (``fleet.pack``: no square roots)."""
        return (torch._foreach_mul(norms, norms) if norms else [], norms)

    def takes_row_norms(self, plan: BucketPlan) -> bool:
        """Whether ``run`` can leave ``plan``'s norms by row (its ``row_norms``): a sketched plan
        of several rows and several parameters in one chunk, its norms by segment."""
        return self.bins > 0 and plan.rows > 1 and plan.n_chunks == 1 and not plan.by_column and len(plan.lengths) > 1

    def run(
        self, flat: torch.Tensor, plan: BucketPlan, sketch_acc: torch.Tensor | None, sq_norms: torch.Tensor, squared: bool = True,
        row_norms: torch.Tensor | None = None, overwrite_sketch: bool = False,
    ) -> None:  # fmt: skip
        """Write ``|g_j|^2`` of every parameter into ``sq_norms``; add the sketch into ``sketch_acc``.

        Args:
            flat: the bucket's flat gradient (any floating dtype; statistics are computed in fp32),
                or, for a plan of rows, a ``(rows, row_width)`` view with a row stride (one band
                of FSDP2's reduce-scatter input: the columns of the parameters that hold gradient
                in those rows), of one chunk if it has more than one row.
            plan: the bucket's plan (its layout must match ``flat``).
            sketch_acc: fp32 tensor of ``plan.bins`` entries to add the sketch into, or None for
                norms only.
            sq_norms: fp32 tensor of ``len(plan.lengths)`` entries, overwritten.
            squared: False writes the norms ``|g_j|`` instead, for a caller that squares the norms
                of all its buckets at once (the DDP hook: one operation a step, not one a bucket).
            row_norms: for a plan that ``takes_row_norms``, fp32 of ``len(lengths) * rows``
                entries: the norm of each parameter's part of each row, parameter by parameter
                (``|g_j|^2`` is the squared norm of its ``rows`` entries), written instead of
                ``sq_norms``, for a caller that takes those sums with other norms of its step (FSDP2:
                one operation a step, not one a reduce-scatter).
            overwrite_sketch: write the sketch over ``sketch_acc`` instead of adding into it (the
                step's first bucket: no zeroing of the sketch before it).
        """
        if row_norms is not None and not self.takes_row_norms(plan):
            raise ValueError(f"a plan of {plan.rows} rows, {len(plan.lengths)} parameters and {plan.n_chunks} chunks has no norms by row")
        if flat.numel() != plan.numel:
            raise ValueError(f"bucket has {flat.numel()} elements but its plan expects {plan.numel}")
        if flat.dim() == 2:  # a band of rows: one row is contiguous, several are one chunk read through the stride
            if tuple(flat.shape) != (plan.rows, plan.row_width) or flat.stride(1) != 1 or (plan.rows > 1 and plan.n_chunks > 1):
                raise ValueError(
                    f"a {tuple(flat.shape)} band with strides {flat.stride()} does not fit its plan of {plan.rows} rows of "
                    f"{plan.row_width} in {plan.n_chunks} chunks: a band of several rows must be one chunk, its columns contiguous"
                )  # fmt: skip
            flat = flat[0] if plan.rows == 1 else flat
        elif plan.rows > 1 and plan.n_chunks == 1:  # rows of one chunk, given flat: the same operations as a band
            flat = flat.view(plan.rows, plan.row_width)
        band = flat.shape if flat.dim() == 2 else None  # the chunk's product and signs are viewed in its shape
        if plan.bins != self.bins:
            raise ValueError(f"plan has {plan.bins} bins but this kernel sketches into {self.bins}")
        sketching = sketch_acc is not None and self.bins > 0
        by_column = plan.by_column
        if not sketching and plan.rows == 1:
            # norms only: one reduction per parameter, or one segmented reduction on accelerators
            squared_norms(flat, plan.lengths, sq_norms, fused=self.fused, squared=squared)
            return
        entry = self._prepared.get(id(plan))
        if entry is None or entry[0] is not plan:
            self._allocate([p for p, *_ in self._prepared.values()] + [plan])
            entry = self._prepared[id(plan)]
        _, views, direct, one_chunk, chunk_parts = entry
        if one_chunk is not None and direct and sketching and band is None:
            # A bucket of one chunk (every bucket on accelerators, small ones on the CPU): three
            # operations, or four with several parameters, whatever its size and dtype.
            product, rows_t = views[plan.numel]
            signs, row_signs = one_chunk
            segments = None if len(plan.lengths) == 1 else product.split(plan.lengths)
            cached = self._one_chunk[id(plan)] = (plan, product, rows_t, signs, row_signs, segments)
            self._pass_one_chunk(cached, flat, sketch_acc, sq_norms, squared, overwrite_sketch)
            return
        if one_chunk is not None and band is not None and sketching and not by_column:
            # A band of FSDP2's rows in one chunk: the same, read through the row stride. One
            # parameter: its squared norm is one dot of the product. Several: the norms of their
            # segments, parameter by parameter (each parameter's rows side by side), then each
            # parameter's sum of its rows' squares is one batched dot, |n_j|^2 = n_j^T n_j: five
            # operations whatever the number of rows and parameters, four with `row_norms`.
            product, rows_t = views[plan.numel]
            signs, row_signs = one_chunk
            torch.mul(signs.view(band), flat, out=product.view(band))
            _into_bins(sketch_acc, rows_t, row_signs, overwrite_sketch)
            params = len(plan.lengths)
            if params == 1:
                torch.dot(product, product, out=sq_norms[0])
            else:
                parts = chunk_parts.get(0)
                if parts is None:
                    segments = product.split(plan.lengths * plan.rows)  # row by row
                    parts = chunk_parts[0] = [segments[r * params + j] for j in range(params) for r in range(plan.rows)]
                if row_norms is not None:
                    torch.stack(torch._foreach_norm(parts, 2), out=row_norms)
                    return
                norms = self._partials[: plan.n_segments]
                torch.stack(torch._foreach_norm(parts, 2), out=norms)
                torch.bmm(norms.view(params, 1, plan.rows), norms.view(params, plan.rows, 1), out=sq_norms.view(params, 1, 1))
            if not squared:
                sq_norms.sqrt_()
            return
        bins, chunk_elems = self.bins, plan.chunk_elems
        # On accelerators a bucket of several chunks takes its norms from the gradient itself, in one
        # multi-tensor norm (fewer operations, and a bf16 gradient's 2 bytes an element, not 4)
        norms_from_gradient = self.fused and plan.rows == 1 and sketching
        if norms_from_gradient:
            _segment_norms(flat, plan.lengths, sq_norms, squared)
        starts, seg_begin, seg_end = plan.segment_start.tolist(), plan.segment_begin.tolist(), plan.segment_end.tolist()
        norms = sq_norms if direct else self._partials  # one chunk: segment k is parameter k
        if by_column:
            columns = self._columns[: plan.row_width]
            columns.zero_()
        for c in range(plan.n_chunks):
            begin = c * chunk_elems
            end = min(begin + chunk_elems, plan.numel)
            product, rows_t = views[end - begin]
            chunk = flat[begin:end] if one_chunk is None else flat
            into = product if band is None else product.view(band)  # where the chunk is written, in its shape
            if sketching:
                if one_chunk is None:
                    position = plan.base + begin
                    signs = self.signs.values[position % self.signs.page : position % self.signs.page + end - begin]
                    row_signs = self.signs.row_signs(position // bins, rows_t.shape[1])
                else:
                    signs, row_signs = one_chunk
                if self.fused:  # one launch: sign * gradient, promoted to fp32
                    torch.mul(signs if band is None else signs.view(band), chunk, out=into)
                else:  # measured faster on the CPU than the mixed-dtype multiply
                    product.copy_(signs)
                    into.mul_(chunk)
                # rows weighted by their signs, summed into bins: s += rows^T v (a partial last row
                # is padded with zeros, see _prepare); the first chunk writes over it where asked
                _into_bins(sketch_acc, rows_t, row_signs, overwrite_sketch and c == 0)
            else:
                into.copy_(chunk)  # a plan of rows without a sketch: the chunk in fp32
            if by_column:
                parts = chunk_parts.get(c)
                if parts is None:
                    parts = chunk_parts[c] = self._column_parts(plan, product, begin, end)
                adds, whole_rows = parts
                if whole_rows is None:  # parts of one or two rows: each squared into its columns
                    for target, part in adds:
                        target.addcmul_(part, part)
                    continue
                product.mul_(product)  # squares, in place: the sketch has read the product
                for target, squares in adds:
                    target.add_(squares)
                columns.addmv_(*whole_rows)  # the whole rows summed into the columns
                continue
            if norms_from_gradient:
                continue
            first, last = starts[c], starts[c + 1]
            whole = last - first == 1 and seg_end[first] - seg_begin[first] == end - begin
            if whole:
                parts = [product]
            else:
                parts = chunk_parts.get(c)
                if parts is None:
                    parts = chunk_parts[c] = [product[seg_begin[k] : seg_end[k]] for k in range(first, last)]
            if whole:
                torch.dot(product, product, out=norms[first])
            else:  # all of the chunk's segments in one multi-tensor norm, whatever their number
                torch.stack(torch._foreach_norm(parts, 2), out=norms[first:last]).square_()
        if by_column and self.fused:  # a parameter's norm, the sum of its (nonnegative) columns, is the squared
            # norm of their square roots: one multi-tensor kernel whatever the number of parameters
            torch.stack(torch._foreach_norm(columns.sqrt().split(plan.lengths), 2), out=sq_norms).square_()
        elif by_column:  # a parameter's norm: the sum of its columns
            sq_norms.zero_().index_add_(0, plan.column_owner, columns)
        elif norms_from_gradient:
            return  # taken before the chunks, squared or not
        elif not direct:  # a parameter split over chunks sums its segments
            sq_norms.zero_().index_add_(0, plan.segment_owner, self._partials[: plan.n_segments])
        if not squared:
            sq_norms.sqrt_()


def _segment_norms(flat: torch.Tensor, lengths: list[int], out: torch.Tensor, squared: bool) -> None:
    """``out[j] = |segment_j|`` (``squared``: ``|segment_j|^2``) of a flat buffer cut into
    ``lengths``, summed in fp32 (fp64 stays fp64): one operation for one segment, else one
    multi-tensor norm (the kernel ``clip_grad_norm_`` uses) and its stack, whatever the number
    of segments; squaring the norms adds one."""
    accumulate = None if flat.dtype in (torch.float32, torch.float64) else torch.float32
    if len(lengths) == 1 and squared and accumulate is None and out.dtype == flat.dtype:
        torch.dot(flat, flat, out=out[0])
        return
    if len(lengths) == 1 and (accumulate or flat.dtype) == out.dtype:
        torch.linalg.vector_norm(flat, dtype=accumulate, out=out[0])
    else:
        norms = torch._foreach_norm(flat.split(lengths), 2, dtype=accumulate)
        if out.dtype == (accumulate or flat.dtype):
            torch.stack(norms, out=out)
        else:
            out.copy_(torch.stack(norms))
    if squared:
        out.square_()


def _into_bins(sketch: torch.Tensor, rows_t: torch.Tensor, row_signs: torch.Tensor, overwrite: bool) -> None:
    """A chunk's rows weighted by their signs, summed into the sketch's bins: written over the
    sketch (the step's first chunk: no zeroing before it) or added into it. One operation."""
    if overwrite:
        torch.mv(rows_t, row_signs, out=sketch)
    else:
        sketch.addmv_(rows_t, row_signs)


def squared_norms_of_buffers(buffers: list[torch.Tensor], lengths: list[list[int]], out: torch.Tensor, squared: bool = True) -> None:
    """``out``, in order, the squared norms of every segment of several flat buffers (buffer ``b``
    cut into ``lengths[b]``), summed in fp32: one multi-tensor norm, its stack and a square,
    whatever the number of buffers and segments (a buffer of one segment is its own view). The
    reduced gradients' norms of a step (DDP's buckets, FSDP2's shards); fp64 buffers keep fp64
    sums, buffer by buffer. ``squared=False``: the norms, one operation fewer (the compact wire
    squares DDP's on the host, ``fleet_stats.KeptWire``)."""
    if any(buffer.dtype == torch.float64 for buffer in buffers):
        offset = 0
        for buffer, sizes in zip(buffers, lengths):
            squared_norms(buffer, list(sizes), out[offset : offset + len(sizes)], squared=squared)
            offset += len(sizes)
        return
    segments = []
    for buffer, sizes in zip(buffers, lengths):
        segments.extend((buffer,) if len(sizes) == 1 else buffer.split_with_sizes(list(sizes)))
    torch.stack(torch._foreach_norm(segments, 2, dtype=torch.float32), out=out)
    if squared:
        out.square_()


def squared_norms(flat: torch.Tensor, lengths: list[int], out: torch.Tensor, fused: bool = False, squared: bool = True) -> None:
    """``out[j] = |segment_j|^2`` in fp32 for a flat buffer cut into segments of ``lengths``
    (``squared=False``: the norms ``|segment_j|``).

    It keeps no shared scratch (it may run on several threads at once). With ``fused``
    (accelerators), or a buffer small enough to be one CPU chunk, all segments go through one
    multi-tensor norm accumulated in fp32 (``_segment_norms``): a few operations per buffer
    whatever its number of parameters; otherwise fp32 and fp64 segments are reduced directly
    and half-precision ones in bounded chunks converted to fp32.
    """
    if fused or flat.dtype == torch.float32 or flat.numel() <= CPU_CHUNK_ELEMS:
        _segment_norms(flat, lengths, out, squared)
        return
    offset = 0  # fp64, or half precision on the CPU in bounded chunks (no buffer-sized fp32 copy)
    for j, length in enumerate(lengths):
        segment = flat[offset : offset + length]
        offset += length
        if segment.dtype == torch.float64:
            out[j] = torch.dot(segment, segment)
        else:
            total = torch.zeros((), dtype=torch.float32, device=flat.device)
            for begin in range(0, length, CPU_CHUNK_ELEMS):
                part = segment[begin : begin + CPU_CHUNK_ELEMS].float()
                total += torch.dot(part, part)
            out[j] = total
    if not squared:
        out.sqrt_()
