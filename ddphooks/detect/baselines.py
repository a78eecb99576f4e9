"""The baselines every score is read against: each rank's trailing window of every signal (its own
history), the window of the signals' distances from the median rank (across ranks), and their
medians and scales.

Baselines are the median and a standard deviation of the last ``window`` steps:

1. ``median``: of the window's known values (NaN where fewer than ``MIN_BASELINE_STEPS`` (8)
   steps are known: no score; a rank kept out of its own for a whole window is not scored until
   it has learned 8 steps again);
2. ``scale = max(1.4826 * MAD, shoulders)``: the scaled median absolute deviation, and the median
   rank's ``scale_quantile`` (0.9) of its absolute deviations over a normal's (``_shoulders``;
   the smaller of the two ranks' at W = 2). The two agree for normal noise; for noise with a
   second mode (ranks whose batches come from different domains) or heavy shoulders (a loss with
   outlier batches) the quantile's is the larger, so what is routine in the run scores as routine;
3. at W >= 3, ``scale *= growth``: the median of the last ``recent`` steps' spreads across ranks
   over the median of all, never below 1 (in the first steps of training the ranks' losses are
   close together and then spread out, and a baseline that still remembers the calm steps would
   take the new normal for a fault). Each step's spread is its MAD across ranks, which the one
   rank that is off cannot move, so that rank does not raise its own bar; at W = 2 there is no
   majority, and the scales are the window's. The combined CUSUM's terms grow with a power of it
   (``combined_growth``, the square root): a ratio of noisy medians over a few steps, floored at
   1, also inflates the scales by chance, and the combined CUSUM would divide all of its terms by
   it.

Scales have floors (1e-3; a sketched signal's, the sketch's noise), so that a constant signal does
not divide by zero.

Own history: per signal and rank, over the rank's own steps. Across ranks: per signal, pooled over
every rank and step of the window (healthy ranks are exchangeable). Both are learned never
including the steps of a rank with a CUSUM past half its threshold or that is under alert (a
lasting fault does not become the new normal before it is reported). The gradient-norm level's
baseline (read against the median rank) learns a rank's step only while its level CUSUM is at zero,
and is held, not aged out, while the rank is left out (see ``DetectorConfig.level_drift``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DetectorConfig
from .robust import MAD_TO_STD, _growth_ratio, _select_quantiles, _sorted_quantiles, _spreads, _typical_shoulder
from .signals import LEVEL_ROW, SIGNALS

#: Fewest steps a baseline is learned from: a median and MAD of one or two steps have no spread,
#: and a rank kept out of its own baseline for a whole window (while it is suspect, see
#: ``Baselines.learn``) would otherwise score its next steps against the scale's floor.
MIN_BASELINE_STEPS = 8


class _History:
    """Trailing values of ``signals`` signals over the last ``window`` steps: a ring buffer,
    ``data`` signals x W x window (each rank's steps of a signal side by side, so its quantiles
    need no transpose; ``next`` the slot of the next step), NaN where missing or excluded. Every
    statistic taken over a window is order-free but the growth's (its last steps: ``slots``).
    ``known`` and ``finite``: per signal and rank, how many of its values in the window are not
    NaN, and finite (kept as steps come and go, not counted over the window every step).
    ``spread``: with ``spreads``, each step's spread across ranks per signal, signals x window
    (see ``_spreads``), taken as the step is pushed: a pushed step never changes. ``steps_first``:
    with ``by_step``, the same values signals x window x W (each step's ranks side by side, for
    statistics across ranks: written as the step is pushed, not transposed every step)."""

    def __init__(self, window: int, world: int, signals: int = 1, spreads: bool = False, by_step: bool = False) -> None:
        self.window, self.world = window, world
        self.data = np.full((signals, world, window), np.nan)
        self.steps_first = np.full((signals, window, world), np.nan) if by_step else None
        self.known = np.zeros((signals, world), dtype=np.int64)
        self.finite = np.zeros((signals, world), dtype=np.int64)
        self.spread = np.full((signals, window), np.nan) if spreads else None
        self.next = 0

    def push(self, rows: np.ndarray, keep: np.ndarray, hold: np.ndarray | None = None) -> None:
        """One step: ``rows`` signals x W (W for one signal), ranks not in ``keep`` as NaN, or,
        where ``hold`` (signals x W) too, as the value their slot already holds: that rank's
        window stays as it was, so its baseline neither learns the step nor ages out; its
        ``steps_first`` (each step's ranks, for the spread across them) gets the step's value, so
        that a spread that grows on every rank is seen even while every rank is held."""
        leaving = self.data[:, :, self.next]
        kept = np.where(keep, rows, np.nan if hold is None else np.where(hold, leaving, np.nan)).reshape(len(self.data), self.world)
        across = kept if hold is None else np.where(keep | hold, rows, np.nan).reshape(len(self.data), self.world)
        self.known += np.isnan(leaving)  # minus the leaving step's known values, plus the new one's
        self.known -= np.isnan(kept)
        self.finite -= np.isfinite(leaving)
        self.finite += np.isfinite(kept)
        self.data[:, :, self.next] = kept
        if self.steps_first is not None:
            self.steps_first[:, self.next] = across
        if self.spread is not None:
            self.spread[:, self.next] = _spreads(kept)
        self.next = (self.next + 1) % self.window

    def clear(self, signal: int) -> None:
        """Forget one signal's steps (the loss's, when its scale changes: see ``Baselines.loss_scale``)."""
        self.data[signal] = np.nan
        self.known[signal] = self.finite[signal] = 0
        if self.steps_first is not None:
            self.steps_first[signal] = np.nan
        if self.spread is not None:
            self.spread[signal] = np.nan

    def slots(self, last: int) -> np.ndarray:
        """The slots of the last ``last`` steps, oldest first."""
        return (self.next - last + np.arange(last)) % self.window

    def steps(self, signal: int = 0) -> np.ndarray:
        """One signal's window, steps x W, oldest first (a copy)."""
        return self.data[signal][:, self.slots(self.window)].T


