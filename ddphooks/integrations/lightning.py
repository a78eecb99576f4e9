"""PyTorch Lightning integration: ``SilentCallback`` turns ddphooks on for a ``Trainer`` run.

Needs ``lightning`` (``import lightning.pytorch as L``, 2.x; the legacy ``pytorch_lightning``
package is not supported). Works with ``DDPStrategy`` (``strategy="ddp"``, ``"ddp_spawn"``, any
accelerator) and with ``ModelParallelStrategy`` when ``configure_model`` applies FSDP2
(``fully_shard``); other strategies (``FSDPStrategy``, which is FSDP1, ``DeepSpeedStrategy``,
single device) get one warning and no hook. ``DeepSpeedStrategy`` runs on CUDA only (Lightning
refuses the CPU), so this callback is not tested with it and says so; ``ddphooks.attach`` measures
the DeepSpeed engine directly (``docs/integrations/deepspeed.md``).

How it plugs in (facts of Lightning 2.x this relies on):

- ``DDPStrategy`` wraps the ``LightningModule`` itself in ``DistributedDataParallel``
  (``trainer.strategy.model``) during ``strategy.setup``, after the callbacks' ``setup`` and
  after the checkpoint's callback states are restored; ``on_fit_start`` comes next, before any
  batch. The callback attaches there with ``ddphooks.attach``.
- ``training_step`` runs inside the DDP forward (Lightning redirects the call through
  ``DistributedDataParallel.forward``), so the DDP output is ``training_step``'s return value, a
  loss tensor or a dict with ``"loss"``: ``attach`` records it as the rank's loss. With
  ``accumulate_grad_batches`` Lightning runs the micro-batches under ``no_sync()``, and the
  step's loss is the mean of their (unscaled) losses. Validation forwards run with the
  ``LightningModule`` in eval mode and without grad, so they never count.
- ``DDPStrategy(ddp_comm_hook=...)`` registers a hook only when the root device is CUDA. If you
  pass ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=silent_hook)`` and
  ``SilentCallback(state=state)`` with the same ``state``, ``attach`` finds it registered and
  only binds it and adds the loss capture; on the CPU (and every other accelerator) the callback
  registers it. Another hook in ``ddp_comm_hook`` cannot coexist (DDP takes one): give it to
  the state instead, ``SilentState(comm_hook=..., comm_state=...)``.

Under ``ModelParallelStrategy`` (experimental in Lightning; runs on the CPU with gloo):

- ``trainer.strategy.model`` is the ``LightningModule`` itself, unwrapped; ``configure_model``
  (before ``on_fit_start``) applies ``fully_shard`` to its layers and to the module holding them.
  The callback attaches (``ShardedSilentState``) to that FSDP2 root: the ``LightningModule`` if it
  is one, else the one outermost ``fully_shard`` module inside it (with several, it warns and
  stays off: ``fully_shard`` the module that holds them).
- ``training_step`` is not a forward of that root, so the rank's loss is taken in
  ``on_before_backward``: the loss Lightning calls backward on, times ``accumulate_grad_batches``
  (Lightning divides by it), i.e. ``training_step``'s loss. ``loss_from`` replaces this.
- Lightning's ``block_backward_sync`` only knows DDP, so with ``accumulate_grad_batches`` FSDP2
  reduce-scatters every micro-batch: each micro-batch is a synchronised step of its own and gets
  its own record (``ddphooks/step`` then counts micro-batches, not optimizer steps).
"""

from __future__ import annotations

import warnings
from pathlib import Path

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import rank_zero_warn
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("ddphooks.integrations.lightning needs Lightning 2.x: pip install 'ddphooks[lightning]'") from error

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddphooks.attach import DDP_ONLY_SETTINGS, LossFrom, attach, sharded_root, unsupported_wrapper
from ddphooks.deepspeed import deepspeed_engine
from ddphooks.hook import PYTHON_REDUCER, SilentState, python_reducer
from ddphooks.sinks import JsonlSink
from ddphooks.sinks.jsonl import drop_records_from
from ddphooks.state import BaseSilentState

