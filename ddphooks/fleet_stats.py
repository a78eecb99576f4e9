"""The compact wire's statistics as the host reads them: ``FleetStats`` (the step's ``SilentStats``
from the all-reduced buffer) and ``FleetSlots`` (the buffer as it arrived, which the detector's
process reads the step from), the buffer's ``FleetLayout`` and the replica check's verdict.

Numpy only, no torch: the detector's process (``ddphooks.detect.process``) rebuilds a step here
from its ``FleetSlots``, as it does a whole-slot step from its ``ddphooks.stats.StepSlots``. What
each rank writes into the buffer, on its device, and what the wire holds, part by part, is
``ddphooks.fleet``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from ddphooks.hosts import RANK_DECIMALS, HostBlocks, HostMatrix, block_cosines, rounded_rows
from ddphooks.stats import (
    MAX_NONFINITE_LISTED,
    MAX_REPLICA_DIFFERENCES,
    BucketLayout,
    HostArrays,
    HostParts,
    SilentStats,
    _float,
    _floats,
    _pending_host,
    weighted_mean_cosine_from_sums,
)

if TYPE_CHECKING:
    import torch

#: Numbers per rank in the compact wire's row (see ``ddphooks.fleet``), and their places.
PER_RANK = 6
#: The loss first and what the host stages after it (``fleet.stage``): one ``cat`` writes them.
WIRE_LOSS, WIRE_COSINE_LOO, WIRE_COSINE_PREVIOUS, WIRE_LAYER, WIRE_STATUS, WIRE_RANK_SQ = range(PER_RANK)
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


@dataclass(frozen=True)
class FleetLayout:
    """Where each part sits in the compact wire's flat buffer of one step (see ``ddphooks.fleet``).

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
    numbers for the cosine matrix (7 in ``ddphooks.fleet``'s docstring): ``world`` rows, each rank's sketch
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


@dataclass(frozen=True)
class KeptWire:
    """Where a compact-wire step lies in the flat fp32 array a rank keeps of it and copies to the
    host in one copy (``BaseSilentState._keep_fleet``): the all-reduced wire (``layout.size``
    numbers), then this rank's inputs of its own values (``own`` numbers: its P squared norms and
    its sketch; none where its statistics failed), then DDP's P reduced norms ``|gbar_p|``,
    unsquared (squared here, in fp32 as torch squares them: one device operation fewer). Under
    FSDP2 ``reduced_sq`` is a part of the wire, summed over its ``replicas`` replica groups
    (0: DDP's norms after the own inputs)."""

    layout: FleetLayout
    own: int
    replicas: int = 0

    @property
    def size(self) -> int:
        return self.layout.size + self.own + (0 if self.replicas else self.layout.n_params)

    def wire(self, kept: np.ndarray) -> np.ndarray:
        return kept[: self.layout.size]

    def own_inputs(self, kept: np.ndarray) -> np.ndarray:
        return kept[self.layout.size : self.layout.size + self.own]

    def reduced_sq(self, kept: np.ndarray) -> np.ndarray:
        """``|gbar_p|^2`` per parameter, fp32 (as the device would have computed it)."""
        if self.replicas:  # every replica holds the same shards: R |gbar_p|^2 summed
            summed = kept[self.layout.part("reduced_sq")]
            return summed if self.replicas == 1 else summed / np.float32(self.replicas)
        return np.square(kept[self.layout.size + self.own :])


#: Numbers per histogram in ``histogram_checks``: the ranks outside the most common bin (all of a
#: tie), 1 if the ranks' fingerprints fell in more than one bin, 1 if some rank did not compare.
SHARD_CHECK = 3


def histogram_checks(counts):
    """What the record needs of summed fingerprint histograms (a row each, ``FINGERPRINT_BINS + 1``
    counts): per row ``SHARD_CHECK`` numbers, the ranks outside its only most common bin (every
    rank of a tie), 1 if the ranks' fingerprints fell in more than one bin, 1 if some rank did not
    compare (small integers, in ``counts``' dtype). A torch tensor or a numpy array, read with
    its own library: on the device for a replica group's parameter histograms (``count_shards``),
    the shards' checks the wire carries; on the host for the buffers' histograms of the whole
    mesh (``replica_verdict``)."""
    xp = _array_module(counts)
    compared = counts[:, FINGERPRINT_BINS] == 0
    hashed = counts[:, :FINGERPRINT_BINS]
    top = xp.amax(hashed, 1)
    total = hashed.sum(1)
    unique = (hashed == top[:, None]).sum(1) == 1
    differing = compared & ((hashed > 0).sum(1) > 1)
    zeros = total * 0  # the flags in counts' dtype (bool + a float array is the float array's)
    return xp.stack([xp.where(unique, total - top, total) * differing, zeros + differing, zeros + ~compared], 1)


def _array_module(array):
    """numpy for a numpy array, else the array's own library (torch for a tensor, which is then
    imported already): this module imports no torch."""
    return np if isinstance(array, np.ndarray) else sys.modules[type(array).__module__.split(".")[0]]


class FleetStats(SilentStats):
    """``SilentStats`` of a step that travelled in the compact wire (see ``ddphooks.fleet``).

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
        reduced_wire: the all-reduced flat buffer (``layout.size``: a tensor, or a numpy array
            where ``FleetSlots`` rebuilds the step), or with ``kept`` the host copy of the
            array the rank kept of the step (``reduced_sq`` None: both are cut from it).
        sampled: the ranks whose per-parameter norms it carries, in row order (``choose_sampled``).
        cosines_step: the step the per-rank cosines belong to (None: none yet).
        replica_check: the statistics of the previous instrumented step where it checked the
            replicas (its histograms), None otherwise.
        hosts: with ``layout.host_form``, the blocks its host-by-host matrix is summed over (the
            state's ``hosts``), for the record's labels.
        kept: where the step lies in ``reduced_wire``'s array (``KeptWire``), or None.
    """

    def __init__(
        self,
        step: int,
        buckets: list[BucketLayout],
        layout: FleetLayout,
        reduced_wire: torch.Tensor | np.ndarray,
        reduced_sq: torch.Tensor | np.ndarray | None,
        transport: str,
        sampled: list[int],
        cosines_step: int | None,
        fingerprinted: list[str] | None = None,
        divided_by_present: bool = False,
        replica_check: "FleetStats | None" = None,
        hosts: HostBlocks | None = None,
        kept: KeptWire | None = None,
    ) -> None:
        per_rank = layout.part("per_rank")
        if kept is not None:  # reduced_wire is the host copy (``PendingHost``) of kept's array: the rows, reduced_sq and the rest cut from it
            rows = HostParts(reduced_wire, lambda array: [kept.wire(array)[per_rank].reshape(layout.world, PER_RANK), kept.reduced_sq(array)])
            rest_host = HostParts(reduced_wire, lambda array: [kept.wire(array)[per_rank.stop :]])
            reduced_sq = None
        else:
            if reduced_wire.shape[0] != layout.size:
                raise ValueError(f"the compact wire has {reduced_wire.shape[0]} numbers, its layout {layout.size}")
            rows = reduced_wire[per_rank].reshape(layout.world, PER_RANK)
            rest = reduced_wire[per_rank.stop :]
            rest_host = HostArrays([rest]) if isinstance(rest, np.ndarray) else _pending_host([rest])
        super().__init__(step, layout.world, buckets, rows, reduced_sq, layout.bins, transport, fingerprinted, divided_by_present=divided_by_present)
        self.layout = layout
        self.sampled = list(sampled)
        self.parameter_rows = self.sampled
        self.cosines_step = cosines_step
        self.hosts = hosts
        self._rest_host = rest_host
        # The check's histograms, names and absent ranks, not the step itself (which would chain
        # every step to the one before where every step checks).
        self._replica_check = None
        if replica_check is not None:
            check = replica_check
            self._replica_check = (check.step, check._histograms, check.fingerprinted, check.absent_ranks, check._shard_checks)

    def slots(self) -> FleetSlots:
        """The step as the buffer arrived (``FleetSlots``, numpy): what travels to the detector's
        process, which reads the step there (``ddphooks.detect.process``): 24 B a rank and a
        few KB more: 122 KB a step at W = 4096 and 273 parameters."""
        with self._lock:
            rows, reduced_sq = self._host.raw()
            (rest,) = self._rest_host.raw()
        return FleetSlots(
            self.step, self.buckets, self.layout, rows, rest, reduced_sq, self.transport, self.sampled, self.cosines_step,
            self.fingerprinted, self.divided_by_present, self._replica_check, self.hosts, self.record_fields,
        )  # fmt: skip

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
        rows = np.column_stack([wire[:, WIRE_LOSS], count, status, wire[:, WIRE_RANK_SQ], wire[:, WIRE_COSINE_LOO : WIRE_LAYER + 1], parameter])
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


@dataclass
class FleetSlots:
    """One compact step as it arrived: the all-reduced buffer (its rows and the rest, numpy, fp32
    as they travelled), the reduced squared norms and what the step's ``FleetStats`` was built
    with. ``stats()`` rebuilds the same ``FleetStats`` with no torch, as ``StepSlots`` does a
    whole-slot step: the pipeline sends this to the detector's process, which reads the step
    and builds its record there (``ddphooks.detect.process``).

    Example::
        >>> slots = pickle.loads(pickle.dumps(state.latest.slots()))   # in another process
        >>> Observation.from_stats(slots.stats())                       # the same observation
    """

    step: int
    buckets: list[BucketLayout]
    layout: FleetLayout
    rows: np.ndarray  # W x PER_RANK
    rest: np.ndarray  # the buffer after the rows
    reduced_sq: np.ndarray  # P
    transport: str
    sampled: list[int]
    cosines_step: int | None
    fingerprinted: list[str]
    divided_by_present: bool
    replica_check: tuple | None  # what FleetStats keeps of the replica check before it
    hosts: HostBlocks | None
    record_fields: dict  # SilentStats.record_fields

    def stats(self) -> FleetStats:
        """The ``FleetStats`` of this step: every value the same, bit for bit."""
        stats = FleetStats(
            self.step, self.buckets, self.layout, np.concatenate([self.rows.ravel(), self.rest]), self.reduced_sq, self.transport,
            self.sampled, self.cosines_step, self.fingerprinted, divided_by_present=self.divided_by_present, hosts=self.hosts,
        )  # fmt: skip
        stats._replica_check = self.replica_check
        stats.record_fields = self.record_fields
        return stats


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
    checks = histogram_checks(np.asarray(histograms, dtype=np.float64))  # the buffers', over the mesh
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
