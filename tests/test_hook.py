"""silent_hook on real gloo process groups, checked against the slow obvious reference.

Each ``_check_*(rank, world, ...)`` function runs on every rank of a fresh process group (through
``ddphooks.launch.spawn``). The reference: every rank computes its local gradient with a plain
``autograd.grad`` on the unwrapped module, the full flattened gradients are ``all_gather``-ed, and
losses, norms, per-bucket and per-parameter norms, the weighted mean cosine and the cosine matrix
are computed directly from them in float64.
"""

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddphooks import JsonlSink, SilentState, attach, silent_hook
from ddphooks.launch import WorkerError, spawn

BUCKET_CAP_MB = 0.002  # about 500 fp32 elements per bucket: three buckets in the small model
RTOL = 1e-5
COSINE_ATOL = 1e-6
TIMEOUT = 240


def _check_cases(rank: int, world: int, cases: list[tuple[str, Callable, tuple]]) -> dict:
    """Several cases in one process group: one spawn instead of one per case (each costs seconds of
    process start-up). Each ``check(rank, world, *args)`` runs in turn and builds its own models,
    states and files; returns each case's result by name. A case that raises ends the run with
    the case and the rank named (every rank's traceback comes back through ``spawn``)."""
    results = {}
    for name, check, args in cases:
        try:
            results[name] = check(rank, world, *args)
        except Exception as error:
            raise AssertionError(f"case {name!r} failed on rank {rank}: {type(error).__name__}: {error}") from error
    return results


def _spawn_cases(world: int, cases: list[tuple[str, Callable, tuple]], timeout: float = TIMEOUT) -> dict:
    """``_check_cases`` on ``world`` ranks, ``timeout`` per case; returns, per case name, the
    results of every rank (indexed by rank)."""
    by_rank = spawn(_check_cases, world, args=(cases,), timeout=timeout * len(cases))
    return {name: [results[name] for results in by_rank] for name, _, _ in cases}


