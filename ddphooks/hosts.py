"""The ranks by host, and the host-by-host cosine matrix of detail records above ``detail_max_world``.

Up to ``detail_max_world`` ranks (256 by default) a detail record carries the sketched W x W
cosine matrix, whatever the wire (``ddphooks.fleet`` sends every rank's sketch on detail steps).
Above it a W x W matrix is no longer something to write every ``detail_every`` steps (16.8 M
entries at W = 4096), so detail records carry a block matrix instead: the ranks grouped by host
(``host_blocks``, from the identity table every rank holds, ``state.ranks``), and per pair of
hosts ``(a, b)`` the mean sketched cosine between a rank of ``a`` and a rank of ``b``:

    C[a, b] = <U_a, U_b> / (n_a n_b),   C[a, a] = (|U_a|^2 - n_a) / (n_a (n_a - 1)),

with ``U_a = sum_{i in a} s_i / |s_i|`` the sum of the unit sketches of host a's n_a ranks (those
present on the step, with a non-zero sketch). ``C[a, b]`` is the mean of the W x W matrix's block
``(a, b)``, its diagonal the mean cosine between two different ranks of one host (undefined for a
host with one rank): the same numbers, averaged, that the rank-by-rank matrix gives, from H x k
numbers instead of W x k. A host whose ranks see other data than the rest shows as a row of lower
cosines; a host whose ranks disagree with each other, as a low diagonal entry.

A record carries it as ``cosine_hosts`` (``HostMatrix.to_record``): the host names, each host's
ranks, how many of them were present, and the lower triangle of ``C`` in hundredths (integers,
``round(100 C)``; null where undefined): the rounding (at most 0.005) is a tenth of the sketch's
own error at the default ``sketch_dim`` (1/sqrt(256) = 0.0625), and the record stays small (at
256 blocks 32,896 integers, about 140 KB, where the full matrix in floats would be 1.4 MB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

#: The most blocks of the host-by-host matrix: beyond it consecutive hosts share a block (at 2048
#: ranks of 8 per host, 256 hosts: one block each; at 4096, 512 hosts: two a block). It keeps a
#: detail record's matrix near 140 KB (the lower triangle's 32,896 integers) and its build within
#: tens of milliseconds: at 512 blocks it would be 560 KB, as much as the rest of a W = 4096
#: detail record without its identity table.
MAX_BLOCKS = 256
#: Where every rank names the same host (PyTorch's fake process group, containers that share a
#: host name), blocks of this many consecutive ranks (or more, to stay within ``MAX_BLOCKS``).
FALLBACK_BLOCK = 8
#: Decimals of the rank-by-rank matrix in the compact wire's records (at most 0.0005 off, a
#: hundredth of the sketch's error at the default ``sketch_dim``): 460 KB at W = 256 instead of 1.4 MB.
RANK_DECIMALS = 3


@dataclass(frozen=True)
class HostBlocks:
    """The ranks of the data-parallel group by block (a host, or several consecutive hosts
    beyond ``MAX_BLOCKS``): the same on every rank, since it is built from the identity table.

    Args:
        labels: one per block: its host name, ``first..last`` for several hosts, or ``ranks a-b``.
        of_rank: each rank's block, in group order.
    """

    labels: tuple[str, ...]
    of_rank: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.labels)

    @property
    def world(self) -> int:
        return len(self.of_rank)

    @cached_property
    def ranks(self) -> list[list[int]]:
        """Each block's ranks, in group order."""
        ranks: list[list[int]] = [[] for _ in self.labels]
        for rank, block in enumerate(self.of_rank):
            ranks[block].append(rank)
        return ranks

    @cached_property
    def index(self) -> np.ndarray:
        """``of_rank`` as an int64 array."""
        return np.asarray(self.of_rank, dtype=np.int64)


