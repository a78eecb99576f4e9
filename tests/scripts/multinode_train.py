"""Plain DDP + ``ddphooks.attach`` under a multi-node torchrun, for tests/test_multinode.py.

``python multinode_train.py OUT STEPS``, launched by torchrun (one launch per "node"). Every
rank trains a small MLP on its own data for STEPS steps and writes ``OUT/losses-rank<r>.json``
(``{"losses": [...], "world_size", "local_rank", "group_rank"}``): the losses its forward
computed, one per step (the model returns its loss, so ``attach`` records it). Rank 0
writes the ddphooks records to ``OUT/stats.jsonl``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddphooks


class Regressor(torch.nn.Module):
    """Returns its loss when given targets, as Hugging Face models do: attach records it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x, target=None):
        prediction = self.net(x)
        return prediction if target is None else torch.nn.functional.mse_loss(prediction, target)


out, steps = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()

torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts it)
model = DistributedDataParallel(Regressor())
state = ddphooks.attach(model, sketch_dim=32, sinks=[ddphooks.JsonlSink(out / "stats.jsonl")])
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
losses = []
for _ in range(steps):
    x = torch.randn(16, 8, generator=data)
    y = x.sum(dim=1, keepdim=True) * (1.0 + rank)  # rank-dependent targets: the losses differ
    loss = model(x, target=y)
    losses.append(loss.item())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

state.close()
info = {
    "losses": losses,
    "world_size": dist.get_world_size(),
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "group_rank": int(os.environ["GROUP_RANK"]),
}
(out / f"losses-rank{rank}.json").write_text(json.dumps(info))
dist.barrier()
# Release everything that holds the process group (DDP's reducer, the state) while the interpreter
# is alive: a gloo group destroyed only at interpreter exit can abort it (torch's worker threads
# still hold work whose tensors need the GIL), "terminate called without an active exception".
del model, state, optimizer, loss
gc.collect()
dist.destroy_process_group()