class _Messages(logging.Handler):
    """The warnings on the "ddphooks" logger."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        logging.getLogger("ddphooks").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _Net(torch.nn.Module):
    """A small MLP (about 6000 parameters) with an optional branch that never runs."""

    def __init__(self, unused_branch: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 48)
        self.hidden = torch.nn.Linear(48, 64)
        self.out = torch.nn.Linear(64, 8)
        self.unused = torch.nn.Linear(8, 8) if unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def _make_ddp(seed: int = 0, dtype: torch.dtype = torch.float32, unused: bool = False, **ddp_kwargs) -> DDP:
    torch.manual_seed(seed)
    module = _Net(unused_branch=unused).to(dtype)
    return DDP(module, bucket_cap_mb=BUCKET_CAP_MB, **ddp_kwargs)


def _batch(rank: int, step: int, micro: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank (and a rank-dependent shift, so gradients really differ)."""
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank + micro)
    x = torch.randn(32, 16, generator=generator) + 0.3 * rank
    y = torch.randn(32, 8, generator=generator)
    return x.to(dtype), y.to(dtype)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _reference(module: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Statistics of one step computed the slow way from all-gathered full local gradients."""
    params = [p for p in module.parameters() if p.requires_grad]
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    grads = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    losses = []
    for x, y in batches:
        loss = _loss(module, x, y)
        losses.append(loss.item())
        for total, g in zip(grads, torch.autograd.grad(loss, params, allow_unused=True)):
            if g is not None:
                total += g.double()
    flat = torch.cat([g.reshape(-1) for g in grads])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    full = torch.stack(gathered)  # W x D, float64
    loss_tensor = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
    all_losses = [torch.empty_like(loss_tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(all_losses, loss_tensor)
    gram = full @ full.T
    norms = gram.diag().sqrt()
    world = full.shape[0]
    off = ~torch.eye(world, dtype=torch.bool)
    per_param, offset = {}, 0
    for name, p in zip(names, params):
        per_param[name] = full[:, offset : offset + p.numel()]
        offset += p.numel()
    return {
        "losses": torch.cat(all_losses).tolist(),
        "grad_norms": norms.tolist(),
        "cosine": (gram / torch.outer(norms, norms)).tolist(),
        "weighted_mean_cosine": (gram[off].sum() / torch.outer(norms, norms)[off].sum()).item(),
        "param_norms": {n: g.norm(dim=1).tolist() for n, g in per_param.items()},
        "param_gradients": per_param,
        "full": full,
    }


def _weighted_cosine(gradients: torch.Tensor) -> float:
    gram = gradients @ gradients.T
    norms = gram.diag().sqrt()
    off = ~torch.eye(gram.shape[0], dtype=torch.bool)
    return (gram[off].sum() / torch.outer(norms, norms)[off].sum()).item()


def _compare(record: dict, ref: dict, sketch_dim: int, previous: dict | None = None) -> None:
    def close(got, expected, atol: float = 0.0) -> None:
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), rtol=RTOL, atol=atol)

    # The identity W^2|gbar|^2 - sum|g_i|^2 subtracts terms of the size of the norms, so a cosine
    # near zero carries an absolute error of ~1e-7 (fp32 norms); cosines get atol=COSINE_ATOL.
    cosine_close = lambda got, expected: close(got, expected, COSINE_ATOL)
    close(record["losses"], ref["losses"])
    close(record["grad_norms"], ref["grad_norms"])
    cosine_close(record["weighted_mean_cosine"], ref["weighted_mean_cosine"])
    by_name = {p["name"]: p for p in record["parameters"]}
    assert set(by_name) == set(ref["param_norms"])
    for name, norms in ref["param_norms"].items():
        close(by_name[name]["grad_norms"], norms)
        if min(norms) > 0:
            cosine_close(by_name[name]["weighted_mean_cosine"], _weighted_cosine(ref["param_gradients"][name]))
    for bucket in record["buckets"]:
        gradients = torch.cat([ref["param_gradients"][name] for name in bucket["parameters"]], dim=1)
        close(bucket["grad_norms"], gradients.norm(dim=1).tolist())
        cosine_close(bucket["weighted_mean_cosine"], _weighted_cosine(gradients))
    if sketch_dim:
        # A single draw of the sketch: |error| <= 4 / sqrt(sketch_dim) (four standard deviations).
        error = (torch.tensor(record["cosine"]) - torch.tensor(ref["cosine"])).abs().max().item()
        assert error <= 4 / math.sqrt(sketch_dim), f"sketched cosine off by {error}"
        assert record["cosine"][0][0] == 1.0
        if previous is not None:  # each rank's gradient against its own of the step before
            exact = torch.nn.functional.cosine_similarity(ref["full"], previous["full"], dim=1)
            error = (torch.tensor(record["cosine_previous"], dtype=torch.float64) - exact).abs().max().item()
            assert error <= 4 / math.sqrt(sketch_dim), f"sketched cosine to the previous step off by {error}"
    else:
        assert record["cosine"] is None and record["mean_cosine"] is None


def _check_reference(rank: int, world: int, sketch_dim: int, steps: int, ddp_kwargs: dict) -> list[dict]:
    """Every instrumented step matches the all-gather reference."""
    model = _make_ddp(**ddp_kwargs)
    state = SilentState(model=model, sketch_dim=sketch_dim)
    model.register_comm_hook(state, silent_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records, previous = [], None
    for step in range(steps):
        x, y = _batch(rank, step)
        ref = _reference(model.module, [(x, y)])
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        state.flush()  # processes the step now (links it to the previous one) instead of at the next step
        record = state.latest.to_dict()
        json.dumps(record, allow_nan=False)  # strict JSON
        assert record["step"] == step and record["world_size"] == world
        # A step is compared with the previous one exactly where both used the same bucket layout
        # (the same sketch signs): DDP rebuilds its buckets after its first step or two.
        layout = [(b["index"], b["parameters"], b["numel"]) for b in record["buckets"]]
        linked = record["cosine_previous"] is not None
        assert linked == (sketch_dim > 0 and previous is not None and layout == previous["layout"]), (step, record["cosine_previous"])
        _compare(record, ref, sketch_dim, previous if linked else None)
        ref["layout"] = layout
        previous = ref
        optimizer.step()
        optimizer.zero_grad()
        records.append(record)
    assert sketch_dim == 0 or any(r["cosine_previous"] is not None for r in records), "no step was compared with its previous one"
    return records


ALL_GATHER_REFERENCE = ("all_gather_reference", _check_reference, (1024, 4, {}))
#: Where the run of test_statistics_match_the_all_gather_reference at each world size comes from:
#: a spawn of its own at W = 4, a case of the world size's fixture below at W = 2 and 3.
REFERENCE_FIXTURES = {2: "reference_two_ranks", 3: "three_ranks"}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_statistics_match_the_all_gather_reference(request, world):
    if world in REFERENCE_FIXTURES:
        records = request.getfixturevalue(REFERENCE_FIXTURES[world])[ALL_GATHER_REFERENCE[0]]
    else:
        records = spawn(_check_reference, world, args=ALL_GATHER_REFERENCE[2], timeout=TIMEOUT)
    assert len(records) == world and all(len(r) == 4 for r in records), world
    assert all(r == records[0] for r in records), "statistics must be identical on every rank"
    assert len(records[0][-1]["buckets"]) >= 3, "the model must span several buckets"
    assert records[0][-1]["transport"] == "piggyback"


DDP_OPTIONS = {
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "find_unused": {"find_unused_parameters": True, "unused": True},
}


@pytest.fixture(scope="module")
def reference_two_ranks() -> dict:
    """``_check_reference`` on two ranks: the all-gather reference, every DDP option and
    sketch_dim=0, in one spawn."""
    cases = [(name, _check_reference, (256, 3, ddp_kwargs)) for name, ddp_kwargs in DDP_OPTIONS.items()]
    return _spawn_cases(2, [ALL_GATHER_REFERENCE, *cases, ("sketch_dim_zero", _check_reference, (0, 2, {}))])


@pytest.mark.parametrize("option", list(DDP_OPTIONS))
def test_statistics_match_reference_under_ddp_options(reference_two_ranks, option):
    records = reference_two_ranks[option]  # _check_reference compared every step on every rank
    assert len(records) == 2 and all(len(r) == 3 for r in records), option
    if "unused" in DDP_OPTIONS[option]:
        unused = [p for p in records[0][-1]["parameters"] if p["name"].startswith("unused.")]
        assert unused and all(p["grad_norms"] == [0.0, 0.0] for p in unused)


def test_sketch_dim_zero_gives_norms_and_losses_only(reference_two_ranks):
    records = reference_two_ranks["sketch_dim_zero"]
    assert records[0][-1]["sketch_dim"] == 0


def _check_sketch_exact(rank: int, world: int) -> None:
    """The gathered sketches equal the projection of the full local gradients (float tolerance)."""
    model = _make_ddp()
    state = SilentState(model=model, sketch_dim=128)
    model.register_comm_hook(state, silent_hook)
    for step in range(2):  # the second step runs on the rebuilt buckets
        x, y = _batch(rank, step)
        ref = _reference(model.module, [(x, y)])
        _loss(model, x, y).backward()
        model.zero_grad()
    stats = state.latest
    expected = torch.zeros(world, state.bins, dtype=torch.float64)
    table = state._kernel(torch.device("cpu")).signs
    end = 0
    for layout in sorted(stats.buckets, key=lambda layout: layout.index):
        plan = state._buckets[layout.index].plan
        assert len(stats.buckets) > 1 and plan.base >= end  # positions of the buckets one after the other
        end = plan.base + plan.numel
        flat = torch.cat([ref["param_gradients"][name] for name in layout.names], dim=1)
        positions = plan.base + torch.arange(flat.shape[1])
        expected.index_add_(1, positions % state.bins, flat * table.signs(plan.base, end).double())
    sketches = torch.from_numpy(stats._arrays[0][:, -state.bins :])
    torch.testing.assert_close(sketches, expected, rtol=1e-4, atol=1e-6)


def test_gathered_sketches_are_exact_projections(three_ranks):
    assert three_ranks["sketch_exact"] == [None] * 3  # _check_sketch_exact compared the sketches on every rank


# -- training is numerically unchanged -----------------------------------------------------------
def _train(rank: int, model: DDP, steps: int, dtype: torch.dtype = torch.float32, state: SilentState | None = None) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = _batch(rank, step, dtype=dtype)
        loss = _loss(model, x, y)
        if state is not None:
            state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _check_parameters_unchanged(rank: int, world: int, hook_kwargs: dict, dtype: torch.dtype, ddp_kwargs: dict) -> tuple:
    plain = _make_ddp(dtype=dtype, **ddp_kwargs)
    plain.register_comm_hook(None, allreduce_hook)
    expected = _train(rank, plain, 6, dtype)
    model = _make_ddp(dtype=dtype, **ddp_kwargs)
    state = SilentState(model=model, **hook_kwargs)
    model.register_comm_hook(state, silent_hook)
    got = _train(rank, model, 6, dtype, state)
    bitwise = all(torch.equal(a, b) for a, b in zip(expected, got))
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=0)
    return bitwise, state.latest.transport


@pytest.fixture(scope="module")
def unchanged_two_ranks() -> dict:
    """Every two-rank ``_check_parameters_unchanged`` case (and ``_check_bf16``) in one spawn."""
    return _spawn_cases(2, [
        ("default", _check_parameters_unchanged, ({"sketch_dim": 256}, torch.float32, {})),
        ("bucket_view", _check_parameters_unchanged, ({"sketch_dim": 256}, torch.float32, {"gradient_as_bucket_view": True})),
        ("auto_transport", _check_parameters_unchanged, ({"sketch_dim": 64, "piggyback_limit_mb": 0.001}, torch.float32, {})),
        ("bf16_statistics", _check_bf16, ()),
        ("bf16", _check_parameters_unchanged, ({"sketch_dim": 256}, torch.bfloat16, {})),
    ])  # fmt: skip


def _step_both(models: list[DDP], states: list[SilentState], x: torch.Tensor, y: torch.Tensor) -> tuple:
    """One step of each model on the same batch; each state's latest statistics."""
    for model, state in zip(models, states):
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        state.flush()
    return tuple(state.latest for state in states)


def _assert_same_step_statistics(compact, full, step: int) -> None:
    """The compact wire's statistics of a step against every rank's whole slot: the same losses,
    norms (to rounding) and summary."""
    assert type(compact).__name__ == "FleetStats" and type(full).__name__ == "SilentStats"
    np.testing.assert_array_equal(compact.losses, full.losses)
    np.testing.assert_allclose(compact.grad_norms, full.grad_norms, rtol=1e-5)
    got, expected = compact.summary(), full.summary()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5, nan_ok=True), (step, key)


