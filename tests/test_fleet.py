"""The compact wire (``ddphooks.fleet``) against the whole slots (``ddphooks.stats``).

In one process: W simulated ranks each pack their part of the compact wire, the parts are summed
(what the all-reduce does), and the ``FleetStats`` built from the sum must give what
``SilentStats`` gives from every rank's whole slot, computed the slow way: the same losses,
norms, dispersion, weighted and mean cosines, layer cosines and mean norms; each rank's own
cosines equal to the full path's (one step late); the sampled ranks' per-parameter norms.
The DDP runs (compact wire against whole slots, same data) are in ``tests/test_hook.py``.
"""

import json
import math
import pickle

import numpy as np
import pytest
import torch

from ddphooks import fleet, fleet_stats
from ddphooks.config import SilentConfig
from ddphooks import hosts as fleet_hosts
from ddphooks.hosts import host_blocks, matrix_from_record
from ddphooks.stats import ABSENT, BucketLayout, SilentStats, slot_size

BUCKETS = [BucketLayout(0, ("a", "b"), (30, 20)), BucketLayout(1, ("c", "d", "e"), (10, 40, 5))]
N_PARAMS, BINS = 5, 64


def _ranks(world: int, seed: int, absent: tuple[int, ...] = ()) -> list[dict]:
    """Per rank: loss, per-bucket squared norms, a sketch sharing a common direction."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(BINS, generator=generator)
    ranks = []
    for rank in range(world):
        gone = rank in absent
        local = [torch.rand(2, generator=generator) + 0.1, torch.rand(3, generator=generator) + 0.1]
        sketch = common + torch.randn(BINS, generator=generator)
        ranks.append(
            {
                "head": torch.tensor([0.0, 0.0, float(ABSENT)]) if gone else torch.tensor([1.5 + rank, 1.0, 0.0]),
                "local_sq": [torch.zeros_like(t) for t in local] if gone else local,
                "sketch": torch.zeros(BINS) if gone else sketch,
                "absent": gone,
            }
        )
    return ranks


def _full_stats(step: int, ranks: list[dict], reduced_sq: torch.Tensor, previous: SilentStats | None = None) -> SilentStats:
    """The whole slots, gathered: the reference path."""
    gathered = torch.stack([torch.cat([r["head"], *r["local_sq"], r["sketch"]]) for r in ranks])
    assert gathered.shape[1] == slot_size(N_PARAMS, BINS)
    return SilentStats(step, len(ranks), BUCKETS, gathered, reduced_sq, BINS, "piggyback", previous=previous)


def _compact(layout: fleet_stats.FleetLayout, rows: list[int], ranks: list[dict], own: list[np.ndarray] | None) -> torch.Tensor:
    """Every rank's part of the compact wire, summed."""
    total = torch.zeros(layout.size)
    for rank, r in enumerate(ranks):
        out = torch.zeros(layout.size)
        staged = _staged(layout, r, None if own is None else own[rank])
        fleet.pack(layout, rows, rank, r["head"][0], r["local_sq"], r["sketch"], staged, None, r["absent"], out, loss_count=int(r["head"][1]))
        total += out
    return total


def _staged(layout: fleet_stats.FleetLayout, rank: dict, values: np.ndarray | None = None) -> torch.Tensor:
    """``fleet.stage`` of a rank: its own values (None: unknown), its status and loss count from its head."""
    return fleet.stage(values, None, layout.n_params, int(rank["head"][2]), int(rank["head"][1]), torch.device("cpu"))


def _own(layout: fleet_stats.FleetLayout, wire: torch.Tensor, ranks: list[dict], previous: list[dict] | None, averages: list) -> list[np.ndarray]:
    """Every rank's ``own_values`` of the step (``averages`` updated in place)."""
    values = []
    for rank, r in enumerate(ranks):
        earlier = None if previous is None else previous[rank]["sketch"].numpy()
        own, averages[rank] = fleet.own_values(layout, fleet.own_sums(layout, wire).numpy(), r["sketch"].numpy(), earlier, torch.cat(r["local_sq"]).numpy(), averages[rank])
        values.append(own)
    return values


