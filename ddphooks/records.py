"""From ``SilentStats`` to the records the sinks receive: compact or detailed, plus what spans steps.

A record is built one step after the other, so this is also where the statistics that need the
previous steps live: the smoothed gradient noise scale. It is built in the detector's process from
the step's slots (with a copy of the log rank's ``RecordBuilder``, ``ddphooks.detect.process``),
where the steps travel as slots, else on the sink writer thread. This module imports no torch.
"""

from __future__ import annotations

import math

from ddphooks.hosts import HostBlocks, host_blocks
from ddphooks.identity import RankTable
from ddphooks.stats import SilentStats, _float

#: Weight of the past in the smoothed noise scale: about 1 / (1 - 0.95) = 20 records.
NOISE_SCALE_DECAY = 0.95
#: ``SilentConfig.per_rank_max_world``'s default.
PER_RANK_MAX_WORLD = 256


def is_detail_step(step: int, every: int, detail_every: int) -> bool:
    """Whether instrumented step ``step`` writes a detail record: every ``detail_every``-th
    instrumented step, counted from step 0 (what every rank knows: the compact wire sends the
    cosine matrix's sketches on these steps)."""
    return detail_every > 0 and (step // every) % detail_every == 0


class RecordBuilder:
    """Builds one step's record and keeps the state that spans records.

    1. A record is *detailed* (cosine matrix, per-bucket and per-parameter tables) on every
       ``detail_every``-th instrumented step, counted from step 0 (``(step // every) %
       detail_every == 0``, so a resumed run keeps the cadence); otherwise it is the compact
       summary.
    2. The smoothed noise scale divides exponential moving averages of ``tr(Sigma)`` and
       ``|G|^2`` kept apart (the ratio of two noisy estimates is biased; averaging each first
       is what McCandlish et al. and the k-diffusion and AdaptDL implementations do). Both
       averages start at zero with the same decay, so their start-up bias cancels in the ratio.
       Steps where either term is not finite leave the averages unchanged.

    Args:
        every: the state's instrumentation period.
        detail_every: instrumented steps between detailed records (0: never).
        detail_max_world: see ``SilentConfig.detail_max_world``.
        global_ranks: where the data-parallel group is a subgroup of the job, the global rank of
            each of its ranks: every record carries it as ``global_ranks``.
        per_rank_max_world: see ``SilentConfig.per_rank_max_world``: above it, a compact
            record summarises each per-rank signal over the ranks (detailed ones never do).
        ranks: who and where each rank of the group is (``ddphooks.identity.RankTable``): the
            first record built and every detailed one carry it as ``identity``
            (``RankTable.to_record``), so a reader of any stretch of a run file finds it within
            ``detail_every`` steps.
        hosts: the ranks by host for the host-by-host cosine matrix of detail records above
            ``detail_max_world`` (None: ``host_blocks`` of ``ranks``' hosts, as the state
            builds it; no such matrix from whole slots without either).

    Example::
        >>> builder = RecordBuilder(every=1, detail_every=100, detail_max_world=256)
        >>> record = builder.build(state.latest, alerts=[])
    """

    def __init__(
        self,
        every: int,
        detail_every: int,
        detail_max_world: int,
        global_ranks: list[int] | None = None,
        per_rank_max_world: int = PER_RANK_MAX_WORLD,
        ranks: RankTable | None = None,
        hosts: HostBlocks | None = None,
    ) -> None:
        self.identity = None if ranks is None else ranks.to_record()  # built once, written as it is
        if hosts is None and ranks is not None:
            hosts = host_blocks(ranks.hosts())
        self.hosts = hosts
        self._identity_written = False
        self.global_ranks = global_ranks
        self.per_rank_max_world = per_rank_max_world
        self.every = every
        self.detail_every = detail_every
        self.detail_max_world = detail_max_world
        self.trace_average = 0.0
        self.signal_average = 0.0
        self.restored = 0  # calls of load_state_dict: a copy in the detector's process takes the state up again

    def is_detailed(self, step: int) -> bool:
        return is_detail_step(step, self.every, self.detail_every)

    def build(self, stats: SilentStats, alerts: list[dict] = (), built: tuple[dict, dict] | None = None) -> dict:
        """The record of one step, with the alerts the pipeline found on it (and those raised
        outside the detector since the last record).

        ``built``: the record as a copy of this builder built it from the step's slots in the
        detector's process, and that builder's state after it: this sets its alerts and takes
        up the state, so a record built here next goes on from it."""
        if built is not None:
            record, state = built
            record["alerts"] = list(alerts)
            self._take_state(state)
            self._identity_written = self._identity_written or "identity" in record
            return record
        detailed = self.is_detailed(stats.step)
        per_rank = detailed or stats.world_size <= self.per_rank_max_world
        record = stats.to_dict(detail=detailed, detail_max_world=self.detail_max_world, alerts=alerts, per_rank=per_rank, hosts=self.hosts)
        record["noise_scale_smoothed"] = _float(self._smoothed_noise_scale(*stats.noise_scale_terms))
        if self.global_ranks is not None:  # a subgroup of the job: which group, which global ranks
            record["global_ranks"] = self.global_ranks
        if self.identity is not None and (detailed or not self._identity_written):
            record["identity"] = self.identity
            self._identity_written = True
        return record

    def _smoothed_noise_scale(self, trace: float, signal: float) -> float:
        if math.isfinite(trace) and math.isfinite(signal):
            self.trace_average = NOISE_SCALE_DECAY * self.trace_average + (1 - NOISE_SCALE_DECAY) * trace
            self.signal_average = NOISE_SCALE_DECAY * self.signal_average + (1 - NOISE_SCALE_DECAY) * signal
        return self.trace_average / self.signal_average if self.signal_average > 0 else math.nan

    def state_dict(self) -> dict:
        return {"trace_average": self.trace_average, "signal_average": self.signal_average}

    def load_state_dict(self, state: dict) -> None:
        self._take_state(state)
        self.restored += 1

    def _take_state(self, state: dict) -> None:
        self.trace_average = float(state["trace_average"])
        self.signal_average = float(state["signal_average"])
