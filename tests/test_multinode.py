"""Two torchrun "nodes" of 2 processes each on this machine (c10d rendezvous, gloo): world size 4.

Both launches run tests/scripts/multinode_train.py: plain DDP + ``ddphooks.attach`` + JsonlSink.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).parent / "scripts" / "multinode_train.py"
NODES, PER_NODE, STEPS = 2, 2, 3
TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_nodes(out: Path) -> list[tuple[int, str]]:
    """Start both torchrun agents, wait for both; kill both if either fails or hangs."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:12]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = []
    for node in range(NODES):
        command = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE), "--node-rank", str(node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            # node 0 hosts the rendezvous store (both would match 127.0.0.1); workers meet on loopback
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
            str(SCRIPT), str(out), str(STEPS),
        ]  # fmt: skip
        log = open(out / f"node{node}.log", "w")
        processes.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    results = []
    try:
        for process, log in processes:
            process.wait(timeout=TIMEOUT_S)
    finally:
        for process, log in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
            log.close()
        for node, (process, _) in enumerate(processes):
            results.append((process.returncode, (out / f"node{node}.log").read_text()[-5000:]))
    return results


def test_two_nodes_of_two_processes(tmp_path):
    for node, (code, log) in enumerate(launch_nodes(tmp_path)):
        assert code == 0, f"node {node} exited with {code}:\n{log}"
    world = NODES * PER_NODE
    ranks = [json.loads((tmp_path / f"losses-rank{rank}.json").read_text()) for rank in range(world)]
    assert all(info["world_size"] == world for info in ranks)
    # the ranks really came from two agents of two local processes each
    assert sorted((info["group_rank"], info["local_rank"]) for info in ranks) == [(n, l) for n in range(NODES) for l in range(PER_NODE)]

    records = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))  # one record per step
    for record in records:
        assert record["world_size"] == world
        assert len(record["grad_norms"]) == world
        computed = [ranks[rank]["losses"][record["step"]] for rank in range(world)]
        np.testing.assert_allclose(record["losses"], computed, rtol=1e-5)
        np.testing.assert_allclose(record["loss_std"], np.std(computed), rtol=1e-5)
