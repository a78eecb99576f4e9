"""``SilentCallback``: ddphooks in a Hugging Face ``transformers.Trainer`` (and its subclasses).

Add the callback and nothing else changes::

    trainer = Trainer(model, args, train_dataset=data, callbacks=[SilentCallback()])

At ``on_train_begin`` it attaches ddphooks (``ddphooks.attach``) to the Trainer's wrapped model, a
DDP module, an FSDP2 (``fully_shard``) root or, with ``TrainingArguments(deepspeed=...)``, the
DeepSpeed engine, records each rank's own mean token loss of every training micro-batch,
writes one record per optimizer step to ``<output_dir>/ddphooks/stats.jsonl``, adds the step's
summary (``ddphooks/loss_std``, ``ddphooks/mean_cosine`` ...) to the Trainer's logs (so every
``report_to`` integration and ``trainer.state.log_history`` get it), saves its state with each
checkpoint and restores it on ``trainer.train(resume_from_checkpoint=...)``.

FSDP2 in the Trainer (transformers 5.x): ``fsdp=True, fsdp_config={"version": 2}`` goes through
Accelerate's FSDP plugin, which Accelerate only enables on accelerators (on the CPU its
``AcceleratorState`` keeps ``MULTI_CPU`` and ``accelerator.prepare`` wraps the model in DDP, which
the callback then measures); a model loaded with ``from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=N))`` is sharded by transformers itself, on any
device. Either way ``trainer.model_wrapped`` is the FSDP2 root at ``on_train_begin``.

This module imports transformers; ``import ddphooks`` does not import this module.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ddphooks.attach import LossFrom, attach, ddp_module, sharded_root, unsupported_wrapper
from ddphooks.deepspeed import deepspeed_engine
from ddphooks.hook import PYTHON_REDUCER, python_reducer
from ddphooks.loss import loss_of
from ddphooks.sinks import JsonlSink
from ddphooks.sinks.jsonl import drop_records_from
from ddphooks.state import BaseSilentState

logger = logging.getLogger("ddphooks")

LOG_PREFIX = "ddphooks/"
"""Prefix of the summary keys added to the Trainer's logs."""
STATE_FILE = "ddphooks_state_{rank}.json"
"""Per-rank state file in each checkpoint folder (like the Trainer's own ``rng_state_{rank}.pth``)."""
IGNORE_INDEX = -100


