"""TensorBoardSink and WandbSink: what they write, read back with each library's own reader."""

from __future__ import annotations

import glob
import json
import math
import struct
import sys
import warnings

import numpy as np
import pytest

from ddphooks.sinks.scalars import SIGNALS, record_scalars

W = 3


def make_record(step: int, detail: bool = False) -> dict:
    """A synthetic record following the schema (values differ per step and per rank)."""
    losses = [1.0 + 0.1 * step + 0.01 * r for r in range(W)]
    record = {
        "step": step,
        "world_size": W,
        "transport": "piggyback",
        "sketch_dim": 251,
        "cosine_noise": 0.06,
        "losses": losses,
        "loss_mean": float(np.mean(losses)),
        "loss_std": float(np.std(losses)),
        "loss_range": max(losses) - min(losses),
        "loss_cv": float(np.std(losses) / np.mean(losses)),
        "grad_norms": [2.0 + step + 0.5 * r for r in range(W)],
        "grad_norm_mean": 2.5 + step,
        "grad_norm_std": 0.4,
        "grad_norm_cv": 0.4 / (2.5 + step),
        "reduced_grad_norm": 1.5 + step,
        "cosine_to_others": [0.3 + 0.01 * step, 0.2, None],
        "cosine_previous": None if step == 0 else [0.1, None, 0.9 - 0.01 * step],  # null before a previous step
        "mean_cosine": 0.25,
        "weighted_mean_cosine": 0.27 + 0.001 * step,
        "noise_scale": None,  # null: must be skipped
        "noise_scale_smoothed": 3.0 + step,
        "nonfinite": {"losses": [], "gradients": []},
        "dropped_records": {},
        "detail": detail,
    }
    if detail:
        record["cosine"] = [[1.0, -0.5, None], [-0.5, 1.0, 0.8], [None, 0.8, 1.0]]
        record["buckets"] = []
        record["parameters"] = []
    return record


RECORDS = [make_record(0, detail=True), make_record(1), make_record(2), make_record(3, detail=True)]


def test_record_scalars_flattens_and_caps():
    scalars = record_scalars(RECORDS[1], max_ranks=2)
    assert scalars["ddphooks/loss_mean"] == RECORDS[1]["loss_mean"]
    assert "ddphooks/noise_scale" not in scalars  # null skipped
    assert scalars["ddphooks/rank1/loss"] == RECORDS[1]["losses"][1]
    assert scalars["ddphooks/rank0/cosine_to_others"] == RECORDS[1]["cosine_to_others"][0]
    assert not any(tag.startswith("ddphooks/rank2/") for tag in scalars)  # capped at 2 ranks
    assert "ddphooks/rank2/loss" in record_scalars(RECORDS[1], max_ranks=None)
    assert "ddphooks/rank2/cosine_to_others" not in record_scalars(RECORDS[1], max_ranks=None)  # null
    assert scalars["ddphooks/rank0/cosine_previous"] == 0.1 and "ddphooks/rank1/cosine_previous" not in scalars
    assert not any("/rank" in tag for tag in record_scalars(RECORDS[1], max_ranks=0))
    with pytest.raises(ValueError, match="max_ranks"):
        record_scalars(RECORDS[1], max_ranks=-1)


def expected_scalars(record: dict) -> dict[str, float]:
    """Independent of record_scalars: the tags the sinks must write for one record."""
    out = {f"ddphooks/{key}": record[key] for key in SIGNALS if record.get(key) is not None}
    for rank in range(W):
        for key, suffix in (("losses", "loss"), ("grad_norms", "grad_norm"), ("cosine_to_others", "cosine_to_others"), ("cosine_previous", "cosine_previous")):
            if record[key] is not None and record[key][rank] is not None:
                out[f"ddphooks/rank{rank}/{suffix}"] = record[key][rank]
    return out


