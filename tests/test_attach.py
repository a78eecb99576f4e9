"""attach(), the lazily bound SilentState and resume, on real gloo process groups.

The reference for every captured loss is the loss the training loop itself computed on that rank
(gathered with ``all_gather``), and for the statistics a state built the classic way (after
``init_process_group``, ``observe_loss`` by hand) on an identical model fed the same batches.
"""

import json
import pickle
import re

import pytest
import torch
import torch.distributed as dist
from test_hook import TIMEOUT, _batch, _loss, _make_ddp, _spawn_cases
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import ddphooks
from ddphooks import JsonlSink, SilentState, silent_hook
from ddphooks.launch import spawn


def _gathered(value: float) -> list[float]:
    tensor = torch.tensor([value], dtype=torch.float64)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return [t.item() for t in out]


class _Output:
    """A forward output with a ``.loss`` attribute, as transformers' ModelOutput has."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class _Wrapped(torch.nn.Module):
    """Returns the loss in the form ``kind`` says: a scalar, an object with .loss, or a dict."""

    def __init__(self, net: torch.nn.Module, kind: str) -> None:
        super().__init__()
        self.net = net
        self.kind = kind

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        loss = _loss(self.net, x, y)
        return {"tensor": loss, "attribute": _Output(loss), "mapping": {"loss": loss, "logits": x}}[self.kind]


def _make_ddp_module() -> torch.nn.Module:
    from test_hook import _Net

    return _Net()


def _wrapped_ddp(kind: str) -> torch.nn.parallel.DistributedDataParallel:
    return torch.nn.parallel.DistributedDataParallel(_Wrapped(_make_ddp().module, kind), bucket_cap_mb=0.002)


def _check_attach_captures_the_loss(rank: int, world: int) -> dict:
    return {kind: _captured_losses(rank, kind) for kind in ("tensor", "attribute", "mapping")}


def _captured_losses(rank: int, kind: str) -> list:
    model = _wrapped_ddp(kind)
    state = ddphooks.attach(model, sketch_dim=64)
    results = []
    for step in range(3):
        computed = []
        micro_batches = 2 if step == 1 else 1  # step 1 accumulates two micro-batches under no_sync
        for micro in range(micro_batches):
            x, y = _batch(rank, step, micro)
            context = model.no_sync() if micro < micro_batches - 1 else torch.enable_grad()
            with context:
                output = model(x, y)
                loss = output if kind == "tensor" else (output.loss if kind == "attribute" else output["loss"])
                computed.append(loss.item())
                loss.backward()
        with torch.no_grad():  # an evaluation forward in between must not count
            model.eval()
            model(*_batch(rank, 99))
            model.train()
        model.zero_grad()
        expected = _gathered(sum(computed) / len(computed))
        results.append((state.latest.step, state.latest.losses.tolist(), expected))
    return results


@pytest.fixture(scope="module")
def two_rank_attach() -> dict:
    """The two-rank runs of this file in one spawn, but resume's (which needs a fresh process group
    for its second half): loss capture, the lazily bound state, attach's errors, the missing loss."""
    return _spawn_cases(2, [
        ("captures", _check_attach_captures_the_loss, ()),
        ("lazy_state", _check_lazy_state, (pickle.dumps(_unbound_state()),)),
        ("attach_errors", _check_attach_errors, ()),
        ("no_loss", _check_no_loss_is_said_once, ()),
    ], TIMEOUT)  # fmt: skip


def _unbound_state() -> SilentState:
    state = SilentState(sketch_dim=64)  # no process group in this process
    assert not state.bound and state.latest is None
    return state


def test_attach_records_each_ranks_loss_from_the_forward_output(two_rank_attach):
    by_kind = two_rank_attach["captures"][0]
    for kind, results in by_kind.items():
        assert [step for step, _, _ in results] == [0, 1, 2], kind
        for _, losses, expected in results:
            assert losses == pytest.approx(expected, rel=1e-6), kind


def _check_lazy_state(rank: int, world: int, pickled: bytes) -> tuple:
    lazy = pickle.loads(pickled)  # created and pickled before any process group existed
    assert not lazy.bound
    model = _make_ddp()
    model.register_comm_hook(lazy, silent_hook)  # binds on the first hook call
    classic = _make_ddp()
    state = SilentState(model=classic, sketch_dim=64)
    classic.register_comm_hook(state, silent_hook)
    out = []
    for step in range(3):
        for ddp, st in ((model, lazy), (classic, state)):
            x, y = _batch(rank, step)
            loss = _loss(ddp, x, y)
            st.observe_loss(loss)
            loss.backward()
            ddp.zero_grad()
        a, b = lazy.latest.to_dict(), state.latest.to_dict()
        out.append(all(a[k] == b[k] for k in ("step", "losses", "grad_norms", "cosine", "weighted_mean_cosine", "noise_scale")))
    with pytest.raises(TypeError, match="a bound SilentState .* cannot be pickled"):
        pickle.dumps(lazy)
    return out, lazy.world_size


def test_state_created_and_pickled_before_the_process_group_binds_lazily(two_rank_attach):
    _unbound_state()  # the state the fixture pickled: unbound in this process
    assert two_rank_attach["lazy_state"] == [([True] * 3, 2)] * 2


def test_lazy_state_still_rejects_bad_values_at_once_and_binding_needs_a_group():
    with pytest.raises(ValueError, match=r"every=0 must be >= 1"):
        SilentState(every=0)
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group.*before the SilentState is bound"):
        SilentState().bind()