def rank_mean_token_loss(shifts_labels: bool) -> LossFrom:
    """A ``loss_from`` for ``ddphooks.attach`` giving the rank's own mean token loss of a forward.

    With ``average_tokens_across_devices=True`` (the default) and a model that takes loss kwargs,
    the Trainer passes ``num_items_in_batch`` (label tokens of the whole optimizer step, summed
    over micro-batches and ranks) to the forward, and ``output.loss`` is this rank's token-loss
    sum divided by that global count: it mixes in the other ranks' token counts. Multiplying by
    ``num_items_in_batch`` and dividing by this micro-batch's own label-token count gives back the
    rank's own mean token loss, what ranks can be compared on. Without ``num_items_in_batch`` the
    model's loss already is that mean. Tokens are counted as the Trainer counts them: over
    ``shift_labels`` when given, else over ``labels[..., 1:]`` for losses that shift (causal LM),
    else over ``labels``, ignoring ``-100``. A micro-batch without label tokens has no mean: its
    loss is NaN (reported as a non-finite loss), like the model's own mean-reduced loss.

    Args:
        shifts_labels: whether the model's loss shifts labels (``Trainer._loss_shifts_labels``).

    Example::
        >>> state = ddphooks.attach(ddp_model, loss_from=rank_mean_token_loss(shifts_labels=True))
    """

    def loss_from(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> torch.Tensor | None:
        loss = loss_of(output)
        global_count = kwargs.get("num_items_in_batch")
        if loss is None or global_count is None:
            return loss
        labels = kwargs.get("shift_labels")
        if labels is None:
            labels = kwargs.get("labels")
            if labels is None:  # the loss was scaled by a count we cannot split: record nothing
                return None
            if shifts_labels:
                labels = labels[..., 1:]
        own_count = labels.ne(IGNORE_INDEX).sum().to(loss.device)
        # Tensor arithmetic only: no .item(), no device synchronisation in the forward.
        return loss.detach().float() * torch.as_tensor(global_count, device=loss.device).float() / own_count

    return loss_from


def loss_shifts_labels(model: torch.nn.Module) -> bool:
    """Whether ``model``'s loss shifts labels; the rule ``Trainer.__init__`` uses to count
    ``num_items_in_batch`` (a causal-LM loss, not an encoder-decoder model).

    Args:
        model: the unwrapped model (``trainer.model``).

    Example::
        >>> loss_shifts_labels(LlamaForCausalLM(config))
        True
    """
    causal = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    return causal and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def _calling_trainer() -> tuple[Trainer | None, str | None]:
    """The ``Trainer`` whose training loop is running this callback, and the checkpoint it resumes.

    Why the call stack: a callback gets the unwrapped model, the optimizer and the data loaders,
    never the Trainer, and nothing on the unwrapped model points back to its DDP wrapper, which
    only the Trainer holds (``model_wrapped``). In transformers 5.x ``_inner_training_loop`` runs
    ``_prepare_for_training`` (``accelerator.prepare``, then ``self.model_wrapped = model``) before
    ``callback_handler.on_train_begin``, and between that call and this callback there are only
    ``CallbackHandler`` frames. So the first frame up the stack whose ``self`` is a ``Trainer`` is
    the training loop of this very run, for ``Trainer`` and every subclass (TRL's ``SFTTrainer``
    overrides ``compute_loss``/``log``, not the loop). Its ``resume_from_checkpoint`` local is the
    checkpoint folder already resolved (``train(resume_from_checkpoint=True)`` becomes the last
    checkpoint's path). Globals or ``gc`` searches would find the wrong Trainer when there are two.
    """
    frame = sys._getframe(1)
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                resume = frame.f_locals.get("resume_from_checkpoint")
                return owner, resume if isinstance(resume, (str, os.PathLike)) else None
            frame = frame.f_back
        return None, None
    finally:
        del frame  # a frame reference kept here would keep the whole stack alive


class SilentCallback(TrainerCallback):
    """Measures silent inconsistency between the ranks of a ``Trainer`` run with ``silent_hook``.

    What it does, by Trainer event:

    - ``on_train_begin``: finds the Trainer and its wrapped model (``trainer.model_wrapped``: DDP,
      an FSDP2 root or, with ``TrainingArguments(deepspeed=...)``, the DeepSpeed engine; the
      callbacks' ``model`` is ``engine.module`` there), ``ddphooks.attach``-es the given ``state`` or one built from the
      settings (a ``SilentState`` for DDP, a ``ddphooks.fsdp.ShardedSilentState`` for FSDP2), with
      a loss capture that records each rank's own mean token loss of every training micro-batch
      (:func:`rank_mean_token_loss`; evaluation forwards never count). It then moves itself to the
      front of the Trainer's callbacks so that its ``on_log`` runs before the reporting
      integrations'. On a resumed run it restores the state saved in the checkpoint, so step
      numbering continues. Without DDP, FSDP2 or DeepSpeed ZeRO (one process, FSDP1) it warns once
      and does nothing else: training is unchanged.
    - ``on_step_end``: when the detector has found new alerts (``state.alerts``, the same on
      every rank at this point; the detector runs on a background thread, so a step's alerts
      reach ``state.alerts`` when the step after next starts its backward, and this callback
      at the end of that step), asks the Trainer to log at this step, so the alert count reaches
      the logs when it happens; with ``stop_on_alert``, also to save a checkpoint and stop
      (``control.should_save``, ``control.should_training_stop``): every rank stops after the
      same step, with the checkpoint of the weights the alert was found on.
    - ``on_log`` (logs with a ``"loss"``, the Trainer's training logging steps): adds
      ``state.latest.summary()`` with keys prefixed ``ddphooks/`` to the logs, and
      ``ddphooks/alerts``, the number of alerts so far, and to the entry the Trainer just
      appended to ``trainer.state.log_history``.
    - ``on_save``: writes ``state.state_dict()`` to ``ddphooks_state_<rank>.json`` in the
      checkpoint folder (every rank, like the Trainer's per-rank RNG state) and flushes the sinks,
      so the records on disk match the checkpoint.
    - ``on_train_end``: ``state.close()`` (writes what is queued, flushes and closes the sinks).

    Records go to ``<args.output_dir>/ddphooks/stats.jsonl`` (``output_dir=`` sets the folder;
    ``stats-rank<r>.jsonl`` with ``log_rank=None``) unless ``sinks`` is among ``settings``; on resume the file is appended to, after dropping the
    records of steps from the checkpoint on (an interrupted run wrote them, the resumed run
    writes them again), so every step appears once.

    The loss comes from the forward output (``output.loss``), rescaled as
    :func:`rank_mean_token_loss` explains; TRL's ``SFTTrainer`` (fused LM head) passes no
    ``num_items_in_batch`` to the model, whose loss then already is the rank's mean. Limits: with
    ``label_smoothing_factor`` or a ``compute_loss_func`` the Trainer computes the loss outside
    the model, the output has none and the records' losses are null (gradient statistics are
    unaffected); a MoE auxiliary loss inside ``output.loss`` is rescaled with the token loss.

    Args:
        state: a ``SilentState`` (DDP), ``ShardedSilentState`` (FSDP2) or ``DeepSpeedSilentState``
            (DeepSpeed) to attach (created beforehand); None: one is created at ``on_train_begin``
            from ``settings``.
        output_dir: folder of the default ``stats.jsonl`` (default: ``<args.output_dir>/ddphooks``);
            not with ``state`` or ``sinks``, which bring their own.
        stop_on_alert: save a checkpoint and stop training at the first step that brings new
            alerts (default False: training goes on, the alerts are logged).
        **settings: ``SilentState`` keyword arguments (``sketch_dim``, ``every``, ``sinks``,
            ``log_rank`` ...; under FSDP2 not the DDP-only ones, ``attach`` says which); not
            together with ``state``.

    Attributes:
        state: the attached state (None before training starts, or without DDP or FSDP2).

    Example::
        >>> from ddphooks.integrations.transformers import SilentCallback
        >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[SilentCallback(sketch_dim=256)])
        >>> trainer.train()                       # torchrun --nproc-per-node 8 train.py
        >>> trainer.state.log_history[-2].get("ddphooks/loss_std")
    """

    def __init__(self, state: BaseSilentState | None = None, output_dir: str | os.PathLike | None = None, stop_on_alert: bool = False, **settings) -> None:
        if state is not None and settings:
            raise TypeError(f"SilentCallback takes either state= or SilentState settings, not both (got state and {sorted(settings)})")
        if output_dir is not None and (state is not None or "sinks" in settings):
            raise TypeError("output_dir sets where the default JsonlSink writes; with state= or sinks= there is none, drop output_dir")
        if state is not None and not isinstance(state, BaseSilentState):
            raise TypeError(
                f"state must be a ddphooks.SilentState (DDP) or ddphooks.fsdp.ShardedSilentState (FSDP2), got {type(state).__name__}"
            )
        self._given_state = state
        self.output_dir = output_dir
        self.settings = settings
        self.stop_on_alert = stop_on_alert
        self.state: BaseSilentState | None = None
        self._warned_latest = False
        self._alerts_seen = 0

    # -- Trainer events ----------------------------------------------------------------------
    def on_train_begin(self, args, trainer_state, control, **kwargs):
        trainer, resume_dir = _calling_trainer()
        if trainer is None:
            warnings.warn(
                "ddphooks SilentCallback found no transformers.Trainer running it (on_train_begin called outside "
                "Trainer.train); it does nothing. Outside a Trainer, call ddphooks.attach(model) yourself.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        wrapped = trainer.model_wrapped  # under DeepSpeed the engine (callbacks get model=engine.module)
        if sharded_root(wrapped) is None and deepspeed_engine(wrapped) is None:  # attach checks those itself
            mode = python_reducer()
            if mode is not None:
                warnings.warn(f"ddphooks SilentCallback does nothing for this run; training is unchanged: {PYTHON_REDUCER.format(mode=mode)}", RuntimeWarning, stacklevel=2)
                return
            try:
                ddp_module(wrapped)
            except TypeError:
                warnings.warn(
                    f"ddphooks SilentCallback: the Trainer's model is a {type(wrapped).__name__}, not DistributedDataParallel "
                    f"or an FSDP2 (fully_shard) root{unsupported_wrapper(getattr(wrapped, '_orig_mod', wrapped))} (world size "
                    f"{args.world_size}), so it does nothing; training is unchanged. It measures DDP, FSDP2 and DeepSpeed "
                    "ZeRO runs of 2+ processes (torchrun --nproc-per-node N ...); FSDP1 is not supported.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
        if resume_dir is None and trainer_state.global_step > 0:
            # A subclass loop without the `resume_from_checkpoint` local: the Trainer's own folder naming.
            resume_dir = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer_state.global_step}")
        default_sink = None
        if self._given_state is not None:
            settings = {"state": self._given_state}
        else:
            settings = dict(self.settings)
            if "sinks" not in settings:
                folder = Path(self.output_dir) if self.output_dir is not None else Path(args.output_dir) / "ddphooks"
                name = "stats-rank{rank}.jsonl" if settings.get("log_rank", 0) is None else "stats.jsonl"
                default_sink = JsonlSink(folder / name, append=resume_dir is not None)
                settings["sinks"] = [default_sink]
        # attach builds the state the model needs: SilentState (DDP) or ShardedSilentState (FSDP2).
        self.state = attach(wrapped, loss_from=rank_mean_token_loss(loss_shifts_labels(trainer.model)), **settings)
        self._alerts_seen = 0
        if resume_dir is not None:
            self._restore(Path(resume_dir), trainer_state.global_step)
            if default_sink is not None and self.state.config.log_rank in (None, self.state.rank):
                # The sink opens its file at the first record, after this: the file is ours to edit.
                drop_records_from(default_sink.path, self.state.step)
        # The Trainer appends its log entry to log_history, then calls on_log on the callbacks in
        # list order: defaults, the report_to integrations, user callbacks. Running first lets
        # on_log add the summary to the `logs` dict every later callback (TensorBoard, W&B, ...)
        # receives. Moving an element that is being iterated is safe here: removing index k and
        # inserting at 0 leaves every element after k at its old index.
        callbacks = trainer.callback_handler.callbacks
        callbacks.remove(self)
        callbacks.insert(0, self)

    def on_step_end(self, args, trainer_state, control, **kwargs):
        if self.state is None:
            return
        alerts = self.state.alerts
        new, self._alerts_seen = alerts[self._alerts_seen :], len(alerts)
        if not new:
            return
        control.should_log = True
        # Not on a watchdog alert: the rank that found one may be the only one, and would stop alone.
        if self.stop_on_alert and any(alert["kind"] != "unsynchronised" for alert in new):
            control.should_save = control.should_training_stop = True
            if trainer_state.is_world_process_zero:
                logger.warning(
                    "ddphooks: stopping training after step %d (stop_on_alert) on %d new alert(s), a checkpoint first; the first: %s",
                    trainer_state.global_step, len(new), new[0]["message"],
                )  # fmt: skip

    def on_log(self, args, trainer_state, control, logs=None, **kwargs):
        if self.state is None or not logs or "loss" not in logs:
            return
        try:
            latest = self.state.latest
        except RuntimeError as error:  # a failed statistics step must not stop training
            if not self._warned_latest:
                self._warned_latest = True
                logger.warning("ddphooks: no summary logged: %s", error)
            return
        if latest is None:
            return
        summary = {LOG_PREFIX + key: value for key, value in latest.summary().items()}
        summary[LOG_PREFIX + "alerts"] = len(self.state.alerts)
        logs.update(summary)
        if trainer_state.log_history:
            trainer_state.log_history[-1].update(summary)  # Trainer.log appended it just before on_log

    def on_save(self, args, trainer_state, control, **kwargs):
        if self.state is None:
            return
        self.state.flush()
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{trainer_state.global_step}"
        if folder.is_dir():  # absent on a node that does not save (no shared file system)
            path = folder / STATE_FILE.format(rank=self.state.rank)
            path.write_text(json.dumps(self.state.state_dict()), encoding="utf-8")

    def on_train_end(self, args, trainer_state, control, **kwargs):
        if self.state is not None:
            self.state.close()

    # -- helpers -------------------------------------------------------------------------------
    def _restore(self, checkpoint: Path, global_step: int) -> None:
        path = checkpoint / STATE_FILE.format(rank=self.state.rank)
        if path.is_file():
            self.state.load_state_dict(json.loads(path.read_text(encoding="utf-8")))
            return
        # A checkpoint taken without ddphooks: one synchronised step per optimizer step, so the
        # Trainer's step count is where numbering goes on.
        logger.warning(
            "ddphooks: %s has no %s; step numbering continues from the Trainer's global step %d", checkpoint, path.name, global_step
        )
        self.state.load_state_dict({"step": global_step})