def _layer_reference(norms: np.ndarray, present: list[int], slow: dict) -> dict[int, tuple[float, int]]:
    """Every present rank's layer level and parameter the slow way (``own_values``' numbered
    steps), per rank and parameter in plain Python; ``slow`` carries the ranks' per-parameter
    state, the pooled scale and what each rank sends with its next step between calls."""
    n_params = norms.shape[1]
    ranks, pooled = slow.setdefault("ranks", {}), slow.setdefault("pooled", [{"s": 0.0, "w": 0.0} for _ in range(n_params)])
    # 1. the pooled scale learns from the present ranks' rises of their step before
    for p in range(n_params):
        sent = [ranks[r]["sent"][p] for r in present if r in ranks]
        learned = sum(1 for v in sent if v is not None)
        if learned:
            mean = sum(v for v in sent if v is not None) / learned
            pooled[p] = {"s": (1 - fleet.LAYER_RATE) * pooled[p]["s"] + fleet.LAYER_RATE * mean, "w": (1 - fleet.LAYER_RATE) * pooled[p]["w"] + fleet.LAYER_RATE}
    for r in ranks:
        ranks[r]["sent"] = [None] * n_params  # an absent rank sends nothing
    result = {}
    for rank in present:
        others = [sum(norms[r][p] for r in present if r != rank) / (len(present) - 1) for p in range(n_params)]
        d = [math.log(norms[rank][p]) - math.log(others[p]) for p in range(n_params)]
        median = sorted(d)[(len(d) - 1) // 2]  # the lower median
        d = [v - median for v in d]
        if rank not in ranks:
            ranks[rank] = {"a": list(d), "c": [0.0] * n_params, "seen": 1, "sent": [None] * n_params}
            result[rank] = (0.0, 0)
            continue
        mine = ranks[rank]
        for p, v in enumerate(d):
            rise = v - mine["a"][p]
            if mine["seen"] >= fleet.LAYER_WARMUP:
                typical = (pooled[p]["s"] / pooled[p]["w"] if pooled[p]["w"] > 0 else 0.0) + 1e-3
                mine["c"][p] = max(0.0, mine["c"][p] + min(rise / typical, fleet.LAYER_CAP) - fleet.LAYER_DRIFT)
            if mine["c"][p] == 0:
                mine["a"][p] = (1 - fleet.LAYER_RATE) * mine["a"][p] + fleet.LAYER_RATE * v
            mine["sent"][p] = math.sqrt(math.pi / 2) * abs(rise)  # every rise, for the pooled scale
        mine["seen"] += 1
        result[rank] = (max(mine["c"]), mine["c"].index(max(mine["c"])))
    return result


def test_sampled_ranks_move_on_every_step_and_cover_every_rank():
    assert fleet.sampled_ranks(10, 4, 0) == [0, 1, 2, 3]
    assert fleet.sampled_ranks(10, 4, 2) == [8, 9, 0, 1]
    assert fleet.sampled_ranks(3, 16, 5) == [0, 1, 2]  # fewer ranks than rows: every rank, every step
    seen = set()
    for index in range(math.ceil(4096 / 16)):
        seen.update(fleet.sampled_ranks(4096, 16, index))
    assert seen == set(range(4096))


@pytest.mark.parametrize("replicas", [0, 1, 3], ids=["ddp", "fsdp2", "hsdp"])
def test_the_step_kept_in_one_array_reads_as_its_parts(replicas):
    # What _keep_fleet copies to the host in one copy: the wire, the rank's own inputs, and DDP's
    # reduced norms unsquared after them (FSDP2: reduced_sq summed over its replicas, in the wire).
    # Read through KeptWire and HostParts, the step's statistics are those of the wire and the
    # squared norms as the device would have computed them, bit for bit.
    from ddphooks.devices import PendingHost

    world = 6
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4, reduced=N_PARAMS if replicas else 0)
    wire = _compact(layout, [0, 1, 2, 3], _ranks(world, 1, ()), None)
    own = torch.rand(N_PARAMS + BINS)
    norms = torch.rand(N_PARAMS) + 0.5
    if replicas:
        wire[layout.part("reduced_sq")] = norms * max(replicas, 1)
        reduced_sq = wire[layout.part("reduced_sq")] / replicas if replicas > 1 else wire[layout.part("reduced_sq")]
        kept_array = torch.cat([wire, own])
    else:
        reduced_sq = norms.square()  # the device's square, which the host's must equal
        kept_array = torch.cat([wire, own, norms])
    kept = fleet_stats.KeptWire(layout, own.numel(), replicas)
    assert kept.size == kept_array.numel()
    np.testing.assert_array_equal(kept.own_inputs(kept_array.numpy()), own.numpy())
    np.testing.assert_array_equal(kept.reduced_sq(kept_array.numpy()), reduced_sq.numpy())
    separate = fleet_stats.FleetStats(0, BUCKETS, layout, wire, reduced_sq, "piggyback", [0, 1, 2, 3], None)
    together = fleet_stats.FleetStats(0, BUCKETS, layout, PendingHost([kept_array]), None, "piggyback", [0, 1, 2, 3], None, kept=kept)
    assert together.summary() == separate.summary()
    np.testing.assert_array_equal(together.sampled_param_sq, separate.sampled_param_sq)
    a, b = together.slots(), separate.slots()
    for name in ("rows", "rest", "reduced_sq"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_whole_slots_kept_in_one_array_read_as_the_slots_and_the_squares():
    from ddphooks.devices import PendingHost
    from ddphooks.stats import HostParts, KeptSlots

    world, ranks = 6, _ranks(6, 1, ())
    gathered = torch.stack([torch.cat([r["head"], *r["local_sq"], r["sketch"]]) for r in ranks])
    norms = torch.rand(N_PARAMS) + 0.5
    kept = HostParts(PendingHost([torch.cat([gathered.reshape(-1), norms])]), KeptSlots(world, gathered.shape[1]).cut)
    together = SilentStats(0, world, BUCKETS, kept, None, BINS, "piggyback")
    separate = SilentStats(0, world, BUCKETS, gathered, norms.square(), BINS, "piggyback")
    assert together.summary() == separate.summary()
    np.testing.assert_array_equal(together.slots().gathered, separate.slots().gathered)
    np.testing.assert_array_equal(together.slots().reduced_sq, separate.slots().reduced_sq)


@pytest.mark.parametrize("replicas", [1, 2])
def test_slot_rows_kept_in_one_array_read_as_the_slots_and_the_summed_reduced_norms(replicas):
    """FSDP2's and DeepSpeed's rows (each rank's slot, then its part of the reduced squared
    norms), cut on the host: the slots as they were, the parts summed over the ranks (and divided
    by the replicas) in fp32, against torch's sum on the device."""
    from ddphooks.devices import PendingHost
    from ddphooks.stats import HostParts, KeptSlotRows

    world, ranks = 6, _ranks(6, 1, ())
    gathered = torch.stack([torch.cat([r["head"], *r["local_sq"], r["sketch"]]) for r in ranks])
    parts = torch.rand(world, N_PARAMS) * 10.0 ** torch.randint(-3, 3, (world, N_PARAMS))
    rows = torch.cat([gathered, parts], dim=1)
    kept = HostParts(PendingHost([rows.reshape(-1)]), KeptSlotRows(world, gathered.shape[1], replicas).cut)
    together = SilentStats(0, world, BUCKETS, kept, None, BINS, "fsdp2")
    separate = SilentStats(0, world, BUCKETS, gathered, parts.sum(dim=0) / replicas, BINS, "fsdp2")
    np.testing.assert_array_equal(together.slots().gathered, separate.slots().gathered)
    np.testing.assert_allclose(together.slots().reduced_sq, separate.slots().reduced_sq, rtol=1e-6)
    assert together.slots().reduced_sq.dtype == np.float32
    np.testing.assert_allclose(together.reduced_param_sq, rows[:, gathered.shape[1] :].double().sum(dim=0).numpy() / replicas, rtol=1e-6)


@pytest.mark.parametrize("absent", [(), (2,)])
def test_compact_wire_gives_the_whole_slots_statistics(absent):
    world = 6
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4)
    reduced_sq = torch.rand(N_PARAMS) + 0.05
    first, second = _ranks(world, 1, absent), _ranks(world, 2, absent)
    full_first = _full_stats(0, first, reduced_sq)
    full_second = _full_stats(1, second, reduced_sq, previous=full_first)

    # Step 0: no cosines yet. Each rank computes its own from the sum, and sends them at step 1.
    averages = [None] * world
    wire = _compact(layout, [0, 1, 2, 3], first, None)
    stats = fleet_stats.FleetStats(0, BUCKETS, layout, wire, reduced_sq, "piggyback", [0, 1, 2, 3], None)
    assert stats.cosine_loo is None and stats.cosine_to_others is None and stats.cosine is None and stats.layer_scores is None
    cosines = _own(layout, wire, first, None, averages)
    # Step 1: the values of step 0 travel; each rank compares with its own sketch of step 0.
    wire2 = _compact(layout, [4, 5, 0, 1], second, cosines)
    later = _own(layout, wire2, second, first, averages)
    stats2 = fleet_stats.FleetStats(1, BUCKETS, layout, wire2, reduced_sq, "piggyback", [4, 5, 0, 1], 0)

    for full, compact, own in ((full_first, stats, cosines), (full_second, stats2, later)):
        np.testing.assert_array_equal(compact.losses, full.losses)
        np.testing.assert_allclose(compact.grad_norms, full.grad_norms, rtol=1e-6)
        np.testing.assert_array_equal(compact.absent, full.absent)
        a, b = compact.summary(), full.summary()
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6, nan_ok=True), key
        # Each rank's own cosines, computed on the rank, equal the full path's from every sketch.
        own = np.stack(own)
        np.testing.assert_allclose(own[:, 0], full.cosine_loo, rtol=1e-5, atol=1e-6)
        if full.cosine_previous is not None:
            np.testing.assert_allclose(own[:, 1], full.cosine_previous, rtol=1e-5, atol=1e-6)
        # The layer CUSUMs are 0 in their warm-up (against the slow way: test_own_values_layer_cusum...).
        assert all(own[r, 2] == 0.0 for r in range(world) if r not in absent)
        for r in absent:
            assert np.isnan(own[r]).all()
        # The layer view: exact weighted mean cosines and mean norms, the sampled ranks' norms.
        record, reference = compact.to_dict(detail=True), full.to_dict(detail=True)
        present = ~full.absent
        for got, expected in zip(record["parameters"] + record["buckets"], reference["parameters"] + reference["buckets"]):
            assert got["weighted_mean_cosine"] == pytest.approx(expected["weighted_mean_cosine"], rel=1e-5, abs=1e-6)
            norms = np.array(expected["grad_norms"], dtype=float)
            assert got["grad_norm_mean"] == pytest.approx(norms[present].mean(), rel=1e-5)
            expected_sampled = [norms[r] if present[r] else None for r in record["sampled_ranks"]]  # an absent rank: null
            assert [v is None for v in got["grad_norms_sampled"]] == [v is None for v in expected_sampled]
            assert [v for v in got["grad_norms_sampled"] if v is not None] == pytest.approx([v for v in expected_sampled if v is not None], rel=1e-6)
        assert record["wire"] == "compact" and record["cosine"] is None
    # The values of step 0 arrive with step 1.
    assert stats2.cosines_step == 0
    np.testing.assert_allclose(stats2.cosine_loo, np.where(full_first.absent, np.nan, full_first.cosine_loo), rtol=1e-5, atol=1e-6)
    expected = np.where(full_first.absent, np.nan, 0.0)
    np.testing.assert_array_equal(stats2.layer_scores, expected)
    np.testing.assert_array_equal(stats2.layer_parameters, expected)
    assert np.isnan(stats2.cosine_previous).all()  # step 0 had no step before it
    sampled = stats2.param_sq[stats2.sampled]
    np.testing.assert_allclose(sampled, full_second.param_sq[stats2.sampled], rtol=1e-6)
    assert np.isnan(np.delete(stats2.param_sq, stats2.sampled, axis=0)).all()


