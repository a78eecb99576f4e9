"""The experimental settings: which examples each rank sees at each step, and with which seeds.

Every setting shards one permutation per rank the way ``DistributedSampler`` does (rank r takes
positions r, r + W, r + 2W, ...). What changes is whose permutation it is:

- ``sync``: one shuffle seed and one random seed on every rank: disjoint shards (normal DDP).
- ``desync-shuffle``: every rank shuffles with its own seed, so shards overlap and differ from
  what the other ranks assume (the sampler bugs users report: a missing ``set_epoch``, a seed
  taken from the rank).
- ``desync-all``: shuffle seeds and random seeds (dropout) differ per rank.
- ``group-sync`` / ``group-desync``: length-grouped batching as ``group_by_length`` does in SFT
  trainers (batches of similar length, in random order), with synchronised or per-rank seeds.
  With per-rank seeds one rank gets long examples while another gets short ones in the same step.
- ``fault``: ``sync``, but from a given step on one rank goes silently wrong, in one of
  ``FAULT_KINDS`` ways (see :class:`RankFault`): its responses are swapped with other examples'
  (``labels``), one parameter's gradient is corrupted as a failing chip would (``sdc``), its data
  loader keeps returning the same batch (``stuck``), or its optimizer runs with another learning
  rate so its replica drifts from the others (``replica``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SETTINGS = ("sync", "desync-shuffle", "desync-all", "group-sync", "group-desync", "fault")
FAULT_KINDS = ("labels", "sdc", "stuck", "replica")
MEGA_BATCH_FACTOR = 4  # a length-sorted mega-batch holds this many global batches
#: sdc: the corrupted gradient is the true one plus Gaussian noise of this many times its norm.
SDC_NOISE_RATIO = 4.0
#: replica: the faulty rank's learning rate is this many times the others'.
REPLICA_LR_FACTOR = 2.0


@dataclass(frozen=True)
class Seeds:
    shuffle: int
    random: int


def seeds_for(setting: str, seed: int, rank: int) -> Seeds:
    """The shuffle and random (dropout) seeds rank ``rank`` uses under ``setting``."""
    if setting not in SETTINGS:
        raise ValueError(f"setting {setting!r} is not one of {', '.join(SETTINGS)}")
    shuffle_desync = setting in ("desync-shuffle", "desync-all", "group-desync")
    random_desync = setting == "desync-all"
    return Seeds(
        shuffle=seed + 1000 * (rank + 1) if shuffle_desync else seed,
        random=seed + rank + 1 if random_desync else seed,
    )


def _permutation(count: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(count)


def _length_grouped(lengths: np.ndarray, global_batch: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation made of length-homogeneous global batches, as ``group_by_length`` builds them.

    Shuffle, cut into mega-batches of MEGA_BATCH_FACTOR global batches, sort each mega-batch by
    length, cut it into global batches, and visit those in a seeded random order. Ranks that
    share the seed get slices of the same length-homogeneous batch at every step; ranks with
    their own seed get unrelated lengths (one long batch next to a short one).
    """
    rng = np.random.default_rng([seed, epoch, 1])
    order = _permutation(len(lengths), seed, epoch)
    mega = global_batch * MEGA_BATCH_FACTOR
    pieces = []
    for begin in range(0, len(order) - mega + 1, mega):
        group = order[begin : begin + mega]
        group = group[np.argsort(-lengths[group], kind="stable")].reshape(MEGA_BATCH_FACTOR, global_batch)
        pieces.append(group[rng.permutation(MEGA_BATCH_FACTOR)].ravel())
    pieces.append(order[len(order) - len(order) % mega :])  # the incomplete last mega-batch as is
    return np.concatenate(pieces)


