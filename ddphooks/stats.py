"""Per-rank slots and the statistics reconstructed from them (no ``torch.distributed`` here).

Every rank packs its local statistics of one step into a *slot* of fp32 numbers::

    [ loss_sum, loss_count, |g_p|^2 for every parameter p (bucket order), sketch (bins) ]

The slots of all ranks travel through one allreduce (each rank fills its own slot, the others
are zero, so the sum is a gather). Together with the squared norms of the *reduced* gradient
``gbar = (1/W) sum_i g_i``, which every rank holds after the allreduce, they give:

1. losses and gradient norms per rank, and their dispersion (population std, ddof=0;
   cv = std / |mean|; range = max - min);
2. the exact norm-weighted mean pairwise cosine, from the identity
   ``sum_{i != j} <g_i, g_j> = W^2 |gbar|^2 - sum_i |g_i|^2``, divided by
   ``sum_{i != j} |g_i| |g_j| = (sum_i |g_i|)^2 - sum_i |g_i|^2``; per parameter, per bucket and
   over the whole model, with no sketch involved;
3. the W x W cosine matrix estimated from the sketches, ``<s_i, s_j> / (|s_i| |s_j|)``.

Everything is computed lazily in float64 on the host the first time it is read, so building a
``SilentStats`` inside a communication callback never synchronises an accelerator.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

LOSS_SUM = 0
LOSS_COUNT = 1
PARAMS_BEGIN = 2


@dataclass(frozen=True)
class BucketLayout:
    """The parameters of one gradient bucket, in the order they sit in its flat buffer."""

    index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.numels)


def slot_size(n_params: int, bins: int) -> int:
    """Number of fp32 entries in one rank's slot."""
    return PARAMS_BEGIN + n_params + bins


def _float(x: float) -> float | None:
    """JSON-safe float: non-finite values become None (null)."""
    x = float(x)
    return x if math.isfinite(x) else None


def _floats(values) -> list[float | None]:
    return [_float(v) for v in np.asarray(values).ravel()]


def _dispersion(values: np.ndarray) -> dict[str, float | None]:
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite value makes them NaN
        mean = float(np.mean(values))
        std = float(np.std(values))  # population std (ddof=0)
    return {
        "mean": mean,
        "std": std,
        "range": float(np.max(values) - np.min(values)),
        "cv": std / abs(mean) if mean != 0 else math.nan,
    }


def weighted_mean_cosine(rank_sq: np.ndarray, reduced_sq: np.ndarray | float) -> np.ndarray | float:
    """Exact norm-weighted mean pairwise cosine from squared norms alone.

    Args:
        rank_sq: ``|g_i|^2`` per rank along axis 0 (W x ...).
        reduced_sq: ``|gbar|^2`` of the averaged gradient (broadcast against ``rank_sq[0]``).

    Returns ``sum_{i!=j} <g_i,g_j> / sum_{i!=j} |g_i||g_j|``; NaN where undefined (W = 1 or a
    zero gradient on all but one rank).
    """
    world = rank_sq.shape[0]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # non-finite norms give NaN
        total_sq = rank_sq.sum(axis=0)
        cross = world * world * np.asarray(reduced_sq) - total_sq
        norms = np.sqrt(rank_sq)
        pair_norms = norms.sum(axis=0) ** 2 - total_sq
        result = np.where(pair_norms > 0, cross / np.where(pair_norms > 0, pair_norms, 1.0), np.nan)
    return result if world > 1 else np.full_like(result, np.nan)


def cosine_from_sketches(sketches: np.ndarray) -> np.ndarray:
    """W x W cosine matrix of the rows of ``sketches``; diagonal 1, NaN where a sketch is zero."""
    gram = sketches @ sketches.T
    norms = np.sqrt(np.diag(gram))
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = gram / np.outer(norms, norms)
    cosine[~np.isfinite(cosine)] = np.nan
    np.fill_diagonal(cosine, 1.0)
    return np.clip(cosine, -1.0, 1.0)


