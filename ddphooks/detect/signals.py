"""The four signals the detector reads of every rank on every step, and which change of each is
suspicious.

Per rank ``i`` on a step:

1. ``loss``: the rank's loss, as ``loss_scale`` reads it (the log while every loss seen is
   positive, relative changes as for the gradient norm; the loss itself from the first loss <= 0
   on), less the step's mean over the ranks: the run's downward trend cancels;
2. ``grad_norm``: ``log|g_i|``, the log of the rank's local gradient norm;
3. ``cosine``: the leave-one-out cosine ``cos(s_i, sum_{j != i} s_j)`` of the rank's sketch with
   the sum of the others' (a drop: the rank disagrees with the rest);
4. ``cosine_previous``: ``atanh(cos(s_i(t), s_i(t-1)))``, the rank's sketched cosine to its own
   gradient of the previous step on Fisher's scale (a rise: a rank that keeps training on the same
   batch, a stuck data loader, produces nearly the same gradient again, while healthy ranks draw a
   new batch every step).

Against the other ranks (``cross_deviations``) each is the distance from the median over all
ranks, the rank itself included (robust to the one rank that is off); at W = 2 the two distances
are opposite, and only ``cosine_previous``, where a rise alone is suspicious, says which rank it
is. The gradient-norm level (``LEVEL``) reads ``log|g_i| - median_j log|g_j|``
(``_relative_to_median``).
"""

from __future__ import annotations

import numpy as np

from .observation import Observation
from .robust import _column_medians

SIGNALS = ("loss", "grad_norm", "cosine", "cosine_previous")
#: Which change of each signal is suspicious, against the rank's own history and against the other
#: ranks: +1 a rise, -1 a drop, 0 either way (see ``ddphooks.detect.scores``). Against its own history
#: only a rise of the loss counts: a rank whose loss falls (a stuck loader memorising its batch)
#: would make the other rank's loss, relative to the step's mean, look risen at W = 2 and take
#: the blame.
OWN_DIRECTION = {"loss": +1, "grad_norm": 0, "cosine": -1, "cosine_previous": +1}
CROSS_DIRECTION = {"loss": 0, "grad_norm": 0, "cosine": -1, "cosine_previous": +1}
#: Which change of each signal counts in the combined CUSUM (W >= 3): the pattern of a rank that
#: trains on wrong data, whose loss and gradient norm rise while its gradient turns from the
#: others'. Each signal's own CUSUM still counts either way (CROSS_DIRECTION); in the sum, a change
#: either way would add every healthy rank's folded noise (0.8 standard deviations a signal on
#: average) to the allowance, and a rank a little off would have to be off by that much more.
COMBINED_DIRECTION = {"loss": +1, "grad_norm": +1, "cosine": -1, "cosine_previous": +1}
#: Signals measured by the sketch, whose changes inside the sketch's noise never count.
SKETCHED = ("cosine", "cosine_previous")
#: The gradient-norm level CUSUM's key (see ``DetectorConfig.level_drift``): its alerts are ``grad_norm`` alerts.
LEVEL = ("level", "grad_norm")
#: Its row in the own-history window, after the signals'.
LEVEL_ROW = len(SIGNALS)
#: At W = 2, the per-parameter persistence CUSUM's key (see ``DetectorConfig.pair_persistence_score``):
#: its alerts are ``layer`` alerts.
PERSISTENT_LAYER = ("persistent", "layer")


def signal_values(obs: Observation, losses: np.ndarray, log_norms: np.ndarray) -> dict[str, np.ndarray]:
    """Every rank's value of each signal on the step (W each, NaN where unknown), from its losses
    on the loss signal's scale and its log gradient norms."""
    nan = np.full(obs.world_size, np.nan)
    # The mean of the known losses without np.nanmean, whose warning for an all-NaN step would
    # need warnings.catch_warnings: that swaps the process-wide filters, and the detector runs
    # on the pipeline thread while training code may set its own.
    known = losses[~np.isnan(losses)]
    with np.errstate(divide="ignore", invalid="ignore"):
        # The loss relative to the step's mean loss: the run's downward trend cancels, and a
        # rank whose loss rises stands out from its own history even at W = 2.
        return {
            "loss": losses - known.mean() if known.size else nan,
            "grad_norm": log_norms,  # its own trend is the others' (see _others_change)
            "cosine": obs.cosine_loo if obs.cosine_loo is not None else nan,
            "cosine_previous": _fisher(obs.cosine_previous) if obs.cosine_previous is not None else nan,
        }


def cross_deviations(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each signal's distance from the median rank's, per rank (at W = 2 only the signals whose
    suspicious change is a rise)."""
    # From the median of all ranks, the rank itself included: at W = 3 the median of the
    # *other* two would be pulled halfway to a faulty rank, making the healthy ones look off.
    # At W = 2 the two deviations are opposite: only a signal where one direction is the
    # suspicious one (a rise of the cosine to the previous step) can say which rank it is.
    world = len(values["loss"])
    return {
        name: row - _column_medians(row[:, None])[0]
        for name, row in values.items()
        if world >= 3 or CROSS_DIRECTION[name] > 0
    }


def _relative_to_median(log_norms: np.ndarray) -> np.ndarray:
    """Each rank's log gradient norm minus the median rank's (the level CUSUM's reading): the
    schedule's and the training phase's trend, shared by every rank, cancels on every step, and
    the one rank that is off cannot move the median (against the mean, a rank's doubled gradient
    would lower every other rank's relative norm by log(2) / W). Unknown (NaN) and zero (-inf)
    norms stay as they are, out of the median."""
    finite = log_norms[np.isfinite(log_norms)]
    return log_norms - np.median(finite) if finite.size else np.full(len(log_norms), np.nan)


def _fisher(cosine: np.ndarray) -> np.ndarray:
    """Fisher's ``atanh`` of a cosine: a rank whose gradient repeats lands near 1, where a sketched
    cosine's error shrinks (about ``(1 - c^2) / sqrt(k)``); on this scale it is about the same
    everywhere, so 0.6 -> 0.9 counts for what it is, far more than 0.0 -> 0.3."""
    return np.arctanh(np.clip(cosine, -0.999, 0.999))
