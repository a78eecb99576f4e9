"""What an on-call engineer needs from a run, on real gloo process groups: every alert names the
host, device and global rank; records never overwrite each other in any topology and nothing that
would work is refused; ``on_alert`` runs off the training thread; ``stop_on`` stops every rank
after the same step, with the last records written."""

import json
import logging
import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
from test_hook import TIMEOUT, _batch, _loss, _make_ddp, _Messages, _spawn_cases

import ddphooks
from ddphooks import JsonlSink
from ddphooks.identity import RankIdentity, RankTable
from ddphooks.launch import spawn

FAULT_STEP = 30


def _read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _train(rank: int, model, state, steps: int, fault_rank: int | None = None, stop: bool = False) -> int:
    """SGD on rank-dependent data; from FAULT_STEP, global rank ``fault_rank`` gets targets of the
    wrong sign (a silent data fault). With ``stop``, leaves the loop where ``should_stop()`` says.
    Returns the number of steps trained."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    for step in range(steps):
        x, y = _batch(rank, step)
        if rank == fault_rank and step >= FAULT_STEP:
            y = -3 * y
        loss = _loss(model, x, y)
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if stop and state.should_stop():
            return step + 1
    return steps


# -- two data-parallel groups in one job: the three ways of naming record files ----------------------
def _check_two_groups(rank: int, world: int, folder: str) -> dict:
    """Ranks {0, 1} and {2, 3} train two DDP models each in two groups, writing records (a) to one
    path per group, (b) to ``{rank}`` with every rank writing, (c) to the README's single path;
    in (a) global rank 3 gets a silent data fault."""
    messages = _Messages()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    group = groups[rank // 2]
    forms = {
        "per_group": (JsonlSink(f"{folder}/per_group/group{rank // 2}.jsonl"), 0, 45, 3),
        "per_rank": (JsonlSink(f"{folder}/per_rank/c-{{rank}}.jsonl"), None, 4, None),
        "one_path": (JsonlSink(f"{folder}/one_path/stats.jsonl"), 0, 4, None),
    }
    alerts = {}
    for name, (sink, log_rank, steps, fault_rank) in forms.items():
        model = _make_ddp(seed=rank // 2, process_group=group)
        state = ddphooks.attach(model, sinks=[sink], log_rank=log_rank, check_replicas_every=0)
        _train(rank, model, state, steps, fault_rank)
        state.flush()  # every writer's file is open (as in a long run, where the groups train side by side) ...
        dist.barrier()  # ... before any closes
        state.close()
        alerts[name] = state.alerts
    logging.getLogger("ddphooks").removeHandler(messages)
    return {"alerts": alerts, "messages": messages.messages, "host": socket.gethostname(), "pid": os.getpid()}


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory) -> tuple:
    folder = tmp_path_factory.mktemp("two_groups")
    return spawn(_check_two_groups, 4, args=(str(folder),), timeout=TIMEOUT), folder


def test_one_path_per_group_works_as_written_and_the_alert_names_global_rank_3(two_groups):
    results, folder = two_groups
    assert sorted(p.name for p in (folder / "per_group").iterdir()) == ["group0.jsonl", "group1.jsonl"]
    for group, first in ((0, 0), (1, 2)):
        records = _read(folder / "per_group" / f"group{group}.jsonl")
        assert [r["step"] for r in records] == list(range(45))  # nothing lost, nothing torn
        assert all(r["global_ranks"] == [first, first + 1] for r in records)
        identity = RankTable.from_record(records[0]).identities
        assert [i.global_rank for i in identity] == [first, first + 1] and [i.group_rank for i in identity] == [0, 1]
        assert [i.pid for i in identity] == [results[first]["pid"], results[first + 1]["pid"]]
        assert all(i.host == results[0]["host"] and i.device == "cpu" for i in identity)
        assert records[0]["identity"]["hosts"] == [results[0]["host"]] and records[0]["identity"]["host"] == [0, 0]  # the columns
        assert all("identity" not in r for r in records[1:] if not r["detail"])  # once, then on detail records
    # The fault is on global rank 3, rank 1 of the second group: named so, with its host.
    for rank in (2, 3):
        alerts = results[rank]["alerts"]["per_group"]
        assert alerts, "no alert for a rank whose targets flipped sign"
        first = alerts[0]
        assert (first["rank"], first["global_rank"], first["host"], first["device"]) == (1, 3, results[3]["host"], "cpu")
        assert FAULT_STEP <= first["step"] <= FAULT_STEP + 10, first
        assert first["message"].startswith(f"global rank 3 (rank 1 of its group) on {results[3]['host']}, cpu: check "), first["message"]
        assert " first: rank 1 has diverged since step " in first["message"], first["message"]
    assert results[2]["alerts"]["per_group"] == results[3]["alerts"]["per_group"]
    assert results[0]["alerts"]["per_group"] == results[1]["alerts"]["per_group"] == []  # the healthy group
    logged = [m for m in results[2]["messages"] if m.startswith("ddphooks alert")]
    assert logged and "global rank 3 (rank 1 of its group)" in logged[0]


def test_rank_in_the_path_gives_one_file_per_process_in_a_job_of_two_groups(two_groups):
    results, folder = two_groups
    assert sorted(p.name for p in (folder / "per_rank").iterdir()) == [f"c-{rank}.jsonl" for rank in range(4)]
    for rank in range(4):
        records = _read(folder / "per_rank" / f"c-{rank}.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2, 3] and records[0]["global_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]


def test_one_path_for_two_groups_keeps_both_writers_records_with_a_warning_naming_the_files(two_groups):
    results, folder = two_groups
    files = sorted(p.name for p in (folder / "one_path").iterdir())
    assert files in (["stats.jsonl", "stats.rank0.jsonl"], ["stats.jsonl", "stats.rank2.jsonl"]), files
    groups = sorted(tuple(_read(folder / "one_path" / name)[0]["global_ranks"]) for name in files)
    assert groups == [(0, 1), (2, 3)]  # one file per group's log rank, none lost
    for name in files:
        assert [r["step"] for r in _read(folder / "one_path" / name)] == [0, 1, 2, 3]
    moved = int(files[1].split(".rank")[1].split(".")[0])
    warned = [m for m in results[moved]["messages"] if "already being written by another writer" in m]
    assert len(warned) == 1 and str(folder / "one_path" / "stats.jsonl") in warned[0] and files[1] in warned[0], results[moved]["messages"]
    other = 2 - moved
    assert not [m for m in results[other]["messages"] if "already being written" in m]


# -- stopping every rank at the same step ------------------------------------------------------------
def _check_stop(rank: int, world: int, folder: str, fault: bool, slow_rank: int | None) -> dict:
    threads = []
    if rank == slow_rank:  # this rank's detector thread falls behind: its training thread waits for it at s + 2
        from ddphooks.detect import Detector

        update = Detector.update
        Detector.update = lambda self, obs: (threading.Event().wait(0.05), update(self, obs))[1]
    model = _make_ddp()
    state = ddphooks.attach(
        model, sinks=[JsonlSink(f"{folder}/stop.jsonl")], stop_on="all", check_replicas_every=0,
        on_alert=lambda alert: threads.append(threading.get_ident()),
    )  # fmt: skip
    trained = _train(rank, model, state, 60, fault_rank=1 if fault else None, stop=True)
    state.close()
    return {
        "trained": trained,
        "step": state.step,
        "stop_alert": state.stop_alert,
        "alerts": state.alerts,
        "on_alert_threads": threads,
        "training_thread": threading.get_ident(),
    }


@pytest.fixture(scope="module")
def stops(tmp_path_factory) -> dict:
    folders = {name: tmp_path_factory.mktemp(name) for name in ("fault", "slow", "healthy")}
    runs = _spawn_cases(2, [
        ("fault", _check_stop, (str(folders["fault"]), True, None)),
        ("slow", _check_stop, (str(folders["slow"]), True, 0)),
        ("healthy", _check_stop, (str(folders["healthy"]), False, None)),
    ], TIMEOUT)  # fmt: skip
    return {name: (runs[name], folders[name]) for name in runs}


@pytest.mark.parametrize("case", ["fault", "slow"])
def test_stop_on_ends_every_rank_after_the_same_step_with_the_last_records_written(stops, case):
    results, folder = stops[case]
    trained = {result["trained"] for result in results}
    assert len(trained) == 1, results  # the same step on both ranks, though one rank's detector is late
    alert = results[0]["stop_alert"]
    assert alert is not None and results[1]["stop_alert"] == alert and alert["rank"] == 1
    stopped = trained.pop()
    assert stopped == alert["step"] + 2 + 1 < 60  # collected at the first bucket of step s + 2; left after that step
    records = _read(folder / "stop.jsonl")
    assert [r["step"] for r in records] == list(range(stopped))  # every trained step's record, the last included
    assert any(a["step"] == alert["step"] for r in records for a in r["alerts"])
    for result in results:  # on_alert ran for every alert, never on the training thread
        assert len(result["on_alert_threads"]) == len(result["alerts"]) >= 1
        assert result["training_thread"] not in result["on_alert_threads"]


def test_a_healthy_run_is_not_stopped(stops):
    results, folder = stops["healthy"]
    assert [(r["trained"], r["stop_alert"], r["alerts"]) for r in results] == [(60, None, [])] * 2
    assert len(_read(folder / "stop.jsonl")) == 60


# -- the table itself, in one process ----------------------------------------------------------------
def test_an_alert_is_named_by_the_table_and_kept_as_it_is_where_the_table_cannot():
    table = RankTable(
        [RankIdentity(4, 0, "node-a", 0, 11, "cuda:0", "GPU-8f2c0000-1111", "00000000:41:00.0"), RankIdentity(5, 1, "node-b", 1, 12, "cuda:1")],
        subgroup=True,
    )
    named = table.name_alert({"step": 9, "rank": 0, "kind": "layer", "message": "rank 0 has diverged"})
    assert named["message"] == "global rank 4 (rank 0 of its group) on node-a, cuda:0 (GPU-8f2c0000-1111): rank 0 has diverged"
    assert (named["global_rank"], named["host"], named["device"], named["device_uuid"]) == (4, "node-a", "cuda:0", "GPU-8f2c0000-1111")
    assert table.name_alert(named) is named  # named once only
    outside = {"step": 9, "rank": 7, "kind": "layer", "message": "rank 7"}
    assert table.name_alert(outside) is outside
    duplicate = table.name_alert({"step": 9, "rank": 0, "ranks": [0, 1], "kind": "duplicate_data", "message": "every rank ..."})
    assert duplicate["message"] == "global ranks 4, 5 (ranks 0, 1 of its group) on node-a, node-b: every rank ..." and duplicate["global_ranks"] == [4, 5]
    whole = RankTable(table.identities, subgroup=False)
    assert whole.describe(1) == "global rank 5 on node-b, cuda:1"
    record = {"identity": table.to_record(), "global_ranks": [4, 5]}
    assert RankTable.from_record(record).identities == table.identities and RankTable.from_record(record).describe(0) == table.describe(0)
    rows = {"identity": [identity.to_dict() for identity in table.identities]}  # a dict per rank reads the same
    assert RankTable.from_record(rows).identities == table.identities
    assert RankTable.from_record({}) is None and RankTable.from_record({"identity": {"hosts": []}}) is None