def test_compact_records_of_a_whole_slot_run_are_those_the_compact_wire_writes():
    """``as_compact_records`` on the whole slots' records gives the compact wire's records (what
    the detector reads: losses, norms, the lagged cosines, the sampled ranks chosen from the
    layer scores, their layer norms and the mean norms)."""
    world, sampled = 6, 2
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=sampled)
    reduced_sq = torch.rand(N_PARAMS) + 0.05
    steps = [_ranks(world, seed) for seed in (5, 6, 7, 8, 9)]
    whole, compact, own, previous, stats, averages = [], [], None, None, None, [None] * world
    for index, ranks in enumerate(steps):
        full = _full_stats(index, ranks, reduced_sq, previous)
        whole.append(full.to_dict())
        rows = fleet.choose_sampled(world, sampled, index, None if stats is None else stats.layer_scores)  # as the hook chooses
        wire = _compact(layout, rows, ranks, own)
        stats = fleet_stats.FleetStats(index, BUCKETS, layout, wire, reduced_sq, "piggyback", rows, index - 1 if index else None)
        compact.append(stats.to_dict())
        own = _own(layout, wire, ranks, steps[index - 1] if index else None, averages)
        previous = full
    converted = fleet.as_compact_records(whole, sampled=sampled)
    assert [r["sampled_ranks"] for r in converted] == [r["sampled_ranks"] for r in compact]
    assert any(r["sampled_ranks"] != fleet.sampled_ranks(world, sampled, i) for i, r in enumerate(compact)), "the layer scores chose no rank"
    for got, expected in zip(converted, compact):
        assert got["cosines_step"] == expected["cosines_step"] and got["cosine_to_others"] is expected["cosine_to_others"] is None
        for key in ("losses", "grad_norms", "cosine_loo", "cosine_previous"):
            if got[key] is None:
                assert expected[key] is None or all(v is None for v in expected[key]), key
            else:
                assert [v is None for v in got[key]] == [v is None for v in expected[key]], key
                assert [v for v in got[key] if v is not None] == pytest.approx([v for v in expected[key] if v is not None], rel=1e-5, abs=1e-6), key
        for p, q in zip(got["parameters"] + got["buckets"], expected["parameters"] + expected["buckets"]):
            assert p["grad_norms_sampled"] == pytest.approx(q["grad_norms_sampled"], rel=1e-6)
            assert p["grad_norm_mean"] == pytest.approx(q["grad_norm_mean"], rel=1e-6)
    assert converted[0]["cosine_loo"] is None and converted[1]["cosine_loo"] == whole[0]["cosine_loo"]


def test_own_values_layer_cusum_against_the_slow_way_and_every_rank_at_once():
    """Each rank's layer CUSUM (``own_values``) against the slow way, step by step over its
    warm-up and a fault (rank 3's parameter 2 x4 from step 30), and the vectorised
    ``layer_levels`` (offline emulation, benchmarks) against both; rank 0 absent on step 10 (NaN,
    its CUSUM kept, its rises of step 9 never sent). The fault's level crosses the detector's
    layer limit (15) on its parameter."""
    world, n_params, steps = 5, 7, 40
    layout = fleet_stats.FleetLayout(world, n_params, 1, 0, 1)
    generator = np.random.default_rng(3)
    base = np.exp(generator.standard_normal(n_params))
    states, slow, twin = [None] * world, {}, None
    for step in range(steps):
        norms = base * np.exp(0.1 * generator.standard_normal((world, n_params)))
        if step >= 30:
            norms[3, 2] *= 4.0
        present = [r for r in range(world) if not (step == 10 and r == 0)]
        levels, parameters, twin = fleet.layer_levels(norms, present, twin)
        reference = _layer_reference(norms, present, slow)
        # The step's all-reduce: the present ranks' norms, and their rises of the step before.
        reduced = torch.zeros(layout.size, dtype=torch.float64)
        reduced[layout.part("param_norms")] = torch.from_numpy(norms[present].sum(axis=0))
        reduced[layout.part("present")] = float(len(present))
        for rank in present:
            if states[rank] is not None:
                reduced[layout.part("rise_sum")] += torch.from_numpy(states[rank].rise_sum)
                reduced[layout.part("rise_count")] += torch.from_numpy(states[rank].rise_count)
        for rank in range(world):
            if rank not in present:
                assert np.isnan(levels[rank]) and np.isnan(parameters[rank])
                absent_sq = np.zeros(n_params)  # no gradient: nothing to compare
                own, states[rank] = fleet.own_values(layout, fleet.own_sums(layout, reduced).numpy(), None, None, absent_sq, states[rank])
                assert np.isnan(own[2:]).all()
                continue
            own, states[rank] = fleet.own_values(layout, fleet.own_sums(layout, reduced).numpy(), None, None, norms[rank] ** 2, states[rank])
            level, parameter = reference[rank]
            assert float(own[2]) == pytest.approx(level, rel=1e-5, abs=1e-5) and levels[rank] == pytest.approx(level, rel=1e-9, abs=1e-9), (step, rank)
            if level > 0:
                assert int(own[3]) == parameter == int(parameters[rank]), (step, rank)
    assert levels[3] > 15 and parameters[3] == 2
    assert max(levels[r] for r in (0, 1, 2, 4)) < 15


def test_choose_sampled_takes_half_a_window_and_the_highest_layer_scores():
    scores = np.array([0.1, 0.2, 9.0, 0.0, np.nan, 3.0, 0.3, 0.2, 0.1, 0.0])
    assert fleet.choose_sampled(10, 4, 0, None) == [0, 1, 2, 3]  # the first step: the window alone
    assert fleet.choose_sampled(10, 4, 0, scores) == [0, 1, 2, 5]  # rank 2 is in the window already: then 5
    assert fleet.choose_sampled(10, 4, 1, scores) == [2, 3, 5, 6]
    # Unknown scores: from the second window, half the ranks away from the first (4 * 2 + 10 // 2 = 13: rank 3 on)
    assert fleet.choose_sampled(10, 5, 4, np.full(10, np.nan)) == [2, 3, 4, 5, 6]
    assert fleet.choose_sampled(4, 16, 3, scores[:4]) == [0, 1, 2, 3]


