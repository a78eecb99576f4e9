"""The online detector (``Detector``): it composes the parts of ``ddphooks.detect`` into one step.

Each step (``Detector.update``):

1. read the signals of every rank (``signals``), on the loss signal's scale (``baselines``);
2. score them against their baselines (``scores``) and each parameter against its own average
   (``attribution``), after ``warmup`` steps;
3. run the rules without a baseline on the step's own values: ``rules.replica``,
   ``rules.nonfinite``, ``rules.duplicate_data``;
4. accumulate the scores in the CUSUMs (``evidence``; on the compact wire above its sampled
   ranks, the ranks' own layer CUSUMs taken as the detector's) and name the ranks past their alert
   level (``rules.divergence``, with ``rules.pair`` at W = 2);
5. teach the baselines the step, leaving out every suspect rank (evidence over half its alert
   level, or under alert): a lasting fault does not become the new normal before it is reported.
"""

from __future__ import annotations

import numpy as np

from .attribution import PARAMETER_KEYS, ParameterAttribution
from .baselines import Baselines
from .config import DetectorConfig
from .evidence import Evidence
from .messages import first_check
from .observation import Observation, _partial_layer_view
from .rules.divergence import DivergenceRule
from .rules.duplicate_data import DuplicateDataRule
from .rules.nonfinite import NonfiniteRule
from .rules.pair import PairSplit
from .rules.replica import ReplicaRule
from .scores import score_step
from .signals import LEVEL, PERSISTENT_LAYER, SIGNALS, _relative_to_median, cross_deviations, signal_values


