"""The parameter attribution: which layers of a rank deviate, scored per parameter for the layer
CUSUMs (``layer`` alerts) and named in every statistical alert.

Per rank ``i`` and parameter ``p``, in standard deviations:

1. ``d_{i,p} = log|g_{i,p}| - median_j log|g_{j,p}|`` (on the compact wire, against the log of
   the other present ranks' mean norm, ``(n mean_p - |g_{i,p}|) / (n - 1)``);
2. less the rank's common factor ``median_q d_{i,q}`` (with ``COMMON_FACTOR_PARAMETERS`` or more);
3. ``rise = d_{i,p} - level_{i,p}``, the exponential average ``level <- (1 - 0.1) level + 0.1 d``
   (``PARAMETER_RATE``; not learned from a suspect rank, nor from a parameter whose CUSUM is
   above 0);
4. ``change = rise / (scale / (1 - 0.9^n) + 1e-3)``, the scale's average bias-corrected over the
   ``n`` steps it has learned (W >= 3: ``1.4826 * median_i |rise_{i,p}|`` pooled over ranks; W = 2:
   ``sqrt(pi / 2) |rise_{i,p}|``, each rank's own), after ``warmup`` steps.

Why: the rank's common factor is removed because a batch that makes one rank's whole gradient
larger moves all its parameters alike, and one corrupted parameter cannot move a median over many
(with it removed, the corrupted weights of the embedded model's ``sdc`` runs rose 9.9 standard
deviations a step instead of 5.9, medians). Only a rise counts (a corrupted gradient carries more
energy: that direction also tells which of two ranks it is). The change is
accumulated in one CUSUM per rank and parameter (allowance ``layer_drift``, threshold
``layer_threshold``; a step counts up to ``layer_cap``, near a corrupted layer's steady rise,
because healthy parameters have heavy tails and there are W x P of these CUSUMs: one
parameter needs five steps at the cap to alert at level 1, however wild, while a corrupted
layer's steady rise of a few standard deviations loses little to the cap), so that a lasting
change in one layer is not lost among the hundreds of parameters that did not change; the
rank's level is its largest. A zero norm is unknown, as a non-finite one: a parameter the
rank's batch did not use (an expert or a task head under conditional computation,
``find_unused_parameters=True``) has no local gradient to compare. The scale of a parameter's rises is learned on every step,
pooled over ranks (an exponential average of their median absolute rise, which the one rank
that is off cannot move; W >= 3). A scale learned only on calm steps would be too small by
the steps it skips, and healthy runs would raise per-parameter alerts. At W = 2, with no
majority, each rank's scale is its own average absolute rise, learned on the steps when its
evidence on that parameter is not accumulating.

An alert names the parameters that deviate most on its rank (``suspicious``): by the evidence of
their CUSUMs, and where there is none, by this step's change.
"""

from __future__ import annotations

import math

import numpy as np

from .config import DetectorConfig
from .evidence import Evidence
from .observation import PARAMETER_DTYPE, Observation
from .robust import MAD_TO_STD, _select_quantiles, _transposed
from .signals import PERSISTENT_LAYER

#: The CUSUMs kept per rank and parameter: the ``layer_drift`` one and, at W = 2, the persistence one.
PARAMETER_KEYS = (("own", "layer"), PERSISTENT_LAYER)

PARAMETER_RATE = 0.1  # weight of a new step in the per-parameter exponential averages
#: Fewest parameters whose median is a rank's common factor (see ``ParameterAttribution.changes``):
#: with one or two, a corrupted parameter would move it.
COMMON_FACTOR_PARAMETERS = 3