def test_choose_sampled_at_large_w_matches_the_choice_made_over_every_rank():
    """At W = 4096, with ties, unknown levels and the window's own ranks among the highest, the
    sampled ranks are those of sorting every rank (the slow way) and skipping the window's."""
    rng = np.random.default_rng(3)
    world, sampled = 4096, 16
    for index in range(40):
        levels = rng.choice([0.0, 0.5, 1.0, 7.0, np.nan], size=world, p=[0.5, 0.2, 0.2, 0.05, 0.05])
        window = fleet.sampled_ranks(world, sampled // 2, index)
        levels[window[: index % 5]] = 99.0  # some of the highest are in the window already
        tie = lambda r: (r - (index * (sampled - len(window)) + world // 2)) % world  # noqa: E731  (the second window's order)
        known = [r for r in range(world) if np.isfinite(levels[r])]
        order = sorted(known, key=lambda r: (-levels[r], tie(r))) + sorted((r for r in range(world) if not np.isfinite(levels[r])), key=tie)
        expected = window + [r for r in order if r not in window][: sampled - len(window)]
        assert fleet.choose_sampled(world, sampled, index, levels) == expected


@pytest.mark.parametrize("world, sampled", [(64, 16), (4096, 16), (100, 7)])
def test_on_healthy_steps_the_whole_budget_rotates_over_every_rank(world, sampled):
    # Every level 0 (a healthy run): ties broken by rank number sampled ranks 0-7 on every step.
    steps = math.ceil(world / (2 * (sampled // 2)))  # ceil(W / sampled) for an even budget
    seen = [fleet.choose_sampled(world, sampled, index, np.zeros(world)) for index in range(steps)]
    assert all(len(set(rows)) == sampled for rows in seen)
    assert set().union(*seen) == set(range(world))  # every rank within those steps
    assert set().union(*seen[:-1]) != set(range(world))  # and not sooner: the bound is the bound
    assert np.bincount(np.concatenate(seen), minlength=world).max() <= 2


def test_compact_wire_lists_the_rank_and_parameters_of_a_non_finite_gradient():
    world = 5
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=2)
    ranks = _ranks(world, 3)
    ranks[4]["local_sq"][1][2] = math.inf  # rank 4 (not sampled), parameter "e"
    wire = _compact(layout, [0, 1], ranks, None)
    stats = fleet_stats.FleetStats(0, BUCKETS, layout, wire, torch.ones(N_PARAMS), "piggyback", [0, 1], None)
    assert stats.nonfinite["gradients"] == [{"rank": 4, "bucket": 1, "parameter": "e"}]
    assert stats.nonfinite["gradient_count"] == 1


def _compact_steps() -> list[fleet_stats.FleetStats]:
    """Compact steps with what their buffers carry beyond the plain case, at W = 6: the ranks' own
    values of the step before and an absent rank; a replica check's verdict on the step after it
    (rank 4 flags itself) with a non-finite gradient; a detail step's W x W matrix; above
    ``detail_max_world`` a detail step's host-by-host matrix."""
    world, names = 6, ["a", "b", "c"]
    reduced_sq = torch.rand(N_PARAMS, generator=torch.Generator().manual_seed(5)) + 0.05
    plain = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4)
    checking = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4, fingerprinted=len(names))
    first, second, third = _ranks(world, 31, (2,)), _ranks(world, 32, (2,)), _ranks(world, 33)
    averages = [None] * world
    cosines = _own(plain, _compact(plain, [0, 1, 2, 3], first, None), first, None, averages)
    own = fleet_stats.FleetStats(1, BUCKETS, plain, _compact(plain, [4, 5, 0, 1], second, cosines), reduced_sq, "piggyback", [4, 5, 0, 1], 0, divided_by_present=True)
    fingerprints = torch.rand(world, len(names), 2, generator=torch.Generator().manual_seed(6))
    fingerprints[4, 1] *= 1.5
    wire = torch.zeros(checking.size)
    for rank, r in enumerate(third):
        out = torch.zeros(checking.size)
        fleet.pack(checking, [0, 1, 2, 3], rank, r["head"][0], r["local_sq"], r["sketch"], _staged(checking, r), fingerprints[rank].reshape(-1), False, out)
        wire += out
    check = fleet_stats.FleetStats(2, BUCKETS, checking, wire, reduced_sq, "piggyback", [0, 1, 2, 3], 1, names)
    after = _ranks(world, 34)
    after[3]["local_sq"][0][1] = math.inf
    wire = torch.zeros(plain.size)
    for rank, r in enumerate(after):
        out = torch.zeros(plain.size)
        fleet.pack(plain, [2, 3, 4, 5], rank, r["head"][0], r["local_sq"], r["sketch"], _staged(plain, r), None, False, out, differs=torch.tensor(float(rank == 4)))
        wire += out
    verdict = fleet_stats.FleetStats(3, BUCKETS, plain, wire, reduced_sq, "piggyback", [2, 3, 4, 5], 2, replica_check=check)
    detail = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4, matrix_rows=world)
    ranks = _ranks(world, 35)
    matrix = fleet_stats.FleetStats(4, BUCKETS, detail, _compact_detail(detail, ranks), reduced_sq, "piggyback", [0, 1], 3)
    blocks = host_blocks([f"node{r % 3}" for r in range(world)])
    by_host = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4, matrix_rows=blocks.count, host_form=True)
    hosts = fleet_stats.FleetStats(5, BUCKETS, by_host, _compact_detail(by_host, ranks, blocks), reduced_sq, "piggyback", [0, 1], 4, hosts=blocks)
    return [own, verdict, matrix, hosts]


def test_a_compact_step_rebuilt_from_its_slots_reads_as_the_same_observation_and_record():
    """What the detector's process gets of a compact step (``FleetSlots``, pickled) gives the
    same ``Observation`` and the same records, field for field, as the step itself."""
    from test_detect_process import _assert_same

    from ddphooks.detect import Observation

    steps = _compact_steps()
    for stats in steps:
        rebuilt = pickle.loads(pickle.dumps(stats.slots())).stats()
        assert type(rebuilt) is fleet_stats.FleetStats and rebuilt.sampled == stats.sampled
        _assert_same(Observation.from_stats(rebuilt), Observation.from_stats(stats))
        for settings in ({"detail": True}, {"detail": False}, {"detail": True, "detail_max_world": 4}):
            assert json.dumps(rebuilt.to_dict(**settings)) == json.dumps(stats.to_dict(**settings))
    own, verdict, matrix, hosts = steps
    assert not np.isnan(own.cosine_loo[[0, 1, 3, 4, 5]]).any() and own.absent.tolist() == [False, False, True, False, False, False]
    assert verdict.replicas["ranks"] == [4] and verdict.nonfinite["gradients"] == [{"rank": 3, "bucket": 0, "parameter": "b"}]
    assert matrix.cosine is not None and hosts.cosine_hosts() is not None


def test_compact_wire_against_the_fleet_budget():
    """Extra bytes per rank and step against #42's budget, 64 KB + 16 B x W, for the 16 M tiny
    Llama of the scale benchmark (273 parameters, 4 buckets, sketch 256): 24 B a rank (8 more than
    the budget's 16) and the sums and sampled rows' 23 KB fit up to W = 5203; at 4096 the wire is
    122 KB against 128 KB."""
    size = lambda world: 4 * fleet_stats.FleetLayout(world, 273, 4, 256, SilentConfig().sampled_ranks).size
    for world in (8, 32, 64, 256, 1024, 2048, 4096, 5203):
        assert size(world) <= 64 * 1024 + 16 * world, world
    assert size(4096) == 24 * 4096 + 4 * (16 * 273 + 4 * 273 + 4 + 1 + 2 * 256) == 122_212
    assert size(5204) > 64 * 1024 + 16 * 5204


def test_the_reduced_part_comes_last_and_only_where_a_transport_asks_for_it():
    """FSDP2's summed reduced shard norms (``FleetLayout.reduced``) follow every other part, so
    that DDP's wire (no such part) keeps its size and every offset; ``pack`` leaves the part to
    the transport (zeros)."""
    ddp = fleet_stats.FleetLayout(4, N_PARAMS, len(BUCKETS), BINS, sampled=2, fingerprinted=3)
    sharded = fleet_stats.FleetLayout(4, N_PARAMS, len(BUCKETS), BINS, sampled=2, fingerprinted=3, reduced=N_PARAMS)
    names = ("per_rank", "sampled", "param_sq", "param_norms", "rise_sum", "rise_count", "bucket_norms", "present", "sketch_sum", "unit_sum", "fingerprints")
    assert [ddp.part(name) for name in names] == [sharded.part(name) for name in names]
    assert ddp.part("reduced_sq") == slice(ddp.size, ddp.size) and sharded.part("reduced_sq") == slice(ddp.size, ddp.size + N_PARAMS)
    assert sharded.size == ddp.size + N_PARAMS == ddp.part("fingerprints").stop + N_PARAMS
    r = _ranks(4, 3)[1]
    out = torch.zeros(sharded.size)
    fleet.pack(sharded, [0, 1], 1, r["head"][0], r["local_sq"], r["sketch"], _staged(sharded, r), None, False, out)
    assert not out[sharded.part("reduced_sq")].any() and out[: ddp.size].any()


def _replica_check(fingerprints: torch.Tensor, names: list[str], shards: int = 1, sharded: int = 0) -> tuple[list[int], dict]:
    """W ranks' fingerprints (W x T x 2) through the compact replica check: each rank's one in
    the histograms, summed; each rank's own verdict; the record's ``replicas`` of the step after.
    Under HSDP (``shards``) the first ``sharded`` tensors are parameter shards (rank i holds
    shard i % shards): their histograms summed over each replica group apart (the transport's
    all-reduce over it), each shard's first replica sending its group's ``histogram_checks``."""
    world, tensors = fingerprints.shape[:2]
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), 0, sampled=2, fingerprinted=tensors, sharded=sharded)
    groups = torch.zeros(shards, sharded, fleet_stats.FINGERPRINT_BINS + 1)
    for rank in range(world):
        counts = torch.empty(sharded, fleet_stats.FINGERPRINT_BINS + 1)
        fleet.count_shards(fingerprints[rank].reshape(-1), counts)
        groups[rank % shards] += counts
    ranks = _ranks(world, 11)
    total = torch.zeros(layout.size)
    for rank, r in enumerate(ranks):
        out = torch.zeros(layout.size)
        checks = fleet_stats.histogram_checks(groups[rank]) if sharded and rank < shards else None
        fleet.pack(layout, [0, 1], rank, r["head"][0], r["local_sq"], None, _staged(layout, r), fingerprints[rank].reshape(-1), False, out, shard_checks=checks)
        total += out
    differs = lambda rank: fleet.replica_differs(layout, total, fingerprints[rank].reshape(-1), groups[rank % shards] if sharded else None)
    flagged = [rank for rank in range(world) if differs(rank).item() == 1.0]
    histograms = total[layout.part("fingerprints")].view(layout.histogram_rows, fleet_stats.FINGERPRINT_BINS + 1).double().numpy()
    checks = total[layout.part("shard_checks")].view(sharded, fleet_stats.SHARD_CHECK).double().numpy() if sharded else None
    return flagged, fleet_stats.replica_verdict(histograms, names, flagged, [], checked_step=7, shard_checks=checks)