#: Prefix of everything the callback logs through the LightningModule.
LOG_PREFIX = "ddphooks/"


class SilentCallback(pl.Callback):
    """Measures loss, gradient-norm and gradient-direction dispersion between the DDP ranks.

    At ``on_fit_start`` the callback attaches ddphooks to the strategy's
    ``DistributedDataParallel`` module (``ddphooks.attach``). Then, for every instrumented
    optimizer step:

    - a record goes to the state's sinks (on rank ``log_rank``, 0 by default). Without a
      ``state`` and without ``sinks``, that is one JSON line per step in
      ``<trainer.log_dir>/ddphooks/stats.jsonl`` (``trainer.log_dir`` is the first logger's
      folder, ``lightning_logs/version_N``, or ``default_root_dir`` without a logger;
      ``stats-{rank}.jsonl`` with ``log_rank=None``);
    - ``state.latest.summary()`` (loss_mean, loss_std, loss_cv, grad_norm_cv, mean_cosine,
      weighted_mean_cosine, noise_scale, ...) is logged as ``ddphooks/<key>`` through
      ``pl_module.log_dict`` in ``on_train_batch_end``, so every Lightning logger gets it at the
      Trainer's ``log_every_n_steps`` cadence, with ``ddphooks/step`` (the step they belong
      to) and ``ddphooks/alerts`` (the number of alerts so far). The values are the same on
      every rank (no ``sync_dist``); NaN where undefined (no loss captured, one rank);
    - with ``stop_on_alert``, the first batch after which the detector has new alerts
      (``state.alerts``, the same on every rank at that point) sets ``trainer.should_stop``, so
      every rank ends the fit after that batch (as ``EarlyStopping`` does; a ``ModelCheckpoint``
      saves as it would at any other end of training).

    The statistics' state (step count, smoothed noise scale) is saved in Lightning checkpoints
    (``state_dict`` / ``load_state_dict``): a run resumed with ``trainer.fit(ckpt_path=...)``
    continues the step numbering, and the default JSONL file, if it is the same file, keeps the
    records before the checkpoint and drops those an interrupted run wrote after it.

    Under ``ModelParallelStrategy`` with FSDP2 it attaches to the FSDP2 root instead (see the
    module's notes: the loss comes from ``on_before_backward``, every micro-batch is a step).
    Without a ``DistributedDataParallel`` model or an FSDP2 root (one device, ``FSDPStrategy``
    which is FSDP1, DeepSpeed) the callback warns once and does nothing.

    Args:
        state: a ``ddphooks.SilentState`` created beforehand (unbound; the same object may be
            given to ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=silent_hook)``), or a
            ``ddphooks.fsdp.ShardedSilentState`` under ``ModelParallelStrategy``. Its
            sinks are used as they are. It binds to one DDP module, so it serves one ``fit``;
            pass settings instead to call ``fit`` more than once on the same callback.
        log_metrics: log the summary through ``pl_module.log_dict`` (default True).
        stop_on_alert: stop the fit after the first batch that brings new alerts (default
            False: training goes on, the alerts are logged and counted).
        loss_from: ``loss_from(module, args, kwargs, output)`` finds the rank's loss in a DDP
            forward when ``training_step`` returns something other than a loss or a dict with
            ``"loss"`` (see ``ddphooks.attach``). With manual optimization, call
            ``callback.state.observe_loss(loss)`` instead.
        **settings: ``SilentState`` keyword arguments (``sketch_dim``, ``every``, ``sinks``,
            ``log_rank`` ...); the state is built from them at ``on_fit_start``.

    Example::

        import lightning.pytorch as L
        from lightning.pytorch.strategies import DDPStrategy
        from ddphooks.integrations.lightning import SilentCallback

        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), max_steps=100,
                            callbacks=[SilentCallback(sketch_dim=256)])
        trainer.fit(model, loader)   # records in <trainer.log_dir>/ddphooks/stats.jsonl
    """

    def __init__(
        self, state: BaseSilentState | None = None, *, log_metrics: bool = True, stop_on_alert: bool = False, loss_from: LossFrom | None = None, **settings
    ) -> None:
        if state is not None and settings:
            raise TypeError(f"SilentCallback takes either state= or SilentState settings, not both (got state and {sorted(settings)})")
        if state is not None and not isinstance(state, BaseSilentState):
            raise TypeError(
                f"state must be a ddphooks.SilentState (DDP) or ddphooks.fsdp.ShardedSilentState (FSDP2), got {type(state).__name__}"
            )
        self._state = state
        self._owns_state = state is None
        self.settings = settings
        self.log_metrics = log_metrics
        self.stop_on_alert = stop_on_alert
        self._alerts_seen = 0
        self.loss_from = loss_from
        self._restored: dict | None = None  # a checkpoint's state, loaded before the state exists
        self._active = False
        self._loss_before_backward = False  # FSDP2: the loss is taken in on_before_backward
        self._warned: set[str] = set()

    @property
    def state(self) -> BaseSilentState | None:
        """The ``SilentState`` of the current run (None before ``on_fit_start``, or when off)."""
        return self._state

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    # -- attaching -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        distributed = dist.is_available() and dist.is_initialized()
        roots = _fsdp2_roots(model) if distributed else []
        if len(roots) > 1:
            self._warn_once(
                "fsdp2-roots",
                f"SilentCallback: the model has several FSDP2 roots ({', '.join(name or 'the LightningModule' for name, _ in roots)}); "
                "ddphooks measures one fully_shard root and is off for this run: apply fully_shard to the module holding them too",
            )
            return
        root = roots[0][1] if roots else None
        if deepspeed_engine(getattr(model, "_orig_mod", model)) is not None:
            self._warn_once(
                "deepspeed",
                "SilentCallback: ddphooks is off for this run, training is unchanged: Lightning's DeepSpeedStrategy is not "
                "measured by this callback (DeepSpeed is: call ddphooks.attach(trainer.strategy.model), the DeepSpeedEngine, "
                "in your LightningModule's on_fit_start on every rank; see docs/integrations/deepspeed.md)",
            )
            return
        if root is None:
            mode = python_reducer()
            if mode is not None:
                message = f"SilentCallback: ddphooks is off for this run, training is unchanged: {PYTHON_REDUCER.format(mode=mode)}"
                self._warn_once("python-reducer", message)
                return
            if not distributed or not isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel):
                self._warn_once(
                    "not-ddp",
                    f"SilentCallback: the {type(trainer.strategy).__name__} strategy gives no DistributedDataParallel model "
                    f"and no FSDP2 (fully_shard) root{unsupported_wrapper(getattr(model, '_orig_mod', model))}; ddphooks is off "
                    "for this run (use strategy='ddp' or DDPStrategy with 2+ processes, or ModelParallelStrategy with "
                    "fully_shard in configure_model; FSDPStrategy (FSDP1) is not supported)",
                )
                return
        target = model if root is None else root
        if self._owns_state and (self._state is None or self._state.bound):
            self._state = self._build_state(trainer, target, sharded=root is not None)  # a second fit: a new state
        if self._restored is not None:
            self._state.load_state_dict(self._restored)
            self._restored = None
        attach(target, state=self._state, loss_from=self.loss_from)
        self._loss_before_backward = root is not None and self.loss_from is None
        self._alerts_seen = len(self._state.alerts)
        self._active = True

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss) -> None:
        if self._active and self._loss_before_backward:
            # Automatic optimization divides training_step's loss by accumulate_grad_batches
            # before backward; manual optimization allows no accumulation (the factor is 1).
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self._state.observe_loss(loss.detach() * scale)

    def _build_state(self, trainer: pl.Trainer, model, sharded: bool = False) -> BaseSilentState:
        carried = self._state.state_dict() if self._state is not None else None  # a second fit continues
        if self._state is not None:
            self._state.close()
        settings = dict(self.settings)
        ddp_only = sorted(set(settings) & DDP_ONLY_SETTINGS) if sharded else []
        if ddp_only:
            raise TypeError(f"SilentCallback: {', '.join(ddp_only)} apply to DDP only, and this run's model is an FSDP2 root: drop them")
        if settings.get("sinks") is None:
            settings["sinks"] = [self._default_sink(trainer, settings.get("log_rank", 0), self._restored or carried)]
        # The process group exists, so the state binds as it is built: given the model, it
        # takes the parameter names from it. attach binds the FSDP2 one.
        if sharded:
            from ddphooks.fsdp import ShardedSilentState

            state = ShardedSilentState(**settings)
        else:
            state = SilentState(model=getattr(model, "_orig_mod", model), **settings)
        if carried is not None:
            state.load_state_dict(carried)
        return state

    def _default_sink(self, trainer: pl.Trainer, log_rank: int | None, resumed: dict | None) -> JsonlSink:
        log_dir = trainer.log_dir or trainer.default_root_dir  # a collective (broadcast): every rank is here
        name = "stats.jsonl" if log_rank is not None else "stats-{rank}.jsonl"
        path = Path(log_dir) / "ddphooks" / name
        writes = log_rank is None or log_rank == trainer.global_rank
        first_step = resumed["step"] if resumed else 0
        if writes and first_step:
            drop_records_from(Path(str(path).replace("{rank}", str(trainer.global_rank))), first_step)
        return JsonlSink(path, append=bool(first_step))

    # -- logging ---------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self._active:
            return
        alerts = self._state.alerts
        new, self._alerts_seen = alerts[self._alerts_seen :], len(alerts)
        # Not on a watchdog alert: the rank that found one may be the only one, and would stop alone.
        if self.stop_on_alert and any(alert["kind"] != "unsynchronised" for alert in new):
            trainer.should_stop = True
            rank_zero_warn(
                f"ddphooks: stopping the fit after global step {trainer.global_step} (stop_on_alert) on {len(new)} new "
                f"alert(s); the first: {new[0]['message']}"
            )
        if not self.log_metrics:
            return
        try:
            stats = self._state.latest
            if stats is None:
                return
            # NaN where a signal is undefined is logged as NaN: leaving the key out would make
            # Lightning's loggers repeat the previous step's value.
            metrics = {LOG_PREFIX + key: float(value) for key, value in stats.summary().items()}
            metrics[LOG_PREFIX + "step"] = float(stats.step)
            metrics[LOG_PREFIX + "alerts"] = float(len(alerts))
        except Exception as error:  # monitoring never stops training
            self._warn_once("latest", f"SilentCallback: no statistics to log ({type(error).__name__}: {error})")
            return
        # Identical on every rank by construction: no sync_dist (it would cost a collective).
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)

    # -- closing ---------------------------------------------------------------------------------
    def _close(self) -> None:
        if self._active:
            self._active = False
            self._state.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()  # write what was measured up to the failure

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self._state is not None:
            return {"silent_state": self._state.state_dict()}
        return {} if self._restored is None else {"silent_state": dict(self._restored)}

    def load_state_dict(self, state_dict: dict) -> None:
        restored = state_dict.get("silent_state")
        if restored is None:
            return
        if self._state is not None and not self._state.bound:
            self._state.load_state_dict(restored)
        else:
            self._restored = restored  # applied at on_fit_start, to the state built or bound there


def _fsdp2_roots(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The outermost FSDP2 (``fully_shard``) modules of ``model`` with their names: ``model``
    itself if it is one (``""``), else those not inside another; empty without FSDP2."""
    root = sharded_root(model)
    if root is not None:
        return [("", root)]
    from torch.distributed.fsdp import FSDPModule

    outermost: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():  # parents come before their children
        if isinstance(module, FSDPModule) and not any(name.startswith(top + ".") for top, _ in outermost):
            outermost.append((name, module))
    return outermost