class Detector:
    """Online detector over step observations; see ``ddphooks.detect`` for the method.

    Args:
        config: thresholds (``DetectorConfig()`` by default).
        keep_scores: keep each step's scores per CUSUM, rank and part (``step_scores``) and the
            CUSUM behind each statistical alert (``fired``), for ``benchmarks/detection.py``.

    Its parts, made at the first step with two ranks or more (and again if the world size
    changes): ``baselines``, ``cusums`` (the evidence), ``attribution``, ``pair`` (W = 2 only, else
    None) and the rules ``divergence``, ``replica``, ``nonfinite`` and ``duplicate_data``.

    Example::
        >>> detector = Detector()
        >>> alerts = detector.update(Observation.from_record(record))
    """

    def __init__(self, config: DetectorConfig | None = None, keep_scores: bool = False) -> None:
        self.config = config or DetectorConfig()
        self.world: int | None = None
        self.seen = 0
        self.alerts: list[dict] = []
        # For the benchmarks (the per-step separation d' of the signal that fired, the best CUSUM
        # over the same scores): each step's scores per CUSUM key (W x parts, before the cap), and
        # the key and part (the parameter, or the direction) behind each statistical alert.
        self.step_scores: dict[tuple[str, str], np.ndarray] | None = {} if keep_scores else None
        self.fired: list[tuple[int, int, tuple[str, str], int]] = []  # (step, rank, key, the part that crossed)

    def _start(self, world: int) -> None:
        config = self.config
        self.world = world
        self.baselines = Baselines(config, world)
        self.cusums = Evidence(config, world, self.step_scores)
        self.attribution = ParameterAttribution(config, world, self.cusums)
        self.pair = PairSplit(config, self.cusums) if world == 2 else None
        fired = self.fired if self.step_scores is not None else None
        self.divergence = DivergenceRule(config, world, self.cusums, self.baselines, self.attribution, self.pair, fired)
        self.replica = ReplicaRule(config)
        self.nonfinite = NonfiniteRule(config)
        self.duplicate_data = DuplicateDataRule(config)

    def update(self, obs: Observation) -> list[dict]:
        """Read one step; return the alerts it raises (also appended to ``self.alerts``)."""
        if obs.world_size - len(obs.absent) < 2:
            return []  # nothing to compare (ranks that joined under Join are absent, not zero)
        if self.world != obs.world_size:
            self._start(obs.world_size)
        if self.step_scores is not None:
            self.step_scores.clear()
        # Non-finite values are unknown here, as in a record (null) read offline; the nonfinite
        # rule reports them.
        losses = np.where(np.isfinite(obs.losses), obs.losses, np.nan) if obs.losses is not None else np.full(obs.world_size, np.nan)
        losses = self.baselines.loss_scale(losses)  # from here on as the loss signal reads them (log or linear)
        with np.errstate(divide="ignore"):
            log_norms = np.log(np.where(np.isfinite(obs.grad_norms), obs.grad_norms, np.nan))
        values = signal_values(obs, losses, log_norms)
        relative_norms = _relative_to_median(log_norms)
        if self.pair is not None:
            self.pair.record(obs, log_norms)
        deviations = cross_deviations(values)
        self.attribution.changes(obs)
        # No scores before the baselines hold `warmup` steps: a median of three steps is no baseline.
        scores = {}
        if self.seen >= self.config.warmup:
            level_owner = None if self.pair is None else self.pair.level_owner
            scores = score_step(
                self.config, self.baselines, values, deviations, losses, relative_norms, obs.cosine_noise, level_owner, self.attribution.parameter_change
            )
        alerts = self.replica.update(obs) + self.nonfinite.update(obs) + self.duplicate_data.update(obs)
        # The level CUSUM's baseline learns a rank's step only if that CUSUM was at zero before it:
        # a lasting shift of a few standard deviations is never learned as the new normal, while
        # a healthy step, independent of the steps before it, is kept or left out by chance alone.
        level = self.cusums.parts.get(LEVEL)
        level_quiet = np.ones(self.world, dtype=bool) if level is None else ~(level > 0).any(axis=1)
        # At W = 2 so does each signal's own baseline: a rank's step is learned only where that
        # signal's own CUSUM and the rank's combined one were at zero before it (held, with the
        # partner's step, elsewhere: Baselines.learn).
        signal_quiet = self._signal_quiet() if self.world == 2 else None
        if _partial_layer_view(obs):  # the compact wire above sampled_ranks: every rank ran its layer CUSUM itself
            for key in PARAMETER_KEYS:  # (the ranks run no persistence CUSUM of their own: none then)
                scores.pop(key, None)
            self.cusums.take_layer_levels(obs, obs.parameter_names or self.attribution.parameter_names)
        for key, z in scores.items():
            self.cusums.accumulate(key, z, obs.step, self.attribution.parameter_rows if key in PARAMETER_KEYS else None)
        alerts += self.divergence.update(obs, values)
        # A rank with half the evidence of an alert (or under alert) does not teach the baselines:
        # otherwise a lasting fault becomes the new normal before it is reported.
        # At W = 2 the level's evidence is the pair's split, as much the other rank's as this one's
        # until it alerts (PairSplit.pair_owner): it does not make either rank suspect, or the
        # healthy rank's baselines would age out under it and score its next steps against a few
        # (its own level baseline is held by level_quiet either way). Nor does the persistence
        # CUSUM: it counts how long a moderate rise lasts, and a rank that stopped learning while
        # it counted would make its own healthy excursions last (on the zoo's healthy W = 2 runs
        # of r = 18-19 a LoRA run's reached 21.1 of its 21.25 that way, 13.9 without).
        suspect = self.evidence(without=(LEVEL, PERSISTENT_LAYER) if self.world == 2 else ()) > 0.5
        suspect[list(self.divergence.episodes)] = True
        self.baselines.learn(values, deviations, relative_norms, losses, suspect, level_quiet, signal_quiet)
        self.seen += 1
        self.attribution.learn(obs, suspect)
        alerts = [first_check(alert) for alert in alerts]
        self.alerts.extend(alerts)
        return alerts

    def _signal_quiet(self) -> np.ndarray:
        """Per signal and rank (signals x W), whether its own CUSUM (every part) is at zero. Not
        the combined CUSUM's: with its lower allowance it is above zero on many healthy steps, and
        holding every signal of a rank while it is made a slow healthy wander of one rank's norm
        against the other's add up (a false alarm on the nanoGPT client at W = 2)."""
        quiet = np.ones((len(SIGNALS), self.world), dtype=bool)
        for index, name in enumerate(SIGNALS):
            parts = self.cusums.parts.get(("own", name))
            if parts is not None:
                quiet[index] = ~(parts > 0).any(axis=1)
        return quiet

    def evidence(self, without: tuple[tuple[str, str], ...] = ()) -> np.ndarray:
        """Per rank, its highest statistical CUSUM as a fraction of that CUSUM's alert level (an
        alert above 1; empty before the first multi-rank step). Times ``alert_level``, the CUSUM
        over its level-1 threshold: ``benchmarks/detection.py`` reports the highest on healthy
        steps, the margin left before a false alarm. ``without``: those CUSUMs left out."""
        if self.world is None:
            return np.zeros(0)
        return self.cusums.levels(without)
