"""TensorBoard sink: the step signals as scalars, the cosine matrix as an image.

Needs the ``tensorboard`` package (``pip install 'ddphooks[tensorboard]'``); it is imported when
the sink is created, never by ``import ddphooks``.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from ddphooks.hosts import matrix_from_record
from ddphooks.sinks.base import Sink
from ddphooks.sinks.scalars import DEFAULT_MAX_RANKS, record_scalars

#: Edge of the cosine image in pixels (about): small matrices are blown up so a 2 x 2 matrix is
#: not a 2-pixel image.
_IMAGE_EDGE = 256


def _summary_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "TensorBoardSink needs the tensorboard package: pip install 'ddphooks[tensorboard]'"
        ) from error
    return SummaryWriter


def cosine_image(matrix) -> np.ndarray:
    """Render a W x W cosine matrix as an RGB image (``uint8``, H x W x 3).

    Blue for -1, white for 0, red for +1; ``None`` / NaN entries grey. Each entry becomes a
    square of ``max(1, 256 // W)`` pixels.

    Args:
        matrix: W rows of W numbers (``None`` allowed), as in a record's ``cosine``.

    Example::

        >>> cosine_image([[1.0, -0.5], [-0.5, 1.0]]).shape
        (256, 256, 3)
    """
    values = np.array([[np.nan if v is None else float(v) for v in row] for row in matrix], dtype=np.float64)
    if values.ndim != 2 or values.shape[0] != values.shape[1]:
        raise ValueError(f"cosine must be a square matrix, got shape {values.shape}")
    c = np.clip(values, -1.0, 1.0)
    positive, negative = np.clip(c, 0.0, 1.0), np.clip(-c, 0.0, 1.0)
    rgb = np.stack([1.0 - negative, 1.0 - positive - negative, 1.0 - positive], axis=-1)
    rgb[np.isnan(values)] = 0.5
    scale = max(1, _IMAGE_EDGE // values.shape[0])
    rgb = rgb.repeat(scale, axis=0).repeat(scale, axis=1)
    return np.round(rgb * 255.0).astype(np.uint8)


class TensorBoardSink(Sink):
    """Writes each record to TensorBoard event files under ``log_dir``.

    Per record, at ``global_step = record["step"]``:

    - ``ddphooks/<signal>`` for the signals in ``ddphooks.sinks.scalars.SIGNALS`` (loss and
      gradient-norm dispersion, reduced gradient norm, mean and weighted mean cosine, noise scale);
    - ``ddphooks/rank<r>/loss``, ``ddphooks/rank<r>/grad_norm``, ``ddphooks/rank<r>/cosine_to_others``
      for ranks below ``max_ranks``;
    - ``ddphooks/cosine_hosts``, above ``detail_max_world``, the host-by-host matrix the same way
      (``cosine_hosts``; rows and columns in its hosts' order);
    - ``ddphooks/cosine``, the W x W cosine matrix as an image (blue -1, white 0, red +1), from
      records that carry it (detail records, every ``detail_every``-th step of ``SilentState``)
      and at most once per ``image_every`` steps.

    ``null`` values are skipped. The event file is created on the first write, so a sink handed
    to every rank creates files only on the writing rank.

    Args:
        log_dir: folder of the event files; ``{rank}`` is replaced by the writing rank.
        image_every: minimum number of steps between two cosine images (1 = every record with a
            matrix).
        max_ranks: ranks that get per-rank series (0 .. max_ranks - 1); ``None`` = all, 0 = none.
            At large world sizes the per-rank lists stay complete in a ``JsonlSink``.
        **writer_kwargs: passed to ``torch.utils.tensorboard.SummaryWriter`` (``flush_secs``, ...).

    Raises:
        ImportError: tensorboard is not installed.

    Example::

        from ddphooks import SilentState
        from ddphooks.sinks.tensorboard import TensorBoardSink

        state = SilentState(sinks=[TensorBoardSink("runs/tb")])   # then: tensorboard --logdir runs/tb
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        *,
        image_every: int = 1,
        max_ranks: int | None = DEFAULT_MAX_RANKS,
        **writer_kwargs,
    ) -> None:
        if isinstance(image_every, bool) or not isinstance(image_every, int) or image_every < 1:
            raise ValueError(f"image_every must be an int >= 1, got {image_every!r}")
        record_scalars({}, max_ranks=max_ranks)  # validates max_ranks here, not on the writer thread
        _summary_writer_class()  # fail here, not on the writer thread
        self.log_dir = str(log_dir)
        self.image_every = image_every
        self.max_ranks = max_ranks
        self.writer_kwargs = writer_kwargs
        self._writer = None
        self._last_image_step = None
        self._warned_ranks = False
        self._closed = False

    @property
    def name(self) -> str:
        return f"TensorBoardSink({self.log_dir!r})"

    def bind_rank(self, rank: int) -> None:
        """Called by ``SilentState`` with the writing process's rank in the job (fills ``{rank}`` in ``log_dir``)."""
        self.log_dir = self.log_dir.replace("{rank}", str(rank))

    def _open(self):
        if self._closed:
            raise ValueError(f"{self.name} is closed")
        if self._writer is None:
            self._writer = _summary_writer_class()(log_dir=self.log_dir, **self.writer_kwargs)
        return self._writer

    def write(self, record: dict) -> None:
        writer = self._open()
        step = int(record["step"])
        for tag, value in record_scalars(record, max_ranks=self.max_ranks).items():
            writer.add_scalar(tag, value, global_step=step)
        world_size = record.get("world_size") or 0
        if self.max_ranks is not None and world_size > self.max_ranks and not self._warned_ranks:
            self._warned_ranks = True
            warnings.warn(
                f"{self.name}: per-rank series only for ranks 0..{self.max_ranks - 1} of {world_size} "
                "(max_ranks); the JSONL records keep every rank",
                stacklevel=2,
            )
        matrix, hosts = record.get("cosine"), record.get("cosine_hosts")
        due = self._last_image_step is None or step - self._last_image_step >= self.image_every
        if matrix and due:
            writer.add_image("ddphooks/cosine", cosine_image(matrix), global_step=step, dataformats="HWC")
            self._last_image_step = step
        elif hosts and due:  # above detail_max_world: the host-by-host matrix, in the hosts' order
            writer.add_image("ddphooks/cosine_hosts", cosine_image(matrix_from_record(hosts)), global_step=step, dataformats="HWC")
            self._last_image_step = step

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._closed = True
