"""The replica rule (kind ``replica``): a rank whose parameters differ from the other replicas'.

1. The records' ``replicas`` key (from parameter fingerprints: ``ranks`` that differ, ``parameters``
   with each tensor's ranks and relative difference) lists the ranks whose replica differs.
2. Each of those ranks not already flagged on the step before is named at once, with no warm-up:
   bitwise-identical replicas are never flagged, so there is nothing to learn. ``score``: the
   largest relative difference of its tensors; ``parameters``: the first ``top_parameters`` of
   them. Where every rank differs (W = 2), no majority says which rank is faulty, and the message
   says so.
3. A rank stays flagged while the replicas' verdict lists it.
"""

from __future__ import annotations

from ..config import DetectorConfig
from ..messages import LIKELY_CAUSES, reference
from ..observation import Observation


class ReplicaRule:
    """The ``replica`` alerts of a run, step by step (``update``); ``episodes``: the ranks the last
    verdict flagged."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.episodes: set[int] = set()

    def update(self, obs: Observation) -> list[dict]:
        """The alerts of one step: each rank the replicas' verdict newly flags."""
        replicas = obs.replicas
        if not replicas:
            return []
        differing = set(replicas.get("ranks", []))
        alerts = []
        for rank in sorted(differing - self.episodes):
            tensors = [p for p in replicas.get("parameters", []) if rank in p.get("ranks", [])]
            names = [p["name"] for p in tensors][: self.config.top_parameters]
            largest = max((p.get("relative_difference") or 0.0 for p in tensors), default=0.0)
            tie = " (no majority at this world size: either rank may be the faulty one)" if len(differing) == obs.world_size else ""
            alerts.append(
                {
                    "step": obs.step,
                    "rank": rank,
                    "kind": "replica",
                    "since": obs.step,
                    "score": float(largest),
                    "signals": ["replicas"],
                    "parameters": names,
                    "message": (
                        f"rank {rank} holds different parameters than the other replicas at step {obs.step}{tie}: "
                        f"{replicas.get('tensors', len(tensors))} tensor(s) differ"
                        + (f" (compared by fingerprint hashes at step {replicas['checked_step']}: sizes unknown)" if replicas.get("checked_step") is not None else f", up to {largest:.3g} relative")
                        + (f", in {', '.join(names[:3])}" if names else "")
                        + f"; typical of {LIKELY_CAUSES['replica']}; {reference('replica')}"
                    ),
                }
            )
        self.episodes = differing
        return alerts
