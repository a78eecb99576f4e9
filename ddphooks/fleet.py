"""The compact wire: what each rank sends above ``SilentConfig.gather_max_world`` ranks, and the
statistics built from it (no ``torch.distributed`` here: the transport calls these functions).

Up to ``gather_max_world`` ranks every rank's whole slot travels on every instrumented step
(``ddphooks.stats``): W x (3 + P + k) numbers for P parameters and a k-entry sketch, so each
rank's share of the all-reduce grows with W (8.6 MB a step at W = 4096, P = 273, k = 256). Above
it, most of what the statistics need is a sum over the ranks, which the same all-reduce gives at
a size that does not depend on W, and each rank finishes its own cosines locally. One flat fp32
buffer, each part summed over the ranks (a rank writes zeros where it has nothing):

1. per rank, ``PER_RANK`` numbers (a gather: only rank i writes row i)::

       [loss_i, cos_loo_i, cos_previous_i, level_i, status_i + 32 (parameter_i + 1), |g_i|^2]

   ``loss_i`` the rank's mean loss of the step (0 and the status flag ``NO_LOSS`` where it
   counted none), the cosines, ``level_i`` and ``parameter_i`` those of its *previous*
   instrumented step (see 4; ``parameter_i + 1`` is 0 where it has no level), the status flags
   and the parameter in one number (small integers: exact);
2. the per-parameter squared norms ``|g_{i,p}|^2`` of ``sampled`` ranks (a gather of
   ``sampled`` rows; ``choose_sampled``): half a window of consecutive ranks that moves on every
   instrumented step (every rank's layer view every ``ceil(2 W / sampled)`` steps whatever the
   levels), half the ranks whose layer ``level`` was highest on the previous step (a rank whose
   layer keeps standing out is sampled on every step), equal levels taken from a second moving
   window (on healthy steps every rank within ``ceil(W / sampled)`` steps, sampled even); chosen from what every rank holds (the step number,
   the previous step's rows), so every rank builds the same layout;
3. sums over the ranks: ``sum_i |g_{i,p}|^2`` and ``sum_i |g_{i,p}|`` per parameter,
   ``sum_i |g_{i,b}|`` per bucket (the exact weighted mean cosines of every layer), the number n
   of ranks present, the sketches' sum ``S = sum_i s_i`` and their unit vectors' sum
   ``U = sum_i s_i / |s_i|``, and per parameter the ranks' layer rises of the previous step
   (``sum_i sqrt(pi / 2) |rise_{i,p}|`` and how many ranks had one; their pooled scale, see 4)
   (an absent rank adds zeros);
4. after the all-reduce each rank computes its own values from 3 (``own_values``): its cosines,
   exactly what ``ddphooks.stats`` computes from every rank's sketch, ``cos(s_i, S - s_i)`` (to
   the sum of the others) and ``cos(s_i, s_i(t'))`` (to its own sketch of the previous
   instrumented step); and its layer CUSUM: the detector's per-parameter CUSUM of
   ``d_p = log|g_{i,p}| - log(mean_{j != i} |g_{j,p}|)`` (less its median over parameters)
   against the rank's own baseline, which only the rank can keep for every parameter and step,
   in the scale pooled over the ranks;
   its ``level`` is the highest of them and ``parameter`` that one's index, and the detector
   takes them as its layer evidence. They reach the other ranks in the next instrumented step's
   row 1, one instrumented step late (``cosines_step`` says which);
5. on replica-check steps, per tensor a histogram over the ranks of a hash of their fingerprints
   (``FINGERPRINT_BINS`` bins and one for ``NOT_COMPARED``: T x 65 counts, each rank adds a one);
   a rank whose bin is not the tensor's only most common one, in any tensor, differs: it knows
   it after the all-reduce and says so in the next instrumented step's status
   (``REPLICA_DIFFERS``), where the record's ``replicas`` names it (``replica_verdict``). Under
   HSDP (R replicas x S shards, rank i holds shard ``i % S``) a parameter's shards differ from
   each other by design and only each shard's R replicas must agree: the parameters' histograms
   (``count_shards``, T_p x 65) are summed over the rank's replica group alone, in an all-reduce
   of their own before this one, so their size does not grow with S; only the buffers' (T_b x
   65) travel here, over the whole mesh, with, per parameter, what the record needs of the
   shards' histograms (``histogram_checks``: the ranks outside the most common bin, whether the
   replicas differ, whether they were compared), written by each shard's first replica (ranks
   0 to S - 1) and summed over the shards;
6. under FSDP2 and HSDP only (``FleetLayout.reduced``), per parameter the squared norm of the
   rank's shard of the averaged gradient: their sum is ``|gbar_p|^2`` (R times it under HSDP,
   whose R replicas hold the same shards: the transport divides by R), which no rank holds
   whole (DDP computes it from its own averaged buckets and sends no such part);
7. on detail steps (``ddphooks.records.is_detail_step``: every ``detail_every``-th instrumented
   step, known to every rank from the step number), the cosine matrix: up to
   ``detail_max_world`` ranks every rank's sketch in its own row (W x k, a gather: the W x W
   matrix of the whole slots), above it per host (``ddphooks.hosts.HostBlocks``, from the
   identity table every rank holds) the sum of its ranks' unit sketches and their count
   (H x (k + 1): the host-by-host matrix, ``ddphooks.hosts``). After every other part, so that
   the other steps' wire keeps its size and every offset.

Per rank and step: 24 B x W plus 4 (sampled x P + 4P + B + 1 + 2k) B (FSDP2: 4P B more): 122 KB at W = 4096 (P =
273, k = 256, 16 sampled ranks; #42's budget 64 KB + 16 B x W holds up to W = 5203), against
8.6 MB for every rank's whole slot; a replica-check step
adds 4 x 65 B per tensor (72 KB for 275 tensors) instead of 8 B per tensor and rank (9 MB).
Under HSDP a replica-check step adds 4 x 65 B per buffer and 4 x 3 B per parameter to this
all-reduce (3.8 KB for 273 parameters and 2 buffers) and an all-reduce of 4 x 65 B per parameter
over the replica group (71 KB), whatever the number of shards: on 2 replicas of 2048 shards as
on 512 of 8 (a histogram per parameter and shard in one all-reduce over the whole mesh would be
145 MB and 568 KB).

A detail step adds 4 W k B (up to ``detail_max_world``) or 4 H (k + 1) B: averaged over
``detail_every`` (100), 0.32 KB a step at W = 32, 2.6 KB at W = 256, 1.3 KB at W = 1024 on 128
hosts and 2.6 KB at W = 4096 on 512 hosts (two a block: ``ddphooks.hosts.MAX_BLOCKS``; k = 251,
the default sketch's bins): at W = 4096 the wire, its replica-check and detail steps averaged in,
stays within #42's budget (125 KB against 131 KB, P = 273).

What it leaves out: the W x W cosine matrix on the steps that are not detail steps, and each
rank's mean cosine to the others (no rank
holds every sketch; the step's mean cosine ``(|U|^2 - n) / (n (n - 1))`` is exact), and each
rank's layer view on the steps it is not sampled (the records show the sampled rows against the
other ranks' exact mean norms; the detector reads every rank's layer level). The per-rank
cosines and layer levels are one step late.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ddphooks.detect import PARAMETER_RATE, DetectorConfig
from ddphooks.fleet_stats import (
    FINGERPRINT_BINS,
    NO_LOSS,
    PER_RANK,
    REPLICA_DIFFERS,
    STATUS_ROOM,
    WIRE_COSINE_LOO,
    WIRE_LOSS,
    WIRE_RANK_SQ,
    WIRE_STATUS,
    FleetLayout,
)
from ddphooks.stats import FINGERPRINT_WIDTH, NOT_COMPARED, _floats

#: The rank's own values (``own_values``): cos_loo, cos_previous, layer level, layer parameter.
OWN_VALUES = 4
#: What ``stage`` puts before a rank's rises: its cosines and layer level, its status, the 1 it
#: adds to ``present``, its loss count (at least 1: the divisor of its mean loss) and a 0 (what
#: ``pack`` writes of the other ranks' rows, expanded).
STAGED_PRESENT, STAGED_COUNT, STAGED_ZERO, STAGED = 4, 5, 6, 7
#: The layer CUSUM each rank runs on itself (``own_values``): the detector's per-parameter rate,
#: warm-up, drift and cap (``DetectorConfig`` defaults), so its level reads against the
#: detector's layer limit.
LAYER_RATE = PARAMETER_RATE
LAYER_WARMUP, LAYER_DRIFT, LAYER_CAP = DetectorConfig.warmup, DetectorConfig.layer_drift, DetectorConfig.layer_cap


def choose_sampled(world: int, sampled: int, index: int, previous_layer: np.ndarray | None) -> list[int]:
    """The ranks whose per-parameter norms travel on the ``index``-th instrumented step:
    ``sampled_ranks(world, ceil(sampled / 2), index)``, then the ranks with the highest layer
    levels ``previous_layer`` (W, NaN: unknown; the levels the previous instrumented step's rows
    carried) among the others, highest first; without them, ``sampled_ranks(world, sampled, index)``.
    Every rank where ``world <= sampled``. The same on every rank: it reads only what every rank
    holds.

    Between equal levels (on a healthy step every level is 0) the order starts at a second window
    that moves ``sampled - ceil(sampled / 2)`` ranks a step, half the ranks away from the first:
    so the whole budget rotates, and on healthy steps every rank is sampled within
    ``ceil(W / (2 floor(sampled / 2)))`` steps, ``ceil(W / sampled)`` for an even budget (by the
    first window alone, whatever the levels, every ``ceil(2 W / sampled)``). Ties broken by rank number instead sampled the same lowest ranks on
    every healthy step, half the budget spent on no information.

    Example::
        >>> choose_sampled(8, 4, 0, np.array([0, 0, 0, 0, 0, 3.0, 0, 5.0]))
        [0, 1, 7, 5]
        >>> choose_sampled(64, 16, 1, np.zeros(64))   # a healthy step: two windows
        [8, 9, 10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47]
    """
    if world <= sampled:
        return list(range(world))
    if previous_layer is None:
        return sampled_ranks(world, sampled, index)
    window = sampled_ranks(world, math.ceil(sampled / 2), index)
    scores = np.where(np.isfinite(previous_layer), previous_layer, -np.inf)
    chosen = set(window)
    rest = sampled - len(window)
    ties = (np.arange(world) - (index * rest + world // 2)) % world  # the second window's order between equals
    # The first `sampled` of the order hold at least `rest` ranks outside the window: only those
    # are read (a loop over all W ranks cost 0.75 ms a step at W = 4096).
    order = np.lexsort((ties, -scores))[:sampled]  # highest first, unknown scores last
    others = [int(r) for r in order if int(r) not in chosen]
    return window + others[:rest]


def sampled_ranks(world: int, sampled: int, index: int) -> list[int]:
    """The ranks whose per-parameter norms travel on the ``index``-th instrumented step: a window
    of ``min(sampled, world)`` consecutive ranks (wrapping around) that starts ``sampled`` ranks
    further on every step.

    Example::
        >>> sampled_ranks(world=10, sampled=4, index=2)
        [8, 9, 0, 1]
    """
    count = min(sampled, world)
    start = (index * count) % world
    return [(start + j) % world for j in range(count)]


def pack(
    layout: FleetLayout,
    rows: list[int],
    rank: int,
    loss_sum: torch.Tensor | None,
    local_sq: list[torch.Tensor],
    sketch: torch.Tensor | None,
    staged: torch.Tensor,
    fingerprint: torch.Tensor | None,
    absent: bool,
    out: torch.Tensor,
    differs: torch.Tensor | None = None,
    shard_checks: torch.Tensor | None = None,
    matrix_row: int | None = None,
    local_norms: list[torch.Tensor] | None = None,
    reduced: torch.Tensor | None = None,
    loss_count: int = 1,
) -> None:
    """Write every number of ``out`` (``layout.size`` fp32, not zeroed first), this rank's part of
    the compact wire and zeros for the others': its row (its mean loss, ``loss_sum`` over
    ``loss_count``, the count ``stage`` was given, 0 where None; its squared norm; from ``staged``,
    what ``stage`` made on the host: its ``own_values`` of the previous step and its status, with
    the layer parameter and ``NO_LOSS`` where it counted no loss in it), its per-parameter squared
    norms (``local_sq``, one tensor per bucket) where it is in ``rows`` (``choose_sampled``), and
    what it adds to the sums (nothing but its row where it is ``absent``): its squared norms, their
    roots (``local_norms`` where the kernel left them, else one operation more), its layer CUSUM's
    rises of the previous step (from ``staged``, for the pooled scale), its buckets' norms, a one in
    ``present``, its sketch and unit sketch, and FSDP2's ``reduced`` (its shards' squared norms, in
    ``reduced_sq``): one ``cat`` writes them from the wire's start, the other ranks' rows and the
    sampled rows from ``staged``'s zero, expanded. On a replica-check step its one in each tensor's
    histogram (``fingerprint_bins``; under HSDP the buffers', and on a shard's first replica its
    group's ``shard_checks``); after one, ``differs`` (``replica_differs``: 1 or 0) sets
    ``REPLICA_DIFFERS`` in its status. On a detail step (``layout.matrix_rows``) its sketch in row
    ``matrix_row`` (its rank) of the matrix part, or with ``layout.host_form`` its unit sketch added
    to row ``matrix_row`` (its block) and a one to that block's count (0 for a zero sketch). The
    parts after the ``cat`` (those steps' histograms and matrix) are zeroed first: one more
    operation, on those steps only. 6 device operations in all on the other steps (one more where
    the rank is sampled, or without ``local_norms``; ``benchmarks/launches.py``), whatever P and
    the buckets; nothing synchronises."""
    row = out[layout.part("per_rank")].view(layout.world, PER_RANK)[rank]
    if absent:
        out.zero_()
        _write_row(row, loss_sum, loss_count, staged, differs)
        return
    sketching = bool(layout.bins) and sketch is not None
    roots = torch._foreach_sqrt(local_sq) if local_norms is None else local_norms
    # each bucket's norm, the norm of its parameters' norms, and the sketch's: one multi-tensor kernel
    norms = torch._foreach_norm([*roots, sketch] if sketching else roots, 2)
    bucket_norms = [norm.view(1) for norm in norms[: len(roots)]]
    # The other ranks' rows and the sampled rows are zeros (read from one staged zero: no zeroing
    # of the wire), then this rank's parts, adjacent, up to where the step's wire is written later.
    zeros = staged[STAGED_ZERO : STAGED_ZERO + 1].expand(layout.part("param_sq").start)
    parts = [zeros, *local_sq, *roots, staged[STAGED:], *bucket_norms, staged[STAGED_PRESENT : STAGED_PRESENT + 1]]
    end = layout.part("present").stop
    if sketching:
        norm = norms[-1]
        # A zero sketch (no gradient on this rank) adds nothing to U, not 0/0.
        unit = torch.div(sketch, norm).nan_to_num_(nan=0.0)
        parts += [sketch, unit]
        end = layout.part("unit_sum").stop
    reduced_part = layout.part("reduced_sq")
    if reduced is not None and reduced_part.start == end:  # FSDP2's, where no replica check's histograms come first
        parts.append(reduced)
        end, reduced = reduced_part.stop, None
    torch.cat(parts, out=out[:end])
    if end < layout.size:  # a replica check's histograms, FSDP2's reduced norms after them, a detail step's matrix
        out[end:].zero_()
    if reduced is not None:
        out[reduced_part] = reduced
    _write_row(row, loss_sum, loss_count, staged, differs)
    param_sq = out[layout.part("param_sq")]
    torch.sum(param_sq, dim=0, out=row[WIRE_RANK_SQ])
    if rank in rows:
        out[layout.part("sampled")].view(layout.rows, layout.n_params)[rows.index(rank)] = param_sq
    if sketching and layout.matrix_rows and matrix_row is not None:
        matrix = out[layout.part("matrix")].view(layout.matrix_rows, layout.bins)
        if layout.host_form:  # this rank's unit sketch into its host's sum, and a one into its count
            matrix[matrix_row] = unit
            torch.sign(norm, out=out[layout.part("matrix_present")][matrix_row])
        else:
            matrix[matrix_row] = sketch
    if fingerprint is not None:
        compared = fingerprint[FINGERPRINT_WIDTH * layout.sharded :]  # the parameter shards' went to count_shards
        index = torch.arange(layout.histogram_rows, device=out.device) * (FINGERPRINT_BINS + 1) + fingerprint_bins(compared)
        out[layout.part("fingerprints")].index_fill_(0, index, 1.0)
    if shard_checks is not None:
        out[layout.part("shard_checks")] = shard_checks.reshape(-1)


def _write_row(row: torch.Tensor, loss_sum: torch.Tensor | None, loss_count: int, staged: torch.Tensor, differs: torch.Tensor | None) -> None:
    """A rank's row of the compact wire but its squared norm: its mean loss (``loss_sum`` over
    ``loss_count``), its values and status (``stage``), ``REPLICA_DIFFERS`` after a replica check
    where it differs."""
    if loss_sum is None:
        row[WIRE_COSINE_LOO : WIRE_STATUS + 1] = staged[:OWN_VALUES]
    elif loss_count == 1:  # the sum is the mean: it and the staged values in one op
        torch.cat([loss_sum.view(1), staged[:OWN_VALUES]], out=row[WIRE_LOSS : WIRE_STATUS + 1])
    else:
        torch.div(loss_sum, staged[STAGED_COUNT], out=row[WIRE_LOSS])
        row[WIRE_COSINE_LOO : WIRE_STATUS + 1] = staged[:OWN_VALUES]
    if differs is not None:
        row[WIRE_STATUS].add_(differs, alpha=REPLICA_DIFFERS)


def fingerprint_bins(fingerprint: torch.Tensor) -> torch.Tensor:
    """Per tensor, the histogram bin of a rank's fingerprint (``T x 2`` L1 and L2 norms, flat):
    a hash of both numbers' bits, so bitwise-equal fingerprints share a bin; ``FINGERPRINT_BINS``
    for a tensor the rank marked ``NOT_COMPARED``. int64 on the fingerprint's device."""
    pairs = fingerprint.view(-1, FINGERPRINT_WIDTH)
    bits = pairs.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    # Odd multipliers below 2**31: every product stays below 2**63, no int64 overflow on any device.
    mixed = (bits[:, 0] * 0x5BD1E995) ^ (bits[:, 1] * 0x27D4EB2D)
    mixed = mixed ^ (mixed >> 29)
    bins = ((mixed & 0x7FFFFFFF) * 0x165667B1 >> 17).remainder(FINGERPRINT_BINS)
    return torch.where((pairs == NOT_COMPARED).any(dim=1), torch.full_like(bins, FINGERPRINT_BINS), bins)


def count_shards(fingerprint: torch.Tensor, out: torch.Tensor) -> None:
    """HSDP: this rank's ones in the histograms of its parameter shards, the first ``len(out)``
    tensors of ``fingerprint`` (``out``: ``sharded x (FINGERPRINT_BINS + 1)`` fp32, overwritten),
    to be summed over its replica group, the ranks that hold the same shards. Device ops only."""
    out.zero_()
    shards = fingerprint[: FINGERPRINT_WIDTH * len(out)]
    index = torch.arange(len(out), device=out.device) * (FINGERPRINT_BINS + 1) + fingerprint_bins(shards)
    out.view(-1).index_fill_(0, index, 1.0)


def replica_differs(layout: FleetLayout, reduced: torch.Tensor, fingerprint: torch.Tensor, shard_counts: torch.Tensor | None = None) -> torch.Tensor:
    """1 where this rank's fingerprint, in some tensor that every rank compared, is not in that
    tensor's only most common bin of the all-reduced histograms (a tie: every rank of it), else
    0 (fp32, a device op: nothing synchronises). The same verdict as ``replica_differences`` on
    every rank's fingerprints, but for two fingerprints that share a bin. Under HSDP
    (``layout.sharded``) the parameter shards' histograms are ``shard_counts``, this rank's
    replica group's (``count_shards``): the verdict of ``replica_differences`` within each
    replica group, the buffers' over the whole mesh."""
    counts = reduced[layout.part("fingerprints")].view(layout.histogram_rows, FINGERPRINT_BINS + 1)
    if layout.sharded:
        counts = torch.cat([shard_counts, counts])
    compared = counts[:, FINGERPRINT_BINS] == 0
    hashed = counts[:, :FINGERPRINT_BINS]
    top = hashed.max(dim=1).values
    unique = (hashed == top.unsqueeze(1)).sum(dim=1) == 1
    # (A tensor this rank did not compare is in the extra bin, and not compared: any bin will do.)
    mine = hashed.gather(1, fingerprint_bins(fingerprint).clamp(max=FINGERPRINT_BINS - 1).unsqueeze(1)).squeeze(1)
    return (compared & ((mine < top) | ~unique)).any().to(torch.float32)


@dataclass
class LayerState:
    """A rank's layer CUSUM between instrumented steps (``own_values``; ``layer_levels`` keeps one
    for every rank at once: the fields but ``scale`` and ``weight`` with a leading rank axis).

    Per parameter, the rank's own:
        average: the running average of its deviation ``d_p``.
        cusum: its CUSUM.
        seen: the steps where it had a parameter to compare (a 0-dim tensor; 0: none yet).
    Per parameter, pooled over the ranks (the same on every rank: read from the all-reduced sums):
        scale: the running mean of ``sqrt(pi / 2) |rise|`` over the ranks that learn.
        weight: the weight ``scale`` has gathered (its bias correction, as in Adam's).
    What the rank adds to the next step's sums:
        rise_sum: ``sqrt(pi / 2) |rise_p|`` where it knew ``d_p`` on this step (not its first), else 0.
        rise_count: 1 there, else 0."""

    average: torch.Tensor | np.ndarray
    cusum: torch.Tensor | np.ndarray
    seen: torch.Tensor | np.ndarray
    scale: torch.Tensor | np.ndarray
    weight: torch.Tensor | np.ndarray
    rise_sum: torch.Tensor | np.ndarray
    rise_count: torch.Tensor | np.ndarray


def own_sums(layout: FleetLayout, wire):
    """The parts of the all-reduced ``wire`` (torch or numpy) that ``own_values`` reads, adjacent in
    it: from the parameters' norms to the sum of the sketches."""
    return wire[layout.part("param_norms").start : layout.part("sketch_sum").stop]


def own_values(
    layout: FleetLayout, sums: np.ndarray, sketch: np.ndarray | None, previous: np.ndarray | None, param_sq: np.ndarray, state: LayerState | None
) -> tuple[np.ndarray, LayerState]:
    """This rank's values of a step, from ``sums`` (``own_sums`` of the step's all-reduced
    wire): ``[cos_loo, cos_previous, layer level, layer parameter]`` (float64, NaN where
    undefined), and its layer CUSUM carried to the next step. On the host, in numpy, when the
    rank packs its next instrumented step: its squared norms ``param_sq`` and ``sketch`` and the
    sums came over in one copy (``BaseSilentState._keep_fleet``), 5 to 10 KB, instead of some 55
    device operations a step on vectors of P numbers. The cosines are those ``ddphooks.stats``
    computes from every rank's sketch (``previous``: this rank's sketch of the previous
    instrumented step where comparable, the same bucket layouts). The layer CUSUM is the
    detector's per-parameter one (``Detector._parameter_changes``), run by the rank on itself,
    since only the rank holds its own history of every parameter, with a scale pooled over the
    ranks through the wire, as the detector pools it (one rank's own scale, from a heavy-tailed
    stream, is noisy enough to raise false alarms):

    1. the pooled scale learns from the ranks' rises of the previous step (the sums in the
       wire): where n_p, the ranks that knew ``d_p``, is > 0,
       ``s_p <- (1 - LAYER_RATE) s_p + LAYER_RATE sum_i sqrt(pi / 2) |rise_{i,p}| / n_p``
       (every rank's rise, a rank whose CUSUM is rising included: a scale of the quiet parts only
       is too small for heavy-tailed gradients, and one faulty rank is 1 / n of the mean);
    2. ``d_p = log|g_p| - log mean_{j != i} |g_{j,p}|`` (the others' exact mean, from the sums),
       unknown where not finite, less its (lower) median over the parameters;
    3. ``rise_p = d_p - a_p`` (``a`` the running average of ``d``, ``d`` itself on the first
       step), ``z_p = rise_p / (s_p / w_p + 1e-3)`` (``w_p`` the weight ``s_p`` has gathered),
       0 where unknown;
    4. after ``LAYER_WARMUP`` steps ``C_p <- max(0, C_p + min(z_p, LAYER_CAP) - LAYER_DRIFT)``;
    5. ``a`` learns (rate ``LAYER_RATE``) only where ``C_p`` is 0, so a lasting fault does not
       become the baseline; the rank's ``sqrt(pi / 2) |rise_p|`` goes into the next step's sums
       wherever ``d_p`` was known;
    6. the level ``max_p C_p`` and its parameter's index go out in the rank's next row.

    A step where the rank has no parameter to compare (absent under ``Join``: no gradient) leaves
    its baseline and CUSUMs as they were (its scale still learns from the others). ``state`` is
    None on the first step."""
    start = layout.part("param_norms").start

    def read(name: str) -> np.ndarray:
        part = layout.part(name)
        return np.asarray(sums[part.start - start : part.stop - start], dtype=np.float64)

    loo = to_previous = math.nan
    with np.errstate(invalid="ignore", divide="ignore"):  # a zero sketch: NaN (0 / 0)
        if layout.bins and sketch is not None:
            s = np.asarray(sketch, dtype=np.float64)
            others = read("sketch_sum") - s
            own = np.sqrt(s @ s)
            loo = (s @ others) / (own * np.sqrt(others @ others))
            if previous is not None:
                p = np.asarray(previous, dtype=np.float64)
                to_previous = (s @ p) / (own * np.sqrt(p @ p))
        norms = np.sqrt(np.asarray(param_sq, dtype=np.float64))
        others_mean = (read("param_norms") - norms) / (read("present")[0] - 1.0)
    n_params = len(norms)
    if state is None:
        zero = np.zeros(n_params)
        state = LayerState(zero, zero, 0.0, zero, zero, zero, zero)
    scale, weight = _pool_scale(state.scale, state.weight, read("rise_sum"), read("rise_count"))
    average, cusum, seen, rise_sum, rise_count, level, parameter = _layer_step(
        norms[None], others_mean[None], state.average[None], state.cusum[None], np.array([state.seen]), scale, weight
    )  # fmt: skip
    state = LayerState(average[0], cusum[0], float(seen[0]), scale, weight, rise_sum[0], rise_count[0])
    values = np.array([np.clip(loo, -1.0, 1.0), np.clip(to_previous, -1.0, 1.0), level[0], parameter[0]])
    values[~np.isfinite(values)] = math.nan
    return values, state


def _layer_step(mine, others_mean, average, cusum, seen, scale, weight) -> tuple:
    """Steps 2-6 of ``own_values`` for R ranks at once (``mine``, ``others_mean``, ``average``,
    ``cusum``: R x P; ``seen``: R; the pooled ``scale`` and ``weight`` after step 1: P): the
    ranks' new ``average``, ``cusum`` and ``seen``, their ``rise_sum`` and ``rise_count`` for the
    next step's sums, and their levels and parameters (NaN where a rank had nothing to compare).
    One rank's ``own_values`` and every rank's ``layer_levels`` run this same arithmetic."""
    with np.errstate(invalid="ignore", divide="ignore"):
        deviation = np.log(mine) - np.log(others_mean)
    deviation = np.where(np.isfinite(deviation), deviation, np.nan)  # a parameter this rank's batch did not use: unknown
    known = np.isfinite(deviation)
    # Less the lower median of an even count, as the detector takes it (NaN sorts last; a rank with
    # no known parameter: all NaN). A sort, not np.nanquantile: 3x faster on one rank's row.
    middle = np.maximum((known.sum(axis=1) - 1) // 2, 0)
    deviation = deviation - np.take_along_axis(np.sort(deviation, axis=1), middle[:, None], axis=1)
    anything = known.any(axis=1)  # a rank with no parameter to compare (absent: no gradient) has no level, and its CUSUM waits
    first = (seen == 0)[:, None]  # its deviations are its baseline, nothing else yet
    rise = np.where(known, deviation - average, 0.0)
    z = rise / (np.where(weight > 0, scale / np.where(weight > 0, weight, 1.0), 0.0) + 1e-3)
    counting = ((seen >= LAYER_WARMUP) & anything)[:, None]
    cusum = np.where(first, 0.0, np.where(counting, np.maximum(0.0, cusum + np.minimum(z, LAYER_CAP) - LAYER_DRIFT), cusum))
    learn = known & (cusum == 0) & ~first
    average = np.where(learn, average + LAYER_RATE * rise, average)  # rise = d - a where known
    average = np.where(first, np.where(known, deviation, 0.0), average)
    pooled = known & ~first
    rise_sum = np.where(pooled, math.sqrt(math.pi / 2) * np.abs(rise), 0.0)
    levels = np.where(anything, cusum.max(axis=1), np.nan)
    parameters = np.where(anything, cusum.argmax(axis=1), np.nan)
    return average, cusum, seen + anything, rise_sum, pooled.astype(np.float64), levels, parameters


def stage(values: np.ndarray | None, layer: LayerState | None, n_params: int, status: int, count: int, device: torch.device) -> torch.Tensor:
    """What ``pack`` writes of this rank that the host knows, on ``device`` in one copy (from
    pinned memory on an accelerator: nothing synchronises): ``[cos_loo, cos_previous, layer
    level]`` of ``values`` (``own_values``; NaN where None or unknown), the wire's status
    (``status`` + ``STATUS_ROOM`` (layer parameter + 1), + ``NO_LOSS`` where ``count`` is 0: small
    integers, exact), 1 (its one in ``present``), ``max(count, 1)``, 0, then the rises of ``layer``
    (``rise_sum``, ``rise_count``; zeros where None)."""
    host = torch.empty(STAGED + 2 * n_params, dtype=torch.float32, pin_memory=device.type != "cpu")
    staged = host.numpy()
    staged[:3] = math.nan if values is None else values[:3]
    parameter = math.nan if values is None else values[3]
    staged[3] = status + (0.0 if math.isnan(parameter) else STATUS_ROOM * (parameter + 1.0)) + (NO_LOSS if count == 0 else 0)
    staged[STAGED_PRESENT], staged[STAGED_COUNT], staged[STAGED_ZERO] = 1.0, max(count, 1), 0.0
    staged[STAGED : STAGED + n_params] = 0.0 if layer is None else layer.rise_sum
    staged[STAGED + n_params :] = 0.0 if layer is None else layer.rise_count
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _pool_scale(scale, weight, rise_sum, rise_count):
    """Step 1 of ``own_values`` (numpy): the pooled scale and its weight after the ranks' rises of
    the previous step, unchanged where no rank learned."""
    learned = rise_count > 0
    mean = rise_sum / np.where(learned, rise_count, 1.0)
    return np.where(learned, (1 - LAYER_RATE) * scale + LAYER_RATE * mean, scale), np.where(learned, (1 - LAYER_RATE) * weight + LAYER_RATE, weight)


def as_compact_records(records: list[dict], sampled: int) -> list[dict]:
    """Records of a run with every rank's whole slot, as the compact wire would have written them
    (what the detector reads of them), for measuring offline what the compact wire changes in
    detection on runs recorded in detail every step (``benchmarks/workloads.py --redetect
    --compact-wire``):

    1. each record's per-rank cosines, layer levels and parameters are those of the record before
       it (``cosines_step``; none for the first), and there is no per-rank ``cosine_to_others``;
    2. a detail record's per-parameter norms are only those of the step's sampled ranks
       (``grad_norms_sampled``, ``sampled_ranks``, ``grad_norm_mean``), chosen by
       ``choose_sampled`` from the layer levels each rank would have sent (computed by
       ``own_values`` from the records' norms);
    3. a replica check's verdict is on the record after it (``checked_step``; the hashes'
       verdict is the fingerprints' but where two fingerprints share a bin).

    The other values are the same to fp32 rounding (``tests/test_fleet.py``)."""
    compact, previous, scores, states = [], None, [], {}
    for index, record in enumerate(records):
        out = dict(record)
        for key in ("cosine_loo", "cosine_previous"):
            out[key] = None if previous is None or previous.get(key) is None else list(previous[key])
        out["cosine_to_others"] = None
        out["cosines_step"] = None if previous is None else previous["step"]
        # A replica check's verdict arrives with the step after it (the ranks flag themselves).
        checked = None if previous is None else previous.get("replicas")
        out["replicas"] = None if checked is None else {**checked, "checked_step": previous["step"]}
        # The levels of two steps before: sent in the previous step's rows (see choose_sampled).
        before = scores[index - 2] if index >= 2 else None
        rows = choose_sampled(int(record["world_size"]), sampled, index, None if before is None else before[0])
        out.update(wire="compact", sampled_ranks=rows, cosine=None)
        # The layer levels of the step before: sent in this step's rows, as the cosines.
        levels = scores[index - 1] if index >= 1 else None
        out.update(layer_levels=None if levels is None else _floats(levels[0]), layer_parameters=None if levels is None else _floats(levels[1]))
        if record.get("parameters") and all("grad_norms" in p for p in record["parameters"]):
            scores.append(_layer_levels(record, states))
            out["parameters"] = [_compact_layer_entry(p, rows) for p in record["parameters"]]
            out["buckets"] = [_compact_layer_entry(b, rows) for b in record.get("buckets") or []]
        else:
            scores.append(None)
        previous = record
        compact.append(out)
    return compact


def _layer_levels(record: dict, states: dict) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's layer level and parameter of a detail record, as ``own_values`` computes them on
    the rank (``states``: the ranks' layer CUSUMs, carried from record to record)."""
    world = int(record["world_size"])
    norms = np.array([[math.nan if v is None else v for v in p["grad_norms"]] for p in record["parameters"]], dtype=float).T  # W x P
    present = [r for r in range(world) if r not in set(record.get("absent") or [])]
    names = tuple(p["name"] for p in record["parameters"])  # a rank's CUSUM restarts where the parameters' order changes, as on the rank
    levels, parameters, states[names] = layer_levels(norms, present, states.get(names))
    return levels, parameters


def layer_levels(norms: np.ndarray, present: list[int], state: LayerState | None) -> tuple[np.ndarray, np.ndarray, LayerState]:
    """Every rank's layer level and parameter of one step at once, as each rank's ``own_values``
    computes its own (the offline emulation, ``as_compact_records``, and benchmarks at large W).

    Args:
        norms: W x P local gradient norms (NaN: unknown).
        present: the ranks that trained on the step (the others: NaN, their CUSUMs kept).
        state: the ranks' layer CUSUMs after the step before (W x P fields, ``seen`` per rank, 0
            for a rank not seen yet; the pooled ``scale`` and ``weight`` P), or None.

    Returns the W levels, the W parameters' indices (float, NaN where absent) and the state."""
    world, n_params = norms.shape
    if state is None:
        zeros, pooled = np.zeros((world, n_params)), np.zeros(n_params)
        state = LayerState(zeros, zeros, np.zeros(world), pooled, pooled, zeros, zeros)
    levels, parameters = np.full(world, np.nan), np.full(world, np.nan)
    rows = np.asarray(present, dtype=int)
    # What the step's all-reduce sums: the present ranks' rises of their step before.
    scale, weight = _pool_scale(state.scale, state.weight, state.rise_sum[rows].sum(axis=0), state.rise_count[rows].sum(axis=0))
    state = LayerState(state.average.copy(), state.cusum.copy(), state.seen.copy(), scale, weight, np.zeros((world, n_params)), np.zeros((world, n_params)))
    if not len(rows):
        return levels, parameters, state
    mine = norms[rows]
    with np.errstate(invalid="ignore", divide="ignore"):
        others = (np.nansum(norms[rows], axis=0) - mine) / (len(rows) - 1.0)
    average, cusum, seen, rise_sum, rise_count, levels[rows], parameters[rows] = _layer_step(
        mine, others, state.average[rows], state.cusum[rows], state.seen[rows], scale, weight
    )  # fmt: skip
    state.average[rows], state.cusum[rows], state.seen[rows] = average, cusum, seen
    state.rise_sum[rows], state.rise_count[rows] = rise_sum, rise_count
    return levels, parameters, state


def _compact_layer_entry(entry: dict, rows: list[int]) -> dict:
    """A detail record's parameter or bucket as the compact wire gives it: the mean norm over the
    present ranks and the sampled ranks' norms instead of every rank's."""
    if "grad_norms" not in entry:
        return dict(entry)
    norms = entry["grad_norms"]
    known = [v for v in norms if v is not None]
    compact = {k: v for k, v in entry.items() if k != "grad_norms"}
    compact.update(grad_norm_mean=sum(known) / len(known) if known else None, grad_norms_sampled=[norms[r] for r in rows])
    return compact

