"""The command line, run as a user runs it."""

import json
import subprocess
import sys


def test_demo_shows_the_fault_in_the_statistics(tmp_path):
    jsonl = tmp_path / "demo.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "ddphooks", "demo", "--steps", "16", "--jsonl", str(jsonl)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "rank 1 gets corrupted labels from here on" in result.stdout
    records = [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]
    assert [r["step"] for r in records] == list(range(16))
    before = [r["loss_std"] for r in records[:8]]
    after = [r["loss_std"] for r in records[8:]]
    assert min(after) > 5 * max(before), (before, after)


def test_demo_rejects_a_single_process():
    result = subprocess.run([sys.executable, "-m", "ddphooks", "demo", "--nproc", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "needs at least 2 processes" in result.stderr