def host_blocks(hosts: Sequence[str], max_blocks: int = MAX_BLOCKS) -> HostBlocks:
    """The blocks of the host-by-host matrix for ranks on ``hosts`` (one host name per rank, in
    group order, as the identity table gives them): one block per host, in the order of each
    host's first rank; beyond ``max_blocks`` hosts, ``ceil(H / max_blocks)`` consecutive hosts a
    block; where every rank names one host (the fake process group), blocks of ``FALLBACK_BLOCK``
    consecutive ranks.

    Example::
        >>> host_blocks(["a", "a", "b", "b", "a"]).of_rank
        (0, 0, 1, 1, 0)
    """
    world = len(hosts)
    names = list(dict.fromkeys(hosts))
    if len(names) < 2 and world > 1:
        size = max(FALLBACK_BLOCK, math.ceil(world / max_blocks))
        count = math.ceil(world / size)
        labels = tuple(f"ranks {b * size}-{min(world, (b + 1) * size) - 1}" for b in range(count))
        return HostBlocks(labels, tuple(r // size for r in range(world)))
    per = max(1, math.ceil(len(names) / max_blocks))
    block = {name: i // per for i, name in enumerate(names)}
    groups = [names[b : b + per] for b in range(0, len(names), per)]
    labels = tuple(g[0] if len(g) == 1 else f"{g[0]}..{g[-1]}" for g in groups)
    return HostBlocks(labels, tuple(block[h] for h in hosts))


def block_cosines(unit_sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """H x H mean cosines between the blocks' ranks from their unit sketches' sums ``unit_sums``
    (H x k) and how many ranks each sum holds (``counts``): see the module docstring. NaN where a
    block has no rank (its row and column) and on the diagonal of a block of one rank."""
    sums = np.asarray(unit_sums, dtype=np.float64)
    n = np.asarray(counts, dtype=np.float64)
    gram = sums @ sums.T
    with np.errstate(divide="ignore", invalid="ignore"):
        matrix = gram / np.outer(n, n)
        diagonal = (np.diag(gram) - n) / (n * (n - 1.0))
    np.fill_diagonal(matrix, diagonal)
    matrix[~np.isfinite(matrix)] = np.nan
    return np.clip(matrix, -1.0, 1.0)


def unit_sums(sketches: np.ndarray, present: np.ndarray, blocks: HostBlocks) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the sum of its present ranks' unit sketches and their number (the ranks with a
    zero sketch left out), from every rank's sketch (W x k): what the compact wire sums on a
    detail step above ``detail_max_world``, computed from whole slots."""
    sketches = np.asarray(sketches, dtype=np.float64)
    norms = np.linalg.norm(sketches, axis=1)
    counted = np.asarray(present, dtype=bool) & (norms != 0)
    sums = np.zeros((blocks.count, sketches.shape[1]))
    rows = np.flatnonzero(counted)
    np.add.at(sums, blocks.index[rows], sketches[rows] / norms[rows, None])
    counts = np.bincount(blocks.index[rows], minlength=blocks.count).astype(np.float64)
    return sums, counts


def rounded_rows(matrix: np.ndarray, decimals: int) -> list[list[float | None]]:
    """``matrix`` rounded to ``decimals`` as JSON rows, null where not finite."""
    values = np.round(np.asarray(matrix, dtype=np.float64), decimals)
    rows = values.tolist()
    for i, j in np.argwhere(~np.isfinite(values)):
        rows[i][j] = None
    return rows


@dataclass
class HostMatrix:
    """The host-by-host matrix of one step (see the module docstring).

    Args:
        cosine: H x H mean cosines (NaN where undefined).
        present: per block, the ranks it averages over.
    """

    cosine: np.ndarray
    present: np.ndarray

    def to_record(self, blocks: HostBlocks) -> dict:
        """The record's ``cosine_hosts``: ``hosts`` (block labels), ``ranks`` (each block's ranks
        in the group), ``present`` (the ranks averaged over on the step) and ``hundredths``, the
        lower triangle of the matrix (row a: blocks 0..a) as integers ``round(100 C)``, null where
        undefined."""
        size = len(self.cosine)
        rows, columns = np.tril_indices(size)
        scaled = np.round(100.0 * self.cosine[rows, columns])  # the lower triangle, row by row
        known = np.isfinite(scaled)
        flat = np.where(known, scaled, 0).astype(np.int64).tolist()
        for index in np.flatnonzero(~known).tolist():
            flat[index] = None
        starts = np.arange(size + 1) * np.arange(1, size + 2) // 2  # row a begins at a (a + 1) / 2
        triangle = [flat[starts[a] : starts[a + 1]] for a in range(size)]
        return {
            "hosts": list(blocks.labels),
            "ranks": blocks.ranks,
            "present": [int(round(n)) if math.isfinite(n) else None for n in np.asarray(self.present, dtype=float).tolist()],
            "hundredths": triangle,
        }


def matrix_from_record(entry: dict) -> np.ndarray:
    """The full H x H matrix (float, NaN where null) of a record's ``cosine_hosts``."""
    triangle = entry["hundredths"]
    size = len(triangle)
    matrix = np.full((size, size), np.nan)
    for a, row in enumerate(triangle):
        values = np.array([np.nan if v is None else v for v in row], dtype=float) / 100.0
        matrix[a, : len(values)] = values
        matrix[: len(values), a] = values
    return matrix