def _check_compact_wire(rank: int, world: int) -> list[str]:
    """The compact wire (``gather_max_world`` below W) against every rank's whole slot, on the same
    data, with each transport and a replica check every other step (the last one after rank 1's
    replica drifted): the same losses, norms, summary and replica verdicts on the same step, each
    rank's cosines one step late, the sampled ranks' per-parameter norms, and training to rounding."""
    kinds = []
    for transport in ("piggyback", "separate"):
        models = [_make_ddp(), _make_ddp()]
        settings = dict(sketch_dim=256, transport=transport, check_replicas_every=2)
        states = [SilentState(model=models[0], **settings), SilentState(model=models[1], gather_max_world=world - 1, sampled_ranks=2, **settings)]
        optimizers = []
        for model, state in zip(models, states):
            model.register_comm_hook(state, silent_hook)
            optimizers.append(torch.optim.SGD(model.parameters(), lr=0.05))
        previous = drifted = None
        for step in range(6):
            x, y = _batch(rank, step)
            if step == 4 and rank == 1:  # a replica drifts on one rank: the check of step 4 names it
                for model in models:
                    with torch.no_grad():
                        model.module.out.bias[0] += 1e-3
            full, compact = _step_both(models, states, x, y)
            _assert_same_step_statistics(compact, full, step)
            if step % 2:  # the compact wire's verdict of the check before (steps 0, 2, 4) comes with the next step
                assert compact.replicas["checked_step"] == step - 1 and compact.replicas["ranks"] == previous.replicas["ranks"], step
                assert {p["name"] for p in compact.replicas["parameters"]} == {p["name"] for p in previous.replicas["parameters"]}
            else:
                assert compact.replicas is None, step
            sampled = compact.sampled
            assert len(sampled) == 2
            np.testing.assert_allclose(compact.param_sq[sampled], full.param_sq[sampled], rtol=1e-5)
            if previous is None:
                assert compact.cosines_step is None and compact.cosine_loo is None
            else:  # this rank's cosines of the previous step, computed on each rank
                assert compact.cosines_step == step - 1 and compact.cosine_to_others is None
                np.testing.assert_allclose(compact.cosine_loo, previous.cosine_loo, rtol=1e-4, atol=1e-5)
                assert np.isfinite(compact.layer_scores).all()
                if previous.cosine_previous is not None:
                    np.testing.assert_allclose(compact.cosine_previous, previous.cosine_previous, rtol=1e-4, atol=1e-5)
            json.dumps(compact.to_dict(), allow_nan=False)
            previous = full
            if step == 4:
                drifted = full.replicas
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        assert drifted["ranks"] == [1] and compact.replicas["ranks"] == [1]  # step 4's check, named at 4 and 5
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        # Both wires' steps go to the detector's process from the training thread: no other thread ran one.
        assert all(state._pipeline._thread is None and not state._pipeline.detector.in_process for state in states)
        for state in states:
            state.close()
        assert [(a["step"], a["kind"]) for a in states[1].alerts] == [(a["step"] + 1, a["kind"]) for a in states[0].alerts]  # the replica alert, a step later
        kinds.append(compact.transport)
    return kinds


