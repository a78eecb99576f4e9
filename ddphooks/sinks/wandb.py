"""Weights & Biases sink: the step signals as W&B metrics.

Needs the ``wandb`` package (``pip install 'ddphooks[wandb]'``); it is imported when the sink is
created, never by ``import ddphooks``.
"""

from __future__ import annotations

from ddphooks.sinks.base import Sink
from ddphooks.sinks.scalars import DEFAULT_MAX_RANKS, record_scalars

#: Logged with every record; the ``ddphooks/*`` metrics are plotted against it (``define_metric``).
STEP_KEY = "ddphooks/step"


def _import_wandb():
    try:
        import wandb
    except ImportError as error:
        raise ImportError("WandbSink needs the wandb package: pip install 'ddphooks[wandb]'") from error
    return wandb


class WandbSink(Sink):
    """Logs each record's scalars to a W&B run.

    The scalars are those of ``ddphooks.sinks.scalars.record_scalars``: ``ddphooks/<signal>``
    (loss and gradient-norm dispersion, reduced gradient norm, mean and weighted mean cosine,
    noise scale) and ``ddphooks/rank<r>/{loss,grad_norm,cosine_to_others}`` for ranks below
    ``max_ranks``, plus ``ddphooks/step``; ``null`` values are skipped.

    Which run: ``run`` if given, else the active ``wandb.run`` at the first write, else a run
    the sink starts with ``wandb.init(**init_kwargs)`` at the first write (on the writing rank
    only; ``mode="offline"`` works without network). A run the sink started is logged with
    ``step=record["step"]`` and finished by ``close()``. A run owned by someone else (a
    Lightning ``WandbLogger``, the HF Trainer) keeps its own step counter, which a lower
    ``step=`` would make W&B drop; there the sink logs without ``step=`` and plots its metrics
    against ``ddphooks/step`` (``run.define_metric``), and never finishes the run.

    Args:
        run: an existing ``wandb`` run to log to.
        max_ranks: ranks that get per-rank series (0 .. max_ranks - 1); ``None`` = all, 0 = none.
        **init_kwargs: for ``wandb.init`` when the sink starts the run (``project``, ``dir``,
            ``mode``, ...).

    Raises:
        ImportError: wandb is not installed.

    Example::

        from ddphooks import SilentState
        from ddphooks.sinks.wandb import WandbSink

        state = SilentState(sinks=[WandbSink(project="my-run", mode="offline")])
    """

    def __init__(self, *, run=None, max_ranks: int | None = DEFAULT_MAX_RANKS, **init_kwargs) -> None:
        record_scalars({}, max_ranks=max_ranks)  # validates max_ranks here, not on the writer thread
        _import_wandb()  # fail here, not on the writer thread; the module is not kept (picklable sink)
        self.max_ranks = max_ranks
        self.init_kwargs = init_kwargs
        self._run = run
        self._owns_run = False
        self._configured = False
        self._closed = False

    @property
    def name(self) -> str:
        return "WandbSink"

    @property
    def run(self):
        """The run logged to (None before the first write when none was given)."""
        return self._run

    def _open(self):
        if self._closed:
            raise ValueError(f"{self.name} is closed")
        if self._run is None:
            wandb = _import_wandb()
            self._run = wandb.run
            if self._run is None:
                self._run = wandb.init(**self.init_kwargs)
                self._owns_run = True
        if not self._configured:
            self._configured = True
            self._run.define_metric(STEP_KEY)
            self._run.define_metric("ddphooks/*", step_metric=STEP_KEY)
        return self._run

    def write(self, record: dict) -> None:
        run = self._open()
        step = int(record["step"])
        scalars = record_scalars(record, max_ranks=self.max_ranks)
        scalars[STEP_KEY] = step
        if self._owns_run:
            run.log(scalars, step=step)
        else:
            run.log(scalars)

    def close(self) -> None:
        if self._owns_run and self._run is not None:
            self._run.finish()
        self._run = None
        self._closed = True