def _check_attach_errors(rank: int, world: int) -> list[str]:
    messages = []
    for case in ("not_ddp", "twice", "other_hook", "state_and_settings"):
        model = _make_ddp()
        try:
            if case == "not_ddp":
                ddphooks.attach(model.module)
            elif case == "twice":
                ddphooks.attach(model)
                ddphooks.attach(model)
            elif case == "other_hook":
                model.register_comm_hook(None, allreduce_hook)
                ddphooks.attach(model)
            else:
                ddphooks.attach(model, state=SilentState(), every=2)
            messages.append("no error")
        except (TypeError, RuntimeError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    # Registered already with this very state (Lightning's DDPStrategy on CUDA): attach only binds.
    model = _wrapped_ddp("tensor")
    state = SilentState()
    model.register_comm_hook(state, silent_hook)
    assert ddphooks.attach(model, state=state) is state and len(model._comm_hooks) == 1
    x, y = _batch(rank, 0)
    loss = model(x, y)  # captured automatically...
    state.observe_loss(loss * 0 + 10.0 + rank)  # ...but an explicit value wins
    loss.backward()
    messages.append(state.latest.losses.tolist())
    messages.append(sorted(state.latest.parameter_names))  # bound before attach: the names come from attach
    return messages


def test_attach_errors_name_the_problem_and_the_fix(two_rank_attach):
    messages = two_rank_attach["attach_errors"][0]
    expected = [
        r"TypeError: attach needs a DistributedDataParallel module or an FSDP2 \(fully_shard\) root, got _Net: wrap the model first",
        r"RuntimeError: ddphooks is already attached to this model",
        r"RuntimeError: the model already has a communication hook \(allreduce_hook\).*attach\(model, comm_hook=your_hook",
        r"TypeError: attach takes either state= or SilentState settings, not both",
    ]
    for pattern, message in zip(expected, messages):
        assert re.search(pattern, message), message
    assert messages[4] == [10.0, 11.0]
    assert messages[5] == sorted(name for name, _ in _Wrapped(_make_ddp_module(), "tensor").named_parameters())


# -- resume ----------------------------------------------------------------------------------------
def _check_resume_phase(rank: int, world: int, folder: str, saved: dict | None) -> dict:
    """Six steps with two states (every=1 with a JSONL sink, every=3), from ``saved`` if given."""
    model, sparse = _make_ddp(), _make_ddp()
    sink = JsonlSink(f"{folder}/stats.jsonl", header={"run": "resume"}, append=saved is not None)
    state = ddphooks.attach(model, sketch_dim=64, sinks=[sink])
    every3 = ddphooks.attach(sparse, sketch_dim=64, every=3)
    if saved is not None:
        state.load_state_dict(saved["dense"])
        every3.load_state_dict(saved["sparse"])
    seen = []
    for step in range(6):
        for ddp in (model, sparse):
            x, y = _batch(rank, step)
            _loss(ddp, x, y).backward()
            ddp.zero_grad()
        seen.append(every3.latest.step)
    state.close()
    return {"dense": state.state_dict(), "sparse": every3.state_dict(), "seen": seen}


def test_resume_continues_numbering_and_the_every_phase(tmp_path):
    first = spawn(_check_resume_phase, 2, args=(str(tmp_path), None), timeout=TIMEOUT)[0]
    assert first["dense"]["step"] == 6 and first["sparse"]["step"] == 6
    second = spawn(_check_resume_phase, 2, args=(str(tmp_path), first), timeout=TIMEOUT)[0]  # a fresh process group
    assert first["seen"] + second["seen"] == [0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9, 9]
    lines = (tmp_path / "stats.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"header": {"run": "resume"}}  # one header, then the 12 records
    assert [json.loads(line)["step"] for line in lines[1:]] == list(range(12))
    assert second["dense"]["records"]["signal_average"] != first["dense"]["records"]["signal_average"]


def test_load_state_dict_rejects_what_is_not_a_state_dict():
    with pytest.raises(ValueError, match=r"not a SilentState state_dict \(needs a non-negative integer 'step'\)"):
        SilentState().load_state_dict({"step": -1})


def _check_no_loss_is_said_once(rank: int, world: int) -> dict:
    import logging

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("ddphooks").addHandler(handler)
    try:
        said = {}
        for explicit in (False, True):
            messages.clear()
            model = _make_ddp()  # returns logits: nothing to capture
            state = ddphooks.attach(model, sketch_dim=64)
            for step in range(3):
                x, y = _batch(rank, step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                if explicit:
                    state.observe_loss(loss)
                loss.backward()
            state.flush()
            said[explicit] = ([m for m in messages if "no loss was recorded" in m], state.latest.losses)
            state.close()
        return said
    finally:
        logging.getLogger("ddphooks").removeHandler(handler)


def test_a_model_that_returns_logits_is_told_once_how_to_give_its_loss(two_rank_attach):
    assert len(two_rank_attach["no_loss"]) == 2
    for rank, said in enumerate(two_rank_attach["no_loss"]):
        warnings, losses = said[False]
        assert len(warnings) == 1 and losses is None, said  # three steps, one warning
        assert f"step 0 on rank {rank}" in warnings[0] and "loss_from=" in warnings[0] and "state.observe_loss(loss)" in warnings[0]
        assert "the forward output was a float32 tensor of shape (32, 8), requires grad (not a 0-dim loss" in warnings[0]
        warnings, losses = said[True]
        assert warnings == [] and len(losses) == 2  # observe_loss gives it: nothing to say
