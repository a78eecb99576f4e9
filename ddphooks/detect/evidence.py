"""Evidence accumulation: every statistical score feeds one-sided CUSUMs, one per rank and part
(each direction of a signal suspicious either way, each parameter), whose level says how much
evidence a rank has against it.

1. Per CUSUM key (kind, signal), rank ``i`` and part ``k``: ``S <- max(0, S + min(z, cap) -
   allowance)``, with ``z`` the step's score (``ddphooks.detect.scores``); the level CUSUM's ``z``
   is signed (``clip(z, -cap, cap)``), the textbook CUSUM of a shift in the mean. At W = 2 each
   parameter has a second, persistence CUSUM (key ``PERSISTENT_LAYER``): its ``z`` is ``1 +
   drift`` on a step whose per-parameter score is over ``pair_persistence_score``, else 0, so it
   counts how long a rise lasts (+1 a raised step, ``-pair_persistence_drift`` another), not how
   high it goes; it makes no rank suspect (``Detector.update``).
2. The rank's level of a key is its largest part; the part's "rising since" is the step it last
   rose from 0.
3. The rank's evidence is its highest level over that CUSUM's alert level (``threshold *
   alert_level``, ``repeat_threshold``, ``layer_threshold``, ``level_threshold`` or
   ``pair_persistence_threshold`` times it): above 1, an alert (``ddphooks.detect.rules.divergence``);
   above 0.5, the rank is suspect and teaches its baselines nothing.

Each score feeds a one-sided CUSUM per (rank, signal): ``S <- max(0, S + z - drift)``; an alert is
raised when ``S > threshold``, after ``warmup`` steps. A signal suspicious either way keeps two, one
for its rises and one for its falls: a gradient norm that dips on one step and spikes on the next
is no lasting shift (on a healthy length-grouped run, one CUSUM of its size alerted on exactly
that). The threshold is ``threshold * alert_level`` (25 at the defaults: 20 times 1.25). With
drift 3 and threshold 20 (level 1) a lasting shift of 10 standard deviations alerts on its 3rd
step, one of 6 on its 7th, and shifts under 3 never do; at the default level, on its 4th and 9th.
A step's score counts up to ``step_cap`` (16): a single outlier step, however large, never alerts
alone (one odd batch is not a rank that diverged); one signal alerts on the
2nd step of a rank that stays off at the earliest. The combined CUSUM at W >= 3 (drift 3, the same
threshold) alerts on the 4th step (5th at the default level) of a rank 3 standard deviations off in three of
its four signals; one
signal alone, capped at 4, adds at most 1 a step, what the same shift adds to its own
CUSUM. The cross-rank ``cosine_previous`` CUSUM has its own settings (allowance 2, or 0.5 at
W = 2, where the same rise scores about half as much and there is no loss term; the cosine's
score capped at 5 a step, the loss fall's at 3; threshold 14, times the alert level): the
cosine's score has light tails
in healthy runs (Fisher's scale, a scale pooled over ranks), while a stuck rank's cosine to its
previous step rises a few standard deviations on most steps but falls back on some (it overshoots
on the batch it keeps seeing), so a small allowance lets the raised steps add up; the caps keep
one wild step from alerting alone (6 at most a step at W >= 3: the 3rd raised step at the
earliest, the 5th with the cosine alone; the 6th at the default level). The level CUSUM adds a
step's score signed, ``S <- max(0, S + clip(z, -cap, cap) - allowance)``, the textbook CUSUM of
a shift in the mean: with its allowance of 1, counting only the rises (each step's z floored at
0) took a spread that widened around the same level for a shift.
"""

from __future__ import annotations

import math

import numpy as np

from .config import DetectorConfig
from .observation import PARAMETER_DTYPE, Observation
from .signals import LEVEL, PERSISTENT_LAYER, SIGNALS


