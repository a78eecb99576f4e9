"""The robust z-scores of a step: per rank, signal and CUSUM, how far the rank is off, in standard
deviations of its baseline (``ddphooks.detect.baselines``), each counted only in its suspicious
direction.

Per rank ``i`` and step ``t`` it scores, as robust z-scores against baselines learned from the run
itself:

1. **against the other ranks** (W >= 3): each signal's distance from the median rank
   (``ddphooks.detect.signals``), less the window's median distance, over its scale; a signal
   counts in its suspicious direction only (``CROSS_DIRECTION``: a drop of ``cosine``, a rise of
   ``cosine_previous``, either way for ``loss`` and ``grad_norm``, each way in a part of its own).
   At W = 2 the two distances are opposite, and only ``cosine_previous``, where a rise alone is
   suspicious, says which rank it is. At W >= 3, on a step where ``cosine_previous`` rose, its
   score also counts how far the rank's loss fell below the median rank's (capped at
   ``repeat_loss_cap``): a rank that keeps training on one batch memorises it, so its loss falls
   below the others' as its gradient repeats;
2. **against its own history** (every W, the only way to tell which of two ranks changed): the
   rank's loss (only a rise counts), its log gradient norm (either way), its leave-one-out
   cosine (only a drop counts) and its cosine to its previous step (only a rise counts), each
   against the rank's trailing median; the
   score that counts is the rank's change minus the largest (W = 2) or the median (W >= 3) change
   of the other ranks, so a change every rank shares (the training trend, a learning-rate step)
   scores nothing. At W = 2 a loss relative to the step's mean rises on one rank as much as it
   falls on the other, so a rank's loss rise counts only if its own loss moved more than the
   other rank's against their trailing medians (a rank given easier data, or a stuck rank
   memorising its batch, whose loss falls, does not get the other rank named);
3. **several signals at once**: the sum of the rank's scores, each in one direction (loss and
   gradient norm rising, cosine to the others falling, cosine to the previous step rising: a rank
   training on wrong data) and capped at ``combined_cap``, in a CUSUM of its own: at W >= 3 its
   cross-rank scores (allowance ``combined_drift``), at W = 2, with no majority, its own-history
   scores (allowance ``pair_combined_drift``). A rank a little off in its loss *and* its gradient norm
   *and* its cosine (shuffled labels: every signal moves by one or two standard deviations, none
   enough alone) is found far sooner than by any one of them; one direction per signal keeps the
   healthy ranks' noise out of the sum, and the cap keeps one wild signal from passing for several.

The level: ``z = (log|g_i| - median_j log|g_j| - its own median) / scale``, signed (a fall counts
against a rise), learned only while its CUSUM is at zero. Per layer: see
``ddphooks.detect.attribution``. A cosine scale never goes below the sketch's own noise,
``cosine_noise = 1/sqrt(sketch_dim)``, and a cosine deviation below ``cosine_floor`` times that
noise scores zero: a cosine change inside the sketch's noise never raises an alert.
"""

from __future__ import annotations

import math

import numpy as np

from .baselines import Baselines
from .config import DetectorConfig
from .signals import COMBINED_DIRECTION, CROSS_DIRECTION, LEVEL, LEVEL_ROW, OWN_DIRECTION, PERSISTENT_LAYER, SIGNALS, SKETCHED


def _nan_to_zero(z: np.ndarray) -> np.ndarray:
    """A score with unknown (NaN) entries scoring zero: ``np.nan_to_num(z, nan=0.0)`` for the
    scores here, which are finite or NaN (non-finite inputs are NaN, scales are floored above
    zero), at a fraction of its cost (it also looks for infinities, on every signal of every step)."""
    return np.where(np.isnan(z), 0.0, z)


def _sides(change: np.ndarray, direction: int) -> list[np.ndarray]:
    """The suspicious parts of a change, each accumulated apart: itself (+1, a rise), its negative
    (-1, a drop), or both (0: a rise and a drop, never their sum or size)."""
    return [change, -change] if direction == 0 else [direction * change]