@dataclass
class _Signal:
    """One signal of a ``_History``: ``values``, its window as steps x W, oldest first (a copy)."""

    history: _History
    index: int

    @property
    def values(self) -> np.ndarray:
        return self.history.steps(self.index)



class Baselines:
    """The detector's windows at world size ``world`` and what it reads of them.

    ``own_history``: every signal's values and the level's relative log gradient norms (signals +
    1 rows x W x window), by step too at W >= 3 (the spread across ranks); ``cross_history``: each
    signal's distances from the median rank, with each step's spread; ``raw``, ``level`` and
    ``cross``: one signal's window each, as steps x W. At W = 2 only, ``pair_history``: the losses
    themselves (which of the two ranks' loss moved, see ``ddphooks.detect.scores``).
    ``log_losses``: the loss signal reads the logs of the losses, until a loss <= 0."""

    def __init__(self, config: DetectorConfig, world: int) -> None:
        self.config = config
        window = config.window
        # Own-history values and deviations from the others, every signal in one window each
        # (signals x W x window); raw and cross: each signal's, as steps x W (``values``).
        # One more row after the signals': the level CUSUM's relative log gradient norms, learned
        # only while that CUSUM is at zero (see learn); its baselines come from the same sorts.
        self.own_history = _History(window, world, len(SIGNALS) + 1, by_step=world >= 3)
        self.cross_history = _History(window, world, len(SIGNALS), spreads=True)
        self.raw = {name: _Signal(self.own_history, index) for index, name in enumerate(SIGNALS)}
        self.level = _Signal(self.own_history, LEVEL_ROW)
        self.cross = {name: _Signal(self.cross_history, index) for index, name in enumerate(SIGNALS)}
        self.pair_history = _History(window, world) if world == 2 else None
        # At W = 2, each rank's partner at the same steps: in rank i's slot of a window, the other
        # rank's value on the step rank i's slot holds (kept, held and left out with rank i's), so
        # that the other rank's change is read over the steps rank i's own baseline holds
        # (``partner_medians``): a shared trend cancels however many steps either rank left out.
        self.partner_history = _History(window, world, len(SIGNALS) + 1) if world == 2 else None
        self.pair_partner = _History(window, world) if world == 2 else None
        self.log_losses = config.loss_scale == "log"  # until a loss <= 0 (see loss_scale)

    def loss_scale(self, losses: np.ndarray) -> np.ndarray:
        """The losses on the scale the loss signal reads them (``DetectorConfig.loss_scale``): their
        logs while every loss seen was positive, the losses themselves from the first step with
        a loss <= 0 on (a loss that may be negative: an ELBO, a GAN's, a policy objective), when
        the loss baselines start afresh rather than mix the two scales."""
        if self.log_losses and (losses <= 0).any():
            self.log_losses = False
            loss = SIGNALS.index("loss")
            for history, signal in ((self.own_history, loss), (self.cross_history, loss), (self.pair_history, 0), (self.partner_history, loss), (self.pair_partner, 0)):
                if history is not None:
                    history.clear(signal)
        if not self.log_losses:
            return losses
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(losses)

    def learn(
        self, values: dict, deviations: dict, relative_norms: np.ndarray, losses: np.ndarray, suspect: np.ndarray, level_quiet: np.ndarray,
        signal_quiet: np.ndarray | None = None,
    ) -> None:
        """One step into the windows: every rank's values, but a ``suspect`` rank's (left out), and
        the level's relative norm of a rank only where its level CUSUM was at zero
        (``level_quiet``; held, not aged out, elsewhere). At W = 2, ``signal_quiet`` (signals x W):
        a rank's step of a signal is learned only where that signal's own CUSUM and the rank's
        combined one were at zero before it, and every step a rank leaves out is held, not aged
        out (its partner's with it, see ``partner_medians``): a lasting shift that is still under
        the evidence of a suspect rank never becomes that rank's new normal."""
        pair = self.pair_history is not None
        keep = np.repeat(~suspect[None], len(SIGNALS) + 1, axis=0)
        keep[LEVEL_ROW] &= level_quiet
        if pair and signal_quiet is not None:
            keep[: len(SIGNALS)] &= signal_quiet
        if pair:
            loss_keep = keep[SIGNALS.index("loss")]
            self.pair_history.push(losses, loss_keep, np.ones(2, dtype=bool))
            self.pair_partner.push(losses[::-1], loss_keep, np.ones(2, dtype=bool))
        # The level's baseline is held while the rank is left out of it, not aged out: read
        # against the median rank, a trend cancels, so an old baseline stays valid, and a shift
        # too small to alert within a window would otherwise outlive its baseline, score nothing
        # and be learned as the new normal once the CUSUM drained. A spread that grows on every
        # rank (early training) still grows the level's scale: the spread across ranks reads
        # every rank's step, held ones too (_History.push). The other signals' trends do not
        # cancel: their baselines age out as before.
        hold = np.zeros_like(keep)
        hold[LEVEL_ROW] = True
        rows = np.stack([values[name] for name in SIGNALS] + [relative_norms])
        if pair:  # every row held: the partner's history holds the same steps, so a trend cancels
            hold[:] = True
            self.partner_history.push(rows[:, ::-1], keep, hold)
        self.own_history.push(rows, keep, hold)
        unknown = np.full(len(suspect), np.nan)  # a signal not compared across ranks (W = 2)
        self.cross_history.push(np.stack([deviations.get(name, unknown) for name in SIGNALS]), ~suspect)

    def own_baselines(self) -> tuple[np.ndarray, np.ndarray]:
        """Per signal and rank (signals x W), the median of its own window and its scale: ``_robust``
        and ``_shoulders`` over the window, grown by ``_growth`` at W >= 3 (see the module
        docstring); the median NaN where the window holds fewer than ``MIN_BASELINE_STEPS`` steps.
        One sort of each rank's steps, one of their distances to its median (the MAD and the
        shoulders' quantile both from it), and two selections per step across ranks."""
        quantile, history = self.config.scale_quantile, self.own_history
        signals, world, steps = history.data.shape
        rows = history.data.reshape(signals * world, steps)  # one row per signal and rank
        count = history.known.reshape(-1)
        median = _sorted_quantiles(np.sort(rows, axis=1), count, 0.5)
        with np.errstate(invalid="ignore"):
            distance = np.abs(rows - median[:, None])
        ordered = np.sort(distance, axis=1)
        infinite = not np.array_equal(history.known, history.finite)  # inf - inf: a NaN distance
        if infinite:
            count = steps - np.count_nonzero(np.isnan(distance), axis=1)
        scale = MAD_TO_STD * np.nan_to_num(_sorted_quantiles(ordered, count, 0.5), nan=0.0)
        median, scale = median.reshape(signals, world), scale.reshape(signals, world)
        if quantile > 0.5:
            scale = np.maximum(scale, _typical_shoulder(_sorted_quantiles(ordered, count, quantile).reshape(signals, world), quantile)[:, None])
        median[history.finite < MIN_BASELINE_STEPS] = np.nan  # no baseline: no score
        if world >= 3:  # at W = 2 the spread across ranks is the gap that the rank that is off makes
            with np.errstate(invalid="ignore"):
                # One row per signal and step; float32, as the per-parameter arithmetic: the
                # spreads' ratio needs no more, and the window's selections cost half as much.
                work = np.subtract(history.steps_first, median[:, None, :], dtype=np.float32)
            per_step = _spreads(work.reshape(signals * steps, world), infinite).reshape(signals, steps)
            scale = scale * _growth_ratio(per_step, history.slots(self.config.recent))[:, None]
        return median, scale

    def partner_medians(self) -> np.ndarray:
        """At W = 2, per signal and rank (signals x 2), the median of the other rank's values over
        the steps this rank's own window holds: the other rank's change is its value now less
        this, read over the same steps as this rank's own change (``ddphooks.detect.scores``)."""
        history = self.partner_history
        signals, world, steps = history.data.shape
        rows = history.data.reshape(signals * world, steps)
        median = _sorted_quantiles(np.sort(rows, axis=1), history.known.reshape(-1), 0.5).reshape(signals, world)
        median[history.finite < MIN_BASELINE_STEPS] = np.nan
        return median

    def pair_moves(self, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """At W = 2, per rank, how far its loss moved against its trailing median, and how far the
        other rank's moved over the same steps (``pair_partner``)."""
        own = _sorted_quantiles(np.sort(self.pair_history.data[0], axis=1), self.pair_history.known[0], 0.5)
        partner = _sorted_quantiles(np.sort(self.pair_partner.data[0], axis=1), self.pair_partner.known[0], 0.5)
        with np.errstate(invalid="ignore"):
            return np.abs(losses - own), np.abs(losses[::-1] - partner)

    def cross_baselines(self, crossed: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | float]:
        """Per signal compared across ranks (indices ``crossed`` into SIGNALS), the median and scale
        of the deviations of every rank and step in the window, pooled over ranks (healthy ranks
        are exchangeable; ``_robust`` and ``_shoulders``), and the growth of their spread across
        ranks (W >= 3, else 1.0; each step's spread taken as the step was pushed)."""
        quantile, history = self.config.scale_quantile, self.cross_history
        data = history.data if len(crossed) == len(history.data) else history.data[crossed]
        signals, world, steps = data.shape
        known, finite = history.known[crossed], history.finite[crossed]
        infinite = not np.array_equal(known, finite)  # inf - inf: a NaN distance
        values = data.reshape(signals, world * steps)
        median = _select_quantiles(values.copy(), 0.5, known.sum(axis=1))
        with np.errstate(invalid="ignore"):
            distance = np.abs(values - median[:, None])
        scale = MAD_TO_STD * np.nan_to_num(_select_quantiles(distance.copy(), 0.5, None if infinite else known.sum(axis=1)), nan=0.0)
        if quantile > 0.5:
            rows = distance.reshape(signals * world, steps)  # each rank's steps
            count = steps - np.count_nonzero(np.isnan(rows), axis=1) if infinite else known.reshape(-1)
            per_rank = _sorted_quantiles(np.sort(rows, axis=1), count, quantile).reshape(signals, world)
            scale = np.maximum(scale, _typical_shoulder(per_rank, quantile))
        median[finite.sum(axis=1) < MIN_BASELINE_STEPS] = np.nan
        growth = _growth_ratio(history.spread[crossed], history.slots(self.config.recent)) if world >= 3 else 1.0
        return median, scale, growth