def _check_compact_wire_without_sketch(rank: int, world: int) -> list:
    """The compact wire with ``sketch_dim=0`` and ``every=2``: losses, norms and the summary as the
    whole slots give them, no cosines."""
    models = [_make_ddp(), _make_ddp()]
    states = [SilentState(model=models[0], sketch_dim=0, every=2), SilentState(model=models[1], sketch_dim=0, every=2, gather_max_world=1)]
    for model, state in zip(models, states):
        model.register_comm_hook(state, silent_hook)
    steps = []
    for step in range(5):
        full, compact = _step_both(models, states, *_batch(rank, step))
        assert type(compact).__name__ == "FleetStats" and compact.step == full.step
        assert compact.cosine_loo is None and compact.cosine_previous is None and math.isnan(compact.mean_cosine)
        np.testing.assert_array_equal(compact.losses, full.losses)
        np.testing.assert_allclose(compact.grad_norms, full.grad_norms, rtol=1e-5)
        assert compact.summary()["weighted_mean_cosine"] == pytest.approx(full.summary()["weighted_mean_cosine"], rel=1e-4, abs=1e-5)
        steps.append(compact.step)
    for state in states:
        state.close()
    return sorted(set(steps))


def _check_default_wire_above_16_ranks(rank: int, world: int) -> tuple[str, int]:
    """At the defaults on 17 ranks (above ``gather_max_world`` = 16) the statistics travel in the
    compact wire: the same losses, norms and summary as every rank's whole slot
    (``gather_max_world=None``) on the same data, each rank's cosines one step late, 16 sampled
    ranks' per-parameter norms, and training to rounding."""
    models = [_make_ddp(), _make_ddp()]
    states = [SilentState(model=models[0], gather_max_world=None), SilentState(model=models[1])]
    optimizers = []
    for model, state in zip(models, states):
        model.register_comm_hook(state, silent_hook)
        optimizers.append(torch.optim.SGD(model.parameters(), lr=0.05))
    previous = None
    for step in range(3):
        full, compact = _step_both(models, states, *_batch(rank, step))
        _assert_same_step_statistics(compact, full, step)
        assert len(compact.sampled) == 16
        np.testing.assert_allclose(compact.param_sq[compact.sampled], full.param_sq[compact.sampled], rtol=1e-5)
        if previous is not None:
            np.testing.assert_allclose(compact.cosine_loo, previous.cosine_loo, rtol=1e-4, atol=1e-5)
        previous = full
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for state in states:
        state.close()
    return compact.transport, compact.layout.world


