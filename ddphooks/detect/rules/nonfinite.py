"""The non-finite rule (kind ``nonfinite``): the rank whose loss or local gradient went NaN or Inf
first, while the other ranks' were finite.

1. On each step, ``bad``: the ranks whose loss (records' ``nonfinite`` key) or local gradient norm
   is not finite (an absent rank's NaN is no fault). ``alone``: not every rank is bad.
2. A rank bad alone is remembered with that step (what went non-finite, which parameters, which
   ranks were finite), for ``quiet_steps`` steps.
3. It is named (``since`` its first remembered step, ``score`` the number of parameters the record
   lists) when it is bad again on the very next step (its NaN reached every replica, or it stays
   non-finite), or bad alone for the ``NONFINITE_AGAIN``-th time within ``quiet_steps`` steps.
4. A named rank is not named again until it has been finite for ``quiet_steps`` steps.

Non-finite values need no baseline: a rank whose loss or local
gradient went NaN or Inf on a step where the other ranks' were finite is named (kind ``nonfinite``,
``since`` that step, the parameters whose gradients were not finite, ``score`` how many of them a
record lists) on the next step if its values are still not finite there, or on its third step
non-finite alone within ``quiet_steps`` (a failing unit that corrupts some steps and not others),
with no warm-up. Without a
loss scaler the averaged gradient carries the NaN to every replica, and from the next step on every
rank is non-finite: the alert says which rank it came from. With one (fp16 ``GradScaler``) an
overflow on one rank makes every rank skip that step and the next step is finite again: that is the
scaler's routine and raises nothing (the scale is halved each time, so the same rank does not
overflow three times within a few steps). Every rank non-finite from the same step (a learning rate that
blows up everywhere) names no rank and raises nothing; the records show it. Non-finite values score
nothing in the other signals (they are unknown there), online as offline, where a record holds them
as null.
"""

from __future__ import annotations

import numpy as np

from ..config import DetectorConfig
from ..messages import LIKELY_CAUSES, reference
from ..observation import Observation

#: Lone non-finite steps of one rank within ``quiet_steps`` that name it (see ``NonfiniteRule.update``):
#: a workload-zoo rank with a failing unit (exponent bits flipped in its gradient) went Inf alone on
#: steps 151, 153, 156 and 163 and was named at 164 by the next-step rule alone.
NONFINITE_AGAIN = 3


class NonfiniteRule:
    """The ``nonfinite`` alerts of a run, step by step (``update``). ``first``: rank -> the steps
    it was non-finite alone, within ``quiet_steps``; ``episodes``: rank under a nonfinite alert ->
    finite steps since."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.first: dict[int, list[dict]] = {}
        self.episodes: dict[int, int] = {}

    def update(self, obs: Observation) -> list[dict]:
        """Ranks whose loss or local gradient went non-finite while the other ranks' were finite,
        named on the next step if they are still not finite (see the module docstring)."""
        report = obs.nonfinite or {}
        bad_loss = {int(rank) for rank in report.get("losses", [])}
        bad_gradient = set(np.flatnonzero(~np.isfinite(obs.grad_norms)).tolist()) - set(obs.absent)  # an absent rank's NaN is no fault
        bad = bad_loss | bad_gradient
        alone = len(bad) < obs.world_size  # every rank at once names none
        # Named: still not finite on the step after it went non-finite alone (its NaN reached every
        # replica, or it stays non-finite), or non-finite alone for the NONFINITE_AGAIN-th time
        # within quiet_steps steps (a failing unit that corrupts some steps only). A loss scaler's
        # overflow on one rank is finite on the next step, and does not come back twice so soon on
        # the same rank: the scale is halved each time.
        window = self.config.quiet_steps
        self.first = {
            rank: kept for rank, lone in self.first.items() if (kept := [first for first in lone if obs.step - first["step"] < window])
        }  # fmt: skip
        alerts = []
        for rank, lone in sorted(self.first.items()):
            if rank not in bad:
                continue
            if lone[-1]["step"] == obs.step - 1:
                alerts.append(self._alert(obs, rank, lone[-1], bad))
            elif alone and len(lone) + 1 >= NONFINITE_AGAIN:
                alerts.append(self._alert(obs, rank, lone[0], bad))
        self.episodes.update((alert["rank"], 0) for alert in alerts)  # a new episode per alert
        for rank in list(self.episodes):
            self.first.pop(rank, None)
            self.episodes[rank] = 0 if rank in bad else self.episodes[rank] + 1
            if self.episodes[rank] >= self.config.quiet_steps:
                del self.episodes[rank]
        if alone:
            for rank in sorted(bad - set(self.episodes)):
                what = " and ".join(part for part, hit in (("loss", rank in bad_loss), ("local gradient", rank in bad_gradient)) if hit)
                names = [g["parameter"] for g in report.get("gradients", []) if g.get("rank") == rank]
                first = {"step": obs.step, "what": what, "parameters": names, "finite": sorted(set(range(obs.world_size)) - bad)}
                self.first.setdefault(rank, []).append(first)
        return alerts

    def _alert(self, obs: Observation, rank: int, first: dict, bad: set[int]) -> dict:
        names = first["parameters"][: self.config.top_parameters]
        if len(bad) == obs.world_size:
            now = "every rank's values are not finite"
        elif obs.step == first["step"] + 1:
            now = "its values are still not finite"
        else:
            now = f"its values are not finite again while the others' are ({NONFINITE_AGAIN} times in {obs.step - first['step'] + 1} steps)"
        return {
            "step": obs.step,
            "rank": rank,
            "kind": "nonfinite",
            "since": first["step"],
            "score": float(len(first["parameters"])),
            "signals": ["nonfinite"],
            "parameters": names,
            "message": (
                f"rank {rank}'s {first['what']} went non-finite (NaN or Inf) at step {first['step']} while rank(s) "
                f"{', '.join(map(str, first['finite']))} had finite values"
                + (f", in {', '.join(names[:3])}" if names else "")
                + f"; at step {obs.step} {now}; typical of {LIKELY_CAUSES['nonfinite']}; {reference('nonfinite')}"
            ),
        }
