"""The duplicate-data rule (kind ``duplicate_data``): ranks that train on the same batches.

1. On each step, group the ranks that agree (``_duplicate_groups``): losses and gradient norms
   equal to ``duplicate_tolerance`` relative (``|a - b| / max(|a|, |b|)``), leave-one-out cosines
   to ``duplicate_cosine_tolerance``.
2. A group whose ranks were together on each of the last ``duplicate_steps`` steps (twice as many
   where a step compared only the gradient norms) is named (``rank`` its lowest rank, ``ranks``
   all of them, ``score`` their number, ``since`` the first step of the run together), unless
   every rank of it is already flagged.
3. A rank stays flagged until it has been in no group for ``quiet_steps`` steps.

Duplicate data needs no baseline, and works from step 0 and at
W = 2: ranks that train on the same batches (no ``DistributedSampler``, or one given the same rank
on every rank; one data seed on every rank) compute the same loss and the same gradient, to
rounding, and W - 1 of them add nothing to the average. Two ranks are duplicates on a step when
their losses and their gradient norms agree to ``duplicate_tolerance`` (relative), and, with a
sketch, their leave-one-out cosines to ``duplicate_cosine_tolerance`` (the same gradient has the
same sum of the others: ``S - s_i = S - s_j``); a group of every rank must also have every
leave-one-out cosine >= ``1 - duplicate_cosine_tolerance``. Groups are found in O(W log W): sort by
loss, cut where neighbours' losses differ beyond the tolerance, sort each piece by gradient norm
and link neighbours that agree in every quantity. A rank with a non-finite or missing loss or
gradient norm, or a zero gradient (a step where no rank has a gradient is no duplicate data),
never counts; with no loss on any rank (none captured) the gradient norms and cosines decide. A
group that stays together for ``duplicate_steps`` consecutive instrumented steps (twice as many
where only the gradient norms are known) is named (``rank`` its lowest rank, ``ranks`` all of
them, ``score`` their number, ``since`` the first of those steps). Distinct data agrees by
chance: a pair of healthy ranks whose losses and gradient norms spread with a coefficient of
variation ``c`` across ranks agrees in one of them to a relative tolerance ``tau`` with a
probability of about ``tau / (sqrt(pi) c)`` a step (the difference of two ranks' values has a
standard deviation of ``sqrt(2) c``), in both about ``tau^2 / (pi c^2)``, on ``k`` steps running
``(tau^2 / (pi c^2))^k``. At W = 1024 (523,776 pairs) over 100,000 steps, with ``tau = 1e-4``,
``c = 1%`` and ``k = 3``: 523,776 x 1e5 x (3.2e-5)^3 = 1.7e-3 false alarms a run, before the
cosines, which agree to 1e-4 by chance about one step in 1,800 more (a spread of 0.1 across
ranks). On the embedded model's healthy runs ``c`` is 3-15% (losses) and 5-24% (gradient norms),
medians over steps, and a pair's chance agreement in both was measured at 3.2e-7 a step
(see ``duplicate_tolerance``): 523,776 x 1e5 x (3.2e-7)^3 = 2e-9 false alarms a run. One alert
per episode: a rank stays flagged until it has been in no duplicate group for ``quiet_steps``
steps; a group with a rank not yet flagged raises a new one.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..config import DetectorConfig
from ..messages import LIKELY_CAUSES, reference
from ..observation import Observation


def _relative_difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b| / max(|a|, |b|)``, 0 where ``a == b`` (two zeros included)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(a == b, 0.0, np.abs(a - b) / np.maximum(np.abs(a), np.abs(b)))


def _duplicate_groups(
    losses: np.ndarray | None, norms: np.ndarray, cosines: np.ndarray | None, tolerance: float, cosine_tolerance: float
) -> tuple[np.ndarray, bool]:
    """Per rank, the lowest rank of its duplicate group on this step (-1 outside any), and whether
    more than the gradient norms were compared (see the module docstring).

    O(W log W): sorted by loss, the ranks fall into pieces of losses that agree neighbour to
    neighbour; each piece sorted by gradient norm, neighbours are linked where they agree in every
    known quantity. Links only join neighbours of that order, so a group is a run of links in it.
    """
    world = len(norms)
    labels = np.full(world, -1)
    valid = np.isfinite(norms) & (norms > 0)  # a zero gradient computes nothing, not the same thing
    use_loss = losses is not None and bool(np.isfinite(losses).any())
    if use_loss:
        valid &= np.isfinite(losses)
    known_cosines = cosines is not None and bool(np.isfinite(cosines[valid]).any())
    ranks = np.flatnonzero(valid)
    if len(ranks) < 2:
        return labels, use_loss or known_cosines
    loss = losses[ranks] if use_loss else np.zeros(len(ranks))
    order = np.argsort(loss, kind="stable")
    pieces = np.empty(len(ranks), dtype=int)
    pieces[order] = np.concatenate([[0], np.cumsum(_relative_difference(loss[order][1:], loss[order][:-1]) > tolerance)])
    order = np.lexsort((norms[ranks], pieces))  # by piece, then by gradient norm
    first, second = ranks[order][:-1], ranks[order][1:]
    link = (pieces[order][1:] == pieces[order][:-1]) & (_relative_difference(norms[first], norms[second]) <= tolerance)
    if use_loss:
        link &= _relative_difference(losses[first], losses[second]) <= tolerance
    if known_cosines:
        gap = np.abs(cosines[first] - cosines[second])
        link &= ~(gap > cosine_tolerance)  # compared where both are known
    if not link.any():
        return labels, use_loss or known_cosines
    segment = np.concatenate([[0], np.cumsum(~link)])  # per position in `order`: its run of links
    sizes = np.bincount(segment)
    lowest = np.full(len(sizes), world)
    np.minimum.at(lowest, segment, ranks[order])
    grouped = sizes[segment] >= 2
    labels[ranks[order][grouped]] = lowest[segment][grouped]
    if known_cosines and len(sizes) == 1 and len(ranks) == world:
        # Every rank in one group: each one's gradient is the sum of the others' direction.
        if np.nanmin(cosines) < 1 - cosine_tolerance:
            labels[:] = -1
    return labels, use_loss or known_cosines


class DuplicateDataRule:
    """The ``duplicate_data`` alerts of a run, step by step (``update``). ``history``: the last
    steps' groups, (step, labels, strong, losses, grad norms, cosines), strong where more than the
    gradient norms were compared; ``episodes``: rank under a duplicate_data alert -> steps in no
    group since."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.history: deque = deque(maxlen=2 * config.duplicate_steps)
        self.episodes: dict[int, int] = {}

    def update(self, obs: Observation) -> list[dict]:
        """Groups of ranks that computed the same loss and gradient on the last ``duplicate_steps``
        steps (twice as many where a step compared only the gradient norms), from step 0: see the
        module docstring."""
        config = self.config
        finite = lambda array: None if array is None else np.where(np.isfinite(array), array, np.nan)
        losses, norms, cosines = finite(obs.losses), finite(obs.grad_norms), finite(obs.cosine_loo)
        labels, strong = _duplicate_groups(losses, norms, cosines, config.duplicate_tolerance, config.duplicate_cosine_tolerance)
        self.history.append((obs.step, labels, strong, losses, norms, cosines))
        alerts = []
        if (labels >= 0).any():
            needed = config.duplicate_steps
            if not all(entry[2] for entry in list(self.history)[-needed:]):
                needed *= 2  # the gradient norms alone: one chance agreement a step is far likelier
            if len(self.history) >= needed:
                recent = np.stack([entry[1] for entry in list(self.history)[-needed:]])  # steps x W
                candidates = np.flatnonzero((recent >= 0).all(axis=0))
                if len(candidates) >= 2:
                    # Ranks together on every one of those steps: the same labels on each.
                    _, together = np.unique(recent[:, candidates].T, axis=0, return_inverse=True)
                    together = np.asarray(together).reshape(-1)
                    for group in sorted((candidates[together == g] for g in np.unique(together)), key=lambda g: g[0]):
                        if len(group) >= 2 and not set(group.tolist()) <= set(self.episodes):
                            alerts.append(self._alert(obs, group))
                            self.episodes.update((int(rank), 0) for rank in group)
        for rank in list(self.episodes):
            self.episodes[rank] = 0 if labels[rank] >= 0 else self.episodes[rank] + 1
            if self.episodes[rank] >= config.quiet_steps:
                del self.episodes[rank]
        return alerts

    def _alert(self, obs: Observation, group: np.ndarray) -> dict:
        """The alert for ``group`` (ranks together on the last steps): since when, and the largest
        relative differences seen among them on those steps."""
        steps = []
        for entry in reversed(self.history):  # back while the group stayed together
            members = entry[1][group]
            if members[0] < 0 or (members != members[0]).any():
                break
            steps.append(entry)
        since = steps[-1][0]

        def largest_gap(index: int) -> float:  # over those steps, (max - min) / max of the group's values, NaN if unknown
            values = [entry[index][group] for entry in steps if entry[index] is not None]
            return max((float(_relative_difference(v.max(), v.min())) for v in values if np.isfinite(v).all()), default=math.nan)

        loss_gap, norm_gap = largest_gap(3), largest_gap(4)
        known = [entry[5][group] for entry in steps if entry[5] is not None and np.isfinite(entry[5][group]).any()]
        every = len(group) == obs.world_size
        ranks = [int(rank) for rank in group]
        if every:
            who = f"every rank (all {len(ranks)})"
        elif len(ranks) <= 8:
            who = f"ranks {', '.join(map(str, ranks))}"
        else:
            who = f"{len(ranks)} ranks ({', '.join(map(str, ranks[:8]))}, ...)"
        agreement = lambda gap: "exactly" if gap == 0 else f"to {gap:.2g} relative"
        agreed = [f"their losses agreed {agreement(loss_gap)}"] if not math.isnan(loss_gap) else []
        agreed.append(f"their gradient norms {'' if agreed else 'agreed '}{agreement(norm_gap)}")
        evidence = " and ".join(agreed)
        if known and every:
            below = max(0.0, 1 - min(float(np.nanmin(v)) for v in known))
            evidence += f"; their gradient cosines to the sum of the others were {'all 1' if below == 0 else f'within {below:.2g} of 1'}"
        elif known:
            gap = max(float(np.nanmax(v) - np.nanmin(v)) for v in known)
            evidence += f"; their gradient cosines to the sum of the others agreed {'exactly' if gap == 0 else f'to {gap:.2g}'}"
        signals = (["loss"] if not math.isnan(loss_gap) else []) + ["grad_norm"] + (["cosine"] if known else [])
        same = "gradient" if math.isnan(loss_gap) else "loss and gradient"
        message = (
            f"{who} computed the same {same} on every step since step {since} ({len(steps)} steps; {evidence}): "
            f"they train on the same data, and the work of {len(ranks) - 1} of these {len(ranks)} ranks is wasted; "
            f"typical of {LIKELY_CAUSES['duplicate_data']}; {reference('duplicate_data')}"
        )
        return {
            "step": obs.step,
            "rank": ranks[0],
            "kind": "duplicate_data",
            "since": int(since),
            "score": float(len(ranks)),
            "signals": signals,
            "parameters": [],
            "message": message,
            "ranks": ranks,
        }