@pytest.mark.parametrize(
    ("world", "changes"),
    [
        (5, {3: [0, 4, 9]}),  # one rank differs in three tensors
        (7, {1: [2], 5: list(range(12))}),  # a single tensor on one rank, every tensor on another
        (2, {1: [6]}),  # no majority: both ranks, as replica_differences names them
        (4, {}),  # replicas equal
    ],
)
def test_compact_replica_check_names_the_ranks_replica_differences_names(world, changes):
    """Against ``replica_differences`` on every rank's fingerprints (the whole slots' check)."""
    from ddphooks.stats import NOT_COMPARED, replica_differences

    generator = torch.Generator().manual_seed(world)
    tensors = 12
    names = [f"t{i}" for i in range(tensors)]
    fingerprints = (torch.rand(tensors, 2, generator=generator) + 1.0).expand(world, tensors, 2).clone()
    fingerprints[:, 11] = torch.tensor([NOT_COMPARED, NOT_COMPARED]) if world == 7 else fingerprints[:, 11]  # a buffer no rank compares
    for rank, which in changes.items():
        fingerprints[rank, which, 1] = torch.nextafter(fingerprints[rank, which, 1], torch.tensor(9.0))  # one ulp: bitwise different
    flagged, verdict = _replica_check(fingerprints, names)
    expected = replica_differences(fingerprints.double().numpy(), names)
    assert flagged == expected["ranks"] == verdict["ranks"]
    # A tensor's difference is seen where the differing fingerprints fall in another bin than the
    # others' (two different fingerprints share a bin 1 time in 64: then that tensor is not seen).
    bins = torch.stack([fleet.fingerprint_bins(fingerprints[rank].reshape(-1)) for rank in range(world)])
    seen = {p["name"] for p in expected["parameters"] if len(set(bins[:, names.index(p["name"])].tolist())) > 1}
    assert verdict["tensors"] == len(seen) and {p["name"] for p in verdict["parameters"]} == seen
    assert len(seen) >= expected["tensors"] - 1 and verdict["not_compared"] == expected["not_compared"]
    assert verdict["checked_step"] == 7 and all(p["relative_difference"] is None for p in verdict["parameters"])


@pytest.mark.parametrize(
    ("world", "shards", "changes"),
    [
        (8, 2, {5: [1], 2: [5]}),  # 4 replicas a shard: rank 5's shard of t1 against 3; a buffer on rank 2
        (6, 3, {4: [0]}),  # 2 replicas a shard: a tie, both holders of shard 1 (ranks 1 and 4) named
        (6, 3, {}),  # every shard's replicas equal (the shards differ from each other)
    ],
)
def test_hsdp_compact_replica_check_compares_each_shard_within_its_replicas(world, shards, changes):
    """Against ``replica_differences`` within each replica group for the parameter shards (what
    ``SilentStats.replicas`` does with ``replica_groups``) and over every rank for the buffers."""
    from ddphooks.stats import NOT_COMPARED, replica_differences

    generator = torch.Generator().manual_seed(world + shards)
    sharded, buffers = 4, 3
    names = [f"p{i}" for i in range(sharded)] + [f"b{i}" for i in range(buffers)]
    per_shard = torch.rand(shards, sharded, 2, generator=generator) + 1.0  # each shard its own values
    fingerprints = torch.cat([per_shard[torch.arange(world) % shards], (torch.rand(buffers, 2, generator=generator) + 1.0).expand(world, buffers, 2)], dim=1)
    fingerprints[:, sharded + 2] = NOT_COMPARED  # a buffer that moved (running statistics)
    for rank, which in changes.items():
        fingerprints[rank, which, 1] = torch.nextafter(fingerprints[rank, which, 1], torch.tensor(9.0))
    flagged, verdict = _replica_check(fingerprints, names, shards, sharded)
    groups = [list(range(s, world, shards)) for s in range(shards)]
    # The slow reference: each shard's replicas (ranked globally), then the buffers over the mesh.
    expected = {}
    for group in groups:
        for found in replica_differences(fingerprints[group, :sharded].double().numpy(), names[:sharded])["parameters"]:
            expected.setdefault(found["name"], set()).update(group[r] for r in found["ranks"])
    everyone = replica_differences(fingerprints[:, sharded:].double().numpy(), names[sharded:])
    buffer_ranks = {found["name"]: set(found["ranks"]) for found in everyone["parameters"]}
    ranks = sorted(set().union(*expected.values(), *buffer_ranks.values()))
    # (These seeds put every differing fingerprint in another bin than its replicas': nothing unseen.)
    assert flagged == verdict["ranks"] == ranks
    assert verdict["tensors"] == len(expected) + len(buffer_ranks) and verdict["not_compared"] == everyone["not_compared"] == 1
    got = {p["name"]: p for p in verdict["parameters"]}
    assert set(got) == set(expected) | set(buffer_ranks)
    for name, holders in expected.items():  # a parameter once, with how many shards' replicas differ
        assert got[name]["ranks"] == ranks and got[name]["shards_differing"] == len({r % shards for r in holders})
        assert got[name]["ranks_differing"] == len(holders)
    for name, holders in buffer_ranks.items():  # a buffer: every flagged rank (which one differs is not sent)
        assert "shards_differing" not in got[name] and got[name]["ranks"] == ranks and got[name]["ranks_differing"] == len(holders)
    # in the wire over the whole mesh: a histogram per buffer and 3 numbers per parameter, whatever the shards
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), 0, sampled=2, fingerprinted=len(names), sharded=sharded)
    assert layout.part("fingerprints").stop - layout.part("fingerprints").start == buffers * (fleet_stats.FINGERPRINT_BINS + 1)
    assert layout.part("shard_checks").stop - layout.part("shard_checks").start == sharded * fleet_stats.SHARD_CHECK


