"""Per-rank slots and the statistics reconstructed from them (no ``torch.distributed`` here).

Every rank packs its local statistics of one step into a *slot* of fp32 numbers::

    [ loss_sum, loss_count, status, |g_p|^2 for every parameter p (bucket order), sketch (bins) ]

``status`` holds flags the other ranks must see, so that every rank makes the same decision from
the same gathered slots: ``ABSENT`` (the rank did not train on this step: it has joined under
DDP's ``Join`` and contributes zeros, so it is left out of every statistic) and
``REPLICA_CHECK_REQUESTED`` (the rank saw DDP stop synchronising and asks every rank to check the
replicas on the next instrumented step).

The slots of all ranks travel through one allreduce (each rank fills its own slot, the others
are zero, so the sum is a gather). Together with the squared norms of the *reduced* gradient
``gbar = (1/W) sum_i g_i``, which every rank holds after the allreduce, they give:

1. losses and gradient norms per rank, and their dispersion (population std, ddof=0;
   cv = std / |mean|; range = max - min);
2. the exact norm-weighted mean pairwise cosine, from the identity
   ``sum_{i != j} <g_i, g_j> = W^2 |gbar|^2 - sum_i |g_i|^2``, divided by
   ``sum_{i != j} |g_i| |g_j| = (sum_i |g_i|)^2 - sum_i |g_i|^2``; per parameter, per bucket and
   over the whole model, with no sketch involved;
3. the W x W cosine matrix estimated from the sketches, ``<s_i, s_j> / (|s_i| |s_j|)``, and in
   O(W k) without the matrix: each rank's mean cosine to the others and their overall mean, from
   the unit sketches ``u_i = s_i / |s_i|`` and ``U = sum_i u_i``:
   ``sum_{j != i} <u_i, u_j> = <u_i, U> - 1`` and ``sum_{i != j} <u_i, u_j> = |U|^2 - W``;
   and each rank's cosine to its *own* gradient of the previous instrumented step,
   ``cos(s_i(t), s_i(t'))``, from the previous step's slots handed to the step (the signs of a
   sketch are fixed per bucket layout, so two steps with the same layout are comparable);
4. the gradient noise scale (McCandlish et al. 2018) in units of one rank's batch, from
   ``|G_s|^2 = mean_i |g_i|^2`` and ``|G_b|^2 = |gbar|^2``:
   ``tr(Sigma) ~ W (|G_s|^2 - |G_b|^2) / (W - 1)``, ``|G|^2 ~ (W |G_b|^2 - |G_s|^2) / (W - 1)``,
   ``B_simple = tr(Sigma) / |G|^2``.

Everything is computed lazily in float64 on the host the first time it is read. The slots reach
the host through ``PendingHost``: on an accelerator a non-blocking copy into pinned memory and an
event, so building a ``SilentStats`` inside a communication callback never synchronises the
device; only reading a value waits for that copy.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from ddphooks.hosts import HostBlocks, HostMatrix, block_cosines, unit_sums

if TYPE_CHECKING:  # torch only in annotations: the detector's process rebuilds steps here without it
    import torch

LOSS_SUM = 0
LOSS_COUNT = 1
STATUS = 2
PARAMS_BEGIN = 3
#: Status flag: the rank did not train on this step (joined under ``Join``); its slot is zeros.
ABSENT = 1
#: Status flag: the rank asks for a replica check on the next instrumented step (see ``ddphooks.watchdog``).
REPLICA_CHECK_REQUESTED = 2
#: Status flag: the rank's statistics of this step failed (a bug in ddphooks; its log says which);
#: the rest of its slot is zeros, and no rank measures the step (``SilentStats.failed_ranks``).
#: Training is unchanged: the gradients' all-reduce is the same.
FAILED = 16
#: Non-finite (rank, parameter) pairs listed in a record; ``gradient_count`` gives the total, so a
#: run that blows up everywhere does not write W x parameters entries per step.
MAX_NONFINITE_LISTED = 64
#: Numbers per tensor in a replica fingerprint: its L1 and L2 norms.
FINGERPRINT_WIDTH = 2
#: The L1 and L2 "norms" a rank writes for a tensor it cannot compare on this step (a norm is
#: never negative, so no real fingerprint looks like it; see ``ddphooks.replicas``).
NOT_COMPARED = -1.0
#: Tensors listed per record where replicas differ (largest difference first).
MAX_REPLICA_DIFFERENCES = 16
#: A record's per-rank signals: one value per rank, or in a compact record above
#: ``per_rank_max_world`` ranks, ``<key>_over_ranks`` (see ``over_ranks``).
PER_RANK_KEYS = ("losses", "grad_norms", "cosine_to_others", "cosine_loo", "cosine_previous")
#: The quantiles over ranks that ``over_ranks`` keeps, by name.
OVER_RANKS_QUANTILES = {"min": 0.0, "p01": 0.01, "p10": 0.1, "p25": 0.25, "median": 0.5, "p75": 0.75, "p90": 0.9, "p99": 0.99, "max": 1.0}
#: The ranks farthest from the median that ``over_ranks`` names.
OVER_RANKS_OUTLIERS = 16


@dataclass(frozen=True)
class BucketLayout:
    """The parameters of one gradient bucket, in the order they sit in its flat buffer."""

    index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.numels)


class HostArrays:
    """A step's tensors already on the host as numpy arrays, in the dtype they travelled in (fp32
    slots): ``PendingHost``'s interface with nothing to wait for. What a ``SilentStats`` rebuilt
    from its ``StepSlots`` reads, in a process that never imports torch (the detector's)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self._host = list(arrays)

    def columns(self, begin: int, end: int) -> np.ndarray:
        """Columns ``begin`` to ``end - 1`` of the first (W x slot) array as float64."""
        return self.raw()[0][:, begin:end].astype(np.float64)

    def arrays(self) -> list[np.ndarray]:
        """The arrays as new float64 arrays (fp32 widens exactly: what ``PendingHost`` gives)."""
        return [array.astype(np.float64) for array in self.raw()]

    def raw(self) -> list[np.ndarray]:
        """The arrays as they travelled (not copied)."""
        return self._host


class HostParts(HostArrays):
    """Arrays cut from one flat array on its way to the host (the first array of a
    ``PendingHost`` or ``HostArrays``), read as ``HostArrays``' are: a step that came over in
    one copy, read as the several arrays its statistics take. ``cut(flat)`` returns them; it is
    called once, at the first read (which waits for the copy)."""

    def __init__(self, source, cut) -> None:
        super().__init__([])
        self._source = source
        self._cut = cut

    def raw(self) -> list[np.ndarray]:
        """The arrays in the dtype they travelled in (fp32), not copied where they are slices."""
        if not self._host:
            self._host = self._cut(self._source.raw()[0])
        return self._host


@dataclass(frozen=True)
class KeptSlots:
    """Where a whole-slot DDP step lies in the flat fp32 array it keeps of it and copies to the host
    in one copy (``SilentState._keep_slots``): the ``world x slot`` gathered slots, then the P
    reduced norms ``|gbar_p|``, unsquared (squared here, in fp32 as torch squares them: one device
    operation fewer). ``cut`` is ``HostParts``'."""

    world: int
    slot: int

    def cut(self, kept: np.ndarray) -> list[np.ndarray]:
        """The gathered slots and the reduced squared norms."""
        end = self.world * self.slot
        return [kept[:end].reshape(self.world, self.slot), np.square(kept[end:])]


@dataclass(frozen=True)
class KeptSlotRows:
    """Where a whole-slot step of a transport whose slots travel in an all-reduce of their own
    (FSDP2, DeepSpeed: ``BaseSilentState._keep_slot_rows``) lies in its one copy: ``world`` rows,
    each a rank's slot of ``slot`` numbers then its part of the P reduced squared norms (its
    shards' or its partition's). The reduced squared norms are the sum of those parts over the
    rows, in fp32 as torch sums them on the device (to fp32 rounding: the order may differ),
    divided by ``replicas`` (HSDP: every replica holds the same shards). ``cut`` is ``HostParts``'."""

    world: int
    slot: int
    replicas: int = 1

    def cut(self, kept: np.ndarray) -> list[np.ndarray]:
        """The gathered slots (a view of the rows) and the reduced squared norms."""
        rows = kept.reshape(self.world, -1)
        reduced = rows[:, self.slot :].sum(axis=0)
        if self.replicas > 1:
            reduced /= np.float32(self.replicas)
        return [rows[:, : self.slot], reduced]


def slot_size(n_params: int, bins: int, n_fingerprinted: int = 0) -> int:
    """Number of fp32 entries in one rank's slot (``n_fingerprinted`` tensors on replica-check
    steps add two numbers each)."""
    return PARAMS_BEGIN + n_params + bins + FINGERPRINT_WIDTH * n_fingerprinted


def _float(x: float) -> float | None:
    """JSON-safe float: non-finite values become None (null)."""
    x = float(x)
    return x if math.isfinite(x) else None


def _floats(values) -> list[float | None]:
    return [_float(v) for v in np.asarray(values).ravel()]


def over_ranks(values: np.ndarray | None) -> dict | None:
    """One per-rank signal summarised over the ranks, for a compact record at large W (O(1) in W).

    1. ``known``: how many ranks have a finite value (absent ranks and non-finite values are
       left out; ``nonfinite`` and ``absent`` list those);
    2. ``quantiles``: of the known values, by name (``OVER_RANKS_QUANTILES``: min, p01, ... max);
    3. ``outliers``: the ``OVER_RANKS_OUTLIERS`` ranks whose values are farthest from the
       median, ``[rank, value]`` farthest first (the lower rank first between equals): the few
       ranks a person looks at, whatever W.

    None for a signal the step does not have (no loss recorded, no sketch).

    Example::
        >>> over_ranks(np.array([1.0, 1.1, 0.9, 5.0]))["outliers"][0]
        [3, 5.0]
    """
    if values is None:
        return None
    ranks = np.flatnonzero(np.isfinite(values))
    known = values[ranks]
    if not known.size:
        return {"known": 0, "quantiles": None, "outliers": []}
    quantiles = np.quantile(known, list(OVER_RANKS_QUANTILES.values()))
    farthest = np.argsort(-np.abs(known - np.median(known)), kind="stable")[:OVER_RANKS_OUTLIERS]
    return {
        "known": int(known.size),
        "quantiles": dict(zip(OVER_RANKS_QUANTILES, _floats(quantiles))),
        "outliers": [[int(ranks[i]), float(known[i])] for i in farthest],
    }


def _dispersion(values: np.ndarray) -> dict[str, float | None]:
    # The array's own methods: the same reductions as np.mean, np.std, np.max and np.min, with
    # fewer calls (summary() runs on the training thread every step).
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite value makes them NaN (inf - inf too)
        mean = float(values.mean())
        centred = values - mean
        std = math.sqrt((centred * centred).mean())  # population std (ddof=0): np.std's steps, without its overhead
        spread = float(values.max() - values.min())
    return {
        "mean": mean,
        "std": std,
        "range": spread,
        "cv": std / abs(mean) if mean != 0 else math.nan,
    }


def weighted_mean_cosine(rank_sq: np.ndarray, reduced_sq: np.ndarray | float) -> np.ndarray | float:
    """Exact norm-weighted mean pairwise cosine from squared norms alone.

    Args:
        rank_sq: ``|g_i|^2`` per rank along axis 0 (W x ...).
        reduced_sq: ``|gbar|^2`` of the averaged gradient (broadcast against ``rank_sq[0]``).

    Returns ``sum_{i!=j} <g_i,g_j> / sum_{i!=j} |g_i||g_j|``; NaN where undefined (W = 1 or a
    zero gradient on all but one rank).
    """
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite norms give NaN
        return weighted_mean_cosine_from_sums(rank_sq.sum(axis=0), np.sqrt(rank_sq).sum(axis=0), rank_sq.shape[0], reduced_sq)


def weighted_mean_cosine_from_sums(total_sq: np.ndarray | float, norms_sum: np.ndarray | float, world: int, reduced_sq: np.ndarray | float) -> np.ndarray | float:
    """``weighted_mean_cosine`` from sums over the ranks alone: ``total_sq = sum_i |g_i|^2`` and
    ``norms_sum = sum_i |g_i|`` (what the compact wire carries, ``ddphooks.fleet``), for ``world``
    ranks. NaN where undefined."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        total_sq = np.asarray(total_sq, dtype=np.float64)
        cross = world * world * np.asarray(reduced_sq) - total_sq
        pair_norms = np.asarray(norms_sum, dtype=np.float64) ** 2 - total_sq
        result = np.where(pair_norms > 0, cross / np.where(pair_norms > 0, pair_norms, 1.0), np.nan)
    return result if world > 1 else np.full_like(result, np.nan)


def noise_scale_terms(rank_sq_total: np.ndarray, reduced_sq_total: float) -> tuple[float, float]:
    """``(tr(Sigma), |G|^2)`` estimated from the per-rank and the averaged squared norms.

    In units of one rank's batch: ``B_small = 1``, ``B_big = W``. NaN for W = 1.
    """
    world = len(rank_sq_total)
    if world < 2:
        return math.nan, math.nan
    small = float(np.mean(rank_sq_total))
    big = float(reduced_sq_total)
    return world * (small - big) / (world - 1), (world * big - small) / (world - 1)


def cosine_to_others(sketches: np.ndarray) -> np.ndarray:
    """Each rank's mean sketched cosine to the other ranks, in O(W k) (no W x W matrix).

    With ``u_i = s_i / |s_i|`` and ``U = sum_j u_j``: ``mean_{j != i} cos(s_i, s_j) = (<u_i, U> - 1) / (W - 1)``.
    NaN for W = 1; a zero or non-finite sketch makes every entry NaN (as it does in the matrix's mean).
    """
    world = sketches.shape[0]
    if world < 2:
        return np.full(world, np.nan)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # Two matrix-vector products, no W x k array of unit sketches: U = S^T (1 / |s|), and
        # <u_i, U> = <s_i, U> / |s_i|. A zero sketch's 1/|s_i| is infinite, a non-finite sketch's
        # entries are: either makes U, and so every entry, NaN. By einsum, not BLAS: numpy's
        # BLAS starts its own threads, which would compete with training for the cores.
        inverse = 1.0 / np.sqrt(np.einsum("ij,ij->i", sketches, sketches))
        units_sum = np.einsum("ij,i->j", sketches, inverse)
        result = (np.einsum("ij,j->i", sketches, units_sum) * inverse - 1.0) / (world - 1)
    result[~np.isfinite(result)] = np.nan
    return result


def cosine_leave_one_out(sketches: np.ndarray) -> np.ndarray:
    """Per rank, ``cos(s_i, sum_{j != i} s_j)``: the rank against the sum of all the others.

    Far better conditioned than pairwise cosines at W >= 3: the sum of the others has W - 1
    batches' worth of signal, so a healthy rank's value sits well above the sketch noise even
    where pairwise cosines do not. NaN for W = 1 or a zero sketch.
    """
    world = sketches.shape[0]
    if world < 2:
        return np.full(world, np.nan)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        others = sketches.sum(axis=0) - sketches  # the one W x k array (einsum sums products without another)
        own_sq = np.einsum("ij,ij->i", sketches, sketches)
        result = np.einsum("ij,ij->i", sketches, others) / (np.sqrt(own_sq) * np.sqrt(np.einsum("ij,ij->i", others, others)))
    result[~np.isfinite(result)] = np.nan
    return np.clip(result, -1.0, 1.0)


def cosine_to_previous(sketches: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """Per rank, ``cos(s_i(t), s_i(t'))``: its sketch against its own sketch of an earlier step.

    Healthy ranks draw a new batch every step, so consecutive gradients share little more than
    the slowly moving mean gradient; a rank that keeps seeing the same batch (a stuck loader)
    produces nearly the same gradient again, and its value rises towards 1. NaN where a sketch is
    zero.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        products = np.einsum("ij,ij->i", sketches, previous)
        result = products / (np.sqrt(np.einsum("ij,ij->i", sketches, sketches)) * np.sqrt(np.einsum("ij,ij->i", previous, previous)))
    result[~np.isfinite(result)] = np.nan
    return np.clip(result, -1.0, 1.0)


def _fingerprint_mode(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fingerprint most rows share, per tensor, by sorting each tensor's W rows.

    Args:
        columns: W x C x 2 fingerprints of C tensors.

    Returns ``(reference, unique)``: C x 2 the most common row of each tensor, and C booleans,
    False where two or more rows tie for the most common. Rows are equal when both numbers are
    ``==``, so a row with a NaN equals no other row.
    """
    world, count = columns.shape[:2]
    l1, l2 = (np.ascontiguousarray(columns[:, :, i].T) for i in range(FINGERPRINT_WIDTH))  # C x W each
    order = np.lexsort((l2, l1), axis=1)  # per tensor, equal rows adjacent (NaN last)
    l1, l2 = np.take_along_axis(l1, order, axis=1), np.take_along_axis(l2, order, axis=1)
    starts = np.ones((count, world), dtype=bool)
    starts[:, 1:] = (l1[:, 1:] != l1[:, :-1]) | (l2[:, 1:] != l2[:, :-1])  # a NaN row starts a run of its own
    reference, unique = np.empty((count, FINGERPRINT_WIDTH)), np.empty(count, dtype=bool)
    for c in range(count):
        begins = np.flatnonzero(starts[c])
        lengths = np.diff(begins, append=world)
        top = int(lengths.argmax())
        reference[c] = l1[c, begins[top]], l2[c, begins[top]]
        unique[c] = (lengths == lengths[top]).sum() == 1
    return reference, unique


def replica_differences(fingerprints: np.ndarray, names: list[str]) -> dict:
    """Which ranks hold parameters (or buffers) that differ from the others', from fingerprints.

    Args:
        fingerprints: W x T x 2 (L1 and L2 norm of each tensor on each rank, computed the same
            way on every rank, so bitwise-identical replicas give identical numbers).
        names: the T tensor names.

    A tensor that any rank marked ``NOT_COMPARED`` (a buffer that differs between ranks by
    design, see ``ddphooks.replicas``) is left out and counted in ``not_compared``. Per tensor,
    the reference is the fingerprint most ranks share (at W = 2 there is no
    majority: both ranks are named). ``relative_difference`` is ``|l2_i - l2_ref| / l2_ref``
    (or the L1 one where the L2 norms agree). Returns ``{"ranks": [...], "tensors": N,
    "parameters": [{"name", "ranks", "relative_difference"}, ...], "not_compared": N}``, the largest differences
    first (at most ``MAX_REPLICA_DIFFERENCES``).

    Vectorised over the W x T fingerprints: O(W T) while more than half the ranks agree on each
    tensor (tens of milliseconds at W = 4096 and 275 tensors), a sort per tensor where none does.
    """
    fingerprints = np.ascontiguousarray(fingerprints, dtype=np.float64)
    world, tensors = fingerprints.shape[:2]
    flat = fingerprints.reshape(world, FINGERPRINT_WIDTH * tensors)  # W x 2T: numpy is slow along a last axis of 2

    def pairs(matches: np.ndarray) -> np.ndarray:
        """Per tensor, both numbers of the fingerprint match (from a ... x 2T comparison)."""
        return matches[..., 0::2] & matches[..., 1::2]

    marked = (flat == NOT_COMPARED).any(axis=0)
    skipped = marked[0::2] | marked[1::2]  # a rank's own state by design (see ddphooks.replicas)
    as_first = pairs(flat == flat[:1])  # W x T: each rank's fingerprint equals rank 0's
    columns = np.flatnonzero(~skipped & ~as_first.all(axis=0))  # the tensors whose replicas differ, in tensor order
    not_compared = int(skipped.sum())
    if not len(columns):
        return {"ranks": [], "tensors": 0, "parameters": [], "not_compared": not_compared}
    count = len(columns)
    # The reference. A fingerprint that more than half the ranks share is the only most common one:
    # try rank 0's, then per tensor the first rank's that differs from every one tried (up to 8
    # tries, O(W) each: a few differing ranks take a few); then the median of each number, which
    # is the majority's where there is one; sort only the tensors that have no majority.
    differs = np.ones((world, count), dtype=bool)
    unique = np.zeros(count, dtype=bool)
    reference = np.empty((count, FINGERPRINT_WIDTH))
    tried = np.zeros((world, count), dtype=bool)
    for attempt in range(9):
        open_ = np.flatnonzero(~unique)
        if not len(open_):
            break
        if attempt == 0:
            row, equal = fingerprints[0, columns], as_first[:, columns]
        else:
            if attempt < 8:
                ranks = np.argmax(~tried[:, open_], axis=0)  # rank 0 for a tensor where every rank was tried
                row = fingerprints[ranks, columns[open_]]  # O x 2
            else:
                found, half = fingerprints[:, columns[open_]], world // 2
                middle = [np.partition(np.ascontiguousarray(found[:, :, i].T), half, axis=1)[:, half] for i in range(FINGERPRINT_WIDTH)]
                row = np.stack(middle, axis=1)  # the majority's fingerprint wherever there is one
            candidates = fingerprints[0].copy()  # T x 2, a candidate per open tensor
            candidates[columns[open_]] = row
            equal = pairs(flat == candidates.reshape(-1))[:, columns[open_]]  # W x O, no copy of the fingerprints
        tried[:, open_] |= equal
        majority = equal.sum(axis=0) * 2 > world
        chosen = open_[majority]
        reference[chosen], unique[chosen], differs[:, chosen] = row[majority], True, ~equal[:, majority]
    open_ = np.flatnonzero(~unique)
    if len(open_):
        found = fingerprints[:, columns[open_]]  # W x O x 2
        reference[open_], unique[open_] = _fingerprint_mode(found)
        resolved = unique[open_]
        differs[:, open_[resolved]] = (found[:, resolved] != reference[open_[resolved]]).any(axis=2)
        with np.errstate(invalid="ignore"):  # no unique most common row (W = 2, a tie): every rank named, against the median
            reference[open_[~resolved]] = np.median(found[:, ~resolved], axis=0)
    # relative_difference: the largest over the named ranks and both numbers (NaN only if all are)
    ranks, which = np.nonzero(differs)
    base = reference[which]
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.fmax.reduce(np.abs(fingerprints[ranks, columns[which]] - base) / np.where(base != 0, np.abs(base), 1.0), axis=1)
    largest = np.full(count, np.nan)
    np.fmax.at(largest, which, relative)
    key = np.where(np.isfinite(largest), largest, 0.0)  # as _float: a non-finite difference sorts as 0
    differing = [
        {"name": names[columns[c]], "ranks": np.flatnonzero(differs[:, c]).tolist(), "relative_difference": _float(largest[c])}
        for c in np.argsort(-key, kind="stable")[:MAX_REPLICA_DIFFERENCES]
    ]
    return {"ranks": np.flatnonzero(differs.any(axis=1)).tolist(), "tensors": count, "parameters": differing, "not_compared": not_compared}


def cosine_from_sketches(sketches: np.ndarray) -> np.ndarray:
    """W x W cosine matrix of the rows of ``sketches``; diagonal 1, NaN where a sketch is zero."""
    gram = sketches @ sketches.T
    norms = np.sqrt(np.diag(gram))
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = gram / np.outer(norms, norms)
    cosine[~np.isfinite(cosine)] = np.nan
    np.fill_diagonal(cosine, 1.0)
    return np.clip(cosine, -1.0, 1.0)


class SilentStats:
    """The statistics of one instrumented step, identical on every rank.

    Built from the gathered slots and the reduced squared norms; every derived value is computed
    on first access. ``to_dict()`` gives a JSON-serialisable record (non-finite values become
    null).

    Args:
        step: index of the synchronised step (``SilentState.step`` when it ran).
        world_size: number of ranks W.
        buckets: layout of every bucket of the step, in bucket order.
        gathered: W x slot tensor of every rank's slot (or a numpy array: ``StepSlots.stats``),
            or a ``HostParts`` giving both arrays from one copy (``reduced_sq`` None).
        reduced_sq: squared norm of the averaged gradient per parameter, in slot order (a
            tensor, or a numpy array with a numpy ``gathered``).
        bins: sketch entries (0: no sketch).
        transport: how the slots travelled ("piggyback" or "separate").
        fingerprinted: names of the tensors whose replica fingerprints the slots end with (on
            replica-check steps; empty otherwise).
        previous: the statistics of the previous instrumented step, for ``cosine_previous``
            (only its gathered slots are kept, and only where its sketch used the same signs).
        replica_groups: the groups of ranks whose fingerprints must agree (HSDP: the replicas of
            each shard); None: all ranks.
        divided_by_present: the transport divided the gradient sum by the number of ranks that
            trained on the step rather than by W (DDP's ``Join`` with
            ``divide_by_initial_world_size=False``), so ``gbar`` is the mean of the present ranks.

    Ranks whose slot says ``ABSENT`` (joined under ``Join``) are left out of every statistic:
    their losses, norms and cosines are NaN (null in a record), dispersion, cosines and the noise
    scale are those of the present ranks, and no replica comparison is made on the step (a
    joined rank's weights are stale by DDP's design until every rank has joined).

    Example::
        >>> stats = state.latest
        >>> stats.summary()["mean_cosine"], stats.cosine_to_others
    """

    def __init__(
        self,
        step: int,
        world_size: int,
        buckets: list[BucketLayout],
        gathered: torch.Tensor | np.ndarray,
        reduced_sq: torch.Tensor | np.ndarray,
        bins: int,
        transport: str,
        fingerprinted: list[str] | None = None,
        previous: "SilentStats | None" = None,
        replica_groups: list[list[int]] | None = None,
        divided_by_present: bool = False,
    ) -> None:
        self.fingerprinted = fingerprinted or []
        self.divided_by_present = divided_by_present
        self.replica_groups = replica_groups
        self.step = step
        self.world_size = world_size
        self.buckets = list(buckets)
        self.n_params = sum(len(b.numels) for b in self.buckets)  # P: read on every step's path, summed once
        self.bins = bins
        self.transport = transport
        if isinstance(gathered, HostParts):  # both already on their way, from one copy
            self._host = gathered
        elif isinstance(gathered, np.ndarray):
            self._host = HostArrays([gathered, reduced_sq])
        else:
            self._host = _pending_host([gathered, reduced_sq])
        self._lock = threading.Lock()
        # The previous step's slots on their way to the host, not the step itself: a reference to
        # it would chain every step to the one before. Its sketch is comparable only where it used
        # the same signs: same bucket layouts, bins and world size (DDP rebuilds its buckets after
        # its first steps).
        comparable = previous is not None and bins and (previous.buckets, previous.bins, previous.world_size) == (self.buckets, bins, world_size)
        self._previous_host = previous._host if comparable else None
        self._summary: dict[str, float] | None = None  # computed at the first summary()

    # -- host arrays, computed once ------------------------------------------------------------
    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            gathered, reduced = self._host.arrays()
        expected = slot_size(self.n_params, self.bins, len(self.fingerprinted))
        if gathered.shape != (self.world_size, expected):
            raise ValueError(f"gathered slots have shape {gathered.shape}, expected {(self.world_size, expected)}")
        return gathered, reduced

    @cached_property
    def status(self) -> np.ndarray:
        """Per rank, the status flags of its slot (``ABSENT``, ``REPLICA_CHECK_REQUESTED``)."""
        return self._arrays[0][:, STATUS].astype(np.int64)

    @cached_property
    def absent(self) -> np.ndarray:
        """Per rank, whether it did not train on this step (joined under DDP's ``Join``)."""
        return (self.status & ABSENT) != 0

    @property
    def absent_ranks(self) -> list[int]:
        return [int(r) for r in np.flatnonzero(self.absent)]

    @cached_property
    def failed_ranks(self) -> list[int]:
        """Ranks whose statistics of this step failed (status ``FAILED``): where any did, the
        step is not measured (``state.latest`` raises, the detector and the records skip it).
        Read on the training thread at every step: the status column alone."""
        return np.flatnonzero(self._status_column() & FAILED).tolist()

    @cached_property
    def replica_check_requested(self) -> bool:
        """Whether a rank asked every rank to check the replicas on the next instrumented step
        (read by the transport on the training thread: the status column alone)."""
        return bool((self._status_column() & REPLICA_CHECK_REQUESTED).any())

    def _status_column(self) -> np.ndarray:
        """``status`` without converting the rest of the slots (where it is not known yet)."""
        if "status" in self.__dict__:
            return self.status
        with self._lock:
            return self._host.columns(STATUS, STATUS + 1)[:, 0].astype(np.int64)

    def _present_reduced(self, reduced_sq: np.ndarray | float) -> np.ndarray | float:
        """Squared norms of the present ranks' mean gradient from those of ``gbar``: the same
        unless ranks were absent and the sum was divided by W (then ``gbar`` is scaled by
        ``present / W``)."""
        present = int((~self.absent).sum())
        if self.divided_by_present or present in (0, self.world_size):
            return reduced_sq
        return np.asarray(reduced_sq) * (self.world_size / present) ** 2

    #: The ranks whose per-parameter norms the step carries, where not every rank's (the compact
    #: wire's sampled ranks, ``ddphooks.fleet``); None: every rank's, in ``param_sq``.
    parameter_rows: list[int] | None = None
    #: What a transport adds to the step's record, after the statistics (DeepSpeed's
    #: ``accumulation``); the slots carry it (``StepSlots``).
    record_fields: dict = {}

    @property
    def param_sq(self) -> np.ndarray:
        """W x P squared norms of each rank's local gradient per parameter (zeros for an absent rank)."""
        gathered, _ = self._arrays
        return gathered[:, PARAMS_BEGIN : PARAMS_BEGIN + self.n_params]

    @property
    def reduced_param_sq(self) -> np.ndarray:
        """P squared norms of the averaged gradient per parameter."""
        return self._arrays[1]

    @cached_property
    def _bucket_bounds(self) -> list[tuple[int, int]]:
        bounds, begin = [], 0
        for bucket in self.buckets:
            bounds.append((begin, begin + len(bucket.numels)))
            begin += len(bucket.numels)
        return bounds

    @property
    def bucket_sq(self) -> np.ndarray:
        """W x B squared norms of each rank's local gradient per bucket."""
        return np.stack([self.param_sq[:, a:b].sum(axis=1) for a, b in self._bucket_bounds], axis=1)

    @property
    def reduced_bucket_sq(self) -> np.ndarray:
        return np.array([self.reduced_param_sq[a:b].sum() for a, b in self._bucket_bounds])

    @property
    def parameter_names(self) -> list[str]:
        return [name for bucket in self.buckets for name in bucket.names]

    # -- the signals ---------------------------------------------------------------------------
    @property
    def losses(self) -> np.ndarray | None:
        """Per-rank mean loss of the step; None if no rank observed a loss (NaN for a rank that
        observed none while others did). A new array on every read, computed once."""
        losses = self._losses
        return None if losses is None else losses.copy()

    @cached_property
    def _losses(self) -> np.ndarray | None:
        gathered, _ = self._arrays
        counts = gathered[:, LOSS_COUNT]
        if not (counts > 0).any():
            return None
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(counts > 0, gathered[:, LOSS_SUM] / np.where(counts > 0, counts, 1.0), np.nan)

    @cached_property
    def rank_sq(self) -> np.ndarray:
        """Per-rank squared norm of the local gradient over all buckets (computed once)."""
        return self.param_sq.sum(axis=1)

    @property
    def grad_norms(self) -> np.ndarray:
        """Per-rank L2 norm of the local gradient (before averaging), over all buckets (NaN for
        an absent rank)."""
        return np.where(self.absent, np.nan, np.sqrt(self.rank_sq))

    @property
    def reduced_grad_norm(self) -> float:
        """L2 norm of the averaged gradient that every rank applies."""
        return float(np.sqrt(self.reduced_param_sq.sum()))

    @property
    def weighted_mean_cosine(self) -> float:
        present = ~self.absent
        return float(weighted_mean_cosine(self.rank_sq[present], self._present_reduced(self.reduced_param_sq.sum())))

    @property
    def cosine(self) -> np.ndarray | None:
        """W x W sketched cosine matrix of the local gradients; None without a sketch."""
        if not self.bins:
            return None
        return self._over_present(cosine_from_sketches, matrix=True)

    def cosine_hosts(self, blocks: HostBlocks) -> HostMatrix | None:
        """The host-by-host matrix (``ddphooks.hosts``): per pair of ``blocks`` (hosts), the mean
        sketched cosine between their ranks, from every rank's sketch; None without a sketch."""
        if not self.bins or blocks.world != self.world_size:
            return None
        sums, counts = unit_sums(self._sketches, ~self.absent, blocks)
        return HostMatrix(block_cosines(sums, counts), counts)

    @cached_property
    def cosine_to_others(self) -> np.ndarray | None:
        """Per rank, its mean sketched cosine to the other ranks; None without a sketch."""
        if not self.bins:
            return None
        return np.clip(self._over_present(cosine_to_others), -1.0, 1.0)

    @property
    def _sketches(self) -> np.ndarray:
        return self._sketch_columns(self._arrays[0])

    def _over_present(self, function, *others: np.ndarray, matrix: bool = False) -> np.ndarray:
        """``function`` of the present ranks' sketches (and rows of ``others``), NaN for the absent."""
        present = ~self.absent
        if present.all():
            return function(self._sketches, *others)
        values = function(self._sketches[present], *(o[present] for o in others))
        if matrix:
            result = np.full((self.world_size, self.world_size), np.nan)
            result[np.ix_(present, present)] = values
        else:
            result = np.full(self.world_size, np.nan)
            result[present] = values
        return result

    def _sketch_columns(self, gathered: np.ndarray) -> np.ndarray:
        begin = PARAMS_BEGIN + self.n_params
        return gathered[:, begin : begin + self.bins]

    @cached_property
    def cosine_loo(self) -> np.ndarray | None:
        """Per rank, the sketched cosine between its gradient and the sum of the others'; None
        without a sketch."""
        return self._over_present(cosine_leave_one_out) if self.bins else None

    @cached_property
    def cosine_previous(self) -> np.ndarray | None:
        """Per rank, the sketched cosine of its gradient to its own gradient of the previous
        instrumented step; None without a sketch or without a comparable previous step. Fixed
        from the moment the step is complete: computed from the two steps' slots when read."""
        if self._previous_host is None:
            return None
        begin = PARAMS_BEGIN + self.n_params  # the same layout: the same columns
        previous = self._previous_host.columns(begin, begin + self.bins)
        return self._over_present(cosine_to_previous, previous)

    @cached_property
    def replicas(self) -> dict | None:
        """On replica-check steps, the ranks and tensors whose fingerprints differ (see
        ``replica_differences``); None on other steps."""
        if not self.fingerprinted:
            return None
        if self.absent.any():  # a joined rank's weights are stale until every rank has joined
            return {"ranks": [], "tensors": 0, "parameters": [], "not_compared": len(self.fingerprinted), "absent": self.absent_ranks}
        fingerprints = self._fingerprints()
        if self.replica_groups is None:
            return replica_differences(fingerprints, self.fingerprinted)
        merged: dict = {"ranks": set(), "tensors": 0, "parameters": [], "not_compared": 0}
        for group in self.replica_groups:  # compare within each group, name the ranks globally
            found = replica_differences(fingerprints[group], self.fingerprinted)
            merged["ranks"].update(group[r] for r in found["ranks"])
            merged["tensors"] += found["tensors"]
            merged["not_compared"] = max(merged["not_compared"], found["not_compared"])
            merged["parameters"] += [dict(d, ranks=[group[r] for r in d["ranks"]]) for d in found["parameters"]]
        merged["parameters"].sort(key=lambda d: -(d["relative_difference"] or 0.0))
        merged["parameters"] = merged["parameters"][:MAX_REPLICA_DIFFERENCES]
        return dict(merged, ranks=sorted(merged["ranks"]))

    def _fingerprints(self) -> np.ndarray:
        """W x T x 2 replica fingerprints of a replica-check step (the end of every slot)."""
        gathered, _ = self._arrays
        begin = gathered.shape[1] - FINGERPRINT_WIDTH * len(self.fingerprinted)
        return gathered[:, begin:].reshape(self.world_size, len(self.fingerprinted), FINGERPRINT_WIDTH)

    @property
    def mean_cosine(self) -> float:
        """Mean of the off-diagonal entries of ``cosine`` (NaN without a sketch or with W = 1),
        computed in O(W k) as the mean of ``cosine_to_others``."""
        per_rank = self.cosine_to_others
        if per_rank is None or self.world_size < 2 or self.absent.all():
            return math.nan
        return float(np.mean(per_rank[~self.absent]))

    @property
    def cosine_noise(self) -> float:
        """Typical error of one sketched cosine, ``1/sqrt(bins)``: a cosine (or a change in one)
        smaller than this is inside the sketch's noise. NaN without a sketch."""
        return 1.0 / math.sqrt(self.bins) if self.bins else math.nan

    @cached_property
    def noise_scale_terms(self) -> tuple[float, float]:
        """``(tr(Sigma), |G|^2)`` of this step (see ``noise_scale_terms``)."""
        present = ~self.absent
        return noise_scale_terms(self.rank_sq[present], self._present_reduced(self.reduced_param_sq.sum()))

    @property
    def noise_scale(self) -> float:
        """Simple gradient noise scale ``W (|G_s|^2 - |G_b|^2) / (W |G_b|^2 - |G_s|^2)`` of this
        step, in units of one rank's batch (McCandlish et al. 2018): the batch size, in ranks,
        beyond which adding ranks stops speeding training up. Noisy on its own; records also
        carry a smoothed value. NaN for W = 1 or where ``|G|^2 <= 0``."""
        trace, signal = self.noise_scale_terms
        return trace / signal if signal > 0 else math.nan

    def summary(self) -> dict[str, float]:
        """The step's scalar signals (what integrations log): O(W k) work, no per-parameter table.
        Computed once (the training loop, the records and the integrations read it): a new dict
        of the same values on every call."""
        if self._summary is None:  # two threads at once compute the same values
            self._summary = self._compute_summary()
        return dict(self._summary)

    def _compute_summary(self) -> dict[str, float]:
        losses, present = self.losses, ~self.absent
        finite = losses is not None and present.any() and bool(np.isfinite(losses[present]).all())
        loss_stats = _dispersion(losses[present]) if finite else dict.fromkeys(("mean", "std", "range", "cv"), math.nan)
        norm_stats = _dispersion(self.grad_norms[present]) if present.any() else dict.fromkeys(("mean", "std", "range", "cv"), math.nan)
        return {
            "loss_mean": loss_stats["mean"],
            "loss_std": loss_stats["std"],
            "loss_range": loss_stats["range"],
            "loss_cv": loss_stats["cv"],
            "grad_norm_mean": norm_stats["mean"],
            "grad_norm_std": norm_stats["std"],
            "grad_norm_cv": norm_stats["cv"],
            "reduced_grad_norm": self.reduced_grad_norm,
            "mean_cosine": self.mean_cosine,
            "weighted_mean_cosine": self.weighted_mean_cosine,
            "noise_scale": self.noise_scale,
        }

    @property
    def nonfinite(self) -> dict[str, list]:
        """Where non-finite values appeared: ranks with a non-finite loss, and (rank, bucket,
        parameter) of every non-finite local gradient norm (NaN/Inf in the gradient, or a
        squared norm beyond the fp32 range). A new dict on every read (the detector and every
        record read it); the parameter owners are looked up only when there is something to list."""
        losses, counts = self.losses, self._arrays[0][:, LOSS_COUNT]
        bad_losses = [] if losses is None else np.flatnonzero((counts > 0) & ~np.isfinite(losses)).tolist()
        gradients, count = self._nonfinite_gradients
        return {"losses": bad_losses, "gradients": [dict(g) for g in gradients], "gradient_count": count}

    @cached_property
    def _nonfinite_gradients(self) -> tuple[list[dict], int]:
        """The listed (rank, bucket, parameter) of non-finite local gradient norms, and their count:
        one W x P pass when every norm is finite (every healthy step), computed once."""
        finite = np.isfinite(self.param_sq)
        if finite.all():
            return [], 0
        bad = np.nonzero(~finite)
        owners = [(bucket.index, name) for bucket in self.buckets for name in bucket.names]
        gradients = [
            {"rank": int(r), "bucket": owners[p][0], "parameter": owners[p][1]}
            for r, p in zip(bad[0][:MAX_NONFINITE_LISTED], bad[1][:MAX_NONFINITE_LISTED])
        ]
        return gradients, int(len(bad[0]))

    # -- output --------------------------------------------------------------------------------
    def to_dict(self, detail: bool = True, detail_max_world: int = 256, alerts: list[dict] = (), per_rank: bool = True, hosts: HostBlocks | None = None) -> dict:
        """A JSON-serialisable record of the step (strict JSON: non-finite values are null).

        The same whenever it is called: nothing is added to a step once it is complete. The
        alerts found on the step are the pipeline's (``SilentState.alerts``); the records the
        sinks receive carry them under ``alerts``.

        Args:
            detail: add the layer view: ``cosine`` (W x W), ``buckets`` and ``parameters``.
                Without it the record is the compact summary, O(W) numbers.
            detail_max_world: above this world size, the detail keeps per-parameter and
                per-bucket summaries over ranks (mean, max, the rank with the max) instead of a
                value per rank, and gives the host-by-host matrix (``cosine_hosts``, where
                ``hosts`` is given) instead of the W x W one.
            alerts: the step's alerts, for the ``alerts`` key (the record builder passes them).
            per_rank: give each per-rank signal (``PER_RANK_KEYS``) one value per rank; False:
                ``<key>_over_ranks`` instead (``over_ranks``: quantiles over ranks and the ranks
                farthest from the median), O(1) in W. ``per_rank`` says which.
            hosts: the ranks by host (``ddphooks.hosts.host_blocks`` of the identity table), for
                the host-by-host matrix above ``detail_max_world``.
        """
        summary = self.summary()

        def signal(key: str, values: np.ndarray | None) -> dict:
            if not per_rank:
                return {f"{key}_over_ranks": over_ranks(values)}
            return {key: None if values is None else _floats(values)}

        record = {
            "step": self.step,
            "world_size": self.world_size,
            "absent": self.absent_ranks,
            "transport": self.transport,
            "sketch_dim": self.bins,
            "cosine_noise": _float(self.cosine_noise),
            "per_rank": per_rank,
            **signal("losses", self.losses),
            **{key: _float(summary[key]) for key in ("loss_mean", "loss_std", "loss_range", "loss_cv")},
            **signal("grad_norms", self.grad_norms),
            **{key: _float(summary[key]) for key in ("grad_norm_mean", "grad_norm_std", "grad_norm_cv", "reduced_grad_norm")},
            **signal("cosine_to_others", self.cosine_to_others),
            **signal("cosine_loo", self.cosine_loo),
            **signal("cosine_previous", self.cosine_previous),
            **{key: _float(summary[key]) for key in ("mean_cosine", "weighted_mean_cosine", "noise_scale")},
            "nonfinite": self.nonfinite,
            "replicas": self.replicas,
            "alerts": list(alerts),
            "detail": detail,
        }
        if detail:
            record.update(self._detail(detail_max_world, hosts))
        record.update(self.record_fields)
        return record

    def _cosine_rows(self) -> list[list[float | None]] | None:
        """The record's ``cosine``: the W x W matrix as JSON rows (None without one)."""
        cosine = self.cosine
        return None if cosine is None else [_floats(row) for row in cosine]

    def _cosine_hosts_record(self, hosts: HostBlocks | None) -> dict | None:
        """The record's ``cosine_hosts`` (``HostMatrix.to_record``), None without one."""
        matrix = None if hosts is None else self.cosine_hosts(hosts)
        return None if matrix is None else matrix.to_record(hosts)

    def _detail(self, detail_max_world: int, hosts: HostBlocks | None = None) -> dict:
        """The layer view: cosine matrix (W x W up to ``detail_max_world``, host by host above
        it), per-bucket and per-parameter norms and cosines."""
        per_rank = self.world_size <= detail_max_world
        matrix = {"cosine": self._cosine_rows()} if per_rank else {"cosine": None, "cosine_hosts": self._cosine_hosts_record(hosts)}
        reduced_param_sq, reduced_bucket_sq = self.reduced_param_sq, self.reduced_bucket_sq
        param_wmc, bucket_wmc = self._layer_cosines()
        param_norms, bucket_norms = self._layer_norms(per_rank)
        parameters = []
        p = 0
        for bucket in self.buckets:
            for name, numel in zip(bucket.names, bucket.numels):
                parameters.append(
                    {
                        "name": name,
                        "bucket": bucket.index,
                        "numel": numel,
                        **param_norms[p],
                        "reduced_norm": _float(math.sqrt(reduced_param_sq[p])),
                        "weighted_mean_cosine": _float(param_wmc[p]),
                    }
                )
                p += 1
        return {
            **matrix,
            "buckets": [
                {
                    "index": bucket.index,
                    "numel": bucket.numel,
                    "parameters": list(bucket.names),
                    **bucket_norms[b],
                    "reduced_norm": _float(math.sqrt(reduced_bucket_sq[b])),
                    "weighted_mean_cosine": _float(bucket_wmc[b]),
                }
                for b, bucket in enumerate(self.buckets)
            ],
            "parameters": parameters,
        }

    def _layer_cosines(self) -> tuple[np.ndarray, np.ndarray]:
        """The exact weighted mean cosine of each parameter and each bucket over the present ranks."""
        present = ~self.absent
        param_wmc = weighted_mean_cosine(self.param_sq[present], self._present_reduced(self.reduced_param_sq))
        bucket_wmc = weighted_mean_cosine(self.bucket_sq[present], self._present_reduced(self.reduced_bucket_sq))
        return param_wmc, bucket_wmc

    def _layer_norms(self, per_rank: bool) -> tuple[list[dict], list[dict]]:
        """Per parameter and per bucket, the ranks' local gradient norms: one per rank, or (not
        ``per_rank``) their mean, max and the rank with the max."""
        present = ~self.absent

        def over_ranks(sq: np.ndarray) -> dict:
            norms = np.where(present, np.sqrt(sq), np.nan)
            if per_rank:
                return {"grad_norms": _floats(norms)}
            if not present.any():
                return {"grad_norm_mean": None, "grad_norm_max": None, "grad_norm_argmax": None}
            with np.errstate(invalid="ignore"):
                ranks = np.flatnonzero(present)
                top = ranks[int(np.argmax(norms[ranks]))]
                return {"grad_norm_mean": _float(np.mean(norms[ranks])), "grad_norm_max": _float(norms[top]), "grad_norm_argmax": int(top)}

        param_sq, bucket_sq = self.param_sq, self.bucket_sq
        return [over_ranks(param_sq[:, p]) for p in range(param_sq.shape[1])], [over_ranks(bucket_sq[:, b]) for b in range(bucket_sq.shape[1])]

    def slots(self) -> "StepSlots":
        """The step as its slots (``StepSlots``, numpy): what travels to the detector's process,
        which reads the step there (``ddphooks.detect.process``; the compact wire's
        ``FleetStats`` gives its ``FleetSlots``)."""
        with self._lock:
            gathered, reduced_sq = self._host.raw()
            previous = None if self._previous_host is None else self._previous_host.raw()[0]
        return StepSlots(
            self.step, self.world_size, self.buckets, gathered, reduced_sq, self.bins, self.transport, self.fingerprinted, previous,
            self.replica_groups, self.divided_by_present, self.record_fields,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"SilentStats(step={self.step}, world_size={self.world_size}, buckets={len(self.buckets)}, sketch_dim={self.bins})"


def _pending_host(tensors: list[torch.Tensor]):
    """``ddphooks.devices.PendingHost`` of torch tensors, imported here where tensors are given:
    this module imports no torch, so that the detector's process reads a step from its slots
    (``StepSlots``) without it."""
    from ddphooks.devices import PendingHost

    return PendingHost(tensors)


@dataclass
class StepSlots:
    """One step's statistics as they arrived: the gathered slots and the reduced squared norms
    (numpy, fp32 as they travelled), the previous step's slots where its sketch is comparable, and
    the layout. ``stats()`` rebuilds the same ``SilentStats`` with no torch: the pipeline sends this
    to the detector's process (a few KB a step at W = 2) instead of reading the step into an
    ``Observation`` on a thread of the training process, where its numpy would hold the GIL.

    Example::
        >>> slots = pickle.loads(pickle.dumps(state.latest.slots()))   # in another process
        >>> Observation.from_stats(slots.stats())                       # the same observation
    """

    step: int
    world_size: int
    buckets: list[BucketLayout]
    gathered: np.ndarray  # W x slot
    reduced_sq: np.ndarray  # P
    bins: int
    transport: str
    fingerprinted: list[str]
    previous: np.ndarray | None  # W x slot of the previous instrumented step, where comparable
    replica_groups: list[list[int]] | None
    divided_by_present: bool
    record_fields: dict  # SilentStats.record_fields

    def stats(self) -> SilentStats:
        """The ``SilentStats`` these slots are of: every value the same, bit for bit."""
        stats = SilentStats(
            self.step, self.world_size, self.buckets, self.gathered, self.reduced_sq, self.bins, self.transport, self.fingerprinted,
            replica_groups=self.replica_groups, divided_by_present=self.divided_by_present,
        )  # fmt: skip
        # The previous step's slots themselves (its SilentStats stayed in the training process).
        stats._previous_host = None if self.previous is None else HostArrays([self.previous])
        stats.record_fields = self.record_fields
        return stats
