"""What the detector reads of one step (``Observation``), from a record as the sinks receive it
(offline, ``Observation.from_record``) or from a live ``SilentStats`` (online,
``Observation.from_stats``): every rank's loss, gradient norm, sketched cosines and per-parameter
norms, replica fingerprints' verdict, non-finite values and absent ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: The per-parameter W x P arithmetic is in float32: the norms come from fp32 slots (their own
#: precision), and at W = 4096 x 273 parameters each pass over float64 cost twice as much
#: (the logs 3.5 times as much).
PARAMETER_DTYPE = np.float32


@dataclass
class Observation:
    """What the detector reads of one step (from a record dict or from ``SilentStats``)."""

    step: int
    world_size: int
    losses: np.ndarray | None  # W, NaN where unknown
    grad_norms: np.ndarray  # W
    cosine_loo: np.ndarray | None  # W, None without a sketch
    cosine_noise: float
    cosine_previous: np.ndarray | None = None  # W, None without a sketch or a comparable previous step
    replicas: dict | None = None
    parameter_names: list[str] | None = None
    parameter_norms: np.ndarray | None = None  # W x P (rows x P with parameter_rows), only where the step carries them
    parameter_rows: list[int] | None = None  # the ranks of parameter_norms' rows where not every rank's (the compact wire)
    parameter_mean_norms: np.ndarray | None = None  # P, with parameter_rows: each parameter's mean norm over all present ranks
    layer_levels: np.ndarray | None = None  # W, the compact wire: each rank's own layer CUSUM level (ddphooks.fleet.own_values), NaN: unknown
    layer_parameters: np.ndarray | None = None  # W, with layer_levels: the index of the parameter each level is that of
    nonfinite: dict | None = None  # a record's ``nonfinite``: ``losses`` (ranks), ``gradients`` ({rank, parameter, ...})
    absent: list[int] = field(default_factory=list)  # ranks that did not train on the step (joined under Join): all NaN

    @classmethod
    def from_record(cls, record: dict) -> "Observation":
        """From a record as the sinks receive it (compact or detailed). Raises ``ValueError`` for a
        compact record that summarises its per-rank signals over the ranks (``per_rank`` false:
        above ``per_rank_max_world``): the detector reads every rank's values."""
        world = int(record["world_size"])
        if record.get("per_rank") is False:
            raise ValueError(
                f"the record of step {record['step']} summarises its per-rank signals over the W = {world} ranks "
                f"(a compact record above per_rank_max_world); offline detection needs every rank's values in every "
                f"record: rerun with per_rank_max_world >= {world} (the online detector reads them whatever it is)"
            )

        def vector(key: str) -> np.ndarray | None:
            values = record.get(key)
            if values is None:
                return None
            return np.array([math.nan if v is None else float(v) for v in values], dtype=float)

        names = norms = rows = means = None
        parameters = record.get("parameters")
        key = "grad_norms_sampled" if record.get("sampled_ranks") is not None else "grad_norms"  # the compact wire: sampled ranks
        if parameters and all(key in p for p in parameters):
            names = [p["name"] for p in parameters]
            norms = np.array([[math.nan if v is None else v for v in p[key]] for p in parameters], dtype=float).T
            if key == "grad_norms_sampled":
                rows = list(record["sampled_ranks"])
                means = np.array([math.nan if p.get("grad_norm_mean") is None else p["grad_norm_mean"] for p in parameters], dtype=float)
        noise = record.get("cosine_noise")
        return cls(
            step=int(record["step"]),
            world_size=world,
            losses=vector("losses"),
            grad_norms=vector("grad_norms"),
            cosine_loo=vector("cosine_loo"),
            cosine_noise=math.nan if noise is None else float(noise),
            cosine_previous=vector("cosine_previous"),
            replicas=record.get("replicas"),
            parameter_names=names,
            parameter_norms=norms,
            parameter_rows=rows,
            parameter_mean_norms=means,
            layer_levels=vector("layer_levels"),
            layer_parameters=vector("layer_parameters"),
            nonfinite=record.get("nonfinite"),
            absent=list(record.get("absent") or []),
        )

    @classmethod
    def from_stats(cls, stats) -> "Observation":
        """From a live ``SilentStats`` (per-parameter norms of every step included: every rank's, or
        with the compact wire those of the step's sampled ranks)."""
        rows = stats.parameter_rows
        return cls(
            step=stats.step,
            world_size=stats.world_size,
            losses=stats.losses,
            grad_norms=stats.grad_norms,
            cosine_loo=stats.cosine_loo,
            cosine_noise=stats.cosine_noise,
            cosine_previous=stats.cosine_previous,
            replicas=stats.replicas,
            parameter_names=stats.parameter_names,
            parameter_norms=_present_norms(stats.param_sq, stats.absent) if rows is None else _present_norms(stats.sampled_param_sq, stats.absent[rows]),
            parameter_rows=rows,
            parameter_mean_norms=None if rows is None else stats.mean_param_norms,
            layer_levels=getattr(stats, "layer_scores", None),
            layer_parameters=getattr(stats, "layer_parameters", None),
            nonfinite=stats.nonfinite,
            absent=stats.absent_ranks,
        )


def _partial_layer_view(obs: Observation) -> bool:
    """Whether the step's layer evidence is the ranks' own layer levels: the compact wire sent
    them and its rows miss some rank. Where every rank is sampled on every step (W <=
    ``sampled_ranks``) the detector's own per-parameter CUSUMs see every rank from its first
    step, against the median rank (the levels' reference is the other ranks' mean, which one rank
    moves by 1 / (W - 1) of its own change), and it keeps them."""
    if obs.layer_levels is None or obs.parameter_rows is None:
        return False
    return len(set(obs.parameter_rows) | set(obs.absent)) < obs.world_size


def _present_norms(param_sq: np.ndarray, absent: np.ndarray) -> np.ndarray:
    """W x P norms from squared norms, NaN on absent ranks: ``np.where(absent[:, None], nan,
    sqrt(param_sq))`` without a second W x P pass where no rank is absent. In ``PARAMETER_DTYPE``,
    the precision of the slots they come from and of the arithmetic that reads them."""
    norms = np.sqrt(param_sq, dtype=PARAMETER_DTYPE)
    absent = np.asarray(absent, dtype=bool)
    if absent.any():
        norms[absent] = np.nan
    return norms

