"""Hugging Face Trainer / TRL SFTTrainer runs with SilentCallback, for tests/test_integration_transformers.py.

Usage: ``torchrun --standalone --nproc-per-node 2 hf_train.py OUT SCENARIO [SCENARIO ...]``
(``python hf_train.py OUT single single-plain`` for the one-process runs). Scenarios, run in order in one process:

- ``trainer-first``: ``Trainer``, causal LM on random tokens with per-example label masks, batch 2
  per rank, gradient accumulation 2, evaluation every 2 steps, a checkpoint every 3 steps,
  logging every step, TensorBoard reporting; interrupted after optimizer step 4 (of max_steps=6),
  one step after its last checkpoint.
- ``trainer-resume``: the same run resumed from its last checkpoint (step 3), trained to step 6.
- ``sft``: TRL ``SFTTrainer`` on prompt/completion text with an offline word-level tokenizer,
  gradient accumulation 2, 4 steps, logging every 2 steps.
- ``trainer-stop``: ``Trainer`` with ``SilentCallback(check_replicas_every=1, stop_on_alert=True)``, up
  to 10 steps, no checkpoints planned; after step 2 rank 1 shifts one weight (its replica
  diverges), so the replica check alerts and training must stop early, with a checkpoint, on both ranks.
- ``single``: ``Trainer`` in one process (no DDP), 2 steps; ``single-plain``: the same without SilentCallback.

Each scenario writes ``OUT/<scenario>-rank<r>.json``: ``micro_batches``, every forward of the
inner model with labels, as this script computes its loss itself from the logits (or, under the
SFTTrainer's fused LM head, the per-token log-probabilities) and the labels: ``training``,
``grad``, ``loss`` (the rank's own mean token loss), ``tokens``; and ``log_history``,
``global_step``, ``world_size``. The Trainer output folder is ``OUT/trainer`` (shared by the two
trainer scenarios), ``OUT/stop``, ``OUT/sft``, ``OUT/single`` and ``OUT/single-plain``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments

from ddphooks.integrations.transformers import SilentCallback
from ddphooks.models import tiny_llama
from token_data import VOCAB, token_rows

WORDS = [f"w{i}" for i in range(VOCAB - 3)]  # the word-level tokenizer's vocabulary, after 3 specials


class LossRecorder:
    """Forward hook (with kwargs) on the inner model: each forward's own mean token loss, computed here."""

    def __init__(self) -> None:
        self.micro_batches: list[dict] = []

    def __call__(self, module, args, kwargs, output) -> None:
        labels = kwargs.get("labels")
        if labels is None:
            return
        with torch.no_grad():
            target = labels[:, 1:]
            mask = target != -100
            tokens = int(mask.sum())
            if getattr(output, "logits", None) is not None:
                logits = output.logits[:, :-1].double()
                total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100, reduction="sum")
            else:  # TRL's fused LM head returns log-probabilities of the next-token labels instead of logits
                total = -(output.log_probs.double() * mask).sum()
        loss = float(total) / tokens if tokens else math.nan
        self.micro_batches.append({"training": module.training, "grad": torch.is_grad_enabled(), "loss": loss, "tokens": tokens})


class StopAfter(TrainerCallback):
    """Ends training after optimizer step ``step`` (an interrupted run; the checkpoint is taken first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class DivergeAfter(TrainerCallback):
    """Shifts one weight on rank 1 after optimizer step ``step``: its replica silently diverges."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step and args.process_index == 1:
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)


def small_model():
    return tiny_llama(vocab_size=VOCAB, hidden=32, layers=2, heads=2, max_positions=64, seed=0)


def common_args(output_dir: Path, **overrides) -> dict:
    args = dict(
        output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_cpu=True,
        dataloader_num_workers=0, ddp_find_unused_parameters=False,
    )  # fmt: skip
    args.update(overrides)
    return args


def run_trainer(out: Path, scenario: str) -> tuple[Trainer, LossRecorder]:
    single = scenario.startswith("single")
    model = small_model()
    recorder = LossRecorder()
    model.register_forward_hook(recorder, with_kwargs=True)
    if single:
        args = TrainingArguments(**common_args(out / scenario, max_steps=2))
        callbacks = [SilentCallback(sketch_dim=32)] if scenario == "single" else []
    elif scenario == "trainer-stop":
        args = TrainingArguments(**common_args(out / "stop", max_steps=10, gradient_accumulation_steps=1, logging_steps=100))
        callbacks = [SilentCallback(sketch_dim=32, check_replicas_every=1, stop_on_alert=True), DivergeAfter(2)]
    else:
        args = TrainingArguments(
            **common_args(
                out / "trainer", max_steps=6, per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=2,
                save_strategy="steps", save_steps=3, report_to=["tensorboard"],
            )
        )  # fmt: skip
        callbacks = [SilentCallback(sketch_dim=32)] + ([StopAfter(4)] if scenario == "trainer-first" else [])
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(48, seed=1), eval_dataset=token_rows(8, seed=2), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=scenario == "trainer-resume")
    return trainer, recorder


def word_tokenizer():
    """A word-level tokenizer built in memory (no download, no training)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def run_sft(out: Path) -> tuple[Trainer, LossRecorder]:
    import random

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rng = random.Random(3)
    rows = [
        {"prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 8))), "completion": " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 9)))}
        for _ in range(32)
    ]
    tokenizer = word_tokenizer()
    model = small_model()
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    recorder = LossRecorder()
    model.register_forward_hook(recorder, with_kwargs=True)
    args = SFTConfig(**common_args(out / "sft", max_steps=4, logging_steps=2, max_length=24))
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[SilentCallback(sketch_dim=32)]
    )
    trainer.train()
    return trainer, recorder


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    for scenario in sys.argv[2:]:
        trainer, recorder = run_sft(out) if scenario == "sft" else run_trainer(out, scenario)
        rank = int(os.environ.get("RANK", "0"))
        result = {
            "micro_batches": recorder.micro_batches,
            "log_history": trainer.state.log_history,
            "global_step": trainer.state.global_step,
            "world_size": trainer.args.world_size,
        }
        (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