class ParameterAttribution:
    """Per rank and parameter, the rise of its share of the gradient norm (``parameter_change``,
    W x P, or rows x P for the compact wire's ``parameter_rows``) and what it is learned from:
    ``parameter_level`` (W x P averages), ``parameter_scale`` (1 x P, W x P at W = 2),
    ``parameter_names``. The layer CUSUMs themselves are ``evidence``'s (keys ``PARAMETER_KEYS``),
    which follow the parameters when they are listed in another order."""

    def __init__(self, config: DetectorConfig, world: int, evidence: Evidence) -> None:
        self.config, self.world, self.evidence = config, world, evidence
        self.parameter_level: np.ndarray | None = None  # W x P exponential averages of log|g_{i,p}|
        self.parameter_scale: np.ndarray | None = None  # standard deviations of their rises, 1 x P (W = 2: W x P; see learn)
        self.parameter_change: np.ndarray | None = None  # this step's W x P change (see changes)
        self.parameter_rows: np.ndarray | None = None  # the ranks of parameter_change's rows, where not every rank's
        self.parameter_names: list[str] | None = None

    def changes(self, obs: Observation) -> None:
        """Per rank and parameter, how far ``d_{i,p} - median_q d_{i,q}`` (with ``d_{i,p} =
        log|g_{i,p}| - median_j log|g_{j,p}|``) rose above its exponential average, in standard
        deviations (``parameter_change``; None without the norms). With ``parameter_rows`` (the
        compact wire) only those ranks' rows: ``median_j log|g_{j,p}|`` is then the log of the
        mean norm of the other ranks present, exact from ``parameter_mean_norms`` (a few sampled
        rows would make a poor median, one row none at all: the rank itself), and each rank's
        baseline is the one it had when it was last sampled."""
        self.parameter_change = None
        if obs.parameter_norms is None or obs.parameter_names is None:
            return
        rows = None if obs.parameter_rows is None else np.asarray(obs.parameter_rows, dtype=np.intp)
        self.parameter_rows = rows
        with np.errstate(divide="ignore", invalid="ignore"):
            # Non-finite norms are unknown, as offline (null); the nonfinite rule reports them. So is a
            # zero norm: a parameter the rank's batch did not use (conditional computation, an
            # expert or a head no sample was routed to) has no local gradient to compare, and its
            # log, -inf, would make every rank that used it look infinitely far above the median.
            # (The log of every norm, then the non-finite ones unknown: the log is finite exactly
            # where the norm is finite and above zero.)
            norms = obs.parameter_norms  # C-ordered logs, whatever the norms' order (offline: a transpose)
            logs = np.log(norms, out=np.empty(norms.shape, dtype=PARAMETER_DTYPE))
            finite = np.isfinite(logs)
            self._parameters_known = bool(finite.all())  # every norm known: no NaN below
            if not self._parameters_known:
                logs[~finite] = np.nan
            # Medians by selection, over each parameter's ranks (a transposed copy) and each
            # rank's parameters: O(W x P), not a sort.
            known = self._parameters_known
            full = None if not known else np.full(logs.shape[1], logs.shape[0])  # every rank known
            if rows is not None and obs.parameter_mean_norms is not None:
                # The other ranks' mean norm: (n mean - own) / (n - 1), over the n ranks present.
                present = obs.world_size - len(obs.absent)
                others = (present * obs.parameter_mean_norms.astype(PARAMETER_DTYPE) - norms) / max(present - 1, 1)
                reference = np.log(others)
                reference[~np.isfinite(reference)] = np.nan
                deviation = logs - reference
            else:
                deviation = logs - _select_quantiles(_transposed(logs), 0.5, full)
            if deviation.shape[1] >= COMMON_FACTOR_PARAMETERS:
                # A batch that makes one rank's whole gradient larger moves every parameter alike;
                # the median over parameters is that common factor, which one corrupted parameter
                # cannot move. Without it, a parameter's noise is mostly the rank's total.
                deviation -= _select_quantiles(deviation.copy(), 0.5, None if not known else np.full(len(logs), logs.shape[1]))[:, None]
            self._parameter_now = deviation
            self._parameter_rise = None  # this step's rise (after the warm-up), for learn
        if self.parameter_names != obs.parameter_names:
            self._reorder(obs.parameter_names)
        if self.parameter_names != obs.parameter_names or self.parameter_level is None:  # other parameters: start afresh
            self.parameter_names = list(obs.parameter_names)
            if rows is None:
                self.parameter_level = self._parameter_now.copy()
            else:  # a rank's level is unknown (NaN) until it is first sampled
                self.parameter_level = np.full((self.world, self._parameter_now.shape[1]), np.nan, dtype=PARAMETER_DTYPE)
                self.parameter_level[rows] = self._parameter_now
            # W >= 3: one scale per parameter, pooled over ranks (1 x P, broadcast); W = 2: each rank's.
            self.parameter_scale = np.zeros((1 if self.world >= 3 else len(self.parameter_level), self.parameter_level.shape[1]), dtype=PARAMETER_DTYPE)
            self.parameter_seen = 0
            for key in PARAMETER_KEYS:
                self.evidence.parts.pop(key, None)
            return
        if self.parameter_seen >= self.config.warmup:
            level = self.parameter_level if rows is None else self.parameter_level[rows]
            rise = self._parameter_rise = self._parameter_now - level
            # The scale's average starts from zero: divided by the weight it has gathered (as in
            # Adam's bias correction), it is not underestimated over the first steps.
            scale = self.parameter_scale if rows is None or len(self.parameter_scale) == 1 else self.parameter_scale[rows]
            scale = scale / (1 - (1 - PARAMETER_RATE) ** self.parameter_seen)
            scale += 1e-3
            with np.errstate(invalid="ignore"):
                change = np.divide(rise, scale)
            finite = np.isfinite(change)  # as np.nan_to_num(nan=0.0, posinf=1e9, neginf=-1e9), looking once
            if not finite.all():
                change[~finite] = np.nan_to_num(change[~finite], nan=0.0, posinf=1e9, neginf=-1e9)
            self.parameter_change = change

    def _reorder(self, names: list[str]) -> None:
        """Follow the same parameters listed in another order (DDP lists them in bucket order, and
        rebuilds its buckets after the first steps): permute their baselines and per-parameter
        CUSUMs by name, so a fault in progress is neither lost nor blamed on another layer.
        Nothing changes unless ``names`` are exactly the known parameters."""
        if self.parameter_level is None or len(set(names)) != len(names) or sorted(names) != sorted(self.parameter_names):
            return
        where = {name: index for index, name in enumerate(self.parameter_names)}
        order = [where[name] for name in names]
        self.parameter_level, self.parameter_scale = self.parameter_level[:, order], self.parameter_scale[:, order]
        for key in PARAMETER_KEYS:
            if key in self.evidence.parts:
                self.evidence.parts[key], self.evidence.parts_start[key] = self.evidence.parts[key][:, order], self.evidence.parts_start[key][:, order]
        self.parameter_names = list(names)

    def learn(self, obs: Observation, suspect: np.ndarray) -> None:
        if obs.parameter_norms is None or self.parameter_level is None or self.parameter_names != obs.parameter_names:
            return
        rate = PARAMETER_RATE
        rows = self.parameter_rows
        level = self._parameter_now
        stored = self.parameter_level if rows is None else self.parameter_level[rows]  # rows: a copy, written back below
        rise = self._parameter_rise if self._parameter_rise is not None else level - stored
        self._parameter_rise = None
        if rows is not None:
            suspect = suspect[rows]
        # A suspect rank does not teach the baseline its fault (with every norm known, the
        # learnable entries are its rows: no W x P pass to find them).
        learnable = ~suspect[:, None] if self._parameters_known else np.isfinite(level) & ~suspect[:, None]
        keep = np.broadcast_to(learnable, level.shape)
        layer_level = self.evidence.layer_level
        if layer_level is not None and layer_level.shape[0] == self.world and layer_level.shape[1] == keep.shape[1]:
            keep = keep & ((layer_level if rows is None else layer_level[rows]) == 0)  # nor does a parameter whose evidence is accumulating
        # (1 - rate) * level + rate * now where kept, in place; the few entries not kept (a
        # scattered few of W x P: a branch per entry would cost more) put back after.
        held = np.flatnonzero(~keep)
        kept_before = stored.flat[held]
        stored *= 1 - rate
        stored += rate * level
        if rows is not None:
            first = np.isnan(stored)  # a rank sampled for the first time: its level is this step's
            stored[first] = level[first]
        stored.flat[held] = kept_before
        if rows is not None:
            self.parameter_level[rows] = stored
        if self.world >= 3:
            # Every step, pooled over ranks: the median absolute rise (1.4826 of it is a standard
            # deviation), which the one rank that is off cannot move (by selection, over each
            # parameter's ranks: a transposed copy).
            deviation = _transposed(rise, np.abs)
            if self._parameters_known:
                deviation[:, suspect] = np.nan
            elif not learnable.all():
                deviation[~learnable.T] = np.nan
            typical = MAD_TO_STD * _select_quantiles(deviation, 0.5)
            learned = np.isfinite(typical)
            if learned.all():
                self.parameter_scale *= 1 - rate
                self.parameter_scale += rate * typical
            else:
                learned_scale = (1 - rate) * self.parameter_scale
                learned_scale += rate * np.nan_to_num(typical)
                self.parameter_scale = np.where(learned, learned_scale, self.parameter_scale)
        else:
            # No majority: each rank's own average absolute rise (sqrt(pi/2) of it is a standard
            # deviation), only while its evidence on the parameter is not accumulating, or the
            # fault would become the scale.
            typical, learned = math.sqrt(math.pi / 2) * np.abs(rise), keep & np.isfinite(rise)
            scale = self.parameter_scale if rows is None else self.parameter_scale[rows]
            scale = np.where(learned, (1 - rate) * scale + rate * np.nan_to_num(typical), scale)
            if rows is None:
                self.parameter_scale = scale
            else:
                self.parameter_scale[rows] = scale
        self.parameter_seen += 1

    def suspicious(self, rank: int, key: tuple[str, str] = ("own", "layer")) -> list[str]:
        """The parameters that deviate most on ``rank``: by the evidence of their CUSUMs of ``key``
        (one of ``PARAMETER_KEYS``), and where there is none, by this step's change."""
        if self.parameter_change is None:
            return []
        rows = self.parameter_rows
        if rows is None:
            change = self.parameter_change[rank].astype(float)  # float64: the tie-break below stays above rounding
        elif rank in rows:  # the compact wire: this step's rise where the rank was sampled, else none
            change = self.parameter_change[int(np.flatnonzero(rows == rank)[0])].astype(float)
        else:
            change = np.zeros(self.parameter_change.shape[1])
        # Accumulated evidence first (the per-parameter CUSUMs), this step's rise where there is none.
        evidence = self.evidence.parts.get(key)
        relative = change if evidence is None else evidence[rank] + 1e-6 * change
        order = np.argsort(-relative)[: self.config.top_parameters]
        return [self.parameter_names[p] for p in order if relative[p] > 0]