def test_tensorboard_sink_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ddphooks.sinks.tensorboard import TensorBoardSink

    sink = TensorBoardSink(tmp_path / "tb-{rank}", image_every=2)
    sink.bind_rank(0)
    for record in RECORDS:
        sink.write(record)
    sink.close()
    with pytest.raises(ValueError, match="closed"):
        sink.write(RECORDS[0])

    accumulator = EventAccumulator(str(tmp_path / "tb-0"), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    expected_tags = set()
    for record in RECORDS:
        expected_tags |= set(expected_scalars(record))
    assert set(tags["scalars"]) == expected_tags
    assert "ddphooks/noise_scale" not in tags["scalars"]
    for tag in expected_tags:
        events = accumulator.Scalars(tag)
        written = [r for r in RECORDS if tag in expected_scalars(r)]  # a null is left out, not written as NaN
        assert [e.step for e in events] == [r["step"] for r in written], tag
        want = [expected_scalars(r)[tag] for r in written]
        np.testing.assert_allclose([e.value for e in events], want, rtol=1e-6, err_msg=tag)

    # the matrix rides on detail records 0 and 3; both are >= image_every apart
    assert tags["images"] == ["ddphooks/cosine"]
    images = accumulator.Images("ddphooks/cosine")
    assert [image.step for image in images] == [0, 3]
    assert images[0].width == images[0].height == 255  # 3 entries x (256 // 3) pixels


def test_tensorboard_draws_the_host_by_host_matrix_above_detail_max_world(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ddphooks.sinks.tensorboard import TensorBoardSink

    # three hosts' lower triangle in hundredths, as a W = 1024 detail record carries it
    hosts = {"hosts": ["a", "b", "c"], "ranks": [[0], [1], [2]], "present": [1, 1, 1], "hundredths": [[90], [10, 80], [-50, None, 70]]}
    sink = TensorBoardSink(tmp_path / "tb", max_ranks=None)  # the record has no per-rank lists: nothing to cap
    sink.write({"step": 0, "world_size": 1024, "cosine": None, "cosine_hosts": hosts})
    sink.close()
    accumulator = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    accumulator.Reload()
    assert accumulator.Tags()["images"] == ["ddphooks/cosine_hosts"]
    [image] = accumulator.Images("ddphooks/cosine_hosts")
    assert image.step == 0 and image.width == image.height == 255  # 3 hosts x (256 // 3) pixels


def test_tensorboard_image_rate_and_colours(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ddphooks.sinks.tensorboard import TensorBoardSink, cosine_image

    image = cosine_image([[1.0, -1.0], [0.0, None]])
    assert image.shape == (256, 256, 3) and image.dtype == np.uint8
    assert tuple(image[0, 0]) == (255, 0, 0)  # +1 red
    assert tuple(image[0, 200]) == (0, 0, 255)  # -1 blue
    assert tuple(image[200, 0]) == (255, 255, 255)  # 0 white
    assert tuple(image[200, 200]) == (128, 128, 128)  # null grey

    sink = TensorBoardSink(tmp_path, image_every=5, max_ranks=2)
    with pytest.warns(UserWarning, match=r"ranks 0\.\.1 of 3"):
        sink.write(make_record(0, detail=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        for step in range(1, 8):
            sink.write(make_record(step, detail=True))
    sink.close()
    accumulator = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    accumulator.Reload()
    assert [image.step for image in accumulator.Images("ddphooks/cosine")] == [0, 5]


def read_wandb_history(run_dir: str) -> list[dict]:
    """History rows of an offline run, decoded from its ``.wandb`` transaction log.

    The file is a LevelDB-style log (7-byte ``:W&B`` header, 32 KiB blocks of records with a
    7-byte header: crc32, length, type) of ``wandb_internal_pb2.Record`` protobufs; wandb
    0.31 has no Python reader for it, so the framing is parsed here and the protobufs with
    wandb's own message classes.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(f"{run_dir}/run-*.wandb")
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, position, pending, rows = 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # block trailer too short for a header: padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a complete record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                rows.append(row)
    return rows


def test_wandb_sink_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    import wandb

    from ddphooks.sinks.wandb import WandbSink

    assert wandb.run is None
    sink = WandbSink(project="ddphooks-test", mode="offline", dir=str(tmp_path))
    assert sink.run is None  # nothing started before the first write
    for record in RECORDS:
        sink.write(record)
    run_dir = sink.run.dir.rsplit("/files", 1)[0]
    sink.close()
    assert wandb.run is None  # the sink finished the run it started
    wandb.teardown()  # finish() can return before wandb-core has written the run file; teardown waits

    rows = read_wandb_history(run_dir)
    assert [row["_step"] for row in rows] == [0, 1, 2, 3]
    for row, record in zip(rows, RECORDS):
        assert row["ddphooks/step"] == record["step"]
        want = expected_scalars(record)
        got = {key: value for key, value in row.items() if key.startswith("ddphooks/") and key != "ddphooks/step"}
        assert set(got) == set(want)
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=1e-12), key


def test_wandb_sink_shared_run_not_finished(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    import wandb

    from ddphooks.sinks.wandb import WandbSink

    run = wandb.init(project="ddphooks-test", mode="offline", dir=str(tmp_path))
    try:
        run.log({"train/loss": 1.0}, step=10)  # the owner's counter is ahead of ours
        sink = WandbSink()
        sink.write(RECORDS[0])
        sink.write(RECORDS[1])
        sink.close()
        assert wandb.run is run  # not finished by the sink
        run_dir = run.dir.rsplit("/files", 1)[0]
    finally:
        run.finish()
    wandb.teardown()
    rows = read_wandb_history(run_dir)
    ours = [row for row in rows if "ddphooks/step" in row]
    # logged without step=: nothing dropped although the run's step was already 10
    assert [row["ddphooks/step"] for row in ours] == [0, 1]
    assert all(row["_step"] >= 10 for row in ours)
    assert ours[1]["ddphooks/loss_mean"] == pytest.approx(RECORDS[1]["loss_mean"], rel=1e-12)


@pytest.mark.parametrize(
    ("module", "factory", "blocked", "extra"),
    [
        ("ddphooks.sinks.tensorboard", lambda m, p: m.TensorBoardSink(p), ("tensorboard", "torch.utils.tensorboard"), "tensorboard"),
        ("ddphooks.sinks.wandb", lambda m, p: m.WandbSink(dir=str(p)), ("wandb",), "wandb"),
    ],
)
def test_missing_library_message(tmp_path, monkeypatch, module, factory, blocked, extra):
    import importlib

    sink_module = importlib.import_module(module)  # the module itself imports without the library
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(ImportError, match=rf"pip install 'ddphooks\[{extra}\]'"):
        factory(sink_module, tmp_path)


def test_bad_settings_raise_at_construction(tmp_path):
    pytest.importorskip("tensorboard")
    from ddphooks.sinks.tensorboard import TensorBoardSink

    with pytest.raises(ValueError, match="image_every"):
        TensorBoardSink(tmp_path, image_every=0)
    with pytest.raises(ValueError, match="max_ranks"):
        TensorBoardSink(tmp_path, max_ranks=-2)


def test_sinks_pickle_before_first_write(tmp_path):
    """A SilentState is pickled with its sinks when Lightning spawns workers."""
    import pickle

    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from ddphooks.sinks.tensorboard import TensorBoardSink
    from ddphooks.sinks.wandb import WandbSink

    tb = pickle.loads(pickle.dumps(TensorBoardSink(tmp_path / "tb", image_every=3, max_ranks=2)))
    assert (tb.log_dir, tb.image_every, tb.max_ranks) == (str(tmp_path / "tb"), 3, 2)
    wb = pickle.loads(pickle.dumps(WandbSink(project="p", mode="offline")))
    assert wb.init_kwargs == {"project": "p", "mode": "offline"}


def test_real_records_through_silent_state(tmp_path, monkeypatch):
    """The sinks behind a real SilentState (1-process gloo group), called from its writer thread
    (where WandbSink starts its run): every signal of every step arrives."""
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    import torch
    import torch.distributed as dist
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.nn.parallel import DistributedDataParallel

    import ddphooks
    from ddphooks.sinks.tensorboard import TensorBoardSink
    from ddphooks.sinks.wandb import WandbSink

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(4, 1))
        jsonl = ddphooks.JsonlSink(tmp_path / "stats.jsonl")
        wandb_sink = WandbSink(project="ddphooks-test", mode="offline", dir=str(tmp_path))
        state = ddphooks.attach(model, sketch_dim=16, sinks=[jsonl, TensorBoardSink(tmp_path / "tb"), wandb_sink])
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            state.observe_loss(loss)  # the output is not a loss: attach cannot capture one
            loss.backward()
        state.close()
    finally:
        dist.destroy_process_group()
    assert state.dropped_records == {}
    wandb.teardown()
    records = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    accumulator = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    for record in records:
        for tag, value in record_scalars(record).items():
            (event,) = [e for e in accumulator.Scalars(tag) if e.step == record["step"]]
            assert event.value == pytest.approx(value, rel=1e-6), tag
    assert {"ddphooks/loss_mean", "ddphooks/grad_norm_mean", "ddphooks/rank0/loss"} <= set(accumulator.Tags()["scalars"])
    assert [image.step for image in accumulator.Images("ddphooks/cosine")] == [0]  # detail record 0
    (run_dir,) = glob.glob(f"{tmp_path}/wandb/offline-run-*")
    rows = read_wandb_history(run_dir)
    assert [row["_step"] for row in rows] == [r["step"] for r in records] == [0, 1, 2]
    for row, record in zip(rows, records):
        assert row["ddphooks/loss_mean"] == pytest.approx(record["loss_mean"], rel=1e-12)