def test_the_default_is_the_compact_wire_above_16_ranks():
    results = _spawn_cases(17, [("default_wire", _check_default_wire_above_16_ranks, ())])["default_wire"]
    assert results == [("piggyback", 17)] * 17


@pytest.fixture(scope="module")
def three_ranks() -> dict:
    """Every three-rank case of this file in one spawn: the all-gather reference, the exact
    sketches, and both ``_check_parameters_unchanged`` cases."""
    return _spawn_cases(3, [
        ALL_GATHER_REFERENCE,
        ("sketch_exact", _check_sketch_exact, ()),
        ("rounding", _check_parameters_unchanged, ({"sketch_dim": 256}, torch.float32, {})),
        ("separate", _check_parameters_unchanged, ({"sketch_dim": 256, "transport": "separate"}, torch.float32, {})),
        ("compact_wire", _check_compact_wire, ()),
        ("compact_wire_without_sketch", _check_compact_wire_without_sketch, ()),
    ])  # fmt: skip


@pytest.mark.parametrize("case", ["default", "bucket_view"])
def test_parameters_bitwise_equal_to_allreduce_hook_on_two_ranks(unchanged_two_ranks, case):
    assert unchanged_two_ranks[case] == [(True, "piggyback")] * 2, case


def test_parameters_equal_to_rounding_on_three_ranks(three_ranks):
    # assert_close(rtol=1e-5, atol=0) runs inside; the piggyback buffer may change the reduction order.
    results = three_ranks["rounding"]
    assert len(results) == 3 and {transport for _, transport in results} == {"piggyback"}


def test_auto_transport_keeps_the_piggyback_buffer_bounded(unchanged_two_ranks):
    # The last bucket holds ~500 fp32 elements (2 KB): a 1 KB limit sends the slots separately.
    assert unchanged_two_ranks["auto_transport"] == [(True, "separate")] * 2


def test_compact_wire_gives_the_whole_slots_statistics_on_three_ranks(three_ranks):
    assert three_ranks["compact_wire"] == [["piggyback", "separate"]] * 3
    assert three_ranks["compact_wire_without_sketch"] == [[0, 2, 4]] * 3  # every=2: the instrumented steps


def test_separate_transport_is_bitwise_on_three_ranks(three_ranks):
    assert three_ranks["separate"] == [(True, "separate")] * 3


