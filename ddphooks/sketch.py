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
2. element ``i`` is multiplied by a random sign ``sigma_i`` in {-1, +1}, drawn once per bucket
   layout from a seeded generator and cached as int8 (1 byte per gradient element). Independent
   signs per element make ``<s_a, s_b>`` unbiased: cross terms ``sigma_i sigma_j a_i b_j`` with
   ``i != j`` in one bin have mean zero. Signs that repeat (periodic, per row, hashed with weak
   mixing) add up coherently on a constant component and break the estimate.
3. ``s[c] = sum_{i mod p = c} sigma_i g_i``. Sketches of several buckets add up to the sketch of the
   whole model, because the projection is linear.

The cosine between two ranks is then estimated as ``<s_a, s_b> / (|s_a| |s_b|)``; normalising by
the sketched norms has a smaller error, about ``(1 - c^2) / sqrt(p)``, than dividing by the exact
norms.

The work is done in chunks of a few hundred KB so that every temporary lives in the CPU cache:
the gradient is read from memory once, and no bucket-sized temporary is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

#: Largest ``sketch_dim`` accepted: every rank sends ``sketch_dim`` floats per instrumented step
#: and the cosine error is already ~0.004 there.
MAX_SKETCH_DIM = 65536
#: Smallest nonzero ``sketch_dim``: below it the cosine error (~1/sqrt(sketch_dim)) exceeds 0.25.
MIN_SKETCH_DIM = 16
#: Elements per chunk on the CPU: the chunk and its fp32 product stay in a 2 MB L2 cache.
CPU_CHUNK_ELEMS = 1 << 17
#: Elements per chunk on accelerators, where each chunk costs kernel launches rather than cache.
ACCELERATOR_CHUNK_ELEMS = 1 << 24


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


def random_signs(numel: int, seed_words: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``numel`` random signs (int8, -1 or +1), the same on every process for the same seed words.

    numpy's PCG64 seeded through a ``SeedSequence`` is used because it is fast (about 5 ns per
    element) and portable; the global torch and numpy generators are never touched.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed_words))))
    bits = rng.integers(0, 2, size=numel, dtype=np.int8)
    signs = torch.from_numpy(bits).mul_(2).sub_(1)
    return signs.to(device)


@dataclass(frozen=True)
class _ChunkSegment:
    """The part of one parameter that falls into one chunk."""

    param: int  # index of the parameter within the bucket
    begin: int  # offset inside the chunk
    end: int


@dataclass(frozen=True)
class _Chunk:
    begin: int  # offset inside the bucket
    end: int
    segments: tuple[_ChunkSegment, ...]


