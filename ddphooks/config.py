"""User knobs of ``SilentState``, validated in one place."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

from ddphooks.detect import LIKELY_CAUSES, DetectorConfig
from ddphooks.records import PER_RANK_MAX_WORLD
from ddphooks.sketch import MAX_CHUNK_ELEMS, MAX_SKETCH_DIM, MIN_SKETCH_DIM

TRANSPORTS = ("auto", "piggyback", "separate")
STATS_KERNELS = ("auto", "torch", "triton")


def _stop_kinds(stop_on: object) -> tuple[str, ...]:
    """``stop_on`` as a sorted tuple of alert kinds (``("all",)`` for all), or a ``ValueError``
    naming the bad kind and the known ones."""
    kinds = (stop_on,) if isinstance(stop_on, str) else stop_on
    if not isinstance(kinds, (tuple, list, set, frozenset)) or not all(isinstance(kind, str) for kind in kinds):
        raise TypeError(f"stop_on must be alert kinds (a tuple of str) or 'all', got {stop_on!r}")
    if "all" in kinds:
        return ("all",)
    for kind in kinds:
        if kind == "unsynchronised":
            raise ValueError(
                "stop_on cannot hold 'unsynchronised': the watchdog's alert is seen by the rank it judges, maybe by no "
                "other, so the ranks would not stop at the same step; use on_alert to react to it"
            )
        if kind not in LIKELY_CAUSES:
            raise ValueError(f"stop_on: {kind!r} is not an alert kind; use 'all' or some of {', '.join(map(repr, LIKELY_CAUSES))}")
    return tuple(sorted(set(kinds)))


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class SilentConfig:
    """Settings of the silent-inconsistency statistics; identical on every rank."""

    sketch_dim: int = 256
    """Entries of each rank's gradient sketch for the W x W cosine matrix (0: norms and losses only)."""

    every: int = 1
    """Instrument steps 0, every, 2*every, ...; the other steps run the plain allreduce."""

    seed: int = 0
    """Seed of the random projection (the same on every rank, independent of the global RNG)."""

    transport: str = "auto"
    """How statistics travel: "piggyback" on the last bucket's allreduce, "separate" in one small
    allreduce per step (bitwise identical to allreduce_hook at any world size), or "auto"
    (piggyback for fp32 buckets, separate otherwise)."""

    piggyback_limit_mb: float = 32.0
    """With transport="auto", a last bucket larger than this travels with the separate transport
    instead, so the piggyback buffer (a copy of the last bucket) stays bounded."""

    log_rank: int | None = 0
    """Rank that writes records to the sinks (None: every rank)."""

    chunk_elems: int | None = None
    """Elements per chunk of the statistics pass (None: 131072 on the CPU, 16M on accelerators), at
    most 16M; the torch path holds an int8 sign table of 8M entries plus one chunk."""

    stats_kernel: str = "auto"
    """How the statistics pass runs: "torch" (torch ops in chunks, every device), "triton" (one
    Triton kernel per bucket, a few launches whatever the bucket's size; CUDA only, needs the
    ``triton`` package and a sketch), or "auto" (the default): Triton on CUDA devices where the
    package imports, the sketch is on and the kernel agrees with the torch path on a probe bucket
    at the first step (``TritonBucketStats.agrees_with_torch``; where it does not, the torch path,
    said once); the torch path on every other device (CPU, NPU). Both compute the same norms and
    sketch, to fp32 rounding; see ``ddphooks.triton_stats``. On an H200 the Triton kernel cost a
    1.1B Llama's DDP step +19% on the GPU against +40% for the torch path
    (``docs/results/device-2026-12-04.md``)."""

    detail_every: int = 100
    """Every ``detail_every``-th instrumented step (and the first) writes a *detail* record with
    the cosine matrix and the per-bucket and per-parameter tables; the others write the compact
    summary (O(W) numbers). 1: every record in detail; 0: never (``stats.to_dict()`` still gives
    the detail on demand). The default keeps a 10,000-step run at W = 8 with 272 parameters
    around 60 MB instead of 1 GB while still sampling the layer view every 100 steps."""

    detail_max_world: int = 256
    """Largest world size whose detail records carry W x W and per-rank tables (the sketched
    cosine matrix, per-rank norms of every bucket and parameter), whatever the wire: above
    ``gather_max_world`` the compact wire sends every rank's sketch on detail steps for it
    (W x sketch_dim numbers, one step in ``detail_every``). Above it those tables grow as W^2 or
    W x parameters (26 MB a record at W = 1024 with 272 parameters), so detail records keep
    per-parameter summaries (mean, max and the rank with the max) and a host-by-host cosine
    matrix (``cosine_hosts``, ``ddphooks.hosts``: the compact wire then sends each host's sum of
    its ranks' unit sketches, H x sketch_dim numbers) instead."""

    per_rank_max_world: int = PER_RANK_MAX_WORLD
    """Largest world size whose compact records carry one value per rank of each per-rank signal
    (losses, gradient norms, cosines: ``ddphooks.stats.PER_RANK_KEYS``). Above it a compact record
    carries ``<key>_over_ranks`` instead: quantiles over the ranks and the 16 ranks farthest from
    the median, so its size does not grow with W (410 KB at W = 4096 with one value per rank);
    detail records keep every rank's values. The online detector reads every rank's values
    whatever this is; offline detection (``ddphooks detect``) needs them in every record: set
    it to at least W for a run to be detected again offline."""

    gather_max_world: int | None = 16
    """Largest world size whose ranks each send their whole slot (every per-parameter norm and
    the sketch) on every instrumented step: W x (3 + parameters + sketch_dim) numbers, a share of
    the all-reduce that grows with W (8.6 MB a step at W = 4096 with 273 parameters). Above it,
    the compact wire (``ddphooks.fleet``): 24 bytes per rank plus sums over the ranks and
    ``sampled_ranks`` ranks' per-parameter norms, 122 KB a step at W = 4096; the per-rank
    cosines, layer levels (each rank's own layer CUSUM) and the replica check's verdict then
    arrive one instrumented step late, the W x W cosine matrix (or above ``detail_max_world`` the
    host-by-host one) travels on detail steps only, and a rank's layer view travels on the steps
    it is sampled. 16 (the default) keeps the whole slot on up to two
    8-accelerator nodes, where it is at most 34 KB a step with 273 parameters; None: the whole
    slot at any W. DDP, FSDP2 and HSDP (``ddphooks.fsdp``); DeepSpeed sends the whole slot at any W."""

    sampled_ranks: int = 16
    """With the compact wire, the ranks per instrumented step whose per-parameter norms travel
    (the detector's and the detail records' layer view): half a window that moves on every step
    (each rank's every ``ceil(2 W / sampled_ranks)`` steps whatever happens), half the ranks whose
    layer levels stood out, equal levels from a second moving window (on healthy steps each
    rank's within ``ceil(W / sampled_ranks)`` steps, for an even value); see
    ``ddphooks.fleet.choose_sampled``."""

    max_pending_records: int = 1024
    """Records waiting for the sink writer thread at most; when a sink is slower than training,
    the oldest waiting record is dropped (and counted) instead of letting memory grow."""

    detect: bool | DetectorConfig = True
    """Run the online detector on every instrumented step (a ``DetectorConfig`` sets its thresholds)."""

    check_replicas_every: int = 100
    """Every N-th instrumented step, compare fingerprints of the ranks' parameters and buffers
    (one read of the model on those steps, 8 bytes per tensor in the slot); 0 turns it off."""

    watch_sync: bool = True
    """Watch for backward passes that DDP should have synchronised but did not (its hooks lost,
    a forward around the DDP module): an ``unsynchronised`` alert (``ddphooks.watchdog``). Needs
    the DDP model (``attach``, ``SilentState(model=...)``); costs a few microseconds a backward."""

    stop_on: tuple[str, ...] | str = ()
    """Alert kinds that stop training: ``state.should_stop()`` turns True on every rank after the
    same step once the detector raised one (two steps after the step the alert is about; see
    ``SilentState.should_stop``). Kinds of ``ddphooks.detect.LIKELY_CAUSES`` (``"layer"``,
    ``"replica"``, ``"nonfinite"`` ...), or ``"all"`` for every kind the detector raises. Empty
    (default): nothing stops training. ``"unsynchronised"`` (the watchdog's, seen by one rank) cannot."""

    def __post_init__(self) -> None:
        _check_int("sketch_dim", self.sketch_dim)
        if self.sketch_dim < 0:
            raise ValueError(f"sketch_dim={self.sketch_dim} is negative; use 0 to turn the sketch off, or 64 to 1024")
        if 0 < self.sketch_dim < MIN_SKETCH_DIM:
            raise ValueError(
                f"sketch_dim={self.sketch_dim} is too small: cosine errors are about 1/sqrt(sketch_dim); "
                f"use 0 (no sketch) or at least {MIN_SKETCH_DIM} (256 is the default)"
            )
        if self.sketch_dim > MAX_SKETCH_DIM:
            raise ValueError(
                f"sketch_dim={self.sketch_dim} is larger than {MAX_SKETCH_DIM}: every rank would send "
                f"{self.sketch_dim} floats per step for a cosine error below 0.004; use 256 to 1024"
            )
        _check_int("every", self.every)
        if self.every < 1:
            raise ValueError(f"every={self.every} must be >= 1 (1 instruments every step, 10 every tenth)")
        _check_int("seed", self.seed)
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not one of {', '.join(map(repr, TRANSPORTS))}")
        if isinstance(self.piggyback_limit_mb, bool) or not isinstance(self.piggyback_limit_mb, (int, float)) or self.piggyback_limit_mb < 0:
            raise ValueError(f"piggyback_limit_mb={self.piggyback_limit_mb!r} must be a number of megabytes >= 0")
        if self.log_rank is not None:
            _check_int("log_rank", self.log_rank)
            if self.log_rank < 0:
                raise ValueError(f"log_rank={self.log_rank} must be a rank (>= 0) or None for every rank")
        if self.chunk_elems is not None:
            _check_int("chunk_elems", self.chunk_elems)
            if not 1024 <= self.chunk_elems <= MAX_CHUNK_ELEMS:
                raise ValueError(f"chunk_elems={self.chunk_elems} must be between 1024 and {MAX_CHUNK_ELEMS}, or None for the default")
        if self.stats_kernel not in STATS_KERNELS:
            raise ValueError(f"stats_kernel={self.stats_kernel!r} is not one of {', '.join(map(repr, STATS_KERNELS))}")
        if self.stats_kernel == "triton" and self.sketch_dim == 0:
            raise ValueError("stats_kernel='triton' computes the norms with the sketch; with sketch_dim=0 use stats_kernel='torch'")
        if self.stats_kernel == "triton" and importlib.util.find_spec("triton") is None:
            raise ValueError("stats_kernel='triton' needs the triton package (pip install triton; torch's CUDA wheels bring it), or stats_kernel='torch'")
        _check_int("detail_every", self.detail_every)
        if self.detail_every < 0:
            raise ValueError(f"detail_every={self.detail_every} must be >= 0 (0: no detail records, 1: every record, 100: default)")
        _check_int("detail_max_world", self.detail_max_world)
        if self.detail_max_world < 1:
            raise ValueError(f"detail_max_world={self.detail_max_world} must be >= 1 (256 is the default)")
        _check_int("per_rank_max_world", self.per_rank_max_world)
        if self.per_rank_max_world < 1:
            raise ValueError(f"per_rank_max_world={self.per_rank_max_world} must be >= 1 (256 is the default)")
        if not isinstance(self.detect, (bool, DetectorConfig)):
            raise TypeError(f"detect must be True, False or a ddphooks.detect.DetectorConfig, got {self.detect!r}")
        _check_int("check_replicas_every", self.check_replicas_every)
        if self.check_replicas_every < 0:
            raise ValueError(f"check_replicas_every={self.check_replicas_every} must be >= 0 (0 turns the replica check off, 100 is the default)")
        if not isinstance(self.watch_sync, bool):
            raise TypeError(f"watch_sync must be True or False, got {self.watch_sync!r}")
        if self.gather_max_world is not None:
            _check_int("gather_max_world", self.gather_max_world)
            if self.gather_max_world < 1:
                raise ValueError(f"gather_max_world={self.gather_max_world} must be >= 1 (the compact wire above it) or None (always the whole slot)")
        _check_int("sampled_ranks", self.sampled_ranks)
        if self.sampled_ranks < 1:
            raise ValueError(f"sampled_ranks={self.sampled_ranks} must be >= 1 (16 is the default)")
        _check_int("max_pending_records", self.max_pending_records)
        if self.max_pending_records < 1:
            raise ValueError(f"max_pending_records={self.max_pending_records} must be >= 1 (1024 is the default)")
        object.__setattr__(self, "stop_on", _stop_kinds(self.stop_on))

    @property
    def stop_kinds(self) -> frozenset[str]:
        """The alert kinds ``stop_on`` names (``"all"``: every kind the detector raises)."""
        return frozenset(LIKELY_CAUSES) if self.stop_on == ("all",) else frozenset(self.stop_on)

    def to_dict(self) -> dict:
        return asdict(self)
