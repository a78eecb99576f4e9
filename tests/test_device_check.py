"""benchmarks/device_check.py (issue #37), the one prepared device check, in its small form.

On the CPU the CPU plays the device and Triton runs in its interpreter, so every comparison of the
GPU run runs here too: its correctness rows must pass, every part must produce its rows with their
figures, and the comparison and the exit code must catch a broken part.
"""

import importlib.util
import json

import numpy as np

from test_benchmarks import BENCHMARKS, _run

KERNELS = ["torch", "triton"] if importlib.util.find_spec("triton") is not None else ["torch"]


def _device_check():
    spec = importlib.util.spec_from_file_location("device_check", BENCHMARKS / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_form_passes_its_correctness_rows_and_writes_every_part(tmp_path):
    out = tmp_path / "device-check.json"
    stdout = _run("device_check.py", "--small", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["small"] and report["parts"] == ["correctness", "fsdp", "sync", "stats", "patterns", "cost"]
    assert report["decision"]["stats_kernel"] is None and set(report["seconds"]) == set(report["parts"])
    rows = report["rows"]
    for r in rows:
        assert set(r) == {"part", "name", "kind", "status", "reason", "figures"}, r
        assert r["status"] in ("pass", "skipped") and r["kind"] in ("correctness", "goal"), (r["name"], r["status"], r["reason"])
    parts = {part: [r for r in rows if r["part"] == part] for part in report["parts"]}
    # correctness and fsdp: per kernel and the compact wire, the records against the CPU run (the
    # compact wire's against the CPU's compact run) and training against the plain run
    for part, transport, configs in (("correctness", "ddp", [*KERNELS, "auto", "torch+compact"]), ("fsdp", "fsdp2", [*KERNELS, "torch+compact"])):
        assert len(parts[part]) == 2 * len(configs)
        for r in parts[part]:
            assert r["status"] == "pass" and r["kind"] == "correctness", r
        records = [r for r in parts[part] if " records " in r["name"]]
        assert [r["name"].rsplit("=", 1)[1] for r in records] == configs and all(r["name"].startswith(transport) for r in records)
        for r in records:
            # every float within the row's 1e-5 + 1e-4 |x| (its status); the largest relative
            # difference is the noise scale's, a difference of close terms (3.2e-4 of 0.025 for
            # FSDP2's Triton pass against the torch path's on 2026-12-07)
            assert r["figures"]["steps"] == 4 and r["figures"]["floats_compared"] > 400 and r["figures"]["max_rel_diff"] < 1e-3
        for r in parts[part]:
            if "bitwise" in r["name"]:
                assert r["figures"]["bitwise_equal"] == r["figures"]["tensors"] == 6
    # sync: the control and every kernel ran their checked steps, skipped for want of CUDA; then the
    # compact wire as rank 0 of 64 on the fake group, with its own control
    assert len(parts["sync"]) == 1 + len(KERNELS) + 1 + 2
    for r in parts["sync"]:
        assert r["status"] == "skipped" and r["reason"].startswith("no CUDA") and r["figures"]["checked_steps"] == 3, r
    controls = [r for r in parts["sync"] if r["name"].startswith("control")]
    assert [r["name"].split("(")[-1] for r in controls] == ["gloo, 1 rank)", "fake group, rank 0 of 64)"]
    instrumented = [r for r in parts["sync"] if not r["name"].startswith("control")]
    assert [r["figures"]["wire"] for r in instrumented] == ["whole slots"] * (len(KERNELS) + 1) + ["compact"]
    assert all(r["figures"]["summary_ok"] for r in instrumented)
    # stats: four layouts, both paths timed against the read pass, launches counted
    timed = [r for r in parts["stats"] if r["kind"] == "goal" and "divides by W" not in r["name"]]
    assert [(r["figures"]["dtype"], r["figures"]["params"]) for r in timed] == [("float32", 8), ("float32", 160), ("bfloat16", 8), ("bfloat16", 160)]
    # the Triton pass's division by W: bitwise torch.div in fp32; bf16 only on a GPU (the interpreter truncates)
    divisions = [r for r in parts["stats"] if "divides by W" in r["name"]]
    assert [(r["status"], r["kind"], r["figures"]["bitwise"]) for r in divisions if "float32" in r["name"]] == [("pass", "correctness", True)] * 2
    assert [(r["status"], r["figures"]["accepted"]) for r in divisions if "bfloat16" in r["name"]] == [("skipped", False)] * 2
    for r in timed:
        assert r["status"] == "skipped" and r["reason"].startswith("no CUDA"), r
        assert sorted(r["figures"]["x_read"]) == sorted(KERNELS) and all(x["median"] > 0 for x in r["figures"]["x_read"].values())
        assert all(n > 0 for n in r["figures"]["launches"].values())
    # patterns: BatchNorm for SyncBatchNorm on the CPU, training bitwise with a record a step; small steps skipped
    norm, small_steps = parts["patterns"]
    assert norm["status"] == "pass" and "BatchNorm (the small form" in norm["name"] and norm["figures"]["bitwise_equal"] == norm["figures"]["tensors"] == 6
    assert norm["figures"]["steps"] == 4 and norm["figures"]["alerts"] == 0
    assert small_steps["status"] == "skipped" and small_steps["reason"].startswith("no CUDA") and small_steps["kind"] == "goal"
    # cost: the tiny Llama under DDP with several buckets, per kernel against allreduce_hook
    assert [r["name"].rsplit("=", 1)[1] for r in parts["cost"]] == KERNELS
    for r in parts["cost"]:
        f = r["figures"]
        assert r["status"] == "skipped" and f["buckets"] > 1 and f["step_s"] > 0 and f["hook_host_s"] > 0 and f["rounds"] == 3, r
        assert f["state_persistent_bytes"] > 0 and f["extra_peak_bytes"] is None  # no device memory on the CPU
        # the two parts timed: the pass inside the hook; the reduced norms in callbacks (gloo may run them on its threads)
        assert 0 < f["host_statistics_pass_s"] < f["hook_host_s"] and f["host_reduced_norms_s"] > 0
        assert {"median", "iqr"} <= set(f["extra_gpu_fraction_of_step"]) and {"median", "iqr"} <= set(f["extra_host_fraction_of_step"])
    assert "default stats_kernel on CUDA: not decided" in stdout and stdout.count("\n") == 3 + len(rows) + 1


def test_the_comparisons_and_the_exit_code_catch_a_broken_part():
    check = _device_check()
    record = [{"step": 0, "transport": "piggyback", "grad_norms": [1.0, 2.0], "cosine": [[1.0, 0.5], [0.5, 1.0]], "noise": None}]
    same = json.loads(json.dumps(record))
    assert check.compare_records(same, record)["ok"] and check.compare_records(same, record)["compared"] == 6
    perturbed = json.loads(json.dumps(record))
    perturbed[0]["cosine"][1][0] = 0.5 + 1e-3
    found = check.compare_records(perturbed, record)
    assert not found["ok"] and found["mismatch"].startswith("[0].cosine[1][0]") and found["worst"] == "[0].cosine[1][0]"
    assert not check.compare_records([{**record[0], "transport": "separate"}], record)["ok"]
    assert not check.compare_records([{k: v for k, v in record[0].items() if k != "noise"}], record)["ok"]
    assert not check.compare_records([{**record[0], "grad_norms": [1.0]}], record)["ok"]
    # Training: one ulp in one tensor is not bitwise equal
    params = [np.arange(6, dtype=np.float32), np.ones(3, dtype=np.float32)]
    changed = [params[0].copy(), np.nextafter(params[1], np.float32(2))]
    assert check.bitwise(params, params)["ok"] and not check.bitwise(changed, params)["ok"]
    # A device run that raised fails its rows; a broken correctness row or part sets the exit code,
    # a missed performance goal does not.
    ok_run = {"records": record, "params": params, "kernels": ["BucketStatsKernel"]}
    ranks = [{"cpu/silent/torch": ok_run, "device/plain/None": ok_run, "device/silent/torch": {"error": "RuntimeError: boom", "traceback": ""}}] * 2
    rows = check.correctness_rows("correctness", ranks, ["torch"], "cuda", "gloo")
    assert [r["status"] for r in rows] == ["fail", "fail"] and "boom" in rows[0]["reason"] and check.exit_code(rows) == 1
    assert check.exit_code([check.row("stats", "x", "goal", "fail", "goal missed: torch 3.00x read")]) == 0
    assert check.exit_code([check.row("stats", "x", "goal", "fail", "error: RuntimeError")]) == 1
    assert check.exit_code([check.row("cost", "x", "goal", "skipped", "no CUDA"), check.row("sync", "y", "correctness", "pass")]) == 0


def test_the_patterns_rows_read_their_runs_against_issue_41s_goals():
    check = _device_check()
    params = [np.ones(3, dtype=np.float32), np.zeros(2, dtype=np.float32)]
    good = {"params": params, "records": check.STEPS, "alerts": 0}
    assert check.sync_batchnorm_rows([{"plain": good, "silent": good}] * 2, "cuda", False)[0]["status"] == "pass"
    moved = {**good, "params": [params[0] + 1e-7, params[1]]}
    failed = check.sync_batchnorm_rows([{"plain": good, "silent": good}, {"plain": good, "silent": moved}], "cuda", False)[0]
    assert failed["status"] == "fail" and failed["reason"].startswith("1 tensors differ")
    refused = check.sync_batchnorm_rows([{"plain": {"error": "RuntimeError: no"}, "silent": good}] * 2, "cuda", False)[0]
    assert refused["status"] == "skipped" and "does not run with gloo on cuda tensors: RuntimeError: no" in refused["reason"]

    def results(cpu_s: float, step: float) -> list[dict]:
        return [{"config": {"hook": "allreduce"}, "median_step_s": 0.025},
                {"config": {"hook": "silent_sink"}, "thread_cpu_s_vs_allreduce_less_pass": {"median": cpu_s, "iqr": [0, 2 * cpu_s]},
                 "overhead_vs_allreduce": step, "overhead_vs_allreduce_iqr": [0.0, 0.1]}]  # fmt: skip
    assert check.small_step_row("small", results(0.8e-3, 0.04))["status"] == "pass"
    missed = check.small_step_row("small", results(1.7e-3, 0.23))
    assert missed["status"] == "fail" and missed["reason"] == "goal missed: CPU 1.70 ms, step +23.0%"


def test_the_default_must_pick_the_triton_kernel_on_cuda_only_where_triton_is_installed():
    check = _device_check()
    assert check.expected_kernel("auto", "cuda", ["torch", "triton", "auto"]) == "TritonBucketStats"
    assert check.expected_kernel("auto", "cuda", ["torch", "auto"]) == "BucketStatsKernel"  # no triton: the torch path
    assert check.expected_kernel("auto", "cpu", ["torch", "triton", "auto"]) == "BucketStatsKernel"
    assert check.expected_kernel("triton", "cpu", ["torch", "triton"]) == "TritonBucketStats"
    assert check.expected_kernel("torch+compact", "cuda", ["torch", "triton"]) == "BucketStatsKernel"


def test_the_stats_part_takes_a_bucket_larger_than_the_sign_tables_page():
    # The device check's stats part (triton_sketch.measure_layout) times 25 MB bf16 buckets, 13.1 M
    # elements: one accelerator chunk, more than the 8 M entries of T, so its torch path needs the
    # table of a chunk's window, as the state makes it. Run on the CPU at 18 MB (9.4 M elements).
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from triton_sketch import measure_layout
    finally:
        sys.path.remove(str(BENCHMARKS))
    import torch

    result = measure_layout(torch.device("cpu"), 18, torch.bfloat16, 8, 1, 256, with_triton=False, warmup=0)
    assert result["numel"] > 1 << 23 and result["x_read"]["torch"]["median"] > 0 and result["launches"]["torch"] > 0, result
