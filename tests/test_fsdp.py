"""ddphooks under FSDP2 and HSDP (``fully_shard``) on gloo, against the slow obvious reference.

The reference is ``test_hook._reference``: an unsharded copy of the model holding the same full
parameters (``full_tensor()``) computes every rank's local gradient on the same batch, the
gradients are all-gathered and every statistic is computed from them in float64.
"""

import copy
import json

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ddphooks
import ddphooks.sketch
from ddphooks.launch import spawn
from test_hook import (
    TIMEOUT,
    _assert_same_step_statistics,
    _assert_step_1_unmeasured,
    _batch,
    _compare,
    _loss,
    _Messages,
    _Net,
    _reference,
    _step_both,
    _steps_with_a_bug,
)


def _sharded(mesh_shape: tuple, seed: int = 0, **fsdp_kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The small MLP fully_shard-ed per layer and at the root, and an unsharded copy of it."""
    torch.manual_seed(seed)
    model = _Net()
    reference = copy.deepcopy(model)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in (model.inp, model.hidden):
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model, reference


def _sync_reference(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Give the reference the sharded model's current full parameters (a collective)."""
    with torch.no_grad():
        for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
            ref.copy_(param.full_tensor())


def _check_reference(rank: int, world: int, mesh_shape: tuple, micro: int, mixed: bool, **settings) -> list[dict]:
    """Every step's record matches the reference; a replica check runs on the last step."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    model, reference = _sharded(mesh_shape, mp_policy=policy)
    state = ddphooks.attach(model, sketch_dim=256, check_replicas_every=2, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for step in range(3):
        _sync_reference(model, reference)
        batches = [_batch(rank, step, m) for m in range(micro)]
        ref = _reference(reference.to(torch.bfloat16) if mixed else reference, [(x.to(torch.bfloat16), y.to(torch.bfloat16)) if mixed else (x, y) for x, y in batches])
        reference.float()
        for m, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(m == micro - 1)  # accumulate the micro-batches, reduce once
            loss = _loss(model, x, y)
            state.observe_loss(loss)
            loss.backward()
        state.flush()
        record = state.latest.to_dict()
        json.dumps(record, allow_nan=False)
        assert record["step"] == step and record["world_size"] == world and state.step == step + 1
        if mixed:  # bf16 forward and backward of the same parameters, in another order: bf16 resolution (2^-8)
            close = lambda got, expected, **tolerance: torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), **tolerance)
            close(record["losses"], ref["losses"], rtol=1e-2, atol=0)
            close(record["grad_norms"], ref["grad_norms"], rtol=1e-3, atol=0)
            close(record["weighted_mean_cosine"], ref["weighted_mean_cosine"], rtol=0, atol=1e-3)
            for parameter in record["parameters"]:
                close(parameter["grad_norms"], ref["param_norms"][parameter["name"]], rtol=1e-2, atol=0)
        else:
            _compare(record, ref, 256)
        optimizer.step()
        optimizer.zero_grad()
        records.append(record)
    state.close()
    return records


def _train(rank: int, world: int, attach: bool, reshard: bool, mixed: bool = False, mesh_shape: tuple | None = None) -> list[torch.Tensor]:
    """Four AdamW steps (on ``mesh_shape``, plain FSDP2 over every rank by default); with
    ``mixed``, bf16 parameters, fp32 reduction and two micro-batches a step."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    model, _ = _sharded(mesh_shape or (world,), reshard_after_forward=reshard, mp_policy=policy)
    if attach:
        ddphooks.attach(model).close()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    micro = 2 if mixed else 1
    for step in range(4):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            _loss(model, *_batch(rank, step, m)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def _check_errors(rank: int, world: int) -> dict:
    model, _ = _sharded((world,))
    errors = {}
    try:
        ddphooks.attach(model, transport="separate")
    except TypeError as error:
        errors["ddp_only"] = str(error)
    ddphooks.attach(model, gather_max_world=64, sampled_ranks=4).close()  # the compact wire's settings: accepted under FSDP2
    try:
        ddphooks.attach(model)
    except RuntimeError as error:
        errors["twice"] = str(error)
    return errors


def _check_root_only_every(rank: int, world: int) -> list:
    """fully_shard on the root alone (its reduce-scatter runs inside FSDP2's own end-of-backward
    callback) with every=2: steps 0, 2 and 4 are measured, the step counter follows every step."""
    torch.manual_seed(0)
    model = _Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    state = ddphooks.attach(model, every=2)
    measured = []
    for step in range(5):
        loss = _loss(model, *_batch(rank, step))
        state.observe_loss(loss)
        loss.backward()
        measured.append((state.step, state.latest.step, len(state.latest.to_dict()["parameters"])))
    state.close()
    return measured


def _check_unused_parameters(rank: int, world: int) -> dict:
    """A parameter without a gradient leaves FSDP2's reduce-scatter layout unknown: the module's
    parameters are one entry for the step, with the exact norm, and a warning says so once."""
    torch.manual_seed(0)
    model = _Net(unused_branch=True)  # the root's group holds out.* and the unused branch
    reference = copy.deepcopy(model)
    fully_shard(model.inp)
    fully_shard(model)
    log = _Messages()
    state = ddphooks.attach(model)
    for step in range(2):
        _sync_reference(model, reference)
        x, y = _batch(rank, step)
        ref = _reference(reference, [(x, y)])
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        model.zero_grad()
    state.close()
    record = state.latest.to_dict()
    joined = torch.cat([ref["param_gradients"][name] for name in ("hidden.weight", "hidden.bias", "out.weight", "out.bias")], dim=1)
    return {
        "names": [p["name"] for p in record["parameters"]],
        "joined": [p["grad_norms"] for p in record["parameters"] if p["name"].endswith("(parameters with gradients)")][0],
        "expected": joined.norm(dim=1).tolist(),
        "warnings": [m for m in log.messages if "got no gradient" in m],
    }


def _check_two_ranks(rank: int, world: int) -> dict:
    """Plain FSDP2 on 2 ranks: the reference in fp32 and with bf16 parameters, training
    unchanged with reshard_after_forward either way, the error messages."""
    return {
        "fp32": _check_reference(rank, world, (world,), 1, False),
        "bf16": _check_reference(rank, world, (world,), 1, True),
        "unchanged": [
            all(torch.equal(a, b) for a, b in zip(_train(rank, world, False, *case), _train(rank, world, True, *case)))
            for case in ((True, False), (False, False), (True, True))
        ],
        "errors": _check_errors(rank, world),
        "root_only_every_2": _check_root_only_every(rank, world),
        "unused": _check_unused_parameters(rank, world),
        "by_column": _check_by_column(rank, world),
        "failure": _check_statistics_failure(rank, world),
        "layout_failure": _check_layout_failure(rank, world),
    }


def _check_statistics_failure(rank: int, world: int, where: str = "kernel", **settings) -> dict:
    """Rank 1's statistics fail on step 1 of 4 (``_broken(where)``: its pass, or its packing):
    what each rank's ``latest`` says per step, whether training stayed bitwise plain FSDP2's, the
    alerts and the wire of the last step."""
    expected = _train(rank, world, False, True)
    model, _ = _sharded((world,))
    state = ddphooks.attach(model, check_replicas_every=0, **settings)
    run = _steps_with_a_bug(rank, model, state, torch.optim.AdamW(model.parameters(), lr=1e-2), where)
    unchanged = all(torch.equal(a, p.full_tensor()) for a, p in zip(expected, model.parameters()))
    return {**run, "unchanged": unchanged, "alerts": len(state.alerts), "wire": type(state.latest).__name__}


def _check_layout_failure(rank: int, world: int) -> dict:
    """Every rank's layout of step 1 fails (``_entry``: it depends only on what the ranks share,
    so it fails alike everywhere): no rank raises into backward or joins the statistics'
    all-reduce, step 1 is reported as not measured, steps 2-3 are measured and training stays
    bitwise plain FSDP2's."""
    from ddphooks.fsdp import ShardedSilentState

    expected = _train(rank, world, False, True)
    model, _ = _sharded((world,))
    state = ddphooks.attach(model, check_replicas_every=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    entry, steps = ShardedSilentState._entry, []
    for step in range(4):
        loss = _loss(model, *_batch(rank, step))
        state.observe_loss(loss)
        if step == 1:
            ShardedSilentState._entry = lambda *args: (_ for _ in ()).throw(RuntimeError("injected bug in _entry"))
        try:
            loss.backward()  # must not raise
        finally:
            ShardedSilentState._entry = entry
        try:
            steps.append(state.latest.step)
        except RuntimeError as error:
            steps.append(str(error))
        optimizer.step()
        optimizer.zero_grad()
    state.close()
    return {"steps": steps, "unchanged": all(torch.equal(a, p.full_tensor()) for a, p in zip(expected, model.parameters()))}


def _check_by_column(rank: int, world: int) -> list[dict]:
    """The per-parameter norms by column (what groups of many shards use) on the same reference."""
    segments = ddphooks.sketch.COLUMN_SEGMENTS
    ddphooks.sketch.COLUMN_SEGMENTS = 0  # every group by column, at 2 shards
    try:
        return _check_reference(rank, world, (world,), 1, False)
    finally:
        ddphooks.sketch.COLUMN_SEGMENTS = segments


def _check_replica_divergence(rank: int, world: int, steps: int = 1, **settings) -> dict:
    """HSDP: a replica whose parameter shard drifted is named; ``replicas`` of the last of
    ``steps`` records, each step a replica check (``settings``: the wire; the compact wire's
    verdict of step 0 comes with step 1)."""
    model, _ = _sharded((2, 2))
    state = ddphooks.attach(model, check_replicas_every=1, **settings)
    if rank == 3:  # replica 1 of shard 1
        with torch.no_grad():
            model.hidden.weight.to_local().add_(1e-3)
    for step in range(steps):
        _loss(model, *_batch(rank, step)).backward()
    state.close()
    return state.latest.to_dict()["replicas"]


def _check_partial_all_reduce(rank: int, world: int) -> dict:
    """HSDP accumulating reduce-scattered shards without the all-reduce: such steps are not
    measured (their local gradient is spread over several reduce-scatters), and said once."""
    model, _ = _sharded((2, 2))
    log = _Messages()
    state = ddphooks.attach(model)
    for step in range(2):
        for micro in range(2):
            model.set_requires_all_reduce(micro == 1)
            _loss(model, *_batch(rank, step, micro)).backward()
    state.close()
    return {"step": state.step, "latest": state.latest, "warnings": [m for m in log.messages if "set_requires_all_reduce(False)" in m]}


def _check_hsdp(rank: int, world: int) -> dict:
    """HSDP on a 2 x 2 mesh: the reference with two accumulated micro-batches, the replica check
    (with the whole slots and the compact wire), accumulation without the all-reduce, the compact
    wire above gather_max_world against the whole slots."""
    return {
        "accumulation": _check_reference(rank, world, (2, 2), 2, False),
        "drifted": _check_replica_divergence(rank, world),
        "drifted_compact": _check_replica_divergence(rank, world, steps=2, gather_max_world=2),
        "partial": _check_partial_all_reduce(rank, world),
        "compact": _check_compact_wire(rank, world, (2, 2), check_replicas_every=1),
    }


def _check_compact_wire(rank: int, world: int, mesh_shape: tuple | None = None, check_replicas_every: int = 0, sketch_dim: int = 256) -> dict:
    """Plain FSDP2 (or HSDP on ``mesh_shape``) forced to the compact wire (``gather_max_world`` =
    W - 1, 2 sampled ranks) against the same model with every rank's whole slot, on the same data
    for four AdamW steps: the same losses, norms, reduced norms (per parameter too) and summary on
    the same step, the sampled ranks' per-parameter norms, each rank's cosines and layer level one
    step late (the whole slots' previous step), and with ``check_replicas_every`` each check's
    verdict in the next step's record, the whole slots' (no replica differs here); returns the
    wire's sizes, its bins and whether the compact run's parameters are bitwise those of the same
    training without ddphooks."""
    expected = _train(rank, world, False, True, mesh_shape=mesh_shape)
    models = [_sharded(mesh_shape or (world,))[0] for _ in range(2)]
    settings = dict(sketch_dim=sketch_dim, check_replicas_every=check_replicas_every)
    states = [
        ddphooks.attach(models[0], gather_max_world=None, **settings),
        ddphooks.attach(models[1], gather_max_world=world - 1, sampled_ranks=2, **settings),
    ]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    previous, sizes = None, []
    for step in range(4):
        full, compact = _step_both(models, states, *_batch(rank, step))
        _assert_same_step_statistics(compact, full, step)  # losses, per-rank norms, summary (reduced norm, mean cosine, dispersion)
        np.testing.assert_allclose(compact.reduced_param_sq, full.reduced_param_sq, rtol=1e-5)  # the shards' sums
        assert len(compact.sampled) == 2
        np.testing.assert_allclose(compact.param_sq[compact.sampled], full.param_sq[compact.sampled], rtol=1e-5)
        if previous is None:
            assert compact.cosines_step is None and compact.cosine_loo is None and compact.layer_scores is None
            # Step 0, a detail step: every rank's sketch travelled, the W x W matrix is the whole slots'
            np.testing.assert_allclose(compact.cosine, full.cosine, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(np.array(compact.to_dict()["cosine"], dtype=float), full.cosine, atol=5e-4 + 1e-5)  # 3 decimals
        else:  # this rank's values of the previous step, computed on each rank
            assert compact.cosines_step == step - 1 and compact.cosine_to_others is None and compact.cosine is None
            np.testing.assert_allclose(compact.cosine_loo, previous.cosine_loo, rtol=1e-4, atol=1e-5)
            assert np.isfinite(compact.layer_scores).all()
            if previous.cosine_previous is not None:
                np.testing.assert_allclose(compact.cosine_previous, previous.cosine_previous, rtol=1e-4, atol=1e-5)
        if check_replicas_every:  # every step checks: the verdict of the step before, the whole slots'
            assert compact.replicas == (None if previous is None else dict(previous.replicas, checked_step=step - 1)), step
        json.dumps(compact.to_dict(), allow_nan=False)
        sizes.append(compact.layout.size)
        previous = full
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for state in states:
        state.close()
    unchanged = all(torch.equal(a, p.full_tensor()) for a, p in zip(expected, models[1].parameters()))
    return {"sizes": sizes, "bins": states[1].bins, "transport": compact.transport, "unchanged": unchanged}


def _check_compact_replica_check(rank: int, world: int) -> list:
    """Plain FSDP2 with the compact wire and a constant buffer that rank 2 holds with other values
    (a rank that built another mask): the replica check of steps 0 and 2 (plain FSDP2 compares
    buffers only), each verdict in the next step's record; per step, ``replicas`` of the record."""
    model, _ = _sharded((world,))
    model.register_buffer("mask", torch.full((8,), 2.0 if rank == 2 else 1.0))
    state = ddphooks.attach(model, gather_max_world=1, check_replicas_every=2)
    replicas = []
    for step in range(4):
        _loss(model, *_batch(rank, step)).backward()
        replicas.append(state.latest.to_dict()["replicas"])
    state.close()
    return replicas


def _check_three_ranks(rank: int, world: int) -> dict:
    """Plain FSDP2 on 3 ranks with the compact wire: against whole slots, a buffer that differs
    on one rank, and a statistics bug (rank 1's pass, or its packing) on step 1."""
    return {
        "compact": _check_compact_wire(rank, world),
        "replica": _check_compact_replica_check(rank, world),
        "failure_kernel": _check_statistics_failure(rank, world, "kernel", gather_max_world=1),
        "failure_pack": _check_statistics_failure(rank, world, "sharded_pack", gather_max_world=1),
    }


# One process group per mesh for the whole module: starting ranks costs more than the checks.
@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_check_two_ranks, 2, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def hsdp() -> list[dict]:
    return spawn(_check_hsdp, 4, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return spawn(_check_three_ranks, 3, timeout=TIMEOUT)


def _same_on_every_rank_and_linked(records: list[list[dict]], hsdp: bool) -> None:
    assert records[0] == records[-1]  # the same statistics on every rank
    first, second, third = records[0]
    # Steps 0 and 2 check replicas: the parameter shards' replicas under HSDP; under plain FSDP2
    # only buffers are held by several ranks, and this model has none.
    agree = {"ranks": [], "tensors": 0, "parameters": [], "not_compared": 0} if hsdp else None
    assert first["replicas"] == third["replicas"] == agree and second["replicas"] is None
    assert third["cosine_previous"] is not None  # the signs stay at the same positions from step to step


def test_fsdp2_statistics_match_an_unsharded_reference(two_ranks):
    _same_on_every_rank_and_linked([r["fp32"] for r in two_ranks], hsdp=False)


def test_fsdp2_with_bf16_parameters_and_fp32_reduction(two_ranks):
    _same_on_every_rank_and_linked([r["bf16"] for r in two_ranks], hsdp=False)


def test_hsdp_statistics_span_the_whole_mesh_with_accumulation(hsdp):
    records = [r["accumulation"] for r in hsdp]
    _same_on_every_rank_and_linked(records, hsdp=True)
    assert all(len(record["losses"]) == 4 for record in records[0])


def test_norms_by_column_match_the_unsharded_reference(two_ranks):
    # _check_reference compares every record with the reference (as for "fp32", one norm per
    # parameter and row); here the same checks pass with every group's norms taken by column
    _same_on_every_rank_and_linked([r["by_column"] for r in two_ranks], hsdp=False)
    by_column, by_segment = (two_ranks[0][case][1]["parameters"] for case in ("by_column", "fp32"))
    assert [v for p in by_column for v in p["grad_norms"]] == pytest.approx([v for p in by_segment for v in p["grad_norms"]], rel=1e-5)


def _on_fake_group(world: int, mesh_shape: tuple | None = None) -> torch.nn.Module:
    """Rank 0 of ``world`` on PyTorch's fake process group (its collectives leave the buffers as
    this rank wrote them), and _Net fully_shard-ed per layer and at the root over it (a
    ``mesh_shape`` of two: HSDP, replicas x shards); the caller destroys the group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch.manual_seed(0)
    model = _Net()
    shape = mesh_shape or (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else None)
    for layer in (model.inp, model.hidden):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _Staggered(torch.nn.Module):
    """One FSDP2 group whose parameters hold gradient in different numbers of shard rows at 256
    shards: ``a`` 200, ``c`` 150, ``e``, ``b`` and ``d`` 8 (rows along dim 0), ``d`` the widest."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        shapes = {"e": (8, 40), "a": (200, 30), "b": (8, 40), "c": (150, 1100), "d": (8, 2500)}
        for name, shape in shapes.items():  # in this order in FSDP2's rows
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(p.square().sum() for p in self.parameters()) * x.mean()


def _local_sq(entry) -> torch.Tensor:
    """A group's local squared norms of its last step, fp64: its ``sq_norms``, or where it was
    measured by row (one band of several rows and parameters) the sums of its norms by row,
    which the step's end takes with the reduced norms (``_shard_norms``)."""
    if entry.row_norms is None:
        return entry.sq_norms.double()
    return entry.row_norms.double().view(len(entry.shard_lengths), -1).square().sum(dim=1)


def _bands_on_many_shards(model: torch.nn.Module, shards: int, inputs: int, **settings) -> dict:
    """Two steps of ``model`` (fully_shard-ed on rank 0 of ``shards``), then, for the second, each
    group's bands against its reduce-scatter input: the norms against float64 sums over the whole
    input, the sketch against one taken slowly from the bands' positions and signs, and the input
    outside the bands all zeros. Returns each group's bands as (first row, rows, first column, columns)."""
    import torch.distributed as dist

    try:
        state = ddphooks.attach(model, detect=False, **settings)
        seen, measure = {}, state._measure
        state._measure = lambda comm, output, flat: (seen.__setitem__(id(comm), (comm.base, flat.clone())), measure(comm, output, flat))
        for _ in range(2):  # the second step after the plans exist
            loss = model(torch.randn(4, inputs)).square().mean()
            state.observe_loss(loss)
            loss.backward()
        sketch, kernel = state._sketch.double(), state._kernel(torch.device("cpu"))
        reference, magnitude, spans, bands = torch.zeros_like(sketch), torch.zeros_like(sketch), [], {}
        bases = sorted(base for base, _ in seen.values())
        for key, entry in state._entries.items():
            base, flat = seen[key]
            rows = flat.view(shards, -1)
            covered = torch.zeros_like(rows, dtype=torch.bool)
            for band in entry.bands:
                part = band.source(flat, entry.width).reshape(-1).double()
                first, last = band.plan.base, band.plan.base + band.plan.numel
                positions = torch.arange(first, last)
                reference.index_add_(0, positions % state.bins, kernel.signs.signs(first, last).double() * part)
                magnitude.index_add_(0, positions % state.bins, part.abs())
                spans.append((first, last))
                # every band lies in its group's positions, before the next group's
                assert base <= first and all(last <= b for b in bases if b > base)
                covered[band.first_row : band.first_row + band.plan.rows, band.column : band.column + band.plan.row_width] = True
            assert torch.count_nonzero(rows[~covered]) == 0  # what the bands leave out is FSDP2's zero padding
            bounds = torch.tensor([0, *entry.shard_lengths]).cumsum(0).tolist()
            expected = [float((rows[:, a:b].double() ** 2).sum()) for a, b in zip(bounds, bounds[1:])]
            assert _local_sq(entry).tolist() == pytest.approx(expected, rel=1e-5)
            bands[entry.layout.names[0]] = [(b.first_row, b.plan.rows, b.column, b.plan.row_width) for b in entry.bands]
        spans.sort()
        assert all(end <= begin for (_, end), (begin, _) in zip(spans, spans[1:]))  # no two bands share a position
        # fp32 sums of thousands of terms: within 1e-5 of the bin's sum of magnitudes (a wrong sign or
        # position is off by the size of a term)
        assert ((sketch - reference).abs() <= 1e-5 * magnitude).all()
        state.close()
    finally:
        dist.destroy_process_group()
    return bands


def test_many_shards_skip_the_padding_rows_and_keep_the_norms():
    # One rank of 256 on the fake process group: the real fully_shard copy-in, with more shards than
    # any of _Net's parameters has rows along dim 0. The rows past a group's last parameter row are
    # FSDP2's zero padding, left out of the pass.
    bands = _bands_on_many_shards(_on_fake_group(256), 256, 16)
    # inp (48 rows along dim 0), hidden (64), the root with out (8): each group its first rows, whole
    assert sorted(b for group in bands.values() for b in group) == [(0, 8, 0, 65), (0, 48, 0, 17), (0, 64, 0, 49)]


@pytest.mark.parametrize("chunk_elems", [None, 1024])
def test_bands_read_the_columns_that_hold_gradient(chunk_elems):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=256)
    model = _Staggered()
    fully_shard(model, mesh=init_device_mesh("cpu", (256,)))
    (bands,) = _bands_on_many_shards(model, 256, 8, chunk_elems=chunk_elems).values()
    # rows 0-7 whole (3710 columns); rows 8-149 a, b and c from column 40 (b, between them, has no
    # rows there: read as zeros); rows 150-199 a alone; a band of several rows is one chunk (1004
    # elements at chunk_elems=1024: rows of a, b and c one at a time, wider than a chunk; 33 rows of a)
    if chunk_elems is None:
        assert bands == [(0, 8, 0, 3710), (8, 111, 40, 1170), (119, 31, 40, 1170), (150, 50, 40, 30)]
    else:
        assert bands == [(0, 8, 0, 3710)] + [(row, 1, 40, 1170) for row in range(8, 150)] + [(150, 33, 40, 30), (183, 17, 40, 30)]


def test_a_statistics_bug_leaves_the_step_unmeasured_and_training_unchanged(two_ranks):
    mine, other = two_ranks[1]["failure"], two_ranks[0]["failure"]
    assert mine["unchanged"] and other["unchanged"] and mine["alerts"] == other["alerts"] == 0
    _assert_step_1_unmeasured(mine, other)


def test_a_layout_bug_on_every_rank_leaves_the_step_unmeasured_without_a_collective(two_ranks):
    for run in (r["layout_failure"] for r in two_ranks):
        assert run["unchanged"] and run["steps"][0] == 0 and run["steps"][2:] == [2, 3]
        assert "could not compute the statistics" in run["steps"][1] and "injected bug in _entry" in run["steps"][1]


def test_training_is_bitwise_unchanged(two_ranks):
    # reshard_after_forward True and False in fp32; bf16 parameters with accumulation
    assert [r["unchanged"] for r in two_ranks] == [[True, True, True]] * 2


def test_hsdp_replica_check_names_the_drifted_replica(hsdp):
    replicas = hsdp[0]["drifted"]
    assert replicas["ranks"] == [1, 3]  # two replicas of one shard: no majority, both named
    assert [p["name"] for p in replicas["parameters"]] == ["hidden.weight"]


def test_root_only_sharding_and_every(two_ranks):
    # (steps seen, step of the latest statistics, parameters in it) after each backward
    assert two_ranks[0]["root_only_every_2"] == [(1, 0, 6), (2, 0, 6), (3, 2, 6), (4, 2, 6), (5, 4, 6)]


def test_parameters_without_gradient_make_one_exact_entry(two_ranks):
    unused = two_ranks[0]["unused"]
    assert sorted(unused["names"]) == ["inp.bias", "inp.weight", "model.(parameters with gradients)"]
    torch.testing.assert_close(torch.tensor(unused["joined"]), torch.tensor(unused["expected"], dtype=torch.float32), rtol=1e-5, atol=0)
    assert [len(r["unused"]["warnings"]) for r in two_ranks] == [1, 1]  # once in two steps, on each rank


def test_hsdp_accumulation_without_all_reduce_is_not_measured_and_said_once(hsdp):
    partial = hsdp[0]["partial"]
    assert partial["step"] == 2 and partial["latest"] is None  # two steps counted, none measured
    assert [len(r["partial"]["warnings"]) for r in hsdp] == [1, 1, 1, 1]  # once, on each rank


def test_errors_name_the_setting_and_the_fix(two_ranks):
    errors = two_ranks[0]["errors"]
    assert "transport applies to DDP only" in errors["ddp_only"]
    assert "already attached" in errors["twice"]  # after attach(model, gather_max_world=64, sampled_ranks=4) was accepted


def test_deepspeed_still_refuses_the_compact_wire_settings():
    class DeepSpeedEngine(torch.nn.Module):  # what attach recognises a DeepSpeed engine by (its class name)
        pass

    refused = r"gather_max_world, sampled_ranks \(the compact wire, ddphooks.fleet\) are built for DDP and FSDP2 only so far; under DeepSpeed"
    with pytest.raises(TypeError, match=refused):
        ddphooks.attach(DeepSpeedEngine(), gather_max_world=64, sampled_ranks=4)


def test_fsdp2_compact_wire_gives_the_whole_slots_statistics_and_unchanged_training(three_ranks):
    # _check_compact_wire compared every step with the whole slots' on every rank
    compact = [r["compact"] for r in three_ranks]
    bins, params, groups = compact[0]["bins"], 6, 3  # _Net: inp, hidden (their own groups), out with the root
    # rows of 6, 2 sampled ranks' norms, 4 sums per parameter, the groups, the count, 2 sketch sums, the reduced part
    size = 6 * 3 + 2 * params + 4 * params + groups + 1 + 2 * bins + params
    detail = size + 3 * bins  # step 0, a detail step: each rank's sketch for the W x W matrix
    assert [r["sizes"] for r in compact] == [[detail] + [size] * 3] * 3 and bins > 0
    assert [(r["transport"], r["unchanged"]) for r in compact] == [("separate", True)] * 3  # bitwise plain FSDP2


def test_fsdp2_compact_replica_check_names_the_rank_whose_buffer_differs(three_ranks):
    replicas = [r["replica"] for r in three_ranks]
    assert replicas[0] == replicas[1] == replicas[2]  # the same records on every rank
    first, after_check, second, after_second = replicas[0]
    assert first is None and second is None  # a check step's verdict travels with the next step
    for verdict, checked in ((after_check, 0), (after_second, 2)):
        assert verdict["checked_step"] == checked and verdict["ranks"] == [2], verdict
        assert [p["name"] for p in verdict["parameters"]] == ["mask"] and verdict["parameters"][0]["ranks_differing"] == 1


@pytest.mark.parametrize("where", ["kernel", "pack"])
def test_a_statistics_bug_leaves_the_step_unmeasured_with_the_compact_wire(three_ranks, where):
    mine, other = three_ranks[1][f"failure_{where}"], three_ranks[0][f"failure_{where}"]
    assert all(r[f"failure_{where}"]["unchanged"] and r[f"failure_{where}"]["alerts"] == 0 for r in three_ranks)
    assert mine["wire"] == other["wire"] == "FleetStats"
    _assert_step_1_unmeasured(mine, other)


def test_hsdp_compact_wire_gives_the_whole_slots_statistics_and_unchanged_training(hsdp):
    # _check_compact_wire compared every step with the whole slots' on every rank, the reduced
    # norms divided by the 2 replicas, and each replica check's empty verdict: the shards differ
    # from each other, only each shard's replicas are compared
    compact = [r["compact"] for r in hsdp]
    bins, params, groups = compact[0]["bins"], 6, 3
    # as plain FSDP2's on 4 ranks, and on every (check) step each parameter's checks within its
    # replica groups (their histograms summed over each group apart); the model has no buffers
    size = 6 * 4 + 2 * params + 4 * params + groups + 1 + 2 * bins + params + params * 3
    detail = size + 4 * bins  # step 0, a detail step: each rank's sketch for the W x W matrix
    assert [r["sizes"] for r in compact] == [[detail] + [size] * 3] * 4 and bins > 0
    assert [(r["transport"], r["unchanged"]) for r in compact] == [("separate", True)] * 4  # bitwise plain HSDP


def test_hsdp_compact_replica_check_names_the_drifted_replica_as_the_whole_slots_do(hsdp):
    whole, compact = hsdp[0]["drifted"], hsdp[0]["drifted_compact"]
    assert all(r["drifted_compact"] == compact for r in hsdp)  # the same record on every rank
    assert compact["checked_step"] == 0 and compact["ranks"] == whole["ranks"] == [1, 3]  # a tie of two replicas: both named
    assert [p["name"] for p in compact["parameters"]] == [p["name"] for p in whole["parameters"]] == ["hidden.weight"]
    assert compact["parameters"][0]["shards_differing"] == 1 and compact["parameters"][0]["ranks"] == [1, 3]
    assert compact["tensors"] == whole["tensors"] == 1 and compact["not_compared"] == whole["not_compared"] == 0


@pytest.mark.parametrize("mesh_shape", [(64,), (8, 8)], ids=["fsdp2", "hsdp"])
def test_fsdp2_at_64_ranks_sends_the_compact_wire_by_default(mesh_shape):
    # One rank of 64 on the fake process group (its all-reduce leaves the buffer as this rank
    # wrote it): attach's defaults send the compact wire above 16 ranks, one all-reduce a step
    # whose size does not depend on W but for its 6 numbers per rank (and, under HSDP, on the
    # replica check of step 0, 3 numbers per parameter, with one histogram per parameter summed
    # over this rank's replica group alone), and the step's FleetStats hold this rank's loss and norms.
    import torch.distributed as dist

    world, shards = 64, mesh_shape[-1]
    model = _on_fake_group(world, mesh_shape)
    all_reduce, sizes, shard_counts = dist.all_reduce, [], []
    try:
        state = ddphooks.attach(model, detect=False)
        def counted(tensor, *args, group=None, **kwargs):  # the statistics' all-reduces (HSDP also all-reduces gradients)
            if state._slots is not None and tensor.untyped_storage().data_ptr() == state._slots.untyped_storage().data_ptr():
                sizes.append(tensor.numel())
            if state._shard_counts is not None and tensor.untyped_storage().data_ptr() == state._shard_counts.untyped_storage().data_ptr():
                shard_counts.append((tensor.numel(), dist.get_world_size(group)))
            return all_reduce(tensor, *args, group=group, **kwargs)

        dist.all_reduce = counted
        losses = []
        for _ in range(2):
            loss = model(torch.randn(4, 16)).square().mean()
            state.observe_loss(loss)
            loss.backward()
            losses.append(loss.item())
        stats = state.latest
        record = stats.to_dict()
        json.dumps(record, allow_nan=False)
        local = sum(float(_local_sq(entry).sum()) for entry in state._entries.values())
        state.close()
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()
    assert type(stats).__name__ == "FleetStats" and record["wire"] == "compact" and stats.layout.world == world
    assert record["cosines_step"] == 0 and len(record["sampled_ranks"]) == 16
    size = 6 * world + 16 * 6 + 4 * 6 + 3 + 1 + 2 * state.bins + 6  # as on 3 ranks, 16 sampled
    check = 6 * 3 if len(mesh_shape) == 2 else 0  # plain FSDP2: no tensor two ranks hold (_Net has no buffers)
    # step 0 checks the replicas and is a detail step: each rank's sketch travels for the W x W matrix
    assert sizes == [size + check + world * state.bins, size] and size + check < world * (3 + 6 + state.bins)  # less than the whole slots without their reduced part
    # the 8 replicas of each shard: 6 histograms of 65 counts, on the check step only
    assert shard_counts == ([(6 * 65, world // shards)] if check else [])
    if check:  # this rank alone in every histogram: the most common bin of each shard, nobody differs
        assert record["replicas"]["checked_step"] == 0 and record["replicas"]["ranks"] == [] and record["replicas"]["not_compared"] == 0
    assert record["losses"][0] == pytest.approx(losses[-1], rel=1e-6)
    assert record["grad_norms"][0] == pytest.approx(local**0.5, rel=1e-5)


def test_unsupported_wrappers_are_named():
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # FSDP1 refuses the CPU: never constructed here
    torch.nn.Module.__init__(fsdp1)
    fsdp1._fsdp_wrapped_module = torch.nn.Linear(1, 1)  # where FSDP1 looks up unknown attributes
    with pytest.raises(TypeError, match="FSDP1, FullyShardedDataParallel, is not supported: use FSDP2's fully_shard"):
        ddphooks.attach(fsdp1)
    module = torch.nn.Linear(1, 1)  # engine.module of a ZeRO-1/2 engine: its parameters carry DeepSpeed's mapping
    module.weight._hp_mapping = None
    with pytest.raises(TypeError, match="pass the DeepSpeedEngine deepspeed.initialize returns, not engine.module"):
        ddphooks.attach(module)


def test_param_groups_reads_the_list_of_newer_torch_and_the_one_group_of_torch_2_11():
    """torch 2.11's FSDPState has one optional ``_fsdp_param_group`` and no list: attach crashed
    there with an AttributeError (the device run of 2026-12-04)."""
    from types import SimpleNamespace

    from ddphooks.fsdp import _param_groups

    first, second = object(), object()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[first, second], _fsdp_param_group=first)) == [first, second]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=first)) == [first]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