class SilentStats:
    """The statistics of one instrumented step, identical on every rank.

    Built from the gathered slots and the reduced squared norms; every derived value is computed
    on first access. ``to_dict()`` gives a JSON-serialisable record (non-finite values become
    null).

    Args:
        step: index of the synchronised step (``SilentState.step`` when it ran).
        world_size: number of ranks W.
        buckets: layout of every bucket of the step, in bucket order.
        gathered: W x slot tensor of every rank's slot.
        reduced_sq: squared norm of the averaged gradient per parameter, in slot order.
        bins: sketch entries (0: no sketch).
        transport: how the slots travelled ("piggyback" or "separate").
    """

    def __init__(
        self,
        step: int,
        world_size: int,
        buckets: list[BucketLayout],
        gathered: torch.Tensor,
        reduced_sq: torch.Tensor,
        bins: int,
        transport: str,
    ) -> None:
        self.step = step
        self.world_size = world_size
        self.buckets = list(buckets)
        self.bins = bins
        self.transport = transport
        self._gathered = gathered
        self._reduced_sq = reduced_sq
        self._lock = threading.Lock()

    # -- host arrays, computed once ------------------------------------------------------------
    @cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            gathered = self._gathered.detach().to("cpu", torch.float64).numpy()
            reduced = self._reduced_sq.detach().to("cpu", torch.float64).numpy()
        n_params = sum(len(b.numels) for b in self.buckets)
        expected = slot_size(n_params, self.bins)
        if gathered.shape != (self.world_size, expected):
            raise ValueError(f"gathered slots have shape {gathered.shape}, expected {(self.world_size, expected)}")
        return gathered, reduced

    @property
    def param_sq(self) -> np.ndarray:
        """W x P squared norms of each rank's local gradient per parameter."""
        gathered, _ = self._arrays
        return gathered[:, PARAMS_BEGIN : gathered.shape[1] - self.bins]

    @property
    def reduced_param_sq(self) -> np.ndarray:
        """P squared norms of the averaged gradient per parameter."""
        return self._arrays[1]

    @cached_property
    def _bucket_bounds(self) -> list[tuple[int, int]]:
        bounds, begin = [], 0
        for bucket in self.buckets:
            bounds.append((begin, begin + len(bucket.numels)))
            begin += len(bucket.numels)
        return bounds

    @property
    def bucket_sq(self) -> np.ndarray:
        """W x B squared norms of each rank's local gradient per bucket."""
        return np.stack([self.param_sq[:, a:b].sum(axis=1) for a, b in self._bucket_bounds], axis=1)

    @property
    def reduced_bucket_sq(self) -> np.ndarray:
        return np.array([self.reduced_param_sq[a:b].sum() for a, b in self._bucket_bounds])

    @property
    def parameter_names(self) -> list[str]:
        return [name for bucket in self.buckets for name in bucket.names]

    # -- the signals ---------------------------------------------------------------------------
    @property
    def losses(self) -> np.ndarray | None:
        """Per-rank mean loss of the step; None if no rank observed a loss (NaN for a rank that
        observed none while others did)."""
        gathered, _ = self._arrays
        counts = gathered[:, LOSS_COUNT]
        if not counts.any():
            return None
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(counts > 0, gathered[:, LOSS_SUM] / np.where(counts > 0, counts, 1.0), np.nan)

    @property
    def grad_norms(self) -> np.ndarray:
        """Per-rank L2 norm of the local gradient (before averaging), over all buckets."""
        return np.sqrt(self.param_sq.sum(axis=1))

    @property
    def reduced_grad_norm(self) -> float:
        """L2 norm of the averaged gradient that every rank applies."""
        return float(np.sqrt(self.reduced_param_sq.sum()))

    @property
    def weighted_mean_cosine(self) -> float:
        return float(weighted_mean_cosine(self.param_sq.sum(axis=1), self.reduced_param_sq.sum()))

    @property
    def cosine(self) -> np.ndarray | None:
        """W x W sketched cosine matrix of the local gradients; None without a sketch."""
        if not self.bins:
            return None
        gathered, _ = self._arrays
        return cosine_from_sketches(gathered[:, gathered.shape[1] - self.bins :])

    @property
    def mean_cosine(self) -> float:
        """Mean of the off-diagonal entries of ``cosine`` (NaN without a sketch or with W = 1)."""
        cosine = self.cosine
        if cosine is None or self.world_size < 2:
            return math.nan
        return float(cosine[~np.eye(self.world_size, dtype=bool)].mean())

    @property
    def nonfinite(self) -> dict[str, list]:
        """Where non-finite values appeared: ranks with a non-finite loss, and (rank, bucket,
        parameter) of every non-finite local gradient norm (NaN/Inf in the gradient, or a
        squared norm beyond the fp32 range)."""
        losses, counts = self.losses, self._arrays[0][:, LOSS_COUNT]
        bad_losses = [] if losses is None else [r for r in range(self.world_size) if counts[r] > 0 and not math.isfinite(losses[r])]
        owners = [(bucket.index, name) for bucket in self.buckets for name in bucket.names]
        gradients = [
            {"rank": int(r), "bucket": owners[p][0], "parameter": owners[p][1]}
            for r, p in zip(*np.nonzero(~np.isfinite(self.param_sq)))
        ]
        return {"losses": bad_losses, "gradients": gradients}

    # -- output --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-serialisable record of the step (strict JSON: non-finite values are null)."""
        losses = self.losses
        loss_stats = (
            _dispersion(losses) if losses is not None and np.isfinite(losses).all() else dict.fromkeys(("mean", "std", "range", "cv"), math.nan)
        )
        norms = self.grad_norms
        norm_stats = _dispersion(norms)
        cosine = self.cosine
        param_sq, reduced_param_sq = self.param_sq, self.reduced_param_sq
        param_wmc = weighted_mean_cosine(param_sq, reduced_param_sq)
        bucket_sq, reduced_bucket_sq = self.bucket_sq, self.reduced_bucket_sq
        bucket_wmc = weighted_mean_cosine(bucket_sq, reduced_bucket_sq)
        parameters = []
        p = 0
        for bucket in self.buckets:
            for name, numel in zip(bucket.names, bucket.numels):
                parameters.append(
                    {
                        "name": name,
                        "bucket": bucket.index,
                        "numel": numel,
                        "grad_norms": _floats(np.sqrt(param_sq[:, p])),
                        "reduced_norm": _float(math.sqrt(reduced_param_sq[p])),
                        "weighted_mean_cosine": _float(param_wmc[p]),
                    }
                )
                p += 1
        return {
            "step": self.step,
            "world_size": self.world_size,
            "transport": self.transport,
            "sketch_dim": self.bins,
            "losses": None if losses is None else _floats(losses),
            "loss_mean": _float(loss_stats["mean"]),
            "loss_std": _float(loss_stats["std"]),
            "loss_range": _float(loss_stats["range"]),
            "loss_cv": _float(loss_stats["cv"]),
            "grad_norms": _floats(norms),
            "grad_norm_mean": _float(norm_stats["mean"]),
            "grad_norm_std": _float(norm_stats["std"]),
            "grad_norm_cv": _float(norm_stats["cv"]),
            "reduced_grad_norm": _float(self.reduced_grad_norm),
            "cosine": None if cosine is None else [_floats(row) for row in cosine],
            "mean_cosine": _float(self.mean_cosine),
            "weighted_mean_cosine": _float(self.weighted_mean_cosine),
            "buckets": [
                {
                    "index": bucket.index,
                    "numel": bucket.numel,
                    "parameters": list(bucket.names),
                    "grad_norms": _floats(np.sqrt(bucket_sq[:, b])),
                    "reduced_norm": _float(math.sqrt(reduced_bucket_sq[b])),
                    "weighted_mean_cosine": _float(bucket_wmc[b]),
                }
                for b, bucket in enumerate(self.buckets)
            ],
            "parameters": parameters,
            "nonfinite": self.nonfinite,
        }

    def __repr__(self) -> str:
        return f"SilentStats(step={self.step}, world_size={self.world_size}, buckets={len(self.buckets)}, sketch_dim={self.bins})"
