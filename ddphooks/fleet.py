"""The compact wire: what each rank sends above ``SilentConfig.gather_max_world`` ranks, and the
statistics built from it (no ``torch.distributed`` here: the transport calls these functions).

Up to ``gather_max_world`` ranks every rank's whole slot travels on every instrumented step
(``ddphooks.stats``): W x (3 + P + k) numbers for P parameters and a k-entry sketch, so each
rank's share of the all-reduce grows with W (8.6 MB a step at W = 4096, P = 273, k = 256). Above
it, most of what the statistics need is a sum over the ranks, which the same all-reduce gives at
a size that does not depend on W, and each rank finishes its own cosines locally. One flat fp32
buffer, each part summed over the ranks (a rank writes zeros where it has nothing):

1. per rank, ``PER_RANK`` numbers (a gather: only rank i writes row i)::

       [loss_i, |g_i|^2, cos_loo_i, cos_previous_i, level_i, status_i + 32 (parameter_i + 1)]

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
import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ddphooks.detect import PARAMETER_RATE, DetectorConfig
from ddphooks.devices import PendingHost
from ddphooks.hosts import RANK_DECIMALS, HostBlocks, HostMatrix, block_cosines, rounded_rows
from ddphooks.stats import (
    FINGERPRINT_WIDTH,
    MAX_NONFINITE_LISTED,
    MAX_REPLICA_DIFFERENCES,
    NOT_COMPARED,
    BucketLayout,
    SilentStats,
    _float,
    _floats,
    weighted_mean_cosine_from_sums,
)

#: Numbers per rank in the compact wire's row (see the module docstring), and their places.
PER_RANK = 6
WIRE_LOSS, WIRE_RANK_SQ, WIRE_COSINE_LOO, WIRE_COSINE_PREVIOUS, WIRE_LAYER, WIRE_STATUS = range(PER_RANK)
#: The rank's own values (``own_values``): cos_loo, cos_previous, layer level, layer parameter.
OWN_VALUES = 4
#: The row as ``FleetStats`` reads it, decoded: ``SilentStats``'s first three columns, then these.
RANK_SQ, COSINE_LOO, COSINE_PREVIOUS, LAYER, LAYER_PARAMETER = 3, 4, 5, 6, 7
#: Status flag of the compact wire: on the replica check before this step, the rank's fingerprint
#: of some tensor was not that tensor's only most common one.
REPLICA_DIFFERS = 4
#: Status flag of the compact wire: the rank observed no loss on this step (its row's loss, a mean,
#: is then 0, not a loss).
NO_LOSS = 8
#: The status flags' room in the ``status + STATUS_ROOM (parameter + 1)`` number (ABSENT 1,
#: REPLICA_CHECK_REQUESTED 2, REPLICA_DIFFERS 4, NO_LOSS 8, FAILED 16; parameter + 1 = 0: no layer
#: level). Exact in fp32 up to 524,286 parameters.
STATUS_ROOM = 32
#: Hash bins per tensor of the compact replica check (and one more for ``NOT_COMPARED``): two
#: different fingerprints share a bin, and that tensor's difference goes unseen, 1 time in 64.
FINGERPRINT_BINS = 64
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


@dataclass(frozen=True)
class FleetLayout:
    """Where each part sits in the compact wire's flat buffer of one step (see the module docstring).

    ``reduced``: numbers of the last part, ``reduced_sq``, a plain sum over the ranks that only a
    sharded transport fills: under FSDP2 each rank holds its shard of the averaged gradient and
    adds ``|its shard of gbar_p|^2`` per parameter (``n_params`` numbers), which sum to
    ``|gbar_p|^2``; DDP computes the reduced norms from its own averaged buckets (0: no part, the
    wire unchanged).

    ``sharded``: under HSDP the first ``sharded`` of the ``fingerprinted`` tensors are parameter
    shards, which only the ranks holding the same shard must agree on: their histograms are
    summed over each replica group apart (``count_shards``), and this wire carries their
    ``shard_checks`` instead (``SHARD_CHECK`` numbers each); the other tensors (buffers) have
    one histogram each here, over the whole mesh. 0 elsewhere (one histogram per tensor).

    ``matrix_rows``: on a detail step (``ddphooks.records.is_detail_step``), rows of ``bins``
    numbers for the cosine matrix (7 in the module docstring): ``world`` rows, each rank's sketch
    in its own row (the W x W matrix, up to ``detail_max_world``), or with ``host_form`` one row
    per block of ``ddphooks.hosts.HostBlocks``, each host's ranks' unit sketches summed, and as
    many counts of the ranks summed (the host-by-host matrix). 0 on other steps."""

    world: int
    n_params: int
    n_buckets: int
    bins: int
    sampled: int
    fingerprinted: int = 0
    reduced: int = 0
    sharded: int = 0
    matrix_rows: int = 0
    host_form: bool = False

    @property
    def rows(self) -> int:
        """Sampled rows of per-parameter norms."""
        return min(self.sampled, self.world)

    @property
    def histogram_rows(self) -> int:
        """Histograms of the replica check in this wire: one per tensor compared over the whole mesh."""
        return self.fingerprinted - self.sharded

    @cached_property
    def _bounds(self) -> dict[str, tuple[int, int]]:
        sizes = {
            "per_rank": self.world * PER_RANK,
            "sampled": self.rows * self.n_params,
            "param_sq": self.n_params,
            "param_norms": self.n_params,
            "rise_sum": self.n_params,
            "rise_count": self.n_params,
            "bucket_norms": self.n_buckets,
            "present": 1,
            "sketch_sum": self.bins,
            "unit_sum": self.bins,
            "fingerprints": self.histogram_rows * (FINGERPRINT_BINS + 1),
            "shard_checks": self.sharded * SHARD_CHECK,
            "reduced_sq": self.reduced,
            "matrix": self.matrix_rows * self.bins,
            "matrix_present": self.matrix_rows if self.host_form else 0,
        }
        bounds, begin = {}, 0
        for name, size in sizes.items():
            bounds[name] = (begin, begin + size)
            begin += size
        return bounds

    def part(self, name: str) -> slice:
        begin, end = self._bounds[name]
        return slice(begin, end)

    @property
    def size(self) -> int:
        return self._bounds["matrix_present"][1]


def pack(
    layout: FleetLayout,
    rows: list[int],
    rank: int,
    head: torch.Tensor,
    local_sq: list[torch.Tensor],
    sketch: torch.Tensor | None,
    own: torch.Tensor,
    fingerprint: torch.Tensor | None,
    absent: bool,
    out: torch.Tensor,
    differs: torch.Tensor | None = None,
    layer: LayerState | None = None,
    shard_checks: torch.Tensor | None = None,
    matrix_row: int | None = None,
) -> torch.Tensor:
    """Write this rank's part of the compact wire into ``out`` (zeroed, ``layout.size`` fp32):
    its row (from ``head`` = [loss_sum, loss_count, status]: its mean loss and status, with
    ``NO_LOSS`` where it counted none; its squared norm; ``own`` = its ``own_values`` of the
    previous step, the layer parameter in the status number), its per-parameter squared norms
    (``local_sq``, one tensor per bucket) where it is in ``rows`` (``choose_sampled``), and what it
    adds to the sums (nothing but its row where it is ``absent``): ``layer``'s rises of the
    previous step (``own_values``, for the pooled scale); on a replica-check step its one in each
    tensor's histogram (``fingerprint_bins``; under HSDP the buffers', and on a shard's first
    replica its group's ``shard_checks``); after one, ``differs`` (``replica_differs``: 1 or 0)
    sets ``REPLICA_DIFFERS`` in its status. On a detail step (``layout.matrix_rows``) its sketch
    in row ``matrix_row`` (its rank) of the matrix part, or with ``layout.host_form`` its unit
    sketch added to row ``matrix_row`` (its block) and a one to that block's count (0 for a zero
    sketch): one or two more ops. Returns the rank's P squared norms in one tensor
    (``own_values`` reads them after the all-reduce). Device ops only: nothing synchronises."""
    param_sq = torch.cat(local_sq) if len(local_sq) > 1 else local_sq[0]
    row = out[layout.part("per_rank")].view(layout.world, PER_RANK)[rank]
    counted = head[1] > 0
    row[WIRE_LOSS] = torch.where(counted, head[0] / torch.where(counted, head[1], 1.0), 0.0)
    row[WIRE_RANK_SQ] = param_sq.sum()
    row[WIRE_COSINE_LOO : WIRE_LAYER + 1] = own[:3]
    # status + STATUS_ROOM (parameter + 1): small integers, exact (NaN parameter: 0).
    status = row[WIRE_STATUS]
    torch.add(head[2], torch.nan_to_num(own[3] + 1.0, nan=0.0), alpha=STATUS_ROOM, out=status)
    status += NO_LOSS * (~counted)
    if differs is not None:
        status += REPLICA_DIFFERS * differs
    if absent:
        return param_sq
    if rank in rows:
        out[layout.part("sampled")].view(layout.rows, layout.n_params)[rows.index(rank)] = param_sq
    out[layout.part("param_sq")] = param_sq
    torch.sqrt(param_sq, out=out[layout.part("param_norms")])
    if layer is not None:
        out[layout.part("rise_sum")] = layer.rise_sum
        out[layout.part("rise_count")] = layer.rise_count
    bucket_norms = out[layout.part("bucket_norms")]
    torch.stack([sq.sum() for sq in local_sq], out=bucket_norms)
    bucket_norms.sqrt_()
    out[layout.part("present")] = 1.0
    if layout.bins and sketch is not None:
        out[layout.part("sketch_sum")] = sketch
        norm = torch.linalg.vector_norm(sketch)
        # A zero sketch (no gradient on this rank) adds nothing to U, not 0/0.
        torch.div(sketch, torch.where(norm > 0, norm, torch.ones_like(norm)), out=out[layout.part("unit_sum")])
        if layout.matrix_rows and matrix_row is not None:
            rows = out[layout.part("matrix")].view(layout.matrix_rows, layout.bins)
            if layout.host_form:  # this rank's unit sketch into its host's sum, and a one into its count
                rows[matrix_row] = out[layout.part("unit_sum")]
                torch.sign(norm, out=out[layout.part("matrix_present")][matrix_row])
            else:
                rows[matrix_row] = sketch
    if fingerprint is not None:
        compared = fingerprint[FINGERPRINT_WIDTH * layout.sharded :]  # the parameter shards' went to count_shards
        index = torch.arange(layout.histogram_rows, device=out.device) * (FINGERPRINT_BINS + 1) + fingerprint_bins(compared)
        out[layout.part("fingerprints")].index_fill_(0, index, 1.0)
    if shard_checks is not None:
        out[layout.part("shard_checks")] = shard_checks.reshape(-1)
    return param_sq


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


#: Numbers per histogram in ``histogram_checks``: the ranks outside the most common bin (all of a
#: tie), 1 if the ranks' fingerprints fell in more than one bin, 1 if some rank did not compare.
SHARD_CHECK = 3


def histogram_checks(counts: torch.Tensor) -> torch.Tensor:
    """What the record needs of summed fingerprint histograms (a row each, ``FINGERPRINT_BINS + 1``
    counts): per row ``SHARD_CHECK`` numbers, the ranks outside its only most common bin (every
    rank of a tie), 1 if the ranks' fingerprints fell in more than one bin, 1 if some rank did not
    compare (small integers, in ``counts``' dtype). For a replica group's parameter histograms
    (``count_shards``) on the device, the shards' checks the wire carries; ``replica_verdict``
    reads the buffers' histograms of the whole mesh with it."""
    compared = counts[:, FINGERPRINT_BINS] == 0
    hashed = counts[:, :FINGERPRINT_BINS]
    top = hashed.max(dim=1).values
    unique = (hashed == top.unsqueeze(1)).sum(dim=1) == 1
    differing = compared & ((hashed > 0).sum(dim=1) > 1)
    outside = torch.where(unique, hashed.sum(dim=1) - top, hashed.sum(dim=1)) * differing
    return torch.stack([outside, differing.to(counts.dtype), (~compared).to(counts.dtype)], dim=1)


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


def own_values(
    layout: FleetLayout, reduced: torch.Tensor, sketch: torch.Tensor | None, previous: torch.Tensor | None, param_sq: torch.Tensor, state: LayerState | None
) -> tuple[torch.Tensor, LayerState]:
    """This rank's values of the step, from the all-reduced buffer ``reduced``: ``[cos_loo,
    cos_previous, layer level, layer parameter]`` in fp32 (NaN where undefined), and its layer
    CUSUM carried to the next step. The cosines are those ``ddphooks.stats`` computes from every
    rank's sketch (``previous``: this rank's sketch of the previous instrumented step where
    comparable, the same bucket layouts). The layer CUSUM is the detector's per-parameter one
    (``Detector._parameter_changes``), run by the rank on itself, since only the rank holds its
    own history of every parameter, with a scale pooled over the ranks through the wire, as the
    detector pools it (one rank's own scale, from a heavy-tailed stream, is noisy enough to
    raise false alarms):

    1. the pooled scale learns from the ranks' rises of the previous step (the sums in
       ``reduced``): where n_p, the ranks that knew ``d_p``, is > 0,
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
    None on the first step. Device ops in float64 (the host path's precision);
    nothing synchronises."""
    nan = torch.full((), math.nan, dtype=torch.float64, device=reduced.device)  # torch.full: a Python scalar copied to a GPU would wait for it
    loo = to_previous = nan
    if layout.bins and sketch is not None:
        s = sketch.double()
        total = reduced[layout.part("sketch_sum")].double()
        own = torch.dot(s, s)
        others = total - s
        loo = torch.dot(s, others) / (own.sqrt() * torch.dot(others, others).sqrt())
        if previous is not None:
            p = previous.double()
            to_previous = torch.dot(s, p) / (own.sqrt() * torch.dot(p, p).sqrt())
    present = reduced[layout.part("present")].double()[0]
    norms = param_sq.double().sqrt()
    others_mean = (reduced[layout.part("param_norms")].double() - norms) / (present - 1.0)
    deviation = norms.log() - others_mean.log()
    deviation = torch.where(torch.isfinite(deviation), deviation, nan)  # a parameter this rank's batch did not use: unknown
    deviation = deviation - torch.nanmedian(deviation)
    known = torch.isfinite(deviation)
    anything = known.any()  # a rank with no parameter to compare (absent: no gradient) has no level, and its CUSUM waits
    zero = torch.zeros_like(deviation)
    if state is None:
        state = LayerState(zero, zero, torch.zeros((), dtype=torch.float64, device=zero.device), zero, zero, zero, zero)
    scale, weight = _pool_scale(state.scale, state.weight, reduced[layout.part("rise_sum")].double(), reduced[layout.part("rise_count")].double())
    first = state.seen == 0  # its deviations are its baseline, nothing else yet
    rise = torch.where(known, deviation - state.average, zero)
    typical = torch.where(weight > 0, scale / torch.where(weight > 0, weight, 1.0), 0.0) + 1e-3
    counted = (state.cusum + (rise / typical).clamp(max=LAYER_CAP) - LAYER_DRIFT).clamp(min=0.0)
    cusum = torch.where(first, zero, torch.where((state.seen >= LAYER_WARMUP) & anything, counted, state.cusum))
    learn = known & (cusum == 0) & ~first
    average = torch.where(learn, (1 - LAYER_RATE) * state.average + LAYER_RATE * deviation, state.average)
    average = torch.where(first, torch.where(known, deviation, zero), average)
    pooled = known & ~first
    rise_sum = torch.where(pooled, math.sqrt(math.pi / 2) * rise.abs(), zero)
    state = LayerState(average, cusum, state.seen + anything.double(), scale, weight, rise_sum, pooled.double())
    level, parameter = state.cusum.max(dim=0)
    level, parameter = torch.where(anything, level, nan), torch.where(anything, parameter.double(), nan)
    values = torch.stack([loo.clamp(-1.0, 1.0), to_previous.clamp(-1.0, 1.0), level, parameter])
    values = torch.where(torch.isfinite(values), values, nan)
    return values.float(), state


def _pool_scale(scale, weight, rise_sum, rise_count):
    """Step 1 of ``own_values`` (torch or numpy): the pooled scale and its weight after the ranks'
    rises of the previous step, unchanged where no rank learned."""
    where = torch.where if isinstance(scale, torch.Tensor) else np.where
    learned = rise_count > 0
    mean = rise_sum / where(learned, rise_count, 1.0)
    return where(learned, (1 - LAYER_RATE) * scale + LAYER_RATE * mean, scale), where(learned, (1 - LAYER_RATE) * weight + LAYER_RATE, weight)


class FleetStats(SilentStats):
    """``SilentStats`` of a step that travelled in the compact wire (see the module docstring).

    The same API and records, with what the compact wire does not carry said so:

    - ``cosine_loo``, ``cosine_previous`` and ``layer_scores``: each rank's values of the
      previous instrumented step, ``cosines_step`` (None on the first: no values);
    - ``cosine`` (the W x W matrix): on detail steps up to ``detail_max_world`` only (every
      rank's sketch travels then), from the same sketches as the whole slots'; above it
      ``cosine_hosts`` on detail steps, from each host's sum of unit sketches; None on the others;
    - ``cosine_to_others``: None;
    - ``param_sq``: the rows of ``sampled_ranks`` only, NaN elsewhere;
    - ``replicas``: the verdict of the replica check of the instrumented step before
      (``checked_step``), on the step after it, naming the ranks that flagged themselves
      (``replica_verdict``); None on the others;
    - ``mean_cosine``, ``weighted_mean_cosine``, the noise scale, losses and gradient norms:
      exact, of this step, as in the full slot.

    Args (beyond ``SilentStats``'s):
        layout: the buffer's layout.
        reduced_wire: the all-reduced flat buffer (``layout.size``).
        sampled: the ranks whose per-parameter norms it carries, in row order (``choose_sampled``).
        cosines_step: the step the per-rank cosines belong to (None: none yet).
        replica_check: the statistics of the previous instrumented step where it checked the
            replicas (its histograms), None otherwise.
        hosts: with ``layout.host_form``, the blocks its host-by-host matrix is summed over (the
            state's ``hosts``), for the record's labels.
    """

    def __init__(
        self,
        step: int,
        buckets: list[BucketLayout],
        layout: FleetLayout,
        reduced_wire: torch.Tensor,
        reduced_sq: torch.Tensor,
        transport: str,
        sampled: list[int],
        cosines_step: int | None,
        fingerprinted: list[str] | None = None,
        divided_by_present: bool = False,
        replica_check: "FleetStats | None" = None,
        hosts: HostBlocks | None = None,
    ) -> None:
        per_rank = reduced_wire[layout.part("per_rank")].view(layout.world, PER_RANK)
        super().__init__(step, layout.world, buckets, per_rank, reduced_sq, layout.bins, transport, fingerprinted, divided_by_present=divided_by_present)
        self.layout = layout
        self.sampled = list(sampled)
        self.parameter_rows = self.sampled
        self.cosines_step = cosines_step
        self.hosts = hosts
        if reduced_wire.numel() != layout.size:
            raise ValueError(f"the compact wire has {reduced_wire.numel()} numbers, its layout {layout.size}")
        self._rest_host = PendingHost([reduced_wire[layout.part("per_rank").stop :]])
        # The check's histograms, names and absent ranks, not the step itself (which would chain
        # every step to the one before where every step checks).
        self._replica_check = None
        if replica_check is not None:
            check = replica_check
            self._replica_check = (check.step, check._histograms, check.fingerprinted, check.absent_ranks, check._shard_checks)

    def slots(self) -> None:
        """None: a compact step is read where it is (its rows, sums and sampled norms need the
        layout and the layer state of this process); the detector's process gets its
        ``Observation``."""
        return None

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The rows decoded (``SilentStats``'s loss sum, loss count and status, the loss being the
        rank's mean over a count of 1, 0 where ``NO_LOSS``; then ``RANK_SQ`` ...) and the reduced
        squared norms."""
        with self._lock:
            wire, reduced = self._host.arrays()
        packed = wire[:, WIRE_STATUS]
        code = np.floor(packed / STATUS_ROOM)
        status = packed - STATUS_ROOM * code
        count = ((status.astype(np.int64) & NO_LOSS) == 0).astype(float)
        parameter = np.where(code > 0, code - 1.0, np.nan)
        rows = np.column_stack([wire[:, WIRE_LOSS], count, status, wire[:, WIRE_RANK_SQ : WIRE_LAYER + 1], parameter])
        return rows, reduced

    def _status_column(self) -> np.ndarray:
        return self.status  # packed with the loss in the wire's rows: decoded with them

    @cached_property
    def _rest(self) -> np.ndarray:
        """The buffer after the rows (sampled norms, sums, fingerprints), float64."""
        with self._lock:
            return self._rest_host.arrays()[0]

    def _part(self, name: str) -> np.ndarray:
        offset = self.layout.part("per_rank").stop
        where = self.layout.part(name)
        return self._rest[where.start - offset : where.stop - offset]

    @property
    def sampled_param_sq(self) -> np.ndarray:
        """``len(sampled)`` x P: the sampled ranks' squared norms per parameter, in ``sampled`` order."""
        return self._part("sampled").reshape(self.layout.rows, self.layout.n_params)[: len(self.sampled)]

    @property
    def mean_param_norms(self) -> np.ndarray:
        """P: each parameter's mean local gradient norm over the ranks present (exact, from the sums)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self._part("param_norms") / self.present_count

    @cached_property
    def param_sq(self) -> np.ndarray:
        """W x P squared norms of each sampled rank's local gradient per parameter, NaN for the
        ranks not sampled on this step (computed once, where asked for: ``sampled_param_sq`` is
        what the detector and the records read)."""
        result = np.full((self.world_size, self.layout.n_params), np.nan)
        result[self.sampled] = self.sampled_param_sq
        return result

    @cached_property
    def layer_scores(self) -> np.ndarray | None:
        """Per rank, its layer level on ``cosines_step``: the highest of its per-parameter layer
        CUSUMs (``own_values``; ``choose_sampled`` reads it, and the detector takes it as the
        rank's layer evidence); None on the first step."""
        return self._own_value(LAYER, sketch=False)

    @cached_property
    def layer_parameters(self) -> np.ndarray | None:
        """Per rank, the index (in ``parameter_names``) of the parameter whose CUSUM is its layer
        level, as a float (NaN where unknown); None on the first step."""
        return self._own_value(LAYER_PARAMETER, sketch=False)

    @cached_property
    def rank_sq(self) -> np.ndarray:
        return self._arrays[0][:, RANK_SQ].copy()

    @property
    def present_count(self) -> int:
        return int(round(float(self._part("present")[0])))

    @property
    def _sketches(self) -> np.ndarray:
        """W x k: every rank's sketch, on a detail step up to ``detail_max_world`` (the matrix part)."""
        return self._part("matrix").reshape(self.world_size, self.bins)

    @property
    def _rank_matrix(self) -> bool:
        """Whether every rank's sketch travelled on this step (a detail step up to ``detail_max_world``)."""
        return bool(self.bins) and self.layout.matrix_rows == self.world_size and not self.layout.host_form

    @property
    def cosine(self) -> np.ndarray | None:
        """The W x W sketched cosine matrix on a detail step up to ``detail_max_world`` (every
        rank's sketch travels then: the whole slots' matrix); None on other steps, where no rank
        holds every sketch."""
        return super().cosine if self._rank_matrix else None

    def cosine_hosts(self, blocks: HostBlocks | None = None) -> HostMatrix | None:
        """The host-by-host matrix on a detail step: above ``detail_max_world`` from the hosts'
        sums of unit sketches that travelled (``blocks`` may be left out), up to it from every
        rank's sketch (``blocks`` needed); None on other steps."""
        if self.bins and self.layout.host_form:
            counts = self._part("matrix_present")
            return HostMatrix(block_cosines(self._part("matrix").reshape(self.layout.matrix_rows, self.bins), counts), counts.copy())
        if self._rank_matrix and blocks is not None:
            return super().cosine_hosts(blocks)
        return None

    def _cosine_rows(self) -> list[list[float | None]] | None:
        """The record's ``cosine``, rounded to ``RANK_DECIMALS`` (at W = 256, 460 KB instead of 1.4 MB)."""
        cosine = self.cosine
        return None if cosine is None else rounded_rows(cosine, RANK_DECIMALS)

    def _cosine_hosts_record(self, hosts: HostBlocks | None) -> dict | None:
        blocks = self.hosts or hosts
        if blocks is None or (self.layout.host_form and blocks.count != self.layout.matrix_rows):
            return None
        matrix = self.cosine_hosts(blocks)
        return None if matrix is None else matrix.to_record(blocks)

    def _own_value(self, column: int, sketch: bool = True) -> np.ndarray | None:
        if (sketch and not self.bins) or self.cosines_step is None:
            return None
        values = self._arrays[0][:, column].copy()
        values[self.absent] = np.nan
        return values

    @property
    def cosine_to_others(self) -> None:
        """Not in the compact wire (``mean_cosine``, their mean, is)."""
        return None

    @cached_property
    def cosine_loo(self) -> np.ndarray | None:
        """Per rank, its sketched cosine to the sum of the others on ``cosines_step``."""
        return self._own_value(COSINE_LOO)

    @cached_property
    def cosine_previous(self) -> np.ndarray | None:
        """Per rank, on ``cosines_step``, its sketched cosine to its own previous instrumented step."""
        return self._own_value(COSINE_PREVIOUS)

    @property
    def mean_cosine(self) -> float:
        """The step's mean sketched cosine between ranks, ``(|U|^2 - n) / (n (n - 1))`` over the
        n ranks present (the mean of every rank's ``cosine_to_others`` of this step)."""
        n = self.present_count
        if not self.bins or n < 2:
            return math.nan
        units = self._part("unit_sum")
        value = (float(units @ units) - n) / (n * (n - 1))
        return value if math.isfinite(value) else math.nan

    @cached_property
    def _nonfinite_gradients(self) -> tuple[list[dict], int]:
        """A rank whose squared norm is not finite, against the parameters whose sum over the ranks
        is not finite (where it is sampled, its own parameters)."""
        bad_ranks = np.flatnonzero(~np.isfinite(self.rank_sq))
        if not len(bad_ranks):
            return [], 0
        owners = [(bucket.index, name) for bucket in self.buckets for name in bucket.names]
        summed = np.flatnonzero(~np.isfinite(self._part("param_sq")))
        rows = self.sampled_param_sq
        where = {rank: row for row, rank in enumerate(self.sampled)}
        pairs = [(int(r), int(p)) for r in bad_ranks for p in (np.flatnonzero(~np.isfinite(rows[where[r]])) if r in where else summed)]
        gradients = [{"rank": r, "bucket": owners[p][0], "parameter": owners[p][1]} for r, p in pairs[:MAX_NONFINITE_LISTED]]
        return gradients, len(pairs)

    @property
    def _histograms(self) -> np.ndarray:
        """``layout.histogram_rows`` x (FINGERPRINT_BINS + 1): per tensor compared over the whole
        mesh (every fingerprinted tensor but HSDP's parameter shards), how many ranks'
        fingerprints fell in each bin."""
        return self._part("fingerprints").reshape(self.layout.histogram_rows, FINGERPRINT_BINS + 1)

    @property
    def _shard_checks(self) -> np.ndarray | None:
        """Under HSDP, ``sharded x SHARD_CHECK``: per parameter, its shards' ``shard_checks`` summed."""
        return self._part("shard_checks").reshape(self.layout.sharded, SHARD_CHECK) if self.layout.sharded else None

    @cached_property
    def replicas(self) -> dict | None:
        """On the instrumented step after a replica check, its verdict (``replica_verdict``)."""
        if self._replica_check is None:
            return None
        step, histograms, names, absent, checks = self._replica_check
        flagged = np.flatnonzero((self.status & REPLICA_DIFFERS) != 0).tolist()
        return replica_verdict(histograms, names, flagged, sorted(set(absent) | set(self.absent_ranks)), step, shard_checks=checks)

    def _layer_cosines(self) -> tuple[np.ndarray, np.ndarray]:
        n = self.present_count
        param_sq, param_norms = self._part("param_sq"), self._part("param_norms")
        bucket_sq = np.array([param_sq[a:b].sum() for a, b in self._bucket_bounds])
        param_wmc = weighted_mean_cosine_from_sums(param_sq, param_norms, n, self._present_reduced(self.reduced_param_sq))
        bucket_wmc = weighted_mean_cosine_from_sums(bucket_sq, self._part("bucket_norms"), n, self._present_reduced(self.reduced_bucket_sq))
        return param_wmc, bucket_wmc

    def _layer_norms(self, per_rank: bool) -> tuple[list[dict], list[dict]]:
        """Per parameter and bucket: the mean norm over the ranks present (exact, from the sums)
        and the sampled ranks' norms (``sampled_ranks`` gives their ranks)."""
        n = self.present_count
        sampled = np.where(self.absent[self.sampled][:, None], np.nan, self.sampled_param_sq)
        with np.errstate(invalid="ignore", divide="ignore"):
            param_mean = self.mean_param_norms
            bucket_mean = self._part("bucket_norms") / n
            bucket_sampled = np.stack([sampled[:, a:b].sum(axis=1) for a, b in self._bucket_bounds], axis=1) if len(sampled) else np.zeros((0, len(self.buckets)))
        params = [{"grad_norm_mean": _float(param_mean[p]), "grad_norms_sampled": _floats(np.sqrt(sampled[:, p]))} for p in range(self.layout.n_params)]
        buckets = [{"grad_norm_mean": _float(bucket_mean[b]), "grad_norms_sampled": _floats(np.sqrt(bucket_sampled[:, b]))} for b in range(len(self.buckets))]
        return params, buckets

    def to_dict(self, detail: bool = True, detail_max_world: int = 256, alerts: list[dict] = (), per_rank: bool = True, hosts: HostBlocks | None = None) -> dict:
        """``SilentStats.to_dict`` plus what the compact wire changes: ``wire`` ("compact"),
        ``cosines_step``, ``sampled_ranks``, and per rank (where the record keeps per-rank values)
        its layer level and parameter on ``cosines_step`` (``layer_levels``, ``layer_parameters``);
        the cosine matrix only on detail steps (rounded to ``RANK_DECIMALS``)."""
        record = super().to_dict(detail, detail_max_world, alerts, per_rank, hosts)
        record.update(wire="compact", cosines_step=self.cosines_step, sampled_ranks=list(self.sampled))
        if per_rank:
            levels, parameters = self.layer_scores, self.layer_parameters
            record.update(layer_levels=None if levels is None else _floats(levels), layer_parameters=None if parameters is None else _floats(parameters))
        return record

    def __repr__(self) -> str:
        return f"FleetStats(step={self.step}, world_size={self.world_size}, buckets={len(self.buckets)}, sketch_dim={self.bins}, sampled={len(self.sampled)})"


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
        deviation = np.log(mine) - np.log(others)
    deviation = np.where(np.isfinite(deviation), deviation, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a rank with no known parameter: all NaN
        # The lower median of an even count, as torch.nanmedian takes it on the rank.
        deviation = deviation - np.nanquantile(deviation, 0.5, axis=1, method="lower", keepdims=True)
    known = np.isfinite(deviation)
    anything = known.any(axis=1)
    seen = state.seen[rows]
    first = (seen == 0)[:, None]
    average, cusum = state.average[rows], state.cusum[rows]
    rise = np.where(known, deviation - average, 0.0)
    z = rise / (np.where(weight > 0, scale / np.where(weight > 0, weight, 1.0), 0.0) + 1e-3)
    counting = ((seen >= LAYER_WARMUP) & anything)[:, None]
    cusum = np.where(first, 0.0, np.where(counting, np.maximum(0.0, cusum + np.minimum(z, LAYER_CAP) - LAYER_DRIFT), cusum))
    learn = known & (cusum == 0) & ~first
    average = np.where(learn, (1 - LAYER_RATE) * average + LAYER_RATE * deviation, average)
    average = np.where(first, np.where(known, deviation, 0.0), average)
    state.average[rows], state.cusum[rows], state.seen[rows] = average, cusum, seen + anything
    pooled = known & ~first
    state.rise_sum[rows], state.rise_count[rows] = np.where(pooled, math.sqrt(math.pi / 2) * np.abs(rise), 0.0), pooled
    levels[rows] = np.where(anything, cusum.max(axis=1), np.nan)
    parameters[rows] = np.where(anything, cusum.argmax(axis=1), np.nan)
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


def replica_verdict(
    histograms: np.ndarray, names: list[str], flagged: list[int], absent: list[int], checked_step: int, shard_checks: np.ndarray | None = None
) -> dict:
    """The record's ``replicas`` of a compact replica check: ``ranks`` the ranks that flagged
    themselves (``replica_differs``), ``tensors`` how many tensors' histograms hold more than one
    bin, ``parameters`` those tensors (``name``, ``ranks``: the flagged ranks, which of them differ
    in which tensor is not sent; ``ranks_differing``: how many ranks are outside the most common
    bin, or every rank of a tie; ``relative_difference``: None, hashes have no size), largest
    first, ``not_compared`` and ``checked_step``. No comparison where a rank was absent (under
    ``Join`` a joined rank's weights are stale by design), as ``SilentStats.replicas``.

    Under HSDP (``shard_checks``: the first ``len(shard_checks)`` of ``names`` are parameter
    shards, compared within each replica group, see ``FleetLayout``) a parameter is one entry
    whatever the number of its shards that differ: ``shards_differing`` counts them and
    ``ranks_differing`` is summed over them. A buffer's histogram spans the whole mesh, as
    without shards."""
    sharded = 0 if shard_checks is None else len(shard_checks)
    checks = histogram_checks(torch.from_numpy(np.asarray(histograms, dtype=np.float64))).numpy()  # the buffers', over the mesh
    if sharded:
        checks = np.concatenate([shard_checks, checks])  # one row a tensor, in the order of ``names``
    base = {"checked_step": checked_step, "not_compared": int((checks[:, 2] > 0).sum())}
    if absent:
        return {"ranks": [], "tensors": 0, "parameters": [], **base, "not_compared": len(names), "absent": absent}
    outside = checks[:, 0]
    tensors = np.flatnonzero(checks[:, 1] > 0)
    order = tensors[np.argsort(-outside[tensors], kind="stable")][:MAX_REPLICA_DIFFERENCES]
    parameters = []
    for t in order:
        entry = {"name": names[t], "ranks": list(flagged)}
        if t < sharded:  # a parameter: how many of its shards' replica groups differ
            entry["shards_differing"] = int(round(checks[t, 1]))
        parameters.append({**entry, "ranks_differing": int(round(outside[t])), "relative_difference": None})
    return {"ranks": list(flagged), "tensors": int(len(tensors)), "parameters": parameters, **base}
