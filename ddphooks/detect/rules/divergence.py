"""The statistical divergence rule (kinds ``loss``, ``grad_norm``, ``cosine``,
``cosine_previous``, ``combined`` and ``layer``): a rank whose evidence passes its alert level.

Each step, for every rank over its alert level or in an episode:

1. ``strongest``: the rank's CUSUM furthest up its own alert level (``ddphooks.detect.evidence``);
   its signal is the alert's kind (the level CUSUM's is ``grad_norm``);
2. above 1 (past its level): at W = 2, a level CUSUM's split is first given to one rank
   (``ddphooks.detect.rules.pair``), and a rank whose partner is under alert is the partner's
   mirror (its evidence emptied, no alert) unless the pair says it changed itself; otherwise a rank
   not in an episode starts one and is named: its strongest signal, every signal over half its
   level (``signals``), since which step that CUSUM has been rising (``since``), its level
   (``score``) and the parameters that deviate most on that rank (``parameters``,
   ``ddphooks.detect.attribution``);
3. at or below 1, an episode counts a quiet step; ``quiet_steps`` of them in a row end it.

One alert per episode: a rank is not named again while its episode lasts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..attribution import ParameterAttribution
from ..baselines import Baselines
from ..config import DetectorConfig
from ..evidence import Evidence
from ..messages import LIKELY_CAUSES, reference
from ..observation import Observation
from ..signals import LEVEL, PERSISTENT_LAYER, SIGNALS, _relative_to_median, cross_deviations
from .pair import PairSplit


@dataclass
class _Episode:
    since: int
    quiet: int = 0


class DivergenceRule:
    """The statistical alerts of a run at world size ``world``, step by step (``update``), read
    from ``evidence`` (the CUSUMs), ``baselines`` (a signal's usual value, for the message),
    ``attribution`` (the parameters named) and, at W = 2, ``pair``. ``episodes``: rank -> its
    episode; ``fired``: where given, (step, rank, key, part) of the CUSUM behind each alert is
    appended to it (for ``benchmarks/detection.py``)."""

    def __init__(
        self, config: DetectorConfig, world: int, evidence: Evidence, baselines: Baselines, attribution: ParameterAttribution,
        pair: PairSplit | None, fired: list | None,
    ) -> None:
        self.config, self.world, self.evidence, self.baselines = config, world, evidence, baselines
        self.attribution, self.pair, self.fired = attribution, pair, fired
        self.episodes: dict[int, _Episode] = {}

    def update(self, obs: Observation, values: dict) -> list[dict]:
        """The alerts of one step, its scores already accumulated (``values``: the step's signals)."""
        config = self.config
        alerts = []
        # Only ranks over their alert level or in an episode need a look (a few, not W).
        for rank in sorted(set(np.flatnonzero(self.evidence.levels() > 1).tolist()) | set(self.episodes)):
            levels = {key: self.evidence.cusum[key][rank] for key in self.evidence.cusum}
            strength = {key: level / self.evidence.limit[key] for key, level in levels.items()}
            strongest = max(strength, key=strength.get)
            episode = self.episodes.get(rank)
            if strength[strongest] > 1:
                since, reading = int(self.evidence.rising_since[strongest][rank]), ""
                if strongest == LEVEL and self.pair is not None and self.pair.level_owner is None:
                    owner, reading = self.pair.give_split(rank, since, [r for r in range(2) if r in self.episodes])
                    if owner != rank:  # the mirror's evidence is the owner's: alert on it, in its episode
                        if owner in self.episodes:
                            continue
                        rank, episode, levels = owner, None, {key: self.evidence.cusum[key][owner] for key in self.evidence.cusum}
                if episode is None and self.world == 2 and 1 - rank in self.episodes:
                    # At W = 2 each rank is read against the other (the median of two, the step's
                    # mean): while one rank's episode lasts, the other's rising scores are its
                    # mirror, the same fault, unless the pair says this rank changed
                    # (PairSplit.changed_itself, read from when the mirror first rose). A mirror's
                    # evidence is emptied, not alerted on.
                    # (Both layer CUSUMs, the layer_drift one and the persistence one, mirror from
                    # when the first of them did: the persistence one outlasts an emptying.)
                    mirrored = ("own", "layer") if strongest == PERSISTENT_LAYER else strongest
                    since = self.pair.mirror_since.setdefault((rank, mirrored), since)
                    if not self.pair.changed_itself(rank, strongest, since):
                        self.evidence.empty(rank)
                        continue
                if episode is None:
                    self.episodes[rank] = _Episode(since)
                    alerts.append(self._alert(obs, rank, strongest, levels, since, values, reading))
                else:
                    episode.quiet = 0
            elif episode is not None:
                episode.quiet += 1
                if episode.quiet >= config.quiet_steps:
                    del self.episodes[rank]
                    if self.pair is not None:
                        self.pair.mirror_since = {key: first for key, first in self.pair.mirror_since.items() if key[0] == rank}
                        if rank == self.pair.level_owner:
                            self.pair.level_owner = None
        return alerts

    def _alert(self, obs: Observation, rank: int, strongest: tuple[str, str], levels: dict, since: int, values: dict, reading: str = "") -> dict:
        if self.fired is not None:
            self.fired.append((obs.step, rank, strongest, int(self.evidence.parts[strongest][rank].argmax())))
        kind, name = strongest
        signals = sorted({f"{n} ({k})" for (k, n), level in levels.items() if level > self.evidence.limit[(k, n)] / 2})
        parameters = self.attribution.suspicious(rank, strongest if name == "layer" else ("own", "layer"))
        against = {"cross": "the other ranks", "level": "its own usual level against the other ranks"}.get(kind, "its own recent steps")
        if name == "layer":
            top = int(self.evidence.parts[strongest][rank].argmax())
            detail = f"the gradient norm of {self.attribution.parameter_names[top]} rose against the median rank's and against this rank's other parameters, step after step"
            if strongest == PERSISTENT_LAYER:  # its rise is moderate but lasting
                detail += f", on most steps since step {since}"
        elif strongest == ("cross", "cosine_previous") and self.world >= 3 and np.isfinite(values["loss"][rank]):
            detail = "; ".join(self._now_and_usual(("cross", signal), rank, values) for signal in ("cosine_previous", "loss"))
        elif name == "combined":
            detail = "; ".join(self._now_and_usual((kind, signal), rank, values) for signal in SIGNALS if np.isfinite(values[signal][rank]))
        else:
            detail = self._now_and_usual(strongest, rank, values)
        label = {
            "layer": "layer gradients",
            "combined": "loss, gradient norm and cosines together",
            "cosine_previous": "gradient cosine to its own previous step",
        }.get(name, name.replace("_", " "))
        message = (
            f"rank {rank} has diverged since step {since}: its {label} depart{'' if name in ('layer', 'combined') else 's'} from {against} "
            f"({detail}; CUSUM {levels[strongest]:.1f} > {self.evidence.limit[strongest]:g})"
        )
        if reading:
            message += f"; {reading}"
        if parameters:
            message += f", mostly in {', '.join(parameters[:3])}"
        message += f"; typical of {LIKELY_CAUSES[name]}; {reference(name)}"
        return {
            "step": obs.step,
            "rank": rank,
            "kind": name,
            "since": since,
            "score": float(levels[strongest]),
            "signals": signals,
            "parameters": parameters,
            "message": message,
        }

    def _now_and_usual(self, key: tuple[str, str], rank: int, values: dict) -> str:
        """One signal of one rank for a message: its value now and its trailing median."""
        kind, name = key
        baselines = self.baselines
        history = (baselines.level if kind == "level" else (baselines.cross if kind == "cross" else baselines.raw)[name]).values[:, rank]
        usual = float(np.nanmedian(history)) if np.isfinite(history).any() else math.nan
        if kind == "level":  # read against the median rank, as it is scored
            now = float(_relative_to_median(values["grad_norm"])[rank])
        else:
            now = float((cross_deviations(values) if kind == "cross" else values)[name][rank])
        describe = {
            ("cross", "loss"): f"{'log ' if baselines.log_losses else ''}loss minus the median rank's",
            ("own", "loss"): f"{'log ' if baselines.log_losses else ''}loss minus the step's mean {'log ' if baselines.log_losses else ''}loss",
            ("cross", "grad_norm"): "log gradient norm minus the median rank's",
            LEVEL: "log gradient norm minus the median rank's",
            ("own", "grad_norm"): "log gradient norm",
            ("cross", "cosine"): "gradient cosine to the others minus the median rank's",
            ("own", "cosine"): "gradient cosine to the other ranks",
            ("cross", "cosine_previous"): "atanh of its gradient cosine to its own previous step minus the median rank's",
            ("own", "cosine_previous"): "gradient cosine to its own previous step",
        }[key]
        if key == ("own", "cosine_previous"):  # scored on Fisher's scale, shown as a cosine
            now, usual = math.tanh(now), math.tanh(usual)
        return f"{describe}: now {now:.4g}, usually {usual:.4g}"
