"""The inter-worker cosine matrix above ``gather_max_world`` (issue 56), on real gloo process groups
and on the fake process group, against the slow obvious reference.

At W = 20 (the compact wire at the defaults) ranks 0-9 and 10-19 train on two different data
distributions: every detail record carries the sketched 20 x 20 matrix (and, with
``detail_max_world`` below 20, the host-by-host one of four synthetic hosts), each within the
1/sqrt(k) RMS bound of the exact cosines from all-gathered full gradients, the two groups apart;
training is bitwise that of ``allreduce_hook``; ``ddphooks report`` draws both. At W = 1024 on the
fake process group (one process, 128 synthetic hosts) a detail record carries the host-by-host
matrix and the report draws it.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import ddphooks
from ddphooks import JsonlSink
from ddphooks.experiment.report import read_run, write_report
from ddphooks.hosts import matrix_from_record
from ddphooks.identity import RankTable
from ddphooks.launch import spawn
from ddphooks.sketch import sketch_bins

WORLD, GROUP, RANKS_PER_HOST, STEPS = 20, 10, 5, 3
BINS = sketch_bins(256)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks 0-9 and 10-19 on two data distributions (other inputs, other targets); each rank
    its own draw of its group's."""
    group = rank // GROUP
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 16, generator=generator) + (2.0 if group else -2.0)
    targets = torch.Generator().manual_seed(77 + group)
    y = torch.tanh(x @ torch.randn(16, 8, generator=targets)) + 0.1 * torch.randn(64, 8, generator=generator)
    return x, y


def _with_host(local_identity):
    """``local_identity`` naming the host ``node<rank // 5>``: four hosts of five ranks on one machine."""

    def named(global_rank, group_rank, device):
        return dataclasses.replace(local_identity(global_rank, group_rank, device), host=f"node{global_rank // RANKS_PER_HOST}")

    return named