class Evidence:
    """The CUSUMs of a detector at world size ``world``: ``cusum`` (key -> W levels),
    ``rising_since`` (key -> W steps, -1 at 0), ``parts`` and ``parts_start`` (key -> W x parts),
    and per key its ``allowance``, ``cap`` and ``limit`` (the alert level). ``step_scores``: where
    given, each step's scores per key (W x parts, before the cap) are kept in it."""

    def __init__(self, config: DetectorConfig, world: int, step_scores: dict | None = None) -> None:
        self.world = world
        self.step_scores = step_scores
        self.cusum = {(kind, name): np.zeros(world) for kind in ("own", "cross") for name in SIGNALS}
        if world >= 3:
            self.cusum[("cross", "combined")] = np.zeros(world)
        else:
            self.cusum[("own", "combined")] = np.zeros(world)
        self.cusum[("own", "layer")] = np.zeros(world)
        self.cusum[LEVEL] = np.zeros(world)
        if world == 2:
            self.cusum[PERSISTENT_LAYER] = np.zeros(world)
        self.rising_since = {key: np.full(world, -1) for key in self.cusum}
        self.parts: dict[tuple[str, str], np.ndarray] = {}  # key -> W x parts CUSUMs (see accumulate)
        # key -> W x parts: the step each part last started rising (read only where it is above 0:
        # its rising since, -1 elsewhere; see accumulate).
        self.parts_start: dict[tuple[str, str], np.ndarray] = {}
        # Per CUSUM: its allowance, the cap on one step's score, and its alert level.
        self.allowance = {key: config.drift for key in self.cusum}
        self.cap = {key: config.step_cap for key in self.cusum}
        self.limit = {key: config.threshold * config.alert_level for key in self.cusum}
        repeat = ("cross", "cosine_previous")
        self.allowance[repeat], self.cap[repeat], self.limit[repeat] = config.repeat_drift, config.repeat_cap, config.repeat_threshold * config.alert_level
        if world == 2:  # the same rise scores about half as much with two ranks (see pair_repeat_drift)
            self.allowance[repeat] = config.pair_repeat_drift
        if world >= 3:  # terms capped one by one: combined_cap; repeat_cap and repeat_loss_cap (in score_step)
            self.allowance[("cross", "combined")], self.cap[("cross", "combined")] = config.combined_drift, math.inf
            self.cap[repeat] = math.inf
        else:
            self.allowance[("own", "combined")], self.cap[("own", "combined")] = config.pair_combined_drift, math.inf
        self.allowance[LEVEL], self.cap[LEVEL], self.limit[LEVEL] = config.level_drift, config.level_cap, config.level_threshold * config.alert_level
        self.allowance[("own", "layer")] = config.layer_drift
        self.cap[("own", "layer")] = config.layer_cap
        self.limit[("own", "layer")] = config.layer_threshold * config.alert_level
        if world == 2:  # a raised step scores 1 + drift (score_step): it adds 1, another takes drift off
            drop = config.pair_persistence_drift
            self.allowance[PERSISTENT_LAYER], self.cap[PERSISTENT_LAYER] = drop, 1 + drop
            self.limit[PERSISTENT_LAYER] = config.pair_persistence_threshold * config.alert_level

    def levels(self, without: tuple[tuple[str, str], ...] = ()) -> np.ndarray:
        """Per rank, its highest CUSUM over that CUSUM's alert level (``Detector.evidence``);
        ``without``: those CUSUMs left out."""
        return np.max(np.stack([self.cusum[key] / self.limit[key] for key in self.cusum if key not in without]), axis=0)

    def accumulate(self, key: tuple[str, str], z: np.ndarray, step: int, rows: np.ndarray | None = None) -> None:
        """One CUSUM per rank and part of ``z`` (W x parts, see ``score_step``), ``S <- max(0, S +
        min(z, cap) - allowance)``; the rank's level of ``key`` is its largest part. Parts keep
        their evidence apart: a rise and a fall of a signal scored either way (a gradient norm
        that dips on one step and spikes on the next is no lasting shift), and the parameters
        (a lasting rise of one parameter's gradient norm on one rank, silent corruption of that
        layer, accumulates there instead of drowning in the noise of all the others). ``rows``:
        ``z`` holds these ranks' parts only (the compact wire's sampled ranks); the others'
        CUSUMs stay as they are, neither fed nor drained by a step that did not see them."""
        if self.step_scores is not None:
            self.step_scores[key] = np.array(z, dtype=float)  # every part, before the cap
        previous = self.parts.get(key)
        if rows is not None:
            self._accumulate_rows(key, z, step, rows)
            return
        if previous is None:  # the first scored step, or other parameters (see ParameterAttribution.changes)
            previous, self.parts_start[key] = np.zeros_like(z), np.full(z.shape, -1, dtype=np.int32)  # steps < 2**31
        updated = np.minimum(z, self.cap[key])  # S + min(z, cap) - allowance, floored at 0, in one buffer
        updated += previous
        updated -= self.allowance[key]
        np.maximum(0.0, updated, out=updated)
        # A part rising since a step keeps it while above 0; only the parts that start rising on
        # this step are written (W x P parts for the layers: no pass over all of them for the rest).
        start = self.parts_start[key]
        start[(previous == 0) & (updated > 0)] = step
        self.parts[key] = updated
        top = updated.argmax(axis=1)
        ranks = np.arange(self.world)
        level = updated[ranks, top]
        self.cusum[key], self.rising_since[key] = level, np.where(level > 0, start[ranks, top], -1)

    def _accumulate_rows(self, key: tuple[str, str], z: np.ndarray, step: int, rows: np.ndarray) -> None:
        """``accumulate`` of the rows ``rows`` of a W x parts CUSUM: O(rows x parts), not O(W x parts)."""
        parts = self.parts.get(key)
        if parts is None:
            parts = self.parts[key] = np.zeros((self.world, z.shape[1]), dtype=z.dtype)
            self.parts_start[key] = np.full(parts.shape, -1, dtype=np.int32)
        before = parts[rows]
        updated = np.minimum(z, self.cap[key])
        updated += before
        updated -= self.allowance[key]
        np.maximum(0.0, updated, out=updated)
        start = self.parts_start[key][rows]
        start[(before == 0) & (updated > 0)] = step
        parts[rows], self.parts_start[key][rows] = updated, start
        top = updated.argmax(axis=1)
        level = updated[np.arange(len(rows)), top]
        self.cusum[key][rows], self.rising_since[key][rows] = level, np.where(level > 0, start[np.arange(len(rows)), top], -1)

    def take_layer_levels(self, obs: Observation, names: list[str] | None) -> None:
        """The compact wire's layer CUSUMs as this detector's own: each rank's level (the highest of
        the per-parameter CUSUMs it ran on itself, ``ddphooks.fleet.own_values``, with this
        detector's default rate, drift and cap) on its parameter, 0 on the others. A rank's
        sampled rows would give it a baseline only from the first step it was sampled, a fault
        older than that included; the rank itself has its whole history."""
        if not names:
            return
        key = ("own", "layer")
        levels = np.nan_to_num(np.asarray(obs.layer_levels, dtype=float), nan=0.0)
        which = np.clip(np.nan_to_num(np.asarray(obs.layer_parameters, dtype=float), nan=0.0).astype(np.intp), 0, len(names) - 1)
        ranks = np.arange(self.world)
        before = self.rising_since.get(key)
        since = np.full(self.world, -1, dtype=np.int32) if before is None or len(before) != self.world else before.astype(np.int32)
        since = np.where(levels > 0, np.where(since >= 0, since, obs.step), -1).astype(np.int32)
        parts = np.zeros((self.world, len(names)), dtype=PARAMETER_DTYPE)
        parts[ranks, which] = levels
        start = np.full(parts.shape, -1, dtype=np.int32)
        start[ranks, which] = since
        self.parts[key], self.parts_start[key] = parts, start
        self.cusum[key], self.rising_since[key] = levels, since

    @property
    def layer_level(self) -> np.ndarray | None:
        """W x P: the per-parameter CUSUMs (None before the first scored step with parameters)."""
        return self.parts.get(("own", "layer"))

    def empty(self, rank: int, keys=None) -> None:
        """``rank``'s CUSUMs of ``keys`` (every one by default) back to zero, and their parts (each
        signal's rise and fall, each parameter)."""
        for key in self.cusum if keys is None else keys:
            if key in self.parts:
                self.parts[key][rank] = 0.0
            self.cusum[key][rank], self.rising_since[key][rank] = 0.0, -1