def _others_change(z: np.ndarray) -> np.ndarray:
    """Per rank, the other ranks' change: the largest at W = 2 (there is one), the median at
    W >= 3; O(W log W) from one sort, not one median per rank."""
    world = len(z)
    if world < 2:
        return np.zeros(world)
    if world == 2:
        return z[::-1].copy()
    order = np.argsort(z, kind="stable")
    position = np.empty(world, dtype=int)
    position[order] = np.arange(world)
    ranked = z[order]
    # The median of the W - 1 others: middle positions of the sorted list with one entry removed.
    count = world - 1
    low, high = (count - 1) // 2, count // 2

    def pick(k: int) -> np.ndarray:  # the k-th smallest of the others, for every rank at once
        return np.where(position <= k, ranked[min(k + 1, world - 1)], ranked[k])

    return 0.5 * (pick(low) + pick(high))


def score_step(
    config: DetectorConfig, baselines: Baselines, values: dict, deviations: dict, losses: np.ndarray, relative_norms: np.ndarray,
    cosine_noise: float, level_owner: int | None, parameter_change: np.ndarray | None,
) -> dict[tuple[str, str], np.ndarray]:
    """Per (kind, signal), every rank's z-scores for this step (>= 0, W x parts): one part for
    a signal suspicious in one direction, two (its rise, its fall) for one suspicious either way,
    one per parameter for the layers. ``values`` and ``deviations``: the step's signals
    (``ddphooks.detect.signals``); ``losses`` on the loss signal's scale; ``relative_norms``: the
    log gradient norms less the median rank's; ``level_owner``: at W = 2, the rank the pair's
    split was given to (``ddphooks.detect.rules.pair``); ``parameter_change``: the per-parameter
    rises (``ddphooks.detect.attribution``)."""
    world = len(losses)
    noise = cosine_noise if math.isfinite(cosine_noise) else 0.0
    floors = {name: max(noise, 1e-3) if name in SKETCHED else 1e-3 for name in SIGNALS}
    ignored = config.cosine_floor * noise  # a sketched change below this is the sketch's noise
    scores = {}
    combined_terms = []
    loss_fall = np.zeros(world)  # how far each rank's loss fell below the median rank's (W >= 3)
    # Baselines in batched sorts (per kind, over every signal and rank at once), since the
    # detector runs on every step of every rank; the scales grow with the recent spread (see
    # ddphooks.detect.baselines).
    own_median, own_scale = baselines.own_baselines()
    partner_median = baselines.partner_medians() if world == 2 else None
    crossed = [name for name in SIGNALS if name in deviations]
    if crossed:
        cross_median, cross_scale, growth = baselines.cross_baselines([SIGNALS.index(name) for name in crossed])
        combined_scale = cross_scale * growth**config.combined_growth
        cross_scale = cross_scale * growth
    for index, name in enumerate(SIGNALS):
        # Own history: the rank's change against its trailing median, minus the others' change.
        median, scale = own_median[index], np.maximum(own_scale[index], floors[name])
        change = values[name] - median
        if name in SKETCHED:
            change = np.where(np.abs(change) < ignored, 0.0, change)
        if partner_median is None:
            sides = [_nan_to_zero(side / scale) for side in _sides(change, OWN_DIRECTION[name])]
            scores[("own", name)] = np.stack([np.maximum(z - _others_change(np.maximum(z, 0.0)), 0.0) for z in sides], axis=1)
        else:
            # W = 2: the other rank's change over the steps this rank's own baseline holds, in the
            # signal's own units: what both ranks show in the same direction is the run's trend,
            # and it cancels as it is, whatever either rank's spread or the steps it left out.
            other = values[name][::-1] - partner_median[index]
            if name in SKETCHED:
                other = np.where(np.abs(other) < ignored, 0.0, other)
            pairs = zip(_sides(change, OWN_DIRECTION[name]), _sides(other, OWN_DIRECTION[name]))
            scores[("own", name)] = np.stack([np.maximum(_nan_to_zero((side - np.maximum(_nan_to_zero(shared), 0.0)) / scale), 0.0) for side, shared in pairs], axis=1)
        if name in deviations:
            position = crossed.index(name)
            median, scale = cross_median[position], max(cross_scale[position], floors[name])
            gap = deviations[name] - median
            if name in SKETCHED:
                gap = np.where(np.abs(gap) < ignored, 0.0, gap)
            sides = [_nan_to_zero(side / scale) for side in _sides(gap, CROSS_DIRECTION[name])]
            scores[("cross", name)] = np.maximum(np.stack(sides, axis=1), 0.0)
            if world >= 3:
                z = _nan_to_zero(gap / max(combined_scale[position], floors[name]))
                combined_terms.append(np.clip(COMBINED_DIRECTION[name] * z, 0.0, config.combined_cap))
                if name == "loss":
                    loss_fall = np.clip(-z, 0.0, config.repeat_loss_cap)
    if combined_terms:
        scores[("cross", "combined")] = sum(combined_terms)[:, None]
    repeat = ("cross", "cosine_previous")
    if world >= 3 and repeat in scores:
        # Repeating data: the gradient repeats and the loss falls below the others' (the rank
        # memorises the batch it keeps seeing); each term capped apart (see repeat_loss_cap).
        # The loss counts only on steps whose cosine rose: a rank with easier data, its loss
        # alone lower, never passes for one whose gradient repeats.
        raised = scores[repeat] > 0
        scores[repeat] = np.minimum(scores[repeat], config.repeat_cap) + np.where(raised, loss_fall[:, None], 0.0)
    # The level: the rank's log gradient norm relative to the median rank's, against its own
    # median, both ways (the second part, a fall); learned while the level CUSUM is at zero.
    z = _nan_to_zero((relative_norms - own_median[LEVEL_ROW]) / np.maximum(own_scale[LEVEL_ROW], floors["grad_norm"]))
    scores[LEVEL] = np.maximum(np.stack([z, -z], axis=1), -config.level_cap)
    if world == 2:
        # With two ranks a loss relative to the step's mean rises on one rank exactly as much as
        # it falls on the other: it counts only for the rank whose own loss moved the more
        # against its trailing median (a rank given easier data, or memorising a batch it keeps
        # seeing, does not get the other rank named).
        # Both read over the steps this rank's baseline holds (Baselines.pair_moves).
        moved, partner_moved = (_nan_to_zero(move) for move in baselines.pair_moves(losses))
        scores[("own", "loss")] = np.where((moved >= partner_moved)[:, None], scores[("own", "loss")], 0.0)
        # So does the level, but a step's own moves are no guide to which rank's norm split
        # from the other's: a shared trend moves both more than a lasting x1.5 does. The
        # pair's split accumulates on both (a rise of one is the fall of the other, one CUSUM
        # in two mirrors) and is given to one rank when it alerts (PairSplit.pair_owner), the mirror's
        # then left out while that rank's episode lasts.
        if level_owner is not None:
            scores[LEVEL][1 - level_owner] = 0.0
        # Several signals at once against the rank's own history: each own score's first part is
        # its change in COMBINED_DIRECTION (a rise; a drop for the cosine), capped one by one.
        scores[("own", "combined")] = sum(np.minimum(scores[("own", name)][:, :1], config.combined_cap) for name in SIGNALS)
    if parameter_change is not None:
        # Per rank and parameter, in standard deviations; accumulated per parameter (ddphooks.detect.evidence).
        scores[("own", "layer")] = parameter_change
        if world == 2:
            # How long each parameter's rise lasts (DetectorConfig.pair_persistence_score): a
            # raised step adds 1 to its persistence CUSUM once the allowance is taken off.
            scores[PERSISTENT_LAYER] = np.where(parameter_change > config.pair_persistence_score, 1 + config.pair_persistence_drift, 0.0)
    return scores