def test_fingerprint_bins_are_equal_for_equal_fingerprints_and_spread_over_the_bins():
    generator = torch.Generator().manual_seed(0)
    prints = torch.rand(4096, 2, generator=generator) + 0.5
    bins = fleet.fingerprint_bins(prints.reshape(-1))
    assert torch.equal(bins, fleet.fingerprint_bins(prints.clone().reshape(-1)))
    counts = torch.bincount(bins, minlength=fleet_stats.FINGERPRINT_BINS)
    assert counts.numel() == fleet_stats.FINGERPRINT_BINS and counts.min() > 30 and counts.max() < 100  # about 64 each
    nudged = prints.clone()
    nudged[:, 0] = torch.nextafter(nudged[:, 0], torch.tensor(9.0))  # one ulp in every L1 norm
    moved = (fleet.fingerprint_bins(nudged.reshape(-1)) != bins).float().mean().item()
    assert moved > 0.95  # 1 in 64 share a bin by chance


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"gather_max_world": 0}, ValueError, r"gather_max_world=0 must be >= 1"),
        ({"gather_max_world": 2.0}, TypeError, r"gather_max_world must be an int"),
        ({"sampled_ranks": 0}, ValueError, r"sampled_ranks=0 must be >= 1"),
    ],
)
def test_bad_compact_wire_settings_are_refused(settings, error, match):
    with pytest.raises(error, match=match):
        SilentConfig(**settings)


def test_compact_row_carries_mean_loss_status_and_layer_parameter_exactly():
    """The 6-number row: the rank's mean loss (NaN where it counted none, listed as non-finite only
    where it counted one), its status flags and its layer parameter in one number, decoded
    exactly, up to the largest parameter index the room allows."""
    from ddphooks.stats import REPLICA_CHECK_REQUESTED

    world = 4
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4)
    ranks = _ranks(world, 5)
    ranks[0]["head"] = torch.tensor([3.0, 2.0, 0.0])  # two losses: the mean 1.5
    ranks[1]["head"] = torch.tensor([0.0, 0.0, float(REPLICA_CHECK_REQUESTED)])  # no loss, asks for a check
    ranks[2]["head"] = torch.tensor([math.inf, 1.0, 0.0])  # a non-finite loss
    largest = 2**24 // fleet_stats.STATUS_ROOM - 2  # status + STATUS_ROOM (parameter + 1) stays below 2**24: exact in fp32
    own = [torch.tensor([0.5, 0.25, 3.0, p]) for p in (4.0, math.nan, largest, 0.0)]
    wire = _compact(layout, [0, 1, 2, 3], ranks, own)
    stats = fleet_stats.FleetStats(1, BUCKETS, layout, wire, torch.ones(N_PARAMS), "piggyback", [0, 1, 2, 3], 0)
    losses = stats.losses
    assert losses[0] == 1.5 and math.isnan(losses[1]) and losses[2] == math.inf and losses[3] == 4.5
    assert stats.nonfinite["losses"] == [2]
    assert stats.replica_check_requested and stats.status.tolist() == [0, REPLICA_CHECK_REQUESTED | fleet_stats.NO_LOSS, 0, 0]
    parameters = stats.layer_parameters
    assert parameters[0] == 4 and math.isnan(parameters[1]) and parameters[2] == largest and parameters[3] == 0
    assert stats.layer_scores.tolist() == [3.0] * world and stats.cosine_loo.tolist() == [0.5] * world


def test_the_default_wire_is_the_whole_slot_up_to_16_ranks_and_the_compact_wire_above():
    """DDP's default ``gather_max_world`` (16): whole slots on two 8-accelerator nodes, the compact
    wire above; None keeps the whole slot at any W; FSDP2 has DDP's default, DeepSpeed says whole
    slots (None)."""
    from types import SimpleNamespace

    from ddphooks.deepspeed import DeepSpeedSilentState
    from ddphooks.fsdp import ShardedSilentState
    from ddphooks.hook import SilentState

    assert SilentConfig().gather_max_world == 16
    record = SimpleNamespace(step=1, layouts=BUCKETS, fingerprinted=[])  # not a detail step (step 0 is)
    default, whole = SilentState(), SilentState(gather_max_world=None)
    for world, compact in ((2, False), (16, False), (17, True), (4096, True)):
        default.world_size = whole.world_size = world
        default.bins = whole.bins = BINS  # set when binding
        layout = default._fleet_layout(record, N_PARAMS)
        assert (layout is not None) == compact, world
        assert layout is None or layout.world == world and layout.sampled == 16
        assert whole._fleet_layout(record, N_PARAMS) is None
    sharded = ShardedSilentState()
    assert (sharded.config.gather_max_world, sharded.config.sampled_ranks) == (16, 16)
    assert DeepSpeedSilentState().config.gather_max_world is None


def test_hsdp_check_steps_carry_the_shards_checks_whatever_the_shards_and_the_buffer_is_sized_for_them():
    """HSDP: a check step's compact wire has one histogram per buffer and ``SHARD_CHECK`` numbers
    per parameter, for 4 replicas of 2 shards as for 2 replicas of 2048 (the parameters'
    histograms are summed over each replica group apart), a step without a check neither, and the
    persistent buffer's capacity is the check step's size (a check does not reallocate it); plain
    FSDP2 one histogram per tensor."""
    from types import SimpleNamespace

    from ddphooks.fsdp import ShardedSilentState
    from ddphooks.replicas import ReplicaTensors

    module = torch.nn.Linear(3, 2)
    module.register_buffer("mask", torch.ones(3))
    state = ShardedSilentState(gather_max_world=4)
    state._replica_tensors = ReplicaTensors(list(module.named_parameters()), module, broadcast_buffers=False)
    sizes = []
    for replicas, shards in ((4, 2), (2, 2048)):
        state.world_size, state.bins, state._shards, state._replicas = replicas * shards, BINS, shards, replicas  # set when binding
        state.hosts = host_blocks([f"node{r // 8}" for r in range(replicas * shards)])
        plain = state._fleet_layout(SimpleNamespace(step=1, layouts=BUCKETS, fingerprinted=[]), N_PARAMS, reduced=N_PARAMS)
        check = state._fleet_layout(SimpleNamespace(step=1, layouts=BUCKETS, fingerprinted=state._replica_tensors.names), N_PARAMS, reduced=N_PARAMS)
        assert (plain.sharded, plain.histogram_rows) == (0, 0)
        assert (check.sharded, check.histogram_rows) == (2, 1)  # weight and bias checked within the replica groups; the mask
        assert check.size == plain.size + (fleet_stats.FINGERPRINT_BINS + 1) + 2 * fleet_stats.SHARD_CHECK
        # The buffer's capacity: a check on a detail step (step 0), whose matrix part is W rows
        # (8 ranks) or one row and count per block (4096 ranks on 512 hosts, two a block).
        detail = state._fleet_layout(SimpleNamespace(step=0, layouts=BUCKETS, fingerprinted=state._replica_tensors.names), N_PARAMS, reduced=N_PARAMS)
        rows = 8 if replicas * shards == 8 else 256
        assert detail.size == check.size + rows * (BINS + detail.host_form) == state._fleet_capacity(plain)
        sizes.append(check.size - plain.size)
    assert sizes[0] == sizes[1]
    state._replicas = 1  # plain FSDP2: the same tensors, one histogram each over the mesh
    assert state._fleet_layout(SimpleNamespace(step=1, layouts=BUCKETS, fingerprinted=state._replica_tensors.names), N_PARAMS).histogram_rows == 3


