"""Lightning DDP run for tests/test_integration_lightning.py (2 CPU processes, gloo).

Run as ``python lightning_train.py OUT``; Lightning's subprocess launcher re-runs this script for
rank 1. Three fits in one launch (starting Lightning twice would double the test's time):

- ``a``: ``SilentCallback(sketch_dim=...)`` with the default JSONL sink, ``accumulate_grad_batches=2``,
  validation every 2 batches plus a sanity check (their forwards must not count), 3 optimizer
  steps, a ``ModelCheckpoint`` at step 2: an "interrupted" run that went one step past its last
  checkpoint;
- ``b``: a new Trainer and callback resumed from the step-2 checkpoint, same logger folder, up to 4
  steps: the records must go on at step 2 in the same file, the step-2 record of ``a`` dropped;
- ``c``: what ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=silent_hook)`` does on CUDA,
  forced on the CPU (Lightning registers the hook only on CUDA), with ``SilentCallback(state=state)``:
  attach must only bind, not register a second hook.

- ``d``: ``SilentCallback(check_replicas_every=1, stop_on_alert=True)``, up to 10 steps; after
  step 2 rank 1 shifts one weight (its replica diverges), so the replica check alerts and the fit
  must stop early on both ranks; each rank writes ``OUT/stop-rank<r>.json``, its last global step.

Every rank writes what its ``training_step`` computed, ``OUT/losses-<fit>-rank<r>.json`` as
``[[optimizer_step, loss], ...]`` per micro-batch, and ``OUT/hooks-c-rank<r>.json`` (the DDP
model's registered comm hooks during fit ``c``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from ddphooks import JsonlSink, SilentState, silent_hook
from ddphooks.integrations.lightning import SilentCallback

OUT = Path(sys.argv[1])
torch.set_num_threads(1)


class Classifier(L.LightningModule):
    def __init__(self, fit: str) -> None:
        super().__init__()
        self.fit_name = fit
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.losses: list[list] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.losses.append([self.trainer.global_step, loss.item()])
        # A dict output in one fit, a bare tensor in the others: attach reads both.
        return {"loss": loss} if self.fit_name == "a" else loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y) * 10.0  # far from the training losses

    def on_train_start(self) -> None:
        hooks = [getattr(hook, "__name__", repr(hook)) for hook, _ in self.trainer.strategy.model._comm_hooks]
        (OUT / f"hooks-{self.fit_name}-rank{self.global_rank}.json").write_text(json.dumps(hooks))

    def on_train_end(self) -> None:
        (OUT / f"losses-{self.fit_name}-rank{self.global_rank}.json").write_text(json.dumps(self.losses))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DivergeAfter(L.Callback):
    """Shifts one weight on rank 1 after optimizer step ``step``: its replica silently diverges."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 1:  # one batch per step here: once
            with torch.no_grad():
                pl_module.net[0].bias.add_(1e-3)

    def on_train_end(self, trainer, pl_module) -> None:
        (OUT / f"stop-rank{trainer.global_rank}.json").write_text(json.dumps(trainer.global_step))


class CudaLikeDDPStrategy(DDPStrategy):
    """Registers ``ddp_comm_hook`` on any device, as ``DDPStrategy`` does only on CUDA."""

    def _register_ddp_hooks(self) -> None:
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state, ddp_comm_hook=self._ddp_comm_hook)


def loaders():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=generator)
    y = torch.randint(0, 4, (96,), generator=generator)
    data = TensorDataset(x, y)
    return DataLoader(data, batch_size=4), DataLoader(data, batch_size=8)


def trainer(max_steps: int, callbacks: list, strategy=None, **kwargs) -> L.Trainer:
    kwargs.setdefault("logger", CSVLogger(OUT, name="csv", version=0))
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy or DDPStrategy(process_group_backend="gloo"),
        max_steps=max_steps,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


train, val = loaders()
L.seed_everything(0)
checkpoints = ModelCheckpoint(dirpath=OUT / "ckpt", every_n_train_steps=2, save_top_k=-1, save_on_train_epoch_end=False)
validation = dict(val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=1)
trainer(3, [SilentCallback(sketch_dim=64), checkpoints], accumulate_grad_batches=2, **validation).fit(Classifier("a"), train, val)

trainer(4, [SilentCallback(sketch_dim=64)], accumulate_grad_batches=2, enable_checkpointing=False, **validation).fit(
    Classifier("b"), train, val, ckpt_path=str(OUT / "ckpt" / "epoch=0-step=2.ckpt")
)

state = SilentState(sketch_dim=64, sinks=[JsonlSink(OUT / "c.jsonl")])
strategy = CudaLikeDDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=silent_hook)
trainer(2, [SilentCallback(state=state)], strategy=strategy, enable_checkpointing=False, logger=False).fit(Classifier("c"), train)

stopping = SilentCallback(sketch_dim=64, check_replicas_every=1, stop_on_alert=True, sinks=[JsonlSink(OUT / "d.jsonl")])
trainer(10, [stopping, DivergeAfter(2)], enable_checkpointing=False, logger=False).fit(Classifier("d"), train)
