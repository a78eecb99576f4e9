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
- ``fault``: ``sync``, but one rank's responses are swapped with random other responses from a
  given step on (shuffled labels): the kind of silent data fault the statistics exist to expose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SETTINGS = ("sync", "desync-shuffle", "desync-all", "group-sync", "group-desync", "fault")
MEGA_BATCH_FACTOR = 4  # a length-sorted mega-batch holds this many global batches


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
