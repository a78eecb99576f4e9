"""DeepSpeed through the HF Trainer and Accelerate with ddphooks, for tests/test_deepspeed.py.

Usage: ``torchrun --standalone --nproc-per-node 2 deepspeed_train.py OUT SCENARIO [SCENARIO ...]`` (``accelerate``
in a launch of its own: Accelerate takes one DeepSpeed plugin per process, the Trainer's is first).

- ``trainer``: ``Trainer`` with ``TrainingArguments(deepspeed=<ZeRO-2 dict>)``, a tiny Llama on
  random tokens, batch 2 per rank, gradient accumulation 2, 3 steps, logging every step and
  ``SilentCallback(sketch_dim=32)``; records in ``OUT/trainer/ddphooks/stats.jsonl``.
- ``trainer-json``: the same with ZeRO-3 given as a JSON file path, gradient accumulation 1.
- ``accelerate``: an Accelerate loop with ``DeepSpeedPlugin(zero_stage=3)`` on the bigram model
  of ``accelerate_loop.py``, ``ddphooks.attach(accelerator.prepare(model))``, gradient
  accumulation 2, 3 steps. Accelerate gates DeepSpeed to accelerators (on the CPU it finds no
  distributed backend unless ``cpu=True``, which turns the plugin off): the gate is opened here
  (see ``accelerate``), the rest is Accelerate's own DeepSpeed path on DeepSpeed's CPU accelerator
  and gloo.

Each scenario writes ``OUT/<scenario>-rank<r>.json`` with ``log_history`` (Trainer) or the loop's
``losses`` and ``grad_norms`` (Accelerate: ``engine.get_global_grad_norm()`` after each step).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}}, "zero_allow_untested_optimizer": True,
        "gradient_clipping": "auto", "steps_per_print": 10**9}  # fmt: skip


def trainer(out: Path, scenario: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from ddphooks.integrations.transformers import SilentCallback
    from ddphooks.models import tiny_llama
    from token_data import VOCAB, token_rows

    stage, accumulation = (2, 2) if scenario == "trainer" else (3, 1)
    config = {**ZERO, "zero_optimization": {"stage": stage}}
    if scenario == "trainer-json":
        path = out / "ds_config.json"
        if int(os.environ["RANK"]) == 0:
            path.write_text(json.dumps(config))
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
        config = str(path)
    args = TrainingArguments(
        output_dir=str(out / scenario), per_device_train_batch_size=2, gradient_accumulation_steps=accumulation, learning_rate=1e-3,
        max_steps=3, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_cpu=True,
        dataloader_num_workers=0, deepspeed=config,
    )  # fmt: skip
    model = tiny_llama(vocab_size=VOCAB, hidden=32, layers=2, heads=2, max_positions=64, seed=0)
    run = Trainer(model=model, args=args, train_dataset=token_rows(48, seed=1), callbacks=[SilentCallback(sketch_dim=32)])
    run.train()
    callback = next(c for c in run.callback_handler.callbacks if isinstance(c, SilentCallback))
    return {"log_history": run.state.log_history, "state": type(callback.state).__name__, "engine": type(run.model_wrapped).__name__}


def accelerate(out: Path) -> dict:
    from accelerate import Accelerator, DeepSpeedPlugin
    from torch.utils.data import DataLoader

    import ddphooks
    from accelerate_loop import BigramLM
    from token_data import token_rows

    plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=2)
    plugin.deepspeed_config["zero_allow_untested_optimizer"] = True  # a client torch optimizer
    world = int(os.environ["WORLD_SIZE"])
    plugin.deepspeed_config.update(train_micro_batch_size_per_gpu=2, train_batch_size=2 * 2 * world)
    # Accelerate's gate (state.py, PartialState._prepare_backend): on a machine without accelerators
    # it finds no distributed backend unless cpu=True, and cpu=True turns the DeepSpeed plugin off.
    # Opened here: where it finds none, the answer it gives with cpu=True (gloo, MULTI_CPU); the rest
    # is Accelerate's own DeepSpeed path (deepspeed.init_distributed, distributed type DEEPSPEED,
    # the loader sharded over the ranks, accelerator.backward -> engine.backward and engine.step).
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    find_backend = PartialState._prepare_backend

    def opened(self, cpu=False, sagemaker_dp=False, backend=None):
        found = find_backend(self, cpu, sagemaker_dp, backend)
        return ("gloo", DistributedType.MULTI_CPU) if found[1] == DistributedType.NO else found

    PartialState._prepare_backend = opened
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = BigramLM()
    loader = DataLoader(token_rows(24, seed=1), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    engine, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    state = ddphooks.attach(engine, sketch_dim=32, sinks=[ddphooks.JsonlSink(out / "accelerate.jsonl")])
    losses, norms = [], []
    for batch in loader:
        with accelerator.accumulate(engine):
            loss = engine(**batch)["loss"]
            losses.append(loss.item())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                norms.append(float(engine.get_global_grad_norm()))
        if len(norms) == 3:
            break
    state.close()
    return {"losses": losses, "grad_norms": norms, "engine": type(engine).__name__, "state": type(state).__name__, "num_processes": accelerator.num_processes}


def main() -> None:
    torch.set_num_threads(1)
    import importlib

    # Its CPU backend compiles a shared-memory all-reduce op for inference (a minute of g++ on a
    # fresh machine); ZeRO's training never uses it. (The module: the attribute
    # deepspeed.comm.torch is the torch package.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    out = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        result = accelerate(out) if scenario == "accelerate" else trainer(out, scenario)
        rank = int(os.environ.get("RANK", 0))
        (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
