"""The scalars that metric-tracking sinks (TensorBoard, W&B) take from a step record.

A record (see docs/records.md for its keys) holds lists and nested detail; a metric tracker wants
flat ``tag -> float``. ``record_scalars`` gives, under one prefix:

- ``<prefix><key>`` for each signal in ``SIGNALS``;
- ``<prefix>rank<r>/loss``, ``<prefix>rank<r>/grad_norm``, ``<prefix>rank<r>/cosine_to_others`` and
  ``<prefix>rank<r>/cosine_previous`` for ranks ``0 .. max_ranks - 1``;
- where a compact record summarises those signals over the ranks (above ``per_rank_max_world``),
  ``<prefix>over_ranks/loss/median`` and the other quantiles (``min``, ``p01`` ... ``max``) instead.

``null`` values (non-finite numbers, or no sketch) are left out, never written as NaN.
"""

from __future__ import annotations

import math

#: Record keys written as scalars: the dispersion and direction signals of a step.
SIGNALS = (
    "loss_mean",
    "loss_std",
    "loss_range",
    "loss_cv",
    "grad_norm_mean",
    "grad_norm_std",
    "grad_norm_cv",
    "reduced_grad_norm",
    "mean_cosine",
    "weighted_mean_cosine",
    "noise_scale",
    "noise_scale_smoothed",
)

#: Per-rank record lists and the tag suffix each one is written under.
PER_RANK = (("losses", "loss"), ("grad_norms", "grad_norm"), ("cosine_to_others", "cosine_to_others"), ("cosine_previous", "cosine_previous"))

#: Default cap on the ranks that get their own series. Four series per rank make a dashboard
#: unreadable (and slow) well before W = 100; the full per-rank lists stay in the JSONL records.
DEFAULT_MAX_RANKS = 16


def _finite(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def record_scalars(record: dict, *, max_ranks: int | None = DEFAULT_MAX_RANKS, prefix: str = "ddphooks/") -> dict[str, float]:
    """Flatten one step record into ``tag -> float`` (nulls left out).

    Args:
        record: a step record (a ``dict`` as sinks receive it).
        max_ranks: per-rank series only for ranks ``0 .. max_ranks - 1``; ``None`` = every
            rank, ``0`` = none.
        prefix: put in front of every tag.

    Returns:
        the scalars, in a stable order (signals, the quantiles over ranks of a record that has
        them, then rank by rank).

    Example::

        >>> record_scalars({"step": 3, "loss_mean": 2.0, "loss_std": None, "losses": [1.5, 2.5]})
        {'ddphooks/loss_mean': 2.0, 'ddphooks/rank0/loss': 1.5, 'ddphooks/rank1/loss': 2.5}
    """
    if max_ranks is not None and (isinstance(max_ranks, bool) or not isinstance(max_ranks, int) or max_ranks < 0):
        raise ValueError(f"max_ranks must be None or an int >= 0, got {max_ranks!r}")
    scalars = {}
    for key in SIGNALS:
        value = _finite(record.get(key))
        if value is not None:
            scalars[prefix + key] = value
    for key, suffix in PER_RANK:
        quantiles = (record.get(f"{key}_over_ranks") or {}).get("quantiles") or {}
        for name, value in quantiles.items():
            value = _finite(value)
            if value is not None:
                scalars[f"{prefix}over_ranks/{suffix}/{name}"] = value
    lists = [(record.get(key) or [], suffix) for key, suffix in PER_RANK]
    ranks = max((len(values) for values, _ in lists), default=0)
    if max_ranks is not None:
        ranks = min(ranks, max_ranks)
    for rank in range(ranks):
        for values, suffix in lists:
            value = _finite(values[rank]) if rank < len(values) else None
            if value is not None:
                scalars[f"{prefix}rank{rank}/{suffix}"] = value
    return scalars