# -- the cosine matrix on detail steps (issue 56) ------------------------------------------------
def _compact_detail(layout: fleet_stats.FleetLayout, ranks: list[dict], blocks=None) -> torch.Tensor:
    """Every rank's part of a detail step's compact wire, summed: its sketch in its row (the rank
    form), or its unit sketch in its host's row (``blocks``: the host form)."""
    total = torch.zeros(layout.size)
    for rank, r in enumerate(ranks):
        out = torch.zeros(layout.size)
        row = blocks.of_rank[rank] if layout.host_form else rank
        fleet.pack(layout, [0, 1], rank, r["head"][0], r["local_sq"], r["sketch"], _staged(layout, r), None, r["absent"], out, matrix_row=row)
        total += out
    return total


def _block_means(cosine: np.ndarray, blocks, present: np.ndarray) -> np.ndarray:
    """The slow way: each pair of hosts' mean over their present ranks' pairs of ``cosine``
    (W x W), distinct ranks only; NaN where there is no such pair."""
    size = blocks.count
    result = np.full((size, size), np.nan)
    for a in range(size):
        for b in range(size):
            pairs = [cosine[i, j] for i in blocks.ranks[a] for j in blocks.ranks[b] if i != j and present[i] and present[j]]
            if pairs:
                result[a, b] = sum(pairs) / len(pairs)
    return result


@pytest.mark.parametrize("absent", [(), (2,)])
def test_a_detail_step_carries_every_ranks_sketch_and_the_whole_slots_matrix(absent):
    """Up to ``detail_max_world`` a detail step's compact wire carries each rank's sketch (a
    gather): the W x W matrix is the whole slots' (to fp32 rounding; the record's rounded to 3
    decimals), an absent rank's row and column NaN; the step's other statistics are unchanged."""
    world = 6
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4, matrix_rows=world)
    plain = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4)
    assert layout.size == plain.size + world * BINS and layout.part("matrix").start == plain.size  # after every other part
    ranks, reduced_sq = _ranks(world, 21, absent), torch.rand(N_PARAMS) + 0.05
    full = _full_stats(0, ranks, reduced_sq)
    wire = _compact_detail(layout, ranks)
    stats = fleet_stats.FleetStats(0, BUCKETS, layout, wire, reduced_sq, "piggyback", [0, 1], None)
    np.testing.assert_allclose(stats.cosine, full.cosine, rtol=1e-5, atol=1e-6)
    assert np.isnan(stats.cosine[list(absent)]).all() and np.isnan(stats.cosine[:, list(absent)]).all()
    without = fleet_stats.FleetStats(0, BUCKETS, plain, torch.cat([wire[: plain.size]]), reduced_sq, "piggyback", [0, 1], None)
    assert without.cosine is None and without.summary() == pytest.approx(stats.summary(), nan_ok=True)
    record = stats.to_dict(detail=True)
    matrix = np.array([[np.nan if v is None else v for v in row] for row in record["cosine"]])
    np.testing.assert_allclose(matrix, full.cosine, atol=5e-4 + 1e-6)
    assert all(v is None or round(v, 3) == v for row in record["cosine"] for v in row)
    assert "cosine_hosts" not in record and record["cosine"][0][0] == 1.0
    assert stats.to_dict(detail=False).get("cosine") is None


@pytest.mark.parametrize("absent", [(), (5,)])
def test_above_detail_max_world_a_detail_step_carries_each_hosts_unit_sketches_and_their_block_means(absent):
    """Above ``detail_max_world`` the wire carries each host's sum of its ranks' unit sketches:
    the host-by-host matrix is each block's mean of the W x W matrix (the slow way, from every
    rank's sketch), with the within-host mean on its diagonal; whole slots give the same from
    their sketches. Hosts need not be contiguous; an absent rank is left out."""
    world = 12
    hosts = [f"node{(r * 5) % 4}" for r in range(world)]  # 3 ranks a host, not in rank order
    blocks = host_blocks(hosts)
    assert blocks.count == 4 and blocks.labels == ("node0", "node1", "node2", "node3") and blocks.ranks[1] == [1, 5, 9]
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=4, matrix_rows=blocks.count, host_form=True)
    ranks, reduced_sq = _ranks(world, 22, absent), torch.rand(N_PARAMS) + 0.05
    full = _full_stats(0, ranks, reduced_sq)
    wire = _compact_detail(layout, ranks, blocks)
    stats = fleet_stats.FleetStats(0, BUCKETS, layout, wire, reduced_sq, "piggyback", [0, 1], None, hosts=blocks)
    assert stats.cosine is None
    slow = _block_means(full.cosine, blocks, ~full.absent)
    got = stats.cosine_hosts()
    np.testing.assert_allclose(got.cosine, slow, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full.cosine_hosts(blocks).cosine, slow, rtol=1e-9, atol=1e-12)
    assert got.present.tolist() == [3.0 - sum(1 for r in absent if blocks.of_rank[r] == b) for b in range(4)]
    record = stats.to_dict(detail=True, detail_max_world=8)
    entry = record["cosine_hosts"]
    assert record["cosine"] is None and entry["hosts"] == list(blocks.labels) and entry["ranks"] == blocks.ranks
    assert [len(row) for row in entry["hundredths"]] == [1, 2, 3, 4] and all(isinstance(v, int) for row in entry["hundredths"] for v in row)
    np.testing.assert_allclose(matrix_from_record(entry), slow, atol=0.005 + 1e-6)
    # Whole slots above detail_max_world: the same record from every rank's sketch.
    whole = full.to_dict(detail=True, detail_max_world=8, hosts=blocks)["cosine_hosts"]
    assert whole["hosts"] == entry["hosts"] and whole["present"] == entry["present"]
    np.testing.assert_allclose(matrix_from_record(whole), matrix_from_record(entry), atol=0.01 + 1e-9)
    json.dumps(record, allow_nan=False)


def test_host_blocks_follow_the_identity_tables_hosts_and_merge_beyond_the_limit():
    assert host_blocks(["b", "b", "a", "a"]).labels == ("b", "a")  # in the order of each host's first rank
    merged = host_blocks([f"n{r // 2:03d}" for r in range(24)], max_blocks=4)  # 12 hosts, 4 blocks of 3
    assert merged.labels == ("n000..n002", "n003..n005", "n006..n008", "n009..n011") and merged.ranks[0] == [0, 1, 2, 3, 4, 5]
    same = host_blocks(["fake"] * 1024)  # one host for every rank (the fake process group): blocks of 8 ranks
    assert same.count == 128 and same.labels[1] == "ranks 8-15" and same.of_rank[1023] == 127
    assert host_blocks(["x"] * 8192).count == 256 and host_blocks(["x"]).count == 1
    big = host_blocks([f"node{r // 8:04d}" for r in range(4096)])  # 512 hosts: two a block
    assert big.count == fleet_hosts.MAX_BLOCKS == 256 and big.labels[1] == "node0002..node0003" and big.ranks[1] == list(range(16, 32))