def rank_batches(setting: str, lengths: np.ndarray, world: int, rank: int, batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
    """Example indices of each of ``steps`` batches of this rank (epochs reshuffle)."""
    shuffle_seed = seeds_for(setting, seed, rank).shuffle
    global_batch = world * batch_size
    per_epoch = len(lengths) // global_batch
    if per_epoch == 0:
        raise ValueError(f"{len(lengths)} examples are fewer than one global batch of {world} x {batch_size}")
    batches = []
    for step in range(steps):
        epoch, index = divmod(step, per_epoch)
        if setting.startswith("group-"):
            order = _length_grouped(lengths, global_batch, shuffle_seed, epoch)
        else:
            order = _permutation(len(lengths), shuffle_seed, epoch)
        step_slice = order[index * global_batch : (index + 1) * global_batch]
        batches.append(step_slice[rank::world])
    return batches


def shuffled_outputs(count: int, seed: int) -> np.ndarray:
    """For the fault: example i gets the response of example ``shuffled_outputs[i]``."""
    return np.random.default_rng([seed, 999]).permutation(count)


# -- faults ----------------------------------------------------------------------------------------
def stuck_batches(batches: list[np.ndarray], first_step: int) -> list[np.ndarray]:
    """The ``stuck`` fault: from ``first_step`` on, the batch of ``first_step`` over and over
    (a data loader whose iterator stopped advancing, a cached batch never refreshed).

    Example::

        >>> [b.tolist() for b in stuck_batches([np.array([0]), np.array([1]), np.array([2])], 1)]
        [[0], [1], [1]]
    """
    if not 0 <= first_step < len(batches):
        return list(batches)
    return list(batches[:first_step]) + [batches[first_step]] * (len(batches) - first_step)


def sdc_parameter(model: torch.nn.Module) -> str:
    """Name of the weight the ``sdc`` fault corrupts: the MLP output projection of the middle
    layer (``model.layers.<L // 2>.mlp.down_proj.weight`` in Llama-style models), else the middle
    matrix of the model. Deterministic in the architecture, so every rank names the same one.

    Example::

        >>> sdc_parameter(tiny_llama(layers=4))
        'model.layers.2.mlp.down_proj.weight'
    """
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 0:
        preferred = f"model.layers.{layers // 2}.mlp.down_proj.weight"
        if preferred in names:
            return preferred
    matrices = [name for name, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    if not matrices:
        raise ValueError("the sdc fault needs a weight matrix to corrupt; this model has none")
    return matrices[len(matrices) // 2]


class GradientCorruption:
    """The ``sdc`` fault: silent data corruption of one parameter's gradient on one rank.

    A tensor hook on the parameter (``param.register_hook``) replaces its local gradient, before
    DDP's reducer copies it into the bucket, by the true gradient plus Gaussian noise whose norm is
    ``ratio`` times the gradient's own: what a failing multiply-accumulate unit computing this
    weight's gradient would produce. Nothing becomes NaN or Inf, the rank's loss is unchanged, and
    the corrupted gradient is averaged into every replica: only gradient statistics can tell. The
    noise comes from its own generator seeded with ``(seed, step)``, so runs are reproducible and
    the global RNG (dropout masks) is untouched. Before ``first_step`` the gradient passes as is.

    Args:
        parameter: the parameter whose gradient is corrupted.
        first_step: first corrupted step.
        seed: seed of the noise.
        ratio: norm of the noise over the norm of the true gradient.

    Set ``step`` before each backward (the training loop's step); ``remove()`` unregisters.

    Example::

        corruption = GradientCorruption(model.get_parameter(sdc_parameter(model)), first_step=40, seed=0)
        for step, batch in enumerate(batches):
            corruption.step = step
            model(**batch).loss.backward()
    """

    def __init__(self, parameter: torch.nn.Parameter, first_step: int, seed: int, ratio: float = SDC_NOISE_RATIO) -> None:
        self.first_step = first_step
        self.seed = seed
        self.ratio = ratio
        self.step = 0
        self._handle = parameter.register_hook(self._corrupt)

    def _corrupt(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.step < self.first_step:
            return None  # keep the gradient as it is
        generator = torch.Generator(device=grad.device).manual_seed(self.seed * 1_000_003 + self.step)
        noise = torch.randn(grad.shape, generator=generator, device=grad.device, dtype=grad.dtype)
        scale = self.ratio * grad.norm() / noise.norm().clamp_min(torch.finfo(grad.dtype).tiny)
        return grad + noise * scale

    def remove(self) -> None:
        self._handle.remove()


@dataclass(frozen=True)
class RankFault:
    """What the ``fault`` setting does to one rank: nothing (``kind`` None) or one of FAULT_KINDS
    from ``first_step`` on.

    Example::

        fault = RankFault.of("fault", "stuck", fault_rank=1, first_step=40, rank=rank)
        batches = fault.batches(batches)
    """

    kind: str | None
    first_step: int

    @classmethod
    def of(cls, setting: str, kind: str, fault_rank: int, first_step: int, rank: int) -> "RankFault":
        if kind not in FAULT_KINDS:
            raise ValueError(f"--fault-kind {kind!r} is not one of {', '.join(FAULT_KINDS)}")
        return cls(kind if setting == "fault" and rank == fault_rank else None, first_step)

    def shuffles_labels(self, step: int) -> bool:
        """``labels``: this step's responses are swapped with other examples'."""
        return self.kind == "labels" and step >= self.first_step

    def batches(self, batches: list[np.ndarray]) -> list[np.ndarray]:
        """``stuck``: the rank's batches, frozen at the fault step."""
        return stuck_batches(batches, self.first_step) if self.kind == "stuck" else batches

    def lr_factor(self, step: int) -> float:
        """``replica``: the factor on the rank's learning rate at ``step``."""
        return REPLICA_LR_FACTOR if self.kind == "replica" and step >= self.first_step else 1.0

    def corrupt(self, model: torch.nn.Module, seed: int) -> GradientCorruption | None:
        """``sdc``: corrupt the gradient of :func:`sdc_parameter` (None on a healthy rank)."""
        if self.kind != "sdc":
            return None
        return GradientCorruption(model.get_parameter(sdc_parameter(model)), self.first_step, seed)
