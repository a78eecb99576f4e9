"""The synchronisation watchdog on real gloo process groups: the ways DDP silently stops
synchronising are named within two optimizer steps, the usual ways of not synchronising on
purpose never are.

Every scenario runs in one spawn (one process group, a fresh DDP model each): the faults, then the
negative controls. A scenario returns the loop step at which each rank's ``state.alerts`` first
held an ``unsynchronised`` alert (None if never), the alerts' kinds, and whether the replicas
still agree at the end (the reference: the faults that stop synchronisation make them drift).
"""

import logging
import socket

import pytest
import torch
import torch.distributed as dist
from test_hook import BUCKET_CAP_MB, TIMEOUT, _batch, _loss, _make_ddp
from torch.nn.parallel import DistributedDataParallel as DDP

import ddphooks
from ddphooks.launch import spawn

STEPS = 8
FAULT_STEP = 4
LR_STEP = 30  # after the detector's warm-up


def _replicas_agree(module: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def _train(rank: int, scenario: str, steps: int = STEPS) -> dict:
    """Train ``steps`` steps of the test MLP under ``scenario``; see the module docstring."""
    unused = scenario == "find_unused"
    kwargs = {"static_graph": True} if scenario == "static_graph" else ({"find_unused_parameters": True} if unused else {})
    if scenario == "frozen":  # the first layer frozen before wrapping (the sentinel is a later one)
        module = _make_ddp().module
        for p in module.inp.parameters():
            p.requires_grad_(False)
        model = DDP(module, bucket_cap_mb=BUCKET_CAP_MB)
    else:
        model = _make_ddp(unused=unused, **kwargs)
    settings = {"every": 3} if scenario == "every" else {}
    state = ddphooks.attach(model, sketch_dim=64, check_replicas_every=0 if scenario != "resume" else 1000, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    forward_module, first_alert, notes = model, None, []
    handler = _ListHandler(notes)
    logging.getLogger("ddphooks").addHandler(handler)
    try:
        for step in range(steps):
            if scenario == "lr_everywhere" and step == LR_STEP:
                for group in optimizer.param_groups:
                    group["lr"] *= 10  # a change every rank shares: nothing names one rank
            if step == FAULT_STEP and scenario == "converted":
                model.module.double()  # PyTorch issue 104336: DDP's autograd hooks are lost
                model.module.float()
            if scenario in ("unwrapped", "resume") and step == FAULT_STEP:
                forward_module = model.module
            if scenario == "resume" and step == FAULT_STEP + 2:
                forward_module = model  # synchronisation resumes
            if scenario == "second_wrapper" and step == FAULT_STEP:
                forward_module = DDP(model.module)  # a second wrapper: it synchronises, ddphooks sees nothing
            micro_batches = 3 if scenario in ("no_sync", "no_sync_outside") else 1
            for micro in range(micro_batches):
                last = micro == micro_batches - 1
                x, y = _batch(rank, step, micro)
                if scenario == "checkpoint":
                    loss = _checkpointed_loss(model, x, y)
                elif scenario == "no_sync_outside" and not last:
                    with model.no_sync():  # forward inside no_sync, backward outside: DDP does not synchronise
                        loss = _loss(forward_module, x, y)
                    loss.backward()
                    continue
                else:
                    context = model.no_sync() if not last else torch.enable_grad()
                    with context:
                        loss = _loss(forward_module, x, y)
                        loss.backward()
                    continue
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if scenario == "eval":
                model.eval()
                with torch.no_grad():
                    _loss(model, *_batch(rank, 100 + step))
                _loss(model, *_batch(rank, 200 + step))  # grad enabled, no backward
                model.train()
            if first_alert is None and any(a["kind"] == "unsynchronised" for a in state.alerts):
                first_alert = step
        state.flush()
        if first_alert is None and any(a["kind"] == "unsynchronised" for a in state.alerts):
            first_alert = steps
        state.close()
    finally:
        logging.getLogger("ddphooks").removeHandler(handler)
    return {
        "first_alert": first_alert,
        "alerts": [(a["kind"], a["rank"], a["step"]) for a in state.alerts],
        "messages": [a["message"] for a in state.alerts],
        "notes": notes,
        "replicas_agree": _replicas_agree(model.module),
        "unsynchronised": state._watchdog.unsynchronised,
    }


def _checkpointed_loss(model: DDP, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A forward whose first layer (the watchdog's sentinel) runs under reentrant activation
    checkpointing, so its gradient comes from a nested backward, through the DDP module."""
    net = model.module
    original = net.inp.forward
    net.inp.forward = lambda h: torch.utils.checkpoint.checkpoint(original, h.requires_grad_(), use_reentrant=True)
    try:
        return _loss(model, x, y)
    finally:
        del net.inp.forward


class _ListHandler(logging.Handler):
    def __init__(self, messages: list) -> None:
        super().__init__()
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


FAULTS = ("converted", "unwrapped", "second_wrapper", "resume")
CONTROLS = ("plain", "no_sync", "no_sync_outside", "every", "static_graph", "find_unused", "frozen", "eval", "checkpoint")


def _check_watchdog(rank: int, world: int) -> dict:
    results = {scenario: _train(rank, scenario) for scenario in FAULTS + CONTROLS}
    results["lr_everywhere"] = _train(rank, "lr_everywhere", steps=2 * LR_STEP)
    return results


@pytest.fixture(scope="module")
def watched():
    return spawn(_check_watchdog, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("scenario", ["converted", "unwrapped", "second_wrapper"])
def test_ddp_that_stops_synchronising_is_named_within_two_steps(watched, scenario):
    for rank, results in enumerate(watched):
        result = results[scenario]
        assert result["first_alert"] is not None and result["first_alert"] <= FAULT_STEP + 1, (rank, result)
        unsynchronised = [a for a in result["alerts"] if a[0] == "unsynchronised"]
        assert unsynchronised == [("unsynchronised", rank, FAULT_STEP)], result  # one alert per episode, naming this rank
        assert result["unsynchronised"] == STEPS - FAULT_STEP  # every later backward was judged unsynchronised
        message = result["messages"][0]
        assert "DistributedDataParallel never communicated them" in message and "model.module(...)" in message
    # One warning on the log rank's "ddphooks" logger, none on the others.
    assert [m for m in watched[0][scenario]["notes"] if m.startswith(f"ddphooks alert: global rank 0 on {socket.gethostname()}, cpu: check a conversion of the module after wrapping first: rank 0: the model received gradients")]
    assert not [m for m in watched[1][scenario]["notes"] if "received gradients" in m]
    # The reference: where no DDP synchronises, the replicas drift apart; the second wrapper
    # still synchronises, only ddphooks no longer sees it.
    assert watched[0][scenario]["replicas_agree"] is (scenario == "second_wrapper")


def test_resumed_synchronisation_is_noted_and_the_replicas_checked(watched):
    for rank, results in enumerate(watched):
        result = results["resume"]
        kinds = [a[:2] for a in result["alerts"]]
        # The unsynchronised steps made the replicas drift: the synchronised steps after them check
        # them (check_replicas_every=1000 would not have until step 1000) and names both ranks.
        assert kinds[0] == ("unsynchronised", rank) and {k for k, _ in kinds[1:]} == {"replica"}, result
        assert result["unsynchronised"] == 2
    assert any("DDP synchronises again at step 4, after 2 unsynchronised backward pass(es)" in n for n in watched[0]["resume"]["notes"])


@pytest.mark.parametrize("scenario", CONTROLS + ("lr_everywhere",))
def test_no_alert_where_ddp_does_not_synchronise_on_purpose(watched, scenario):
    for results in watched:
        result = results[scenario]
        assert result["alerts"] == [] and result["unsynchronised"] == 0, result
        assert result["replicas_agree"]