def _sketch_rows(gradients: torch.Tensor, bins: int, seed: int = 0) -> torch.Tensor:
    """Each row's CountSketch with the hook's kernel and sign table (of ``seed``)."""
    from ddphooks.sketch import BucketPlan, BucketStatsKernel, SignTable

    kernel = BucketStatsKernel(bins, torch.device("cpu"), SignTable(seed, bins, torch.device("cpu")))
    plan = BucketPlan([gradients.shape[1]], bins, 0, torch.device("cpu"), 1 << 17)
    sketches = torch.zeros(len(gradients), bins)
    for row, g in zip(sketches, gradients):
        kernel.run(g.clone(), plan, row, torch.empty(1))
    return sketches


def test_the_matrices_against_the_exact_cosines_of_the_gradients():
    """The accuracy of both forms against exact cosines (float64, from the full gradients), at
    the default sketch (251 bins): 32 ranks on 4 hosts, hosts 0-1 and 2-3 on two different data
    distributions (two shared directions and noise). RMS error within ``1/sqrt(bins)``, averaged
    over four projection seeds: one seed's RMS scatters around its mean (0.058 +- 0.004 over 18
    seeds and data draws on 2026-12-07, 0.065 at worst, with the hashed table signs; 0.059 +-
    0.005, 0.071 at worst, with the PCG64 table before them), so a single seed would be a coin
    flip against a bound of 0.063."""
    from ddphooks.sketch import sketch_bins

    bins, world, dim = sketch_bins(256), 32, 200_000
    generator = torch.Generator().manual_seed(3)
    shared = torch.randn(2, dim, generator=generator, dtype=torch.float64)
    group = torch.tensor([0] * 16 + [1] * 16)
    gradients = shared[group] + 1.2 * torch.randn(world, dim, generator=generator, dtype=torch.float64)
    unit = gradients / gradients.norm(dim=1, keepdim=True)
    exact = (unit @ unit.T).numpy()
    blocks = host_blocks([f"node{r // 8}" for r in range(world)])
    bound = 1 / math.sqrt(bins)
    rank_layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), bins, sampled=4, matrix_rows=world)
    host_layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), bins, sampled=4, matrix_rows=blocks.count, host_form=True)
    reference = _block_means(exact, blocks, np.ones(world, dtype=bool))
    off = ~np.eye(world, dtype=bool)
    rank_rms, host_rms = [], []
    for seed in range(4):
        sketches = _sketch_rows(gradients.float(), bins, seed)
        ranks = [{"head": torch.tensor([1.0, 1.0, 0.0]), "local_sq": [torch.ones(2), torch.ones(3)], "sketch": s, "absent": False} for s in sketches]
        rank_stats = fleet_stats.FleetStats(0, BUCKETS, rank_layout, _compact_detail(rank_layout, ranks), torch.ones(N_PARAMS), "piggyback", [0, 1], None)
        rank_rms.append(float(np.sqrt(np.mean((rank_stats.cosine - exact)[off] ** 2))))
        host_stats = fleet_stats.FleetStats(0, BUCKETS, host_layout, _compact_detail(host_layout, ranks, blocks), torch.ones(N_PARAMS), "piggyback", [0, 1], None, hosts=blocks)
        host_rms.append(float(np.sqrt(np.mean((host_stats.cosine_hosts().cosine - reference) ** 2))))
        # The two data distributions: within a group well above across groups, in both forms.
        matrix = host_stats.cosine_hosts().cosine
        assert min(matrix[0, 1], matrix[2, 3]) > max(matrix[0, 2], matrix[1, 3]) + 0.2
    print(f"rank-by-rank RMS {rank_rms}, host-by-host RMS {host_rms}, bound 1/sqrt({bins}) = {bound:.4f}")
    assert np.mean(rank_rms) < bound and np.mean(host_rms) < bound


def test_detail_steps_keep_the_compact_wire_within_its_budget_averaged_over_detail_every():
    """#42's budget, 64 KB + 16 B x W a step, averaged over ``detail_every`` (100) and
    ``check_replicas_every`` (100): the 16 M tiny Llama of the scale benchmark (273 parameters,
    275 tensors checked, 4 buckets, the default sketch's 251 bins), 8 ranks a host. A detail step
    adds W x 251 x 4 B up to 256 ranks (2.6 KB a step averaged at W = 256), H x 252 x 4 B above
    (2.6 KB at W = 4096 on 512 hosts, two a block)."""
    bins, config = 251, SilentConfig()
    for world in (32, 256, 1024, 4096):
        hosts = host_blocks([f"node{r // 8}" for r in range(world)])
        rows, host_form = (world, False) if world <= config.detail_max_world else (hosts.count, True)
        plain = fleet_stats.FleetLayout(world, 273, 4, bins, config.sampled_ranks)
        detail = fleet_stats.FleetLayout(world, 273, 4, bins, config.sampled_ranks, matrix_rows=rows, host_form=host_form)
        check = fleet_stats.FleetLayout(world, 273, 4, bins, config.sampled_ranks, fingerprinted=275)
        averaged = 4 * (plain.size + (detail.size - plain.size) / config.detail_every + (check.size - plain.size) / config.check_replicas_every)
        assert averaged <= 64 * 1024 + 16 * world, world
        extra = 4 * (detail.size - plain.size) / config.detail_every
        assert extra == pytest.approx({32: 321.3, 256: 2570.2, 1024: 1290.2, 4096: 2580.5}[world], abs=0.1), world


def test_a_present_rank_with_no_loss_and_a_zero_sketch_against_the_slow_way():
    """A rank that counted no loss sends a mean loss of 0 and ``NO_LOSS`` in its status; a rank
    whose sketch is 0 adds nothing to the unit sum (not 0 / 0) and has no own cosines; another
    rank's own cosines, to the others and to its previous sketch, are the plain formula's."""
    world = 3
    layout = fleet_stats.FleetLayout(world, N_PARAMS, len(BUCKETS), BINS, sampled=2)
    ranks = _ranks(world, 5)
    ranks[1]["head"], ranks[1]["sketch"] = torch.tensor([0.0, 0.0, 0.0]), torch.zeros(BINS)
    total = _compact(layout, [0, 1], ranks, None)
    row = total[layout.part("per_rank")].view(world, fleet_stats.PER_RANK)[1]
    assert row[fleet_stats.WIRE_LOSS] == 0.0 and row[fleet_stats.WIRE_STATUS] == fleet_stats.NO_LOSS
    unit = sum(r["sketch"] / r["sketch"].norm() for r in (ranks[0], ranks[2]))
    torch.testing.assert_close(total[layout.part("unit_sum")], unit)
    sums, local = fleet.own_sums(layout, total).numpy(), [torch.cat(r["local_sq"]).numpy() for r in ranks]
    own, _ = fleet.own_values(layout, sums, ranks[1]["sketch"].numpy(), ranks[0]["sketch"].numpy(), local[1], None)
    assert np.isnan(own[:2]).all()
    previous = torch.randn(BINS, generator=torch.Generator().manual_seed(9))
    own, _ = fleet.own_values(layout, sums, ranks[0]["sketch"].numpy(), previous.numpy(), local[0], None)
    mine, others = ranks[0]["sketch"].double(), (ranks[1]["sketch"] + ranks[2]["sketch"]).double()
    cosine = lambda a, b: float(a @ b / (a.norm() * b.norm()))
    assert float(own[0]) == pytest.approx(cosine(mine, others), abs=1e-6)
    assert float(own[1]) == pytest.approx(cosine(mine, previous.double()), abs=1e-6)
    own, _ = fleet.own_values(layout, sums, ranks[0]["sketch"].numpy(), None, local[0], None)
    assert float(own[0]) == pytest.approx(cosine(mine, others), abs=1e-6) and np.isnan(own[1])
