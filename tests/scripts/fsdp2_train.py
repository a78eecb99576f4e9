"""FSDP2 runs with ddphooks in the Hugging Face Trainer, Accelerate and Lightning, for tests/test_integration_fsdp2.py.

Usage: ``torchrun --standalone --nproc-per-node 2 fsdp2_train.py OUT SCENARIO [SCENARIO ...]``; the
scenarios run in order in one process group (gloo, CPU):

- ``accelerate-plugin``: an Accelerate loop configured for FSDP2,
  ``Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``, then
  ``ddphooks.attach(accelerator.prepare(model))``; gradient accumulation over 2 micro-batches with
  ``accelerator.accumulate``, 4 optimizer steps. On the CPU Accelerate drops the FSDP plugin
  (``AcceleratorState`` enables FSDP for accelerator device types only) and ``prepare`` returns
  DDP: the scenario records what it got.
- ``accelerate-plugin-forced``: the same with Accelerate's state set to FSDP after the
  ``Accelerator`` is made, as Accelerate itself sets it on accelerator devices: ``prepare``
  then shards with Accelerate's own FSDP2 preparation and ``accumulate`` skips the
  reduce-scatter on the micro-batches.
- ``accelerate-sharded``: the same loop with the model ``fully_shard``-ed by the script (Accelerate
  would wrap a sharded model in DDP on the CPU, which fails) and the optimizer and data loader
  prepared by Accelerate; accumulation with ``accelerator.accumulate`` and
  ``model.set_requires_gradient_sync(accelerator.sync_gradients)``, what ``Accelerator.no_sync``
  does under FSDP2.
- ``trainer-config``: ``Trainer(fsdp=True, fsdp_config={"version": 2})`` with ``SilentCallback``;
  on the CPU Accelerate drops the plugin here too and the Trainer runs DDP.
- ``trainer-native``: the Trainer's FSDP2 that runs on the CPU: a model loaded with
  ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`` (transformers applies
  ``fully_shard``), ``SilentCallback``, gradient accumulation 2, 4 steps, a checkpoint at step 2
  (``save_only_model=True``: transformers cannot resume a model sharded at load time).
- ``lightning``: Lightning's ``ModelParallelStrategy`` (``fully_shard`` in ``configure_model``,
  data-parallel size 2) with ``SilentCallback``, ``accumulate_grad_batches=2``, 2 optimizer steps;
  Lightning lets FSDP2 reduce-scatter every micro-batch, so each is a synchronised step.

Every rank writes its own records (``log_rank=None``, detailed every step) and
``OUT/<scenario>-rank<r>.json``: what the run computed itself: the loss of every micro-batch
(the Accelerate loop's ``loss.item()``; the rank's own mean token loss from the logits and labels
in the Trainer runs, as tests/scripts/hf_train.py computes it; ``training_step``'s loss in
Lightning), the norm of the averaged gradient of each synchronised step (Accelerate: the full
gradient before ``optimizer.step``; Trainer: its logged ``grad_norm``; Lightning: the growth of the
full gradient in each micro-batch's backward), and what wrapped the model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader

import ddphooks
from token_data import VOCAB, token_rows

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
MICRO = 2  # micro-batches per optimizer step, every scenario


def dump(scenario: str, result: dict) -> None:
    (OUT / f"{scenario}-rank{RANK}.json").write_text(json.dumps(result))


def grad_norm(model: torch.nn.Module) -> float:
    """Norm of the averaged gradient (a collective for sharded gradients)."""
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))


def fresh_accelerate_state() -> None:
    """Each scenario configures Accelerate anew (its state is a process-wide singleton)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()  # the process group (PartialState) stays
    GradientState._reset_state()


