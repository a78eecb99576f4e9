"""The W = 2 split and mirror: with two ranks every score reads one rank against the other, so
a fault on one rank shows on both. This module says which of the two a split belongs to.

The gradient-norm level (``LEVEL``) at W = 2 is one split in two mirrored CUSUMs: a rise of one
rank against the other is the other's fall. It accumulates on both, makes neither rank suspect,
and, as it alerts, is given to one rank (``give_split``): the rank already under alert if one is
(the same fault, most likely), else the rank the pair's mean log gradient norm moved with
(``pair_owner``); the mirror's level CUSUM is emptied and left out while the owner's episode
lasts.

While one rank's episode lasts, the other rank's rising evidence is taken for its mirror and
emptied, not alerted on, unless the pair says that rank changed itself (``changed_itself``: a
layer whose pair mean rose against its trend).

The pair's mean against its trend (``trend_shift``), from a history of (step, m_t):

1. ``m_t``: the pair's mean (of the two ranks' log gradient norms, or of one parameter's);
2. fit ``m_t = a + b t`` to the up to ``window`` steps before ``since`` among the last
   ``PAIR_STEPS x window`` steps (a constant where fewer than ``MIN_BASELINE_STEPS``);
3. ``shift``: the median of ``m_t - (a + b t)`` over the steps from ``since``; ``spread``:
   ``1.4826 x`` the median absolute residual of the steps before.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..baselines import MIN_BASELINE_STEPS
from ..config import DetectorConfig
from ..evidence import Evidence
from ..observation import Observation
from ..signals import LEVEL

#: At W = 2, the pair's mean log gradient norm is kept over this many windows of steps (see
#: PairSplit.pair_owner): a level alert comes 13 steps or more after its CUSUM began rising.
PAIR_STEPS = 4


class PairSplit:
    """At W = 2: the last steps' mean log gradient norm of the pair with their step numbers
    (``pair_means``: which rank a split of the pair's norms belongs to), the same per parameter with
    the parameters' names (``pair_parameter_means``: which rank a layer's split belongs to), the
    mirrors' evidence seen so far (``mirror_since``: (rank, key) -> when it began) and the rank the
    level's evidence was given to while its episode lasts (``level_owner``)."""

    def __init__(self, config: DetectorConfig, evidence: Evidence) -> None:
        self.config, self.evidence = config, evidence
        self.pair_means: deque = deque(maxlen=PAIR_STEPS * config.window)
        self.pair_parameter_means: deque = deque(maxlen=PAIR_STEPS * config.window)
        self.mirror_since: dict[tuple, int] = {}
        self.level_owner: int | None = None

    def record(self, obs: Observation, log_norms: np.ndarray) -> None:
        """One step's means: of the two log gradient norms, and of each parameter's log norms
        (where the step carries every rank's)."""
        self.pair_means.append((obs.step, float(np.mean(log_norms))))  # NaN where either is unknown
        if obs.parameter_norms is not None and obs.parameter_rows is None:
            with np.errstate(divide="ignore", invalid="ignore"):
                logs = np.log(np.where(np.isfinite(obs.parameter_norms) & (obs.parameter_norms > 0), obs.parameter_norms, np.nan))
            self.pair_parameter_means.append((obs.step, obs.parameter_names, logs.mean(axis=0)))

    def changed_itself(self, rank: int, key: tuple[str, str], since: int) -> bool:
        """At W = 2, whether ``rank``'s layer evidence (``key``, rising since ``since``) is its own
        change, not its mirror of the other rank's: the parameter's gradient norm rose against the
        other rank's, and the pair's mean log norm of that parameter, which moves with the rank
        that changed, rose against its trend (``trend_shift``, as ``pair_owner`` reads the
        gradient norm) by more than its steps' spread about that trend before. Any other key:
        False, the pair's split of it belongs to the rank under alert."""
        if key[1] != "layer" or not self.pair_parameter_means:
            return False
        parameter = int(self.evidence.parts[key][rank].argmax())
        names = self.pair_parameter_means[-1][1]
        history = [(step, means[parameter]) for step, step_names, means in self.pair_parameter_means if step_names == names]
        shift = self.trend_shift(history, since)
        return shift is not None and shift[0] > shift[1]

    def trend_shift(self, history: list[tuple[int, float]], since: int) -> tuple[float, float] | None:
        """Steps 2-3 of the module docstring on ``history`` (step, the pair's mean): the median, over the
        steps from ``since``, of the mean against the straight line through its up to ``window``
        steps before (a constant where fewer than ``MIN_BASELINE_STEPS``), and the spread of the
        steps before about that line (1.4826 x their median absolute residual); None without a
        step before ``since`` or from it."""
        steps, means = (np.array(column, dtype=float) for column in zip(*history))
        known = np.isfinite(means)
        before = known & (steps < since)
        before &= np.cumsum(before[::-1])[::-1] <= self.config.window  # the last `window` of them
        after = known & (steps >= since)
        if not before.any() or not after.any():
            return None
        if before.sum() >= MIN_BASELINE_STEPS:
            slope, intercept = np.polyfit(steps[before], means[before], 1)
        else:
            slope, intercept = 0.0, float(np.median(means[before]))
        spread = 1.4826 * float(np.median(np.abs(means[before] - (intercept + slope * steps[before]))))
        return float(np.median(means[after] - (intercept + slope * steps[after]))), spread

    def give_split(self, rank: int, since: int, flagged: list[int]) -> tuple[int, str]:
        """At W = 2, the rank the pair's split in gradient norm is given to as ``rank``'s level
        CUSUM alerts, and the reading for its message: the rank already under alert if one is (the
        same fault, most likely), else ``pair_owner``'s (``flagged``: the ranks under alert). The mirror's level CUSUM is emptied and
        left out (``score_step``) while the owner's episode lasts."""
        owner, reading = (flagged[0], "") if len(flagged) == 1 else self.pair_owner(rank, since)
        self.level_owner = owner
        self.evidence.empty(1 - owner, (LEVEL,))
        return owner, reading

    def pair_owner(self, rank: int, since: int) -> tuple[int, str]:
        """At W = 2, which rank the pair's split in gradient norm belongs to, as ``rank``'s level
        CUSUM (rising since ``since``) alerts, and the reading for the message. The split itself
        is certain, its owner is not: rank a's norm rising by a factor and rank b's falling by it
        make the same split. What tells them apart is the pair's mean log norm, which moves with
        the changed rank's, by half the split: its steps from ``since`` on, against the straight
        line through its steps before (the shared trend, extrapolated), rose for a rank that rose.

        1. ``m_t``: the mean of the two ranks' log gradient norms at step t.
        2. Fit ``m_t = a + b t`` to the up to ``window`` steps before ``since`` among the last
           ``PAIR_STEPS x window`` steps (a constant where fewer than ``MIN_BASELINE_STEPS``; none:
           the owner is then the rank that alerted).
        3. ``shift``: the median of ``m_t - (a + b t)`` over the steps from ``since``.
        4. The owner is the rank whose norm rose against the other's if ``shift > 0``, else
           the one whose norm fell."""
        rose = rank if int(self.evidence.parts[LEVEL][rank].argmax()) == 0 else 1 - rank  # part 0: a rise against the other
        trend = self.trend_shift(list(self.pair_means), since)
        if trend is None:
            return rank, "which of the two changed could not be read (too few steps before the split)"
        shift = trend[0]
        owner = rose if shift > 0 else 1 - rose
        fell = 1 - rose
        reading = (
            f"with two ranks the split is certain but not which rank changed: the pair's mean log gradient norm, which moves with "
            f"the rank that changed, moved {shift:+.3g} against its trend before step {since}, as rank {rose}'s norm rose against "
            f"rank {fell}'s: rank {owner} is the likelier; check both"
        )
        return owner, reading
