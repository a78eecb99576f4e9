"""The replica check compares only what the wrapper keeps identical (``ddphooks.replicas``).

A CNN with BatchNorm (running statistics that move with each rank's batch) and a constant mask
buffer trains under DDP with ``broadcast_buffers`` on and off and under FSDP2: healthy runs raise
no replica alert at any check, and a rank whose parameters drift is still named.
"""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from test_hook import _spawn_cases

import ddphooks
from ddphooks.launch import spawn
from ddphooks.replicas import ReplicaTensors

TIMEOUT = 180
STEPS = 6
BATCHNORM_BUFFERS = {"norm.running_mean", "norm.running_var", "norm.num_batches_tracked"}


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)
        self.register_buffer("mask", (torch.arange(8) % 2).float())  # a constant buffer: compared

    def forward(self, x):
        features = torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)) * (1 + self.mask)
        return self.head(features)


def _train(rank: int, model: torch.nn.Module, drift_rank: int | None) -> tuple[list, list]:
    state = ddphooks.attach(model, check_replicas_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    replicas = []
    for step in range(STEPS):
        x = torch.randn(8, 3, 6, 6, generator=generator) * (1 + rank)
        y = torch.randint(0, 4, (8,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == drift_rank and step == 2:
            with torch.no_grad():
                head = model.module.head if isinstance(model, DDP) else model.head
                head.weight.add_(1e-3)  # this replica's parameters now differ
        replicas.append(state.latest.replicas)
    state.close()
    return [(a["step"], a["rank"], a["kind"]) for a in state.alerts], replicas


def _check_ddp(rank: int, world: int, broadcast: bool, drift_rank: int | None) -> tuple[list, list]:
    torch.manual_seed(0)
    return _train(rank, DDP(_ConvNet(), broadcast_buffers=broadcast), drift_rank)


def _check_fsdp2(rank: int, world: int) -> tuple[list, list]:
    # Imported here: torch.distributed.fsdp takes most of a second to import, in every worker.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _ConvNet()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return _train(rank, model, None)


def _ddp_runs(world: int, drift_rank: int | None) -> dict:
    """``_check_ddp`` with broadcast_buffers on and off, in one spawn; keyed by broadcast."""
    results = _spawn_cases(world, [(f"broadcast={broadcast}", _check_ddp, (broadcast, drift_rank)) for broadcast in (True, False)], TIMEOUT)
    return {broadcast: results[f"broadcast={broadcast}"] for broadcast in (True, False)}


@pytest.fixture(scope="module")
def healthy_ddp_runs() -> dict:
    return _ddp_runs(2, None)


@pytest.fixture(scope="module")
def drifting_ddp_runs() -> dict:
    return _ddp_runs(3, 1)


@pytest.mark.parametrize("broadcast", [True, False])
def test_batchnorm_under_ddp_raises_no_replica_alert(healthy_ddp_runs, broadcast):
    results = healthy_ddp_runs[broadcast]
    assert len(results) == 2, broadcast
    for alerts, replicas in results:
        assert [a for a in alerts if a[2] == "replica"] == []
        assert all(r["ranks"] == [] and r["tensors"] == 0 for r in replicas), replicas
        # broadcast: every buffer compared as DDP broadcast it; otherwise the running statistics are left out
        assert {r["not_compared"] for r in replicas} == {0 if broadcast else len(BATCHNORM_BUFFERS)}


def test_batchnorm_under_fsdp2_raises_no_replica_alert():
    for alerts, replicas in spawn(_check_fsdp2, 2, timeout=TIMEOUT):
        assert [a for a in alerts if a[2] == "replica"] == []
        assert all(r["ranks"] == [] and r["not_compared"] == len(BATCHNORM_BUFFERS) for r in replicas), replicas


@pytest.mark.parametrize("broadcast", [True, False])
def test_a_drifting_replica_is_still_named_beside_batchnorm(drifting_ddp_runs, broadcast):
    alerts, replicas = drifting_ddp_runs[broadcast][0]
    assert all(r["ranks"] == [] for r in replicas[:3])
    assert replicas[3]["ranks"] == [1] and {p["name"] for p in replicas[3]["parameters"]} >= {"head.weight"}
    assert ("replica" in {kind for _, _, kind in alerts}) and {rank for _, rank, kind in alerts if kind == "replica"} == {1}


def _compared(replicas: ReplicaTensors, step: int) -> dict[str, bool]:
    """Per fingerprinted tensor: whether this rank's fingerprint is comparable on ``step``."""
    rows = replicas.fingerprint(step).view(-1, 2)
    return {name: bool((row >= 0).all()) for name, row in zip(replicas.names, rows)}


def test_buffers_that_moved_on_a_rank_are_marked_not_compared():
    module = _ConvNet()
    replicas = ReplicaTensors(list(module.named_parameters()), module, broadcast_buffers=False)
    assert set(replicas.names) == {n for n, _ in module.named_parameters()} | BATCHNORM_BUFFERS | {"mask"}
    assert all(_compared(replicas, 0).values())  # nothing ran: every tensor as at binding
    module(torch.randn(2, 3, 4, 4))  # a training forward moves the running statistics
    moved = {name for name, ok in _compared(replicas, 1).items() if not ok}
    assert moved == BATCHNORM_BUFFERS
    # nothing moved since, but the statistics are this rank's own from now on
    assert {name for name, ok in _compared(replicas, 2).items() if not ok} == BATCHNORM_BUFFERS
    module.mask = torch.ones(8)  # a buffer replaced by other values
    assert {name for name, ok in _compared(replicas, 3).items() if not ok} == BATCHNORM_BUFFERS | {"mask"}
    del module.mask  # a buffer the module no longer has
    assert not _compared(replicas, 4)["mask"]


def test_buffers_captured_after_a_broadcast_are_compared_even_when_the_forward_moved_them():
    module = _ConvNet()
    replicas = ReplicaTensors([], module, broadcast_buffers=True)
    replicas.capture_broadcast(5)
    module(torch.randn(2, 3, 4, 4))
    assert all(_compared(replicas, 5).values())  # as broadcast, before the forward moved them
    module(torch.randn(2, 3, 4, 4))
    # step 6 had no capture (no forward through the wrapper): what moved since the broadcast is left out
    assert {name for name, ok in _compared(replicas, 6).items() if not ok} == BATCHNORM_BUFFERS
    assert all(_compared(replicas, 7).values())  # not for good: the next broadcast makes them identical again


def _check_capture_failure(rank: int, world: int) -> tuple[list, list]:
    """A failing broadcast capture never reaches the forward: the step falls back to the buffers
    that did not move, and says so."""
    import logging

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("ddphooks").addHandler(handler)

    def broken(self, step):
        raise RuntimeError("capture failed")

    ReplicaTensors.capture_broadcast = broken
    torch.manual_seed(0)
    alerts, replicas = _train(rank, DDP(_ConvNet()), None)
    return alerts, replicas, [m for m in messages if "could not fingerprint the broadcast buffers" in m]


def test_a_failing_broadcast_capture_never_raises_into_the_forward():
    alerts, replicas, messages = spawn(_check_capture_failure, 2, timeout=TIMEOUT)[0]
    assert [a for a in alerts if a[2] == "replica"] == [] and len(replicas) == STEPS
    assert all(r["not_compared"] == len(BATCHNORM_BUFFERS) for r in replicas[1:]), replicas
    assert messages and "capture failed" in messages[0]
