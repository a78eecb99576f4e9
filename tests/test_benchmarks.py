"""Every benchmark script runs on one tiny configuration and prints/writes its documented fields.

Speed is never asserted here: performance claims live in benchmarks/README.md.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str, env: dict | None = None) -> str:
    environment = {**os.environ, **env} if env else None
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


BREAKDOWN_PARTS = {
    "statistics pass", "last bucket: division into piggyback buffer + slot", "reduced norms + SilentStats",
    "processing: the step to the detector, the one before's alerts and record", "summary()", "sending the step's slots to the detector's process",
    "reading the alerts back", "submit to the writer", "record building",
    "writing (JsonlSink)", "sync watchdog: forward pre-hook + sentinel gradient hook",
}  # fmt: skip


def _check_sink_config(result, instrumented_steps):
    """The user's configuration: its file got one record per instrumented step, and every part of
    the breakdown was timed (the writer's parts come from rank 0)."""
    assert result["config"] == {"hook": "silent_sink", "sketch_dim": 256, "every": 1}
    assert result["records_written"] == instrumented_steps and result["dropped_records"] == {}
    assert set(result["breakdown"]) == BREAKDOWN_PARTS
    for part, value in result["breakdown"].items():
        assert value["per"] == ("record" if value["thread"] == "writer" else "step"), part
        assert 0 < value["iqr"][0] <= value["median"] <= value["iqr"][1], part
    # the detector runs in its own process: the training thread sends the step, reads the alerts
    # back and submits the record (within "processing")
    parts = ("sending the step's slots to the detector's process", "reading the alerts back", "submit to the writer")
    assert {result["breakdown"][part]["thread"] for part in parts} == {"training"}
    assert result["reads_outside_processing"] == 0  # every read back of alerts was timed within "processing"


def test_overhead_json_fields(tmp_path):
    out = tmp_path / "overhead.json"
    configs = ("none", "allreduce", "norms_separate", "silent", "silent_sink")
    stdout = _run("overhead.py", "--models", "tiny-mlp", "--steps", "2", "--warmup", "1", "--configs", *configs, "--json", str(out))
    results = json.loads(out.read_text())
    assert {r["config"]["hook"] for r in results} == set(configs)
    for r in results:
        assert set(r["config"]) == {"hook", "sketch_dim", "every"}
        assert r["world_size"] == 2 and r["model"] == "tiny-mlp" and r["median_step_s"] > 0 and r["steps"] == 2
        assert (r["hook_s_per_step"] > 0) == (r["config"]["hook"] != "none")
        assert isinstance(r["overhead_vs_allreduce"], float)
        if not r["config"]["hook"].startswith("silent"):
            assert r["config"]["sketch_dim"] is None and r["config"]["every"] is None
        assert ("breakdown" in r) == (r["config"]["hook"] == "silent_sink")
    assert {(r["config"]["sketch_dim"], r["config"]["every"]) for r in results if r["config"]["hook"] == "silent"} == {
        (k, e) for k in (0, 64, 256, 1024) for e in (1, 10)
    }
    _check_sink_config(next(r for r in results if r["config"]["hook"] == "silent_sink"), instrumented_steps=1 + 2)
    assert "vs allreduce" in stdout and "silent k=256 every=10" in stdout and "where the time goes" in stdout


def test_overhead_quick_has_the_users_configuration(tmp_path):
    out = tmp_path / "quick.json"
    stdout = _run("overhead.py", "--quick", "--models", "tiny-mlp", "--steps", "3", "--warmup", "1", "--json", str(out))
    results = json.loads(out.read_text())
    assert {r["config"]["hook"] for r in results} == {"none", "allreduce", "norms_separate", "silent", "silent_sink"}
    _check_sink_config(next(r for r in results if r["config"]["hook"] == "silent_sink"), instrumented_steps=1 + 3)
    assert "silent + JsonlSink + summary()" in stdout


def test_overhead_small_steps(tmp_path):
    """--small: tiny-gpt, allreduce_hook against the defaults with a JsonlSink, detector on and off,
    with the training thread's CPU per step over allreduce_hook's."""
    out = tmp_path / "small.json"
    stdout = _run("overhead.py", "--small", "--steps", "3", "--warmup", "1", "--block", "3", "--json", str(out))
    results = {r["config"]["hook"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"allreduce", "silent_sink", "silent_sink_nodetect"}
    for r in results.values():
        assert r["model"] == "tiny-gpt" and r["steps"] == 3 and r["thread_cpu_s_per_step"] > 0
        assert set(r["thread_cpu_s_vs_allreduce"]) == {"median", "iqr"}
    assert results["allreduce"]["thread_cpu_s_vs_allreduce"]["median"] == 0
    for hook in ("silent_sink", "silent_sink_nodetect"):  # the breakdowns also subtract their statistics pass
        assert set(results[hook]["thread_cpu_s_vs_allreduce_less_pass"]) == {"median", "iqr"}
    _check_sink_config(results["silent_sink"], instrumented_steps=3 * 3)  # a warm-up round and two timed ones, blocks of 3
    assert results["silent_sink_nodetect"]["records_written"] == 3 * 3
    assert "in blocks of 3 steps" in stdout
    assert "training thread's CPU per step" in stdout and "less statistics pass ms" in stdout and "detect=False" in stdout


def test_overhead_cnn_is_a_resnet_of_the_cnn_clients_shape():
    """``--models cnn``: issue 59's held-out CNN client has 4.9 M parameters in 86 tensors, with
    BatchNorm; the stand-in, built and run for one step as overhead.py runs it."""
    import torch

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import overhead
    finally:
        sys.path.remove(str(BENCHMARKS))
    model = overhead.build("cnn", torch.device("cpu"))
    parameters = [p for p in model.parameters() if p.requires_grad]
    assert len(parameters) == 86 and 4.85e6 < sum(p.numel() for p in parameters) < 4.95e6
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    batch = overhead.make_batch("cnn", model, 0, torch.device("cpu"))
    loss = overhead.loss_of("cnn", model, batch)
    loss.backward()
    assert batch["images"].shape == (overhead.CNN_BATCH, 3, 32, 32) and math.isfinite(loss.item())
    assert all(p.grad is not None for p in parameters)


def test_overhead_fsdp_rows(tmp_path):
    out = tmp_path / "fsdp.json"
    stdout = _run("overhead.py", "--fsdp", "--models", "tiny-mlp", "--steps", "2", "--warmup", "1", "--json", str(out))
    results = {r["config"]["hook"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"fsdp", "fsdp_silent_sink", "fsdp_silent"}
    assert results["fsdp"]["persistent_bytes"] is None and results["fsdp"]["hook_s_per_step"] == 0
    for hook in ("fsdp_silent_sink", "fsdp_silent"):
        assert results[hook]["hook_s_per_step"] > 0 and isinstance(results[hook]["overhead_vs_fsdp"], float)
        assert 8 * 2**20 < results[hook]["persistent_bytes"] < 64 * 2**20  # the sign tables, nothing per element
    parts = results["fsdp_silent_sink"]["breakdown"]
    assert {"statistics pass", "end of backward: slot all-reduce + SilentStats", "reading the alerts back"} <= set(parts)
    assert results["fsdp_silent_sink"]["records_written"] == 1 + 2
    assert "vs fsdp" in stdout and "fsdp2 + silent + JsonlSink + summary()" in stdout


def test_overhead_deepspeed_rows(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "deepspeed.json"
    stdout = _run("overhead.py", "--deepspeed", "--models", "tiny-mlp", "--steps", "2", "--warmup", "1", "--json", str(out))
    results = {r["config"]["hook"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"ds2", "ds2_silent_sink", "ds3", "ds3_silent_sink"}
    for stage in ("2", "3"):
        plain, measured = results[f"ds{stage}"], results[f"ds{stage}_silent_sink"]
        assert plain["persistent_bytes"] is None and plain["hook_s_per_step"] == 0 and plain["overhead_vs_deepspeed"] == 0
        assert measured["hook_s_per_step"] > 0 and isinstance(measured["overhead_vs_deepspeed"], float)
        assert 8 * 2**20 < measured["persistent_bytes"] < 64 * 2**20  # the sign tables, nothing per element
        assert {"statistics pass", "end of backward: reduced norms + slot all-reduce + SilentStats", "reading the alerts back"} <= set(measured["breakdown"])
        assert measured["records_written"] == 1 + 2
    assert "vs deepspeed" in stdout and "ZeRO-3 + silent + JsonlSink + summary()" in stdout


def test_records_quick_fields_and_size_goals(tmp_path):
    out = tmp_path / "records.json"
    stdout = _run("records.py", "--quick", "--json", str(out))
    report = json.loads(out.read_text())
    rows = {(r["world_size"], r["parameters"]): r for r in report["rows"]}
    assert set(rows) == {(8, 272), (1024, 272)} and report["detail_every"] == 100
    for r in rows.values():
        assert r["bins"] == 251 and r["buckets"] >= 2
        timed = ("before_s", "submit_s", "writer_compact_s", "writer_detail_s", "build_compact_s", "write_compact_s", "summary_s", "detector_s", "handoff_s")
        for key in timed:
            if r[key] is not None:
                assert 0 < r[key]["iqr"][0] <= r[key]["median"] <= r[key]["iqr"][1], key
        assert r["compact_bytes"] < r["detail_bytes"] and r["cosine_previous_in_records"]  # every key a real record has
        assert (r["detector_s"] is None) == (r["handoff_s"] is None) == (r["world_size"] > 64)  # --quick times the detector up to W = 64
        every = report["detail_every"]
        assert r["bytes_per_step"] == (r["detail_bytes"] + (every - 1) * r["compact_bytes"]) / every
    # The full record main serialised at W = 1024 (W x W cosine, per-rank tables) is what the change removed.
    assert rows[(1024, 272)]["before_bytes"] > 100 * rows[(1024, 272)]["detail_bytes"]
    assert rows[(1024, 272)]["compact_bytes"] > rows[(8, 272)]["compact_bytes"]  # O(W) per-rank vectors
    # The size goals for the default record, on the sizes the script read back from its JSONL file.
    for world, limit in ((8, 16 * 1024), (1024, 256 * 1024)):
        assert rows[(world, 272)]["compact_bytes"] <= limit and rows[(world, 272)]["bytes_per_step"] <= limit, world
        (goal,) = [g for g in report["goals"] if g["goal"] == "default record bytes" and g["world_size"] == world]
        assert goal["limit"] == limit and goal["met"] and goal["compact_bytes"] == rows[(world, 272)]["compact_bytes"]
    assert "before ms" in stdout and "goal: default record bytes at W=1024" in stdout


def test_hook_cost_fields(tmp_path):
    out = tmp_path / "cost.json"
    stdout = _run("hook_cost.py", "--buckets", "1", "--sketch-dims", "0", "256", "--rounds", "2", "--json", str(out))
    results = json.loads(out.read_text())
    assert [(r["bucket_mb"], r["sketch_dim"]) for r in results] == [(1, 0), (1, 256)]
    for r in results:
        for key in ("statistics_x_read", "reduced_x_read", "persistent_bytes_per_element", "transient_bytes_per_call"):
            assert r[key] >= 0
    assert results[1]["bins"] == 251 and "stats/read" in stdout
    # The accelerator path of a one-chunk bucket: a few ops whatever its number of parameters;
    # nothing kept per element but the plan's few integers per chunk; the sign tables are fixed.
    assert 0 < results[1]["accelerator_ops"] == results[1]["accelerator_ops_64_params"] <= 8
    # the CPU's: T (8 M int8) and a chunk of it again, the row signs and a chunk's scratch
    assert results[1]["persistent_bytes_per_element"] < 0.05 and 8 * 2**20 < results[1]["persistent_fixed_bytes"] < 10 * 2**20
    assert "135M" in stdout and "7B" in stdout


def test_triton_sketch_agrees_with_the_kernel_under_the_interpreter():
    # The script compares the Triton kernel with BucketStatsKernel (sketch and norms, four bucket
    # layouts from 13 to 1021 bins) and fails on a disagreement; on the CPU, in Triton's interpreter.
    # --time runs the timing table's code on a tiny bucket (its figures mean something on a GPU only).
    stdout = _run("triton_sketch.py", "--time", "--device", "cpu", "--buckets-mb", "0.02", "--rounds", "2", env={"TRITON_INTERPRET": "1"})
    lines = stdout.splitlines()
    rows = [line.split() for line in lines[1 : lines.index("")]]
    assert [int(row[0]) for row in rows] == [61, 251, 1021, 13]
    assert all(float(row[4]) < 1e-5 and float(row[5]) < 1e-5 for row in rows)
    timed = [line.split() for line in lines if line.startswith("  0.02")]
    assert [(row[1], row[2]) for row in timed] == [("float32", "8"), ("float32", "160"), ("bfloat16", "8"), ("bfloat16", "160")]
    assert all(float(row[4]) > 0 and float(row[6]) > 0 and int(row[-3]) > 0 and int(row[-1]) > 0 for row in timed), timed


def test_comm_accounting_fields(tmp_path):
    out = tmp_path / "comm.json"
    _run("comm_accounting.py", "--json", str(out))
    rows = json.loads(out.read_text())
    assert {r["world_size"] for r in rows} == {2, 8, 64, 1024}
    tiny = [r for r in rows if r["model"] == "tiny-llama-12M" and r["world_size"] == 8][0]
    assert tiny["tensors"] == 93 and tiny["slot_bytes"] == 4 * (3 + 93 + 251)
    assert tiny["launches"]["silent_piggyback"] == tiny["launches"]["allreduce_hook"]


def test_scale_quick_table_on_the_fake_process_group(tmp_path):
    out = tmp_path / "scale.json"
    stdout = _run("scale.py", "--quick", "--json", str(out))
    every_row = json.loads(out.read_text())["rows"]
    rows = {r["world_size"]: r for r in every_row if r["wire"] == "whole slots"}
    compact = {r["world_size"]: r for r in every_row if r["wire"] == "compact"}
    assert set(rows) == set(compact) == {8, 64, 512} and len(every_row) == 6
    for world, r in [*rows.items(), *compact.items()]:
        assert r["transport"] == "piggyback" and r["tensors"] == 21 and r["steps"] == 3  # the real DDP path, its final buckets
        for key in ("allreduce_hook_ms", "silent_hook_ms", "slot_parts_ms", "detector_ms", "kept_bytes", "wire_numel", "replica_check_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, (world, key)
        assert r["slot_bytes_per_step"] == 4 * r["wire_numel"]
        assert 0 < r["slot_fraction_of_gradient_bytes"] < 1
        assert 0 < r["compact_record_bytes"] < r["detail_record_bytes"]
    for world, r in rows.items():
        assert r["wire_numel"] == world * (3 + 21 + 251)  # per rank: loss pair, status, one norm per tensor, the sketch
    for world, r in compact.items():  # rows of 6, 16 sampled ranks' norms (at most W), sums of 4 x 21 (norms, rises), 1 bucket, 1 count, 2 x 251
        assert r["wire_numel"] == 6 * world + min(16, world) * 21 + 4 * 21 + 1 + 1 + 2 * 251, world
        assert r["slot_bytes_per_step"] <= 64 * 1024 + 16 * world  # the fleet budget
    assert compact[512]["kept_bytes"] < rows[512]["kept_bytes"]
    assert rows[64]["compact_record_bytes"] > rows[8]["compact_record_bytes"]  # O(W) per-rank vectors
    assert rows[512]["compact_record_bytes"] < rows[64]["compact_record_bytes"]  # above per_rank_max_world: over ranks, O(1)
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| W | wire | DDP in-hook ms beyond allreduce_hook | detector ms") and len(table) == (1 + 6) + (1 + 6)
    assert table[7].startswith("| W | wire | FSDP2 statistics pass ms/step")
    every_sharded = json.loads(out.read_text())["fsdp_rows"]
    sharded = {r["world_size"]: r for r in every_sharded if r["wire"] == "whole slots"}
    sharded_compact = {r["world_size"]: r for r in every_sharded if r["wire"] == "compact"}
    assert set(sharded) == set(sharded_compact) == {8, 64, 512} and len(every_sharded) == 6
    for world, r in [*sharded.items(), *sharded_compact.items()]:  # the real FSDP2 path: the pass ran inside every reduce-scatter
        assert r["pass_ms"] > 0 and r["step_ms"] > r["pass_ms"] and r["input_elements"] > 0 and r["end_of_backward_ms"] > 0, (world, r)
        assert r["pass_ns_per_element"] == pytest.approx(1e6 * r["pass_ms"] / r["read_elements"])
        assert r["slot_bytes_per_step"] == 4 * r["wire_numel"] and r["kept_bytes"] > 0
    assert sharded[8]["input_elements"] == sharded[64]["input_elements"] == sharded[64]["read_elements"]  # this model's sizes divide by 64: no padding
    # at 512 shards FSDP2 pads the 64-row parameters to 512 rows; the pass reads the rows that hold gradient
    assert sharded[512]["input_elements"] > 2 * sharded[8]["input_elements"] and sharded[512]["read_elements"] < 1.1 * sharded[8]["input_elements"]
    for world, r in sharded.items():  # per rank: loss pair, status, one norm per tensor, the sketch, then its reduced shard norms
        assert r["wire_numel"] == world * (3 + 21 + 251 + 21)
    for world, r in sharded_compact.items():  # as DDP's compact wire, 3 groups (2 layers, the root), and the 21 reduced norms
        assert r["wire_numel"] == 6 * world + min(16, world) * 21 + 4 * 21 + 3 + 1 + 2 * 251 + 21, world
    assert sharded_compact[512]["kept_bytes"] < sharded[512]["kept_bytes"]


def test_scale_model_overrides_reach_the_fsdp2_table(tmp_path):
    out = tmp_path / "scale.json"
    _run("scale.py", "--quick", "--only", "fsdp2", "--worlds", "8", "--steps", "1", "--model", "hidden=128", "--json", str(out))
    written = json.loads(out.read_text())
    assert written["model"]["hidden"] == 128 and written["model"]["layers"] == 2 and len(written["fsdp_rows"]) == 2
    refused = subprocess.run([sys.executable, str(BENCHMARKS / "scale.py"), "--model", "hiden=3"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--model 'hiden=3': expected NAME=INT with NAME one of vocab_size, hidden" in refused.stderr


def test_scale_plain_read_reads_the_passs_elements_beside_its_default_row(tmp_path):
    out = tmp_path / "scale.json"
    stdout = _run("scale.py", "--quick", "--only", "fsdp2", "--worlds", "8", "64", "--steps", "1", "--plain-read", "--json", str(out))
    written = json.loads(out.read_text())
    default = {r["world_size"]: r for r in written["fsdp_rows"] if (r["wire"] == "compact") == (r["world_size"] > 16)}
    plain = {r["world_size"]: r for r in written["plain_read_rows"]}
    assert sorted(plain) == [8, 64]
    for world, row in plain.items():  # the same bands, read by a sum instead of the pass; the pass from its default-wire row
        assert row["plain_read_elements"] == row["read_elements"] == default[world]["read_elements"] > 0
        assert row["pass_ms"] == default[world]["pass_ms"] and row["plain_read_ms"] > 0
    assert "| 8 | whole slots (default) |" in stdout.split("The pass against a plain read")[1]


def test_scale_hsdp_rows_count_the_replica_groups_histograms_whatever_the_shards(tmp_path):
    # HSDP, 2 replicas of 4 and of 32 shards: a check step's compact wire adds, whatever the
    # shards, per parameter 65 counts summed over its replica group (an all-reduce of its own,
    # counted here) and 3 numbers, and per buffer 65 counts; the 64-rank default is the compact wire
    out = tmp_path / "scale.json"
    stdout = _run("scale.py", "--quick", "--only", "fsdp2", "--hsdp", "2", "--worlds", "8", "64", "--steps", "1", "--json", str(out))
    assert "HSDP, 2 replicas of W / 2 shards" in stdout
    rows = {(r["world_size"], r["wire"]): r for r in json.loads(out.read_text())["fsdp_rows"]}
    extra = {world: rows[world, "compact"]["replica_step_bytes"] - rows[world, "compact"]["slot_bytes_per_step"] for world in (8, 64)}
    buffers, left = divmod(extra[8] - 4 * 21 * (65 + 3), 4 * 65)  # 21 parameters of the 2-layer tiny Llama
    assert extra[8] == extra[64] and left == 0 and 0 <= buffers <= 4
    assert rows[64, "compact"]["amortised_bytes_per_step"] <= 64 * 1024 + 16 * 64 and all(r["replicas"] == 2 for r in rows.values())
    refused = subprocess.run([sys.executable, str(BENCHMARKS / "scale.py"), "--only", "fsdp2", "--hsdp", "3", "--worlds", "8"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--hsdp 3: every W of the FSDP2 table must be a multiple of the replicas" in refused.stderr


def test_detection_measures_delay_and_false_alarms(tmp_path):
    from test_detect import _stream

    from ddphooks.detect import Detector, DetectorConfig, Observation

    fault = tmp_path / "faults" / "run-fault-w4.jsonl"
    healthy = tmp_path / "healthy" / "run-sync-w4.jsonl"
    for path, header, records in (
        (fault, {"setting": "fault", "world_size": 4, "fault_kind": "labels", "fault_step": 60, "config": {"fault_rank": 2}},
         _stream(4, 100, seed=0, fault_rank=2, fault_step=60)),
        (healthy, {"setting": "sync", "world_size": 4, "config": {}}, _stream(4, 200, seed=1)),
    ):  # fmt: skip
        path.parent.mkdir(parents=True)
        path.write_text("\n".join(json.dumps(line) for line in [{"header": header}, *records]) + "\n")
    # One run of the script for the table, --levels and --oracle (each subprocess imports torch)
    out = _run("detection.py", str(tmp_path / "faults"), str(tmp_path / "healthy"), "--levels", "1", "2", "--oracle", "--json", str(tmp_path / "d.json"))
    assert "labels" in out and "pooled" in out and "delay / bound" in out and "best CUSUM" in out
    result = json.loads((tmp_path / "d.json").read_text())
    (row,) = result["delays"]
    assert (row["kind"], row["world"], row["fault_step"], row["missed"]) == ("labels", 4, 60, 0) and 0 <= row["median"] <= 5
    assert {(h["setting"], h["alerts"]) for h in result["healthy"]} >= {("sync", 0)}
    # The margin, the slow way: every CUSUM on every healthy step (the healthy run, the fault run
    # before its fault) over its threshold at level 1
    config = DetectorConfig()
    level_one = {("cross", "cosine_previous"): config.repeat_threshold, ("own", "layer"): config.layer_threshold}
    highest = 0.0
    for records in (_stream(4, 200, seed=1), _stream(4, 100, seed=0, fault_rank=2, fault_step=60)[:60]):
        detector = Detector(config)
        for record in records:
            detector.update(Observation.from_record(record))
            for key, levels in detector.cusums.cusum.items():
                highest = max(highest, levels.max() / level_one.get(key, config.threshold))
    assert 0.1 < highest < 1.25 and result["peaks"] == {"4": round(highest, 3)}
    # --levels: per alert level, false alarms pooled per world size and the delay against the bound
    pooled = {row["level"]: row for row in result["levels"] if "steps" in row}
    assert pooled[1.0]["steps"] == pooled[2.0]["steps"] == 200 + 60  # the healthy run and the fault run before its fault
    faults = {row["level"]: row for row in result["levels"] if "kind" in row}
    assert faults[1.0]["dprime"] > 1 and faults[1.0]["bound"] > 0  # the planted shift is a few standard deviations a step
    assert faults[2.0]["delays"][0] is None or faults[2.0]["delays"][0] >= faults[1.0]["delays"][0]  # more evidence needed
    # d', the slow way: the part of the CUSUM that crossed, the faulty rank's first 10 steps from the
    # fault against every rank's scores before it
    detector, kept = Detector(DetectorConfig(alert_level=1.0), keep_scores=True), []
    for record in _stream(4, 100, seed=0, fault_rank=2, fault_step=60):
        detector.update(Observation.from_record(record))
        kept.append((record["step"], dict(detector.step_scores)))
    step, _, key, part = next(fired for fired in detector.fired if fired[1] == 2 and fired[0] >= 60)
    assert step - 60 == faults[1.0]["delays"][0]
    faulty = [row[key][2, part] for number, row in kept if 60 <= number < 70 and key in row]
    healthy = [z for number, row in kept if number < 60 and key in row for z in row[key][:, part]]
    assert faults[1.0]["dprime"] == pytest.approx((np.mean(faulty) - np.mean(healthy)) / np.std(healthy))
    # --oracle: the best CUSUM over the same scores, its threshold above every healthy step's level;
    # its choice includes the detector's allowance and cap, so with no false alarm it is no later
    (best,) = result["oracle"]
    assert (best["kind"], best["world"], len(best["delays"])) == ("labels", 4, 1) and best["threshold"] > 0
    assert best["delays"][0] is not None and 0 <= best["delays"][0] <= row["median"] == best["detector"]
    # one combined CUSUM per rank: M = 4 streams, ln(4) / (d'^2 / 2) more
    assert best["streams"] == 4 and best["streams_bound"] == pytest.approx(best["bound"] + math.log(4) / (best["dprime"] ** 2 / 2))
    # The threshold, the slow way: every healthy step's scores of that CUSUM (the healthy run, the
    # fault run before its fault), one plain CUSUM per rank and part with the chosen allowance and cap
    key, cap = tuple(best["key"]), best["cap"] if best["cap"] is not None else float("inf")
    highest = 0.0
    for records, end in ((_stream(4, 200, seed=1), 200), (_stream(4, 100, seed=0, fault_rank=2, fault_step=60), 60)):
        detector, levels = Detector(keep_scores=True), {}
        for record in records[:end]:
            detector.update(Observation.from_record(record))
            for rank, parts in enumerate(detector.step_scores.get(key, [])):
                for part, z in enumerate(parts):
                    level = max(0.0, levels.get((rank, part), 0.0) + min(z, cap) - best["drift"])
                    levels[(rank, part)], highest = level, max(highest, level)
    assert best["threshold"] == pytest.approx(highest)
    # A second fault run that differs only in its fault kind is the same run before its fault:
    # those 60 steps are healthy steps once, not twice; --set reaches the detector's config
    twin = tmp_path / "faults" / "run-fault-stuck-w4.jsonl"
    header = {"setting": "fault", "world_size": 4, "fault_kind": "stuck", "fault_step": 60, "config": {"fault_rank": 2, "fault_kind": "stuck"}}
    first = json.loads(fault.read_text().splitlines()[0])["header"]
    first["config"]["fault_kind"] = "labels"
    fault.write_text("\n".join([json.dumps({"header": first}), *fault.read_text().splitlines()[1:]]) + "\n")
    twin.write_text("\n".join([json.dumps({"header": header}), *fault.read_text().splitlines()[1:]]) + "\n")
    _run("detection.py", str(tmp_path / "faults"), "--set", "recent=32", "--json", str(tmp_path / "twins.json"))
    twins = json.loads((tmp_path / "twins.json").read_text())
    (before,) = [h for h in twins["healthy"] if h["setting"] == "fault, before the fault"]
    assert before["steps"] == 60 and twins["config"]["recent"] == 32
    # a name that is no field fails and lists the fields
    bad = subprocess.run([sys.executable, str(BENCHMARKS / "detection.py"), str(tmp_path), "--set", "recnt=32"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'recnt=32'" in bad.stderr and "recent" in bad.stderr
