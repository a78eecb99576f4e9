"""An Accelerate training loop with ddphooks, for tests/test_integration_accelerate.py.

Usage: ``torchrun --standalone --nproc-per-node 2 accelerate_loop.py OUT``

A bigram language model in plain torch (no transformers import: a faster launch) on random
tokens with per-example label masks, batch 2 per rank, gradient accumulation over 2 micro-batches
with ``accelerator.accumulate``, 4 optimizer steps. Its forward returns ``{"loss": ...}``, the
mean token loss, as Hugging Face models do; ``ddphooks.attach`` on the prepared (DDP) model
records each training forward's loss; records go to ``OUT/stats.jsonl``. Each rank writes
``OUT/rank<r>.json``: ``losses``, the loss of every micro-batch as the loop itself saw it
(``.item()`` of the loss it calls backward on), and ``syncs``, ``accelerator.sync_gradients``
after each micro-batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

import ddphooks
from token_data import VOCAB, token_rows

EXAMPLES = 32


class BigramLM(torch.nn.Module):
    """Next-token logits from the current token only; the loss is the mean over unmasked labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.head(self.embed(input_ids))[:, :-1]
        return {"loss": F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)}


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = BigramLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(token_rows(EXAMPLES, seed=1), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = ddphooks.attach(model, sketch_dim=32, sinks=[ddphooks.JsonlSink(out / "stats.jsonl")])

    losses, syncs = [], []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch)["loss"]
            losses.append(loss.item())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            syncs.append(accelerator.sync_gradients)
    state.close()
    result = {"losses": losses, "syncs": syncs, "world_size": accelerator.num_processes, "alerts": [a["kind"] for a in state.alerts]}
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    # Tear the group down before the interpreter exits: left to exit, its threads sometimes
    # abort the process ("terminate called without an active exception", seen once in CI).
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