def accelerate_loop(scenario: str) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate_loop import BigramLM

    sharded = scenario == "accelerate-sharded"
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(gradient_accumulation_steps=MICRO, cpu=True, fsdp_plugin=plugin)
    if scenario == "accelerate-plugin-forced":
        # What AcceleratorState sets on accelerator devices, where its gate (state.py: FSDP for the
        # MULTI_GPU/NPU/... types only) lets the plugin through; the rest is Accelerate's own code:
        # prepare() shards with fsdp2_prepare_model, accumulate() calls set_requires_gradient_sync.
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType

        process_type = PartialState._shared_state["distributed_type"]  # restored below: the process group outlives the scenario
        PartialState._shared_state["distributed_type"] = AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["fsdp_plugin"] = plugin
    torch.manual_seed(0)
    model = BigramLM()
    if sharded:
        fully_shard(model.embed)
        fully_shard(model)  # the root holds the head
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(token_rows(32, seed=1), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    if sharded:
        optimizer, loader = accelerator.prepare(optimizer, loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    wrapped = type(model).__name__
    sink = ddphooks.JsonlSink(OUT / f"{scenario}-stats-rank{RANK}.jsonl")
    state = ddphooks.attach(model, sketch_dim=32, log_rank=None, detail_every=1, sinks=[sink])
    losses, syncs, norms = [], [], []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            if sharded:
                model.set_requires_gradient_sync(accelerator.sync_gradients)
            loss = model(**batch)["loss"]
            losses.append(loss.item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(grad_norm(model))
            optimizer.step()
            optimizer.zero_grad()
            syncs.append(accelerator.sync_gradients)
    state.close()
    kind, is_fsdp2 = str(accelerator.distributed_type), accelerator.is_fsdp2
    if scenario == "accelerate-plugin-forced":
        PartialState._shared_state["distributed_type"] = process_type
    dump(scenario, {
        "wrapped": wrapped, "distributed_type": kind, "is_fsdp2": is_fsdp2,
        "losses": losses, "syncs": syncs, "grad_norms": norms, "state_step": state.step, "alerts": [a["kind"] for a in state.alerts],
    })  # fmt: skip


def tiny_model_dir() -> Path:
    """A tiny Llama saved once (rank 0) for the ranks' from_pretrained."""
    from ddphooks.models import tiny_llama

    path = OUT / "tiny-llama"
    if RANK == 0 and not path.exists():
        tiny_llama(vocab_size=VOCAB, hidden=16, layers=2, heads=2, max_positions=32, seed=0).save_pretrained(path)
    dist.barrier()
    return path


def trainer_run(scenario: str) -> None:
    from hf_train import LossRecorder, common_args
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.distributed import DistributedConfig

    from ddphooks.integrations.transformers import SilentCallback

    class Wrapped(TrainerCallback):
        """What the Trainer wrapped the model in, seen when the callbacks start."""

        def __init__(self) -> None:
            self.seen: dict = {}

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            wrapped = trainer.model_wrapped
            self.seen = {
                "wrapped": type(wrapped).__name__, "fsdp2_root": isinstance(wrapped, FSDPModule),
                "fsdp_modules": [name for name, m in wrapped.named_modules() if isinstance(m, FSDPModule)],
                "is_fsdp_enabled": trainer.is_fsdp_enabled, "distributed_type": str(trainer.accelerator.distributed_type),
            }  # fmt: skip

    native = scenario == "trainer-native"
    path = tiny_model_dir()
    if native:
        model = LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))
        overrides = dict(max_steps=4, save_strategy="steps", save_steps=2, save_only_model=True)
    else:
        model = LlamaForCausalLM.from_pretrained(path)
        overrides = dict(max_steps=4, fsdp=True, fsdp_config={"version": 2})
    recorder = LossRecorder()
    model.register_forward_hook(recorder, with_kwargs=True)
    args = TrainingArguments(**common_args(OUT / scenario, gradient_accumulation_steps=MICRO, learning_rate=1e-2, **overrides))
    wrapped = Wrapped()
    silent = SilentCallback(sketch_dim=32, log_rank=None, detail_every=1)
    callbacks = [silent, wrapped]
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(32, seed=1), callbacks=callbacks)
    trainer.train()
    dump(scenario, {
        "micro_batches": recorder.micro_batches, "log_history": trainer.state.log_history, "global_step": trainer.state.global_step,
        "state": type(silent.state).__name__, "state_step": silent.state.step, **wrapped.seen,
    })  # fmt: skip


def lightning_run(scenario: str) -> None:
    import lightning.pytorch as L
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ddphooks.integrations.lightning import SilentCallback

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
            self.losses: list[float] = []
            self.norms: list[float] = []  # per micro-batch: the norm of its own averaged gradient
            self.previous: torch.Tensor | None = None  # the accumulated gradient before this micro-batch

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def on_before_zero_grad(self, optimizer) -> None:
            self.previous = None

        def on_after_backward(self) -> None:
            # FSDP2 adds each micro-batch's reduced gradient to the sharded .grad: the difference is its own
            full = torch.cat([p.grad.full_tensor().double().flatten() for p in self.net.parameters()])
            self.norms.append(float((full - self.previous).norm() if self.previous is not None else full.norm()))
            self.previous = full

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=generator), torch.randint(0, 4, (64,), generator=generator))
    module = Classifier()
    sink = ddphooks.JsonlSink(OUT / f"{scenario}-stats-rank{RANK}.jsonl")
    callback = SilentCallback(sketch_dim=32, log_rank=None, detail_every=1, sinks=[sink])
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=2, accumulate_grad_batches=MICRO, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=4))
    dump(scenario, {"losses": module.losses, "grad_norms": module.norms, "global_step": trainer.global_step, "state_step": callback.state.step})


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    environ = dict(os.environ)
    for scenario in sys.argv[2:]:
        if scenario.startswith("accelerate"):
            accelerate_loop(scenario)
        elif scenario.startswith("trainer"):
            trainer_run(scenario)
        elif scenario == "lightning":
            lightning_run(scenario)
        else:
            raise ValueError(scenario)
        # Accelerate's FSDP plugin and TrainingArguments(fsdp=...) leave ACCELERATE_USE_FSDP, FSDP_* behind
        os.environ.clear()
        os.environ.update(environ)
        if "accelerate" in sys.modules:
            fresh_accelerate_state()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
