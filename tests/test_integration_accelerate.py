"""ddphooks.attach in an Accelerate loop with gradient accumulation: 2 processes under torchrun (gloo, CPU).

The loop is tests/scripts/accelerate_loop.py; it writes the loss of every micro-batch as it saw it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_loop.py"


def test_accelerate_accumulation_records_mean_of_the_loops_losses(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"

    records = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # one record per optimizer step, not per micro-batch
    assert all(r["world_size"] == 2 for r in records)
    for rank in (0, 1):
        loop = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert loop["world_size"] == 2
        assert loop["syncs"] == [False, True] * 4  # accelerator.accumulate synchronised every 2nd micro-batch
        assert loop["alerts"] == []  # the micro-batches under no_sync are no unsynchronised backward passes
        expected = np.asarray(loop["losses"]).reshape(4, 2).mean(axis=1)
        np.testing.assert_allclose([r["losses"][rank] for r in records], expected, rtol=1e-5, err_msg=f"rank {rank}")
    # the ranks saw different data, so the check compares two different series
    assert records[0]["losses"][0] != pytest.approx(records[0]["losses"][1], rel=1e-5)
