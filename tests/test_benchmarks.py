"""Every benchmark script runs on one tiny configuration and prints/writes its documented fields.

Speed is never asserted here: performance claims live in benchmarks/README.md.
"""

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_overhead_json_fields(tmp_path):
    out = tmp_path / "overhead.json"
    stdout = _run("overhead.py", "--models", "tiny-mlp", "--steps", "2", "--warmup", "1", "--configs", "none", "allreduce", "norms_separate", "silent", "--json", str(out))
    results = json.loads(out.read_text())
    hooks = {r["config"]["hook"] for r in results}
    assert hooks == {"none", "allreduce", "norms_separate", "silent"}
    for r in results:
        assert set(r["config"]) == {"hook", "sketch_dim", "every"}
        assert r["world_size"] == 2 and r["model"] == "tiny-mlp" and r["median_step_s"] > 0
        assert (r["hook_s_per_step"] > 0) == (r["config"]["hook"] != "none")
        assert isinstance(r["overhead_vs_allreduce"], float)
        if r["config"]["hook"] != "silent":
            assert r["config"]["sketch_dim"] is None and r["config"]["every"] is None
    assert {(r["config"]["sketch_dim"], r["config"]["every"]) for r in results if r["config"]["hook"] == "silent"} == {
        (k, e) for k in (0, 64, 256, 1024) for e in (1, 10)
    }
    assert "vs allreduce" in stdout and "silent k=256 every=10" in stdout


def test_hook_cost_fields(tmp_path):
    out = tmp_path / "cost.json"
    stdout = _run("hook_cost.py", "--buckets", "1", "--sketch-dims", "0", "256", "--rounds", "2", "--json", str(out))
    results = json.loads(out.read_text())
    assert [(r["bucket_mb"], r["sketch_dim"]) for r in results] == [(1, 0), (1, 256)]
    for r in results:
        for key in ("statistics_x_read", "reduced_x_read", "persistent_bytes_per_element", "transient_bytes_per_call"):
            assert r[key] >= 0
    assert results[1]["bins"] == 251 and "stats/read" in stdout


def test_comm_accounting_fields(tmp_path):
    out = tmp_path / "comm.json"
    _run("comm_accounting.py", "--json", str(out))
    rows = json.loads(out.read_text())
    assert {r["world_size"] for r in rows} == {2, 8, 64, 1024}
    tiny = [r for r in rows if r["model"] == "tiny-llama-12M" and r["world_size"] == 8][0]
    assert tiny["tensors"] == 93 and tiny["slot_bytes"] == 4 * (2 + 93 + 251)
    assert tiny["launches"]["silent_piggyback"] == tiny["launches"]["allreduce_hook"]


def test_transport_table():
    stdout = _run("transport.py", "--bucket-mb", "1", "--rounds", "2")
    for name in ("bucket only", "piggyback", "coalesced", "separate"):
        assert name in stdout