def _check_two_groups(rank: int, world: int, paths: list[str]) -> dict:
    import ddphooks.state as state_module

    state_module.local_identity = _with_host(state_module.local_identity)
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        models.append(DDP(_Net()))
    plain, by_rank, by_host = models
    plain.register_comm_hook(None, allreduce_hook)
    states = [
        ddphooks.attach(by_rank, detail_every=1, sinks=[JsonlSink(paths[0])]),  # the defaults: the compact wire, W <= detail_max_world
        ddphooks.attach(by_host, detail_every=1, detail_max_world=8, transport="separate", sinks=[JsonlSink(paths[1])]),
    ]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.05) for model in models]
    exact = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        # The slow obvious reference: this rank's local gradient, all-gathered in float64.
        params = list(by_rank.module.parameters())
        local = torch.autograd.grad(torch.nn.functional.mse_loss(by_rank.module(x), y), params)
        flat = torch.cat([g.reshape(-1) for g in local]).double()
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        full = torch.stack(gathered)
        unit = full / full.norm(dim=1, keepdim=True)
        exact.append((unit @ unit.T).tolist())
        for model, state in zip(models, [None, *states]):
            loss = torch.nn.functional.mse_loss(model(x), y)
            if state is not None:
                state.observe_loss(loss)
            loss.backward()
        for state in states:
            state.flush()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    latest = [state.latest for state in states]
    for state in states:
        state.close()
    # Training unchanged: the separate transport bitwise allreduce_hook's at any W; the piggyback
    # (the gradients and the statistics in one all-reduce) to rounding, as without the matrix.
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), by_host.parameters()))
    for a, b in zip(plain.parameters(), by_rank.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    transports = [s.transport for s in latest]
    return {"exact": exact, "wire": [type(s).__name__ for s in latest], "transports": transports, "hosts": list(states[1].hosts.labels)}


def _block_means(cosine: np.ndarray, blocks: list[list[int]]) -> np.ndarray:
    """Each pair of hosts' mean cosine over its pairs of distinct ranks, the slow way."""
    return np.array([[np.mean([cosine[i, j] for i in a for j in b if i != j]) for b in blocks] for a in blocks])


@pytest.fixture(scope="module")
def twenty_ranks(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("w20")
    paths = [str(folder / "by-rank.jsonl"), str(folder / "by-host.jsonl")]
    results = spawn(_check_two_groups, WORLD, args=(paths,), timeout=240, threads=1)
    return {"paths": paths, "results": results, "folder": folder}


def test_w20_detail_records_carry_the_matrix_that_shows_the_two_groups(twenty_ranks):
    result = twenty_ranks["results"][0]
    assert result["wire"] == ["FleetStats", "FleetStats"] and result["hosts"] == ["node0", "node1", "node2", "node3"]
    assert result["transports"] == ["piggyback", "separate"]
    by_rank, by_host = (read_run(path).records for path in twenty_ranks["paths"])
    assert len(by_rank) == len(by_host) == STEPS
    bound = 1 / math.sqrt(BINS)
    group = np.arange(WORLD) // GROUP
    same, other = group[:, None] == group[None, :], group[:, None] != group[None, :]
    off = ~np.eye(WORLD, dtype=bool)
    for record, host_record, exact in zip(by_rank, by_host, result["exact"]):
        exact = np.array(exact)
        assert record["wire"] == "compact" and record["detail"] and len(record["cosine"]) == WORLD
        matrix = np.array(record["cosine"], dtype=float)
        rms = float(np.sqrt(np.mean((matrix - exact)[off] ** 2)))
        assert rms < bound, (record["step"], rms)
        # The two groups: within each, the ranks' gradients agree; across, they do not.
        assert matrix[same & off].mean() > matrix[other].mean() + 0.3, record["step"]
        entry = host_record["cosine_hosts"]
        assert host_record["cosine"] is None and entry["hosts"] == result["hosts"] and entry["present"] == [5, 5, 5, 5]
        hosts = matrix_from_record(entry)
        reference = _block_means(exact, entry["ranks"])
        host_rms = float(np.sqrt(np.mean((hosts - reference) ** 2)))
        assert host_rms < bound, (record["step"], host_rms)
        assert min(hosts[0, 1], hosts[2, 3]) > max(hosts[0, 2], hosts[1, 3]) + 0.3
        print(f"step {record['step']}: rank-by-rank RMS {rms:.4f}, host-by-host RMS {host_rms:.4f} (bound {bound:.4f})")
    assert [RankTable.from_record(r).identities[7].host for r in (by_rank[0], by_host[0])] == ["node1", "node1"]


def test_the_report_draws_the_w20_matrices_by_host(twenty_ranks):
    pytest.importorskip("matplotlib")
    for path, name in zip(twenty_ranks["paths"], ("by-rank", "by-host")):
        out = twenty_ranks["folder"] / f"report-{name}"
        summary = write_report([path], out, heatmaps=2).read_text()
        figures = sorted(p.name for p in out.glob("cosine-*.png"))
        assert len(figures) == 1 and f"![{figures[0][:-4]}]" in summary, name
        assert (out / figures[0]).stat().st_size > 5000


def _done_work() -> type:
    """benchmarks/scale.py's completed work for the fake group's collectives (their futures hold no value)."""
    import importlib.util

    from test_benchmarks import BENCHMARKS

    spec = importlib.util.spec_from_file_location("scale", BENCHMARKS / "scale.py")
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    return scale._DoneWork


def _fake_group_records(world: int, path: str, hosts_of) -> None:
    """Two detail steps of a tiny model at ``world`` ranks on the fake process group, rank 0 in
    one process: the identity table with synthetic hosts (``hosts_of(rank)``), and the other
    ranks' parts of the detail step's matrix as a real all-reduce would sum them (each host's
    ranks' unit sketches: a shared direction and the host's own)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    all_gather_object, all_reduce = dist.all_gather_object, dist.all_reduce
    generator = torch.Generator().manual_seed(0)

    def identities(output, obj, group=None):
        if not (isinstance(obj, tuple) and len(obj) == 3 and dataclasses.is_dataclass(obj[2])):
            output[:] = [obj] * len(output)
            return
        settings, problem, identity = obj
        output[:] = [(settings, problem, dataclasses.replace(identity, global_rank=r, group_rank=r, host=hosts_of(r), local_rank=r % 8)) for r in range(len(output))]

    held, done_work = {}, _done_work()

    def summed(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        state, record = held.get("state"), held.get("record")
        layout = None if record is None else record.fleet
        if layout is not None and layout.matrix_rows and tensor.numel() >= layout.size:
            wire = tensor[tensor.numel() - layout.size :]
            rows = wire[layout.part("matrix")].view(layout.matrix_rows, layout.bins)
            counts = torch.bincount(torch.tensor(state.hosts.of_rank), minlength=layout.matrix_rows).float()
            shared = torch.randn(layout.bins, generator=generator)
            own = torch.randn(layout.matrix_rows, layout.bins, generator=generator)
            units = (shared + own) / (shared + own).norm(dim=1, keepdim=True)
            rows.copy_(counts[:, None] * units)
            wire[layout.part("matrix_present")] = counts
        if not async_op:
            return None
        future = torch.futures.Future()  # completed at once, holding the tensor (a real work's future does)
        future.set_result([tensor])
        return done_work(future)

    dist.all_gather_object, dist.all_reduce = identities, summed
    try:
        torch.manual_seed(0)
        model = DDP(_Net())
        state = ddphooks.attach(model, detail_every=1, detect=False, sinks=[JsonlSink(path)])
        pack = state._pack_fleet
        held["state"] = state

        def keep(record, out, status):  # the step being packed, for the fake all-reduce
            held["record"] = record
            pack(record, out, status)

        state._pack_fleet = keep
        for step in range(2):
            x, y = _batch(0, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            state.observe_loss(loss)
            loss.backward()
            state.flush()
        state.close()
    finally:
        dist.all_gather_object, dist.all_reduce = all_gather_object, all_reduce
        dist.destroy_process_group()


def test_a_fake_group_w1024_detail_record_carries_the_host_matrix_and_the_report_draws_it(tmp_path):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "w1024.jsonl")
    _fake_group_records(1024, path, lambda rank: f"node{rank // 8:03d}")
    records = read_run(path).records
    entry = records[-1]["cosine_hosts"]
    assert records[-1]["wire"] == "compact" and records[-1]["cosine"] is None
    assert len(entry["hosts"]) == 128 and entry["hosts"][5] == "node005" and entry["ranks"][5] == list(range(40, 48))
    matrix = matrix_from_record(entry)
    assert matrix.shape == (128, 128) and np.isfinite(matrix).all() and np.allclose(matrix, matrix.T)
    json.dumps(records[-1], allow_nan=False)
    out = tmp_path / "report"
    write_report([path], out, heatmaps=1)
    [figure] = out.glob("cosine-*.png")
    assert figure.stat().st_size > 5000