class BucketPlan:
    """How one bucket layout is cut into chunks, and its cached random signs.

    A plan is built once per bucket layout (DDP rebuilds its buckets once, after the first
    iteration) and reused on every step.

    Args:
        lengths: number of elements of each parameter, in bucket order (segments are contiguous).
        bins: sketch entries ``p`` (a prime), or 0 for norms only.
        seed_words: seed of this bucket's signs; must be identical on every rank.
        device: where the bucket lives.
        chunk_elems: elements per chunk (rounded to a multiple of ``bins``).
    """

    def __init__(
        self,
        lengths: list[int],
        bins: int,
        seed_words: tuple[int, ...],
        device: torch.device,
        chunk_elems: int,
    ) -> None:
        self.lengths = list(lengths)
        self.numel = sum(self.lengths)
        self.device = torch.device(device)
        self.bins = bins
        if bins:
            # A chunk holds whole rows of `bins` elements, so every chunk starts at bin 0.
            chunk_elems = max(bins, chunk_elems // bins * bins)
        self.chunk_elems = min(chunk_elems, max(self.numel, 1))
        self.signs = random_signs(self.numel, seed_words, device) if bins else None
        starts = np.concatenate([[0], np.cumsum(self.lengths)]).tolist()
        chunks = []
        for begin in range(0, self.numel, self.chunk_elems):
            end = min(begin + self.chunk_elems, self.numel)
            segments = tuple(
                _ChunkSegment(j, max(starts[j], begin) - begin, min(starts[j + 1], end) - begin)
                for j in range(len(self.lengths))
                if starts[j] < end and starts[j + 1] > begin
            )
            chunks.append(_Chunk(begin, end, segments))
        self.chunks = chunks
        self.n_segments = sum(len(c.segments) for c in chunks)
        self.segment_owner = torch.tensor(
            [s.param for c in chunks for s in c.segments], dtype=torch.long, device=device
        )

    def persistent_bytes(self) -> int:
        """Bytes this plan keeps alive between steps (the cached signs dominate)."""
        signs = self.signs.numel() * self.signs.element_size() if self.signs is not None else 0
        return signs + self.segment_owner.numel() * 8


class BucketStatsKernel:
    """Per-parameter squared norms and the sketch of flat buckets, in one chunked pass.

    Per chunk (512 KB of fp32, so the work stays in the L2 cache): copy the chunk's int8 signs into
    an fp32 scratch buffer, multiply it in place by the gradient chunk (the only read from
    memory), add its rows into one partial sketch, and take the squared norm of each parameter
    segment from the product (``sigma^2 = 1``, so ``|sigma g|^2 = |g|^2``). Half-precision
    gradients are promoted to fp32 by the multiply itself. Without a sketch (``bins == 0``) the
    kernel only takes one squared norm per parameter (``squared_norms``).

    The scratch is shared by all buckets: DDP calls the hook for one bucket after the other on
    one thread, so it is never used concurrently. Views into it are prepared once per plan, which
    keeps the per-chunk Python work to four calls.

    On accelerators the per-parameter squared norms of a chunk come from one fused multi-tensor
    norm (``torch._foreach_norm``, the kernel ``clip_grad_norm_`` uses) instead of one ``dot`` per
    parameter segment: a bucket holds dozens of parameters, and each launch costs microseconds
    of host time. (``torch.segment_reduce`` would be one launch too, but its kernels sum each
    segment sequentially, slow on a GPU and less accurate in fp32.)

    Args:
        bins: sketch entries ``p`` of every plan this kernel runs (0 for norms only).
        device: where the buckets live.
        fused: use the fused multi-tensor norm (None: on every device but the CPU).
    """

    def __init__(self, bins: int, device: torch.device, fused: bool | None = None) -> None:
        self.bins = bins
        self.device = torch.device(device)
        self.fused = self.device.type != "cpu" if fused is None else fused
        self._scratch_elems = 0
        self._prepared: dict[int, tuple[BucketPlan, list]] = {}

    def _allocate(self, plans: list[BucketPlan]) -> None:
        """Size the scratch for the largest plan and prepare the views of every live plan."""
        f32 = dict(dtype=torch.float32, device=self.device)
        self._scratch_elems = max(plan.chunk_elems for plan in plans)
        self._product = torch.empty(self._scratch_elems, **f32)  # sign * gradient, one chunk
        self._colsums = torch.empty(max(len(plan.chunks) for plan in plans), self.bins, **f32)
        self._partials = torch.empty(max(plan.n_segments for plan in plans), **f32)
        self._prepared = {id(plan): (plan, self._prepare(plan)) for plan in plans}

    def _prepare(self, plan: BucketPlan) -> list:
        prepared = []
        k = 0
        for ci, chunk in enumerate(plan.chunks):
            length = chunk.end - chunk.begin
            product = self._product[:length]
            full = length - length % self.bins
            partials = self._partials[k : k + len(chunk.segments)]
            segments = [(product[seg.begin : seg.end], partials[j]) for j, seg in enumerate(chunk.segments)]
            k += len(chunk.segments)
            rows = product[:full].view(-1, self.bins)
            signs = plan.signs[chunk.begin : chunk.end]
            parts = [part for part, _ in segments]
            prepared.append((chunk.begin, chunk.end, signs, product, rows, self._colsums[ci], segments, partials, parts))
        return prepared

    def persistent_bytes(self) -> int:
        """Bytes of scratch kept between calls."""
        if not self._scratch_elems:
            return 0
        return 4 * (self._scratch_elems + self._colsums.numel() + self._partials.numel())

    def forget(self, plan: BucketPlan) -> None:
        """Drop the prepared views of a plan that is no longer used (after a bucket rebuild)."""
        self._prepared.pop(id(plan), None)

    def run(self, flat: torch.Tensor, plan: BucketPlan, sketch_acc: torch.Tensor | None, sq_norms: torch.Tensor) -> None:
        """Write ``|g_j|^2`` of every parameter into ``sq_norms``; add the sketch into ``sketch_acc``.

        Args:
            flat: the bucket's flat gradient (any floating dtype; statistics are computed in fp32).
            plan: the bucket's plan (its layout must match ``flat``).
            sketch_acc: fp32 tensor of ``plan.bins`` entries to add the sketch into, or None for
                norms only.
            sq_norms: fp32 tensor of ``len(plan.lengths)`` entries, overwritten.
        """
        if flat.numel() != plan.numel:
            raise ValueError(f"bucket has {flat.numel()} elements but its plan expects {plan.numel}")
        if plan.bins != self.bins:
            raise ValueError(f"plan has {plan.bins} bins but this kernel sketches into {self.bins}")
        if sketch_acc is None or not self.bins:
            # norms only: one reduction per parameter, or one segmented reduction on accelerators
            squared_norms(flat, plan.lengths, sq_norms, fused=self.fused)
            return
        entry = self._prepared.get(id(plan))
        if entry is None or entry[0] is not plan:
            self._allocate([p for p, _ in self._prepared.values()] + [plan])
            entry = self._prepared[id(plan)]
        for begin, end, signs, product, rows, colsum, segments, partials, parts in entry[1]:
            product.copy_(signs)
            product.mul_(flat[begin:end])
            torch.sum(rows, 0, out=colsum)
            if self.fused:  # all of the chunk's segments in one multi-tensor kernel
                torch.stack(torch._foreach_norm(parts, 2), out=partials).square_()
            else:  # one dot per segment: measured fastest on the CPU, where a call costs no launch
                for part, partial in segments:
                    torch.dot(part, part, out=partial)
        sq_norms.zero_().index_add_(0, plan.segment_owner, self._partials[: plan.n_segments])
        sketch_acc.add_(self._colsums[: len(plan.chunks)].sum(0))
        last_length = plan.chunks[-1].end - plan.chunks[-1].begin
        tail = last_length % self.bins
        if tail:  # the last chunk of a bucket may end in the middle of a row
            sketch_acc[:tail].add_(self._product[last_length - tail : last_length])


def squared_norms(flat: torch.Tensor, lengths: list[int], out: torch.Tensor, fused: bool = False) -> None:
    """``out[j] = |segment_j|^2`` in fp32 for a flat buffer cut into segments of ``lengths``.

    Used on reduced buckets inside future callbacks (possibly several threads at once), so it
    keeps no shared scratch. With ``fused`` (accelerators) all segments go through one
    multi-tensor norm accumulated in fp32, a few kernel launches per bucket whatever its number
    of parameters; otherwise fp32 and fp64 segments are reduced directly and half-precision ones
    in bounded chunks converted to fp32.
    """
    if fused:
        accumulate = None if flat.dtype == torch.float64 else torch.float32  # fp64 stays fp64, the rest sums in fp32
        out.copy_(torch.stack(torch._foreach_norm(flat.split(lengths), 2, dtype=accumulate)).square_())
        return
    offset = 0
    for j, length in enumerate(lengths):
        segment = flat[offset : offset + length]
        offset += length
        if segment.dtype == torch.float32:
            torch.dot(segment, segment, out=out[j])
        elif segment.dtype == torch.float64:
            out[j] = torch.dot(segment, segment)
        else:
            total = torch.zeros((), dtype=torch.float32, device=flat.device)
            for begin in range(0, length, CPU_CHUNK_ELEMS):
                part = segment[begin : begin + CPU_CHUNK_ELEMS].float()
                total += torch.dot(part, part)
            out[j] = total