def _check_bf16(rank: int, world: int) -> None:
    model = _make_ddp(dtype=torch.bfloat16)
    state = SilentState(model=model, sketch_dim=256)
    model.register_comm_hook(state, silent_hook)
    for step in range(2):
        x, y = _batch(rank, step, dtype=torch.bfloat16)
        ref = _reference(model.module, [(x, y)])  # bf16 local gradients, compared in float64
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        record = state.latest.to_dict()
        assert record["transport"] == "separate"
        torch.testing.assert_close(torch.tensor(record["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
        # The reduced gradient itself is bf16: the identity is exact for it up to bf16 rounding.
        assert abs(record["weighted_mean_cosine"] - ref["weighted_mean_cosine"]) < 2e-2
        model.zero_grad()


def test_bf16_model_gets_fp32_accurate_norms_and_unchanged_training(unchanged_two_ranks):
    assert unchanged_two_ranks["bf16_statistics"] == [None, None]  # _check_bf16 compared both steps
    assert unchanged_two_ranks["bf16"] == [(True, "separate")] * 2


def _check_wrapped_comm_hook(rank: int, world: int) -> tuple:
    plain = _make_ddp()
    plain.register_comm_hook(None, fp16_compress_hook)
    expected = _train(rank, plain, 4)
    model = _make_ddp()
    state = SilentState(model=model, comm_hook=fp16_compress_hook, comm_state=None)
    model.register_comm_hook(state, silent_hook)
    got = _train(rank, model, 4, state=state)
    return all(torch.equal(a, b) for a, b in zip(expected, got)), state.latest.transport


@pytest.fixture(scope="module")
def two_rank_steps(tmp_path_factory) -> dict:
    """The two-rank runs of a wrapped comm hook, every, no_sync, non-finite values and the JSONL
    sink in one spawn; the sink's folder under "jsonl_folder"."""
    folder = tmp_path_factory.mktemp("jsonl")
    runs = _spawn_cases(2, [
        ("wrapped_comm_hook", _check_wrapped_comm_hook, ()),
        ("every", _check_every, ()),
        ("no_sync", _check_no_sync, ()),
        ("nonfinite", _check_nonfinite, ()),
        ("statistics_failure", _check_statistics_failure, ()),
        ("jsonl", _check_jsonl, (str(folder),)),
    ])  # fmt: skip
    return {**runs, "jsonl_folder": folder}


def test_wrapping_another_comm_hook_keeps_its_result(two_rank_steps):
    assert two_rank_steps["wrapped_comm_hook"] == [(True, "separate")] * 2


# -- sampling, accumulation, non-finite values ---------------------------------------------------
def _observed_step(model: DDP, state: SilentState, rank: int, step: int) -> None:
    """Forward, observe the loss, backward; gradients cleared (no optimizer: statistics only)."""
    x, y = _batch(rank, step)
    loss = _loss(model, x, y)
    state.observe_loss(loss)
    loss.backward()
    model.zero_grad()


def _check_every(rank: int, world: int) -> list:
    model = _make_ddp()
    state = SilentState(model=model, sketch_dim=64, every=3)
    model.register_comm_hook(state, silent_hook)
    seen, records = [], []
    for step in range(9):
        _observed_step(model, state, rank, step)
        seen.append((state.step, state.latest.step))
        records.append(state.latest.to_dict())
    return seen, records


def test_every_instruments_one_step_in_n_and_keeps_the_last_record(two_rank_steps):
    seen, records = two_rank_steps["every"][0]
    assert seen == [(1, 0), (2, 0), (3, 0), (4, 3), (5, 3), (6, 3), (7, 6), (8, 6), (9, 6)]
    # A record is final when backward() returns: the step-6 record read after step 6 is the one
    # read after steps 7 and 8 (the pipeline works on it in between), cosine_previous included.
    assert records[6]["cosine_previous"] is not None  # step 3 had the same bucket layout (not step 0: DDP rebuilt it)
    assert records[6] == records[7] == records[8]


def _check_no_sync(rank: int, world: int) -> None:
    model = _make_ddp()
    state = SilentState(model=model, sketch_dim=512)
    model.register_comm_hook(state, silent_hook)
    for step in range(3):
        batches = [_batch(rank, step, micro) for micro in range(3)]
        ref = _reference(model.module, batches)  # summed local gradient, mean loss
        with model.no_sync():
            for x, y in batches[:-1]:
                loss = _loss(model, x, y)
                state.observe_loss(loss)
                loss.backward()
        loss = _loss(model, *batches[-1])
        state.observe_loss(loss)
        loss.backward()
        record = state.latest.to_dict()
        assert record["step"] == step
        _compare(record, ref, 512)
        model.zero_grad()


def test_gradient_accumulation_with_no_sync(two_rank_steps):
    assert two_rank_steps["no_sync"] == [None, None]  # _check_no_sync compared every step on every rank


def _check_nonfinite(rank: int, world: int) -> dict:
    model = _make_ddp()
    state = SilentState(model=model, sketch_dim=64)
    model.register_comm_hook(state, silent_hook)
    if rank == 1:
        model.module.hidden.weight.register_hook(lambda grad: grad * float("nan"))
    x, y = _batch(rank, 0)
    loss = _loss(model, x, y)
    state.observe_loss(torch.tensor(float("inf")) if rank == 0 else loss)
    loss.backward()  # must not raise
    record = state.latest.to_dict()
    json.dumps(record, allow_nan=False)
    return record


def test_non_finite_gradients_and_losses_are_reported_not_raised(two_rank_steps):
    record = two_rank_steps["nonfinite"][0]
    assert record["nonfinite"]["losses"] == [0]
    bad = record["nonfinite"]["gradients"]
    assert [(b["rank"], b["parameter"]) for b in bad] == [(1, "hidden.weight")]
    assert record["losses"][0] is None and record["grad_norms"][1] is None


@contextlib.contextmanager
def _broken(where: str):
    """A bug in this rank's statistics: its pass over a bucket ("kernel"), or the packing of its
    slot under DDP ("pack") or FSDP2 ("sharded_pack"), raises."""
    from ddphooks.fsdp import ShardedSilentState
    from ddphooks.sketch import BucketStatsKernel

    owner, name = {"kernel": (BucketStatsKernel, "run"), "pack": (SilentState, "_pack"), "sharded_pack": (ShardedSilentState, "_pack")}[where]
    original = getattr(owner, name)

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected bug in {name}")

    setattr(owner, name, broken)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _steps_with_a_bug(rank: int, model: torch.nn.Module, state, optimizer: torch.optim.Optimizer, where: str) -> dict:
    """Four steps, rank 1's statistics failing (``_broken(where)``) on step 1: what ``latest``
    says after each (its step or the error it raises), and the warnings."""
    log, steps, after = _Messages(), [], None
    for step in range(4):
        loss = _loss(model, *_batch(rank, step))
        state.observe_loss(loss)
        with _broken(where) if rank == 1 and step == 1 else contextlib.nullcontext():
            loss.backward()  # must not raise
        state.flush()
        try:
            steps.append(state.latest.step)
        except RuntimeError as error:
            steps.append(str(error))
        if step == 2:  # compared with the failed step's slots: alike on every rank
            after = state.latest.to_dict()["cosine_previous"]
        optimizer.step()
        optimizer.zero_grad()
    state.close()
    logging.getLogger("ddphooks").removeHandler(log)
    return {"steps": steps, "messages": log.messages, "after": after}


def _assert_step_1_unmeasured(failing: dict, other: dict) -> None:
    """Step 1 not measured on either rank, alike (both read the flag in the failing rank's slot),
    the steps around it measured; the failing rank's log says what failed, each rank's says once
    that the step is not measured."""
    measured = [step for step in range(len(failing["steps"])) if step != 1]
    assert [failing["steps"][step] for step in measured] == [other["steps"][step] for step in measured] == measured
    assert failing["steps"][1] == other["steps"][1] and "did not measure step 1" in other["steps"][1] and "rank(s) [1]" in other["steps"][1]
    assert any("statistics of step 1 failed on this rank" in m and "injected bug" in m for m in failing["messages"])
    assert not any("injected bug" in m for m in other["messages"])
    assert failing["after"] == other["after"] and failing["after"] is not None
    for run in (failing, other):
        assert sum("step 1 is not measured" in m and "[1]" in m for m in run["messages"]) == 1


def _check_statistics_failure(rank: int, world: int) -> dict:
    """Rank 1's statistics fail on step 1 of 4 (its pass, or its packing), with each wire and
    transport: what each rank's ``latest`` says per step, whether training stayed bitwise that of
    ``allreduce_hook``, the alerts and the warnings."""
    plain = _make_ddp()
    plain.register_comm_hook(None, allreduce_hook)
    expected = _train(rank, plain, 4)
    found = {}
    for wire, settings in (("piggyback", {}), ("separate", {"transport": "separate"}), ("compact", {"gather_max_world": 1})):
        for where in ("kernel", "pack"):
            model = _make_ddp()
            state = SilentState(model=model, sketch_dim=64, check_replicas_every=0, **settings)
            model.register_comm_hook(state, silent_hook)
            run = _steps_with_a_bug(rank, model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), where)
            unchanged = all(torch.equal(a, b.detach()) for a, b in zip(expected, model.parameters()))
            found[f"{wire}/{where}"] = {**run, "unchanged": unchanged, "alerts": len(state.alerts)}
    return found


def test_a_statistics_bug_leaves_the_step_unmeasured_and_training_unchanged(two_rank_steps):
    for case, (mine, other) in ((c, (two_rank_steps["statistics_failure"][1][c], two_rank_steps["statistics_failure"][0][c])) for c in two_rank_steps["statistics_failure"][0]):
        assert mine["unchanged"] and other["unchanged"], case  # bitwise allreduce_hook's, the failed step too
        assert mine["alerts"] == other["alerts"] == 0, case
        _assert_step_1_unmeasured(mine, other)


# -- sinks ---------------------------------------------------------------------------------------
def _check_jsonl(rank: int, world: int, folder: str) -> None:
    model = _make_ddp()
    sink = JsonlSink(f"{folder}/stats-{{rank}}.jsonl", header={"run": "test"})
    state = SilentState(model=model, sketch_dim=64, sinks=[sink], every=2)
    model.register_comm_hook(state, silent_hook)
    for step in range(5):
        _observed_step(model, state, rank, step)
    state.close()


def test_jsonl_sink_writes_one_flushed_line_per_instrumented_step_on_rank_zero(two_rank_steps):
    tmp_path = two_rank_steps["jsonl_folder"]
    assert two_rank_steps["jsonl"] == [None, None]
    assert not (tmp_path / "stats-1.jsonl").exists()
    lines = (tmp_path / "stats-0.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"header": {"run": "test"}}
    records = [json.loads(line) for line in lines[1:]]
    assert [r["step"] for r in records] == [0, 2, 4]
    for key in ("losses", "grad_norms", "cosine", "loss_std", "grad_norm_cv", "mean_cosine", "weighted_mean_cosine"):
        assert key in records[0]


# -- bad input: the same clear error on every rank, never a hang --------------------------------
BAD_INPUTS = {
    "differ": r"settings differ across ranks \(rank 0 has \{'sketch_dim': 256.*rank 1 has \{'sketch_dim': 64",
    "invalid_on_one_rank": r"rank 1: ValueError: every=0 must be >= 1",
    "other_group": r"is not the process group of the DDP model.*process_group=None",
    "not_ddp": r"model must be the DistributedDataParallel module.*got _Net",
    "piggyback_bf16": r"transport='piggyback' needs fp32 gradients.*torch.bfloat16.*'auto'",
}


def _bad_input_error(rank: int, world: int, case: str) -> str:
    model = _make_ddp()
    kwargs = {"model": model}
    if case == "differ":
        kwargs["sketch_dim"] = 256 if rank == 0 else 64
    elif case == "invalid_on_one_rank":
        kwargs["every"] = 0 if rank == 1 else 1
    elif case == "other_group":
        kwargs["process_group"] = dist.new_group(list(range(world)))
    elif case == "not_ddp":
        kwargs["model"] = model.module
    elif case == "piggyback_bf16":
        kwargs["model"] = _make_ddp(dtype=torch.bfloat16)
        kwargs["transport"] = "piggyback"
    try:
        SilentState(**kwargs)
    except (TypeError, ValueError) as error:
        return str(error)
    return "no error"


def _check_bad_inputs(rank: int, world: int) -> dict:
    errors = {case: _bad_input_error(rank, world, case) for case in BAD_INPUTS}
    state = SilentState(model=_make_ddp())
    with pytest.raises(ValueError, match=r"observe_loss expects the scalar loss tensor .* got \(3,\); pass loss.mean\(\)"):
        state.observe_loss(torch.ones(3))
    return errors


def test_bad_input_raises_the_same_error_on_every_rank():
    # One process group for every case: each case must leave the group usable for the next one.
    errors = spawn(_check_bad_inputs, 2, timeout=TIMEOUT)
    for case, message in BAD_INPUTS.items():
        assert errors[0][case] == errors[1][case], case
        assert errors[0][case] != "no error", case
        assert __import__("re").search(message, errors[0][case]), errors[0][case]


def _check_worker_failure(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("boom")
    dist.barrier()


def test_spawn_reports_a_failing_rank_instead_of_hanging():
    with pytest.raises(WorkerError, match=r"(?s)rank 1 failed.*KeyError: 'boom'"):
        spawn(_check_worker_failure, 2, timeout=60)


def _check_environment(rank: int, world: int) -> str | None:
    return os.environ.get("DDPHOOKS_TEST_VALUE")


def test_spawn_gives_the_workers_the_callers_environment_at_the_call(monkeypatch):
    # The first call starts the fork server (where the platform has one), the second runs after
    # the variable changed: a worker forked from that server would see the old value.
    monkeypatch.setenv("DDPHOOKS_TEST_VALUE", "first")
    assert spawn(_check_environment, 2, timeout=60) == ["first", "first"]
    monkeypatch.setenv("DDPHOOKS_TEST_VALUE", "second")
    assert spawn(_check_environment, 2, timeout=60) == ["second", "second"]


def _reduced_norms_of_six_runs(rank: int, world: int) -> list[float]:
    """Each step's reduced norms (the whole gradient's and each parameter's) of six fresh
    4-step runs with the compact wire, whose callbacks do the most work on gloo's threads; a
    49 K-element layer, where a BLAS dot on two threads splits its sum."""
    values = []
    for run in range(6):
        torch.manual_seed(run)
        net = torch.nn.Sequential(torch.nn.Linear(32, 192), torch.nn.Tanh(), torch.nn.Linear(192, 256), torch.nn.Tanh(), torch.nn.Linear(256, 16))
        model = DDP(net, bucket_cap_mb=0.1)
        state = attach(model, gather_max_world=1, check_replicas_every=2, detect=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            generator = torch.Generator().manual_seed(1000 * step + 100 * rank)
            x, y = torch.randn(64, 32, generator=generator) + 0.3 * rank, torch.randn(64, 16, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x), y)
            state.observe_loss(loss)
            loss.backward()
            state.flush()
            record = state.latest.to_dict()
            values += [record["reduced_grad_norm"], *(p["reduced_norm"] for p in record["parameters"])]
            optimizer.step()
            optimizer.zero_grad()
        state.close()
    return values


def test_every_rank_records_the_same_reduced_norms_bit_for_bit():
    """The reduced gradient is the same on every rank, so are its norms in every rank's records:
    gloo's callback threads compute with the process's thread count (devices.match_intra_op_threads;
    without it this failed in about one run in three here)."""
    first, second = spawn(_reduced_norms_of_six_runs, 2, timeout=TIMEOUT)
    assert len(first) == 6 * 4 * 7 and first == second


def test_a_callback_thread_computes_with_the_process_thread_count():
    """What the hook's callbacks call first on gloo's threads: a thread PyTorch did not start gets
    the process's ``set_num_threads``, so a BLAS dot there sums as on the training thread."""
    import threading

    from ddphooks.devices import match_intra_op_threads

    vectors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (70_001, 300_000, 1_000_000)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [torch.dot(v, v).item() for v in vectors]
        found = {}

        def in_a_new_thread(match: bool) -> None:
            if match:
                match_intra_op_threads()
                match_intra_op_threads()  # once per thread: the second call does nothing
            found[match] = [torch.dot(v, v).item() for v in vectors]

        for match in (False, True):
            thread = threading.Thread(target=in_a_new_thread, args=(match,))
            thread.start()
            thread.join()
    finally:
        torch.set_num_threads(threads)
    if found[False] == expected:
        pytest.skip("this machine's BLAS sums alike in a new thread (one core, or one thread by default): nothing to match")
    assert found[True] == expected
