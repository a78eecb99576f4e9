"""One prepared device check (issue #37): the CUDA path's correctness and cost on one GPU, in one run.

    pip install -e ".[test]" && python benchmarks/device_check.py --json docs/results/device-check.json
    python benchmarks/device_check.py --parts stats cost --json /tmp/rerun.json     # a subset (rerun)
    python benchmarks/device_check.py --small --json /tmp/small.json                # the CPU form

Designed for <= 10 minutes on one H200 (each part has a time budget, and is killed past it). It prints
one table, a row per check, and writes the same rows as JSON (``name``, ``part``, ``kind``,
``status`` pass / fail / skipped, ``reason``, ``figures``). The exit code is 1 if a correctness row
fails or any part breaks (an exception, a timeout); a missed performance goal only shows in its row.

Parts (``--parts``):
  correctness  DDP, 2 ranks on the one GPU over gloo (gloo carries CUDA tensors; NCCL refuses two
               ranks on one device): every record (losses, per-rank and per-parameter norms,
               cosines, the sketched cosine matrix, replica fingerprints) equal to the same run on
               the CPU to fp32 rounding, for stats_kernel "torch", "triton" and "auto" (the default,
               which must pick Triton on CUDA), and for the compact
               wire ("torch+compact": gather_max_world=1, ddphooks.fleet; against the CPU's compact
               run); the parameters after training bitwise equal to torch's allreduce_hook on the GPU.
  fsdp         the same for FSDP2 (fully_shard) on the one GPU, over gloo with CUDA tensors; skipped
               with the error if plain FSDP2 itself cannot run there.
  sync         no host synchronisation on the hook path: one rank (NCCL where it exists), the
               backward of the instrumented steps under torch.cuda.set_sync_debug_mode("error")
               after two warm-up steps (plans and sign tables built; their synchronisations are
               counted, in "warn" mode), each step's record flushed outside the mode (ddphooks'
               pipeline thread is off the hook path; the mode is process-wide); the control, plain
               allreduce_hook under the same mode, must pass too, or the row says nothing (then
               skipped). The compact wire needs more than one rank: it runs as rank 0 of
               FAKE_WORLD on PyTorch's fake process group (benchmarks/scale.py's FakeCollectives
               fill the other ranks' values on the GPU), with its own allreduce_hook control.
  stats        the statistics pass per bucket (25 and 100 MB, fp32 and bf16, 8 and 160 parameters):
               the shipped torch path and the Triton kernel as x one read pass (median [IQR] of
               per-round ratios, CUDA events) and kernels launched per bucket (profiler); goal
               <= 2x a read and <= 8 launches (benchmarks/triton_sketch.py's measure_layout).
  patterns     issue 41's rows that need a GPU: DDP with SyncBatchNorm (torch refuses it on the CPU),
               2 ranks on the one GPU over gloo, training bitwise equal to allreduce_hook with a record
               every step and no alert (skipped with the error where plain DDP itself cannot run
               it); and small steps, `overhead.py --small` on one rank (torchrun, NCCL): the training
               thread's CPU beyond allreduce_hook and the statistics pass at the defaults with a
               JsonlSink and summary(), goal <= 1 ms, and the step over allreduce_hook's, goal <= 5%.
  cost         what a user pays: a ~1.1B Llama-shaped model (transformers LlamaConfig, random
               weights, bf16) under DDP with its default 25 MB buckets, one rank: the hook's extra
               GPU time in the backward and its host time, per step, against the step (forward +
               backward) of plain allreduce_hook, goal <= 1%, and of that host time the
               statistics pass's and the reduced norms' (since 2026-12-07 with the copy of the
               slots they are kept with, ``SilentState._keep_slots``); the extra device memory
               (memory_allocated after warm-up, max_memory_allocated during a step).

Without CUDA (or with ``--small``) it runs the small form: the CPU plays the device (so every
comparison runs), Triton under its interpreter (TRITON_INTERPRET=1), a tiny Llama, tiny buckets;
the sync part runs its steps without the debug mode and the timing rows only exercise the code:
those rows are "skipped: no CUDA" with their figures.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# -- config ----------------------------------------------------------------------------------------
PARTS = ("correctness", "fsdp", "sync", "stats", "patterns", "cost")
#: Seconds each part may take on the GPU (the worker processes are killed past it): 610 s in all.
BUDGET_S = {"correctness": 140, "fsdp": 90, "sync": 90, "stats": 80, "patterns": 90, "cost": 150}
#: Issue 41's small-step goals: the training thread's CPU beyond allreduce_hook and the statistics
#: pass (seconds), and the step time over allreduce_hook's (a fraction).
GOAL_SMALL_CPU_S, GOAL_SMALL_STEP_FRACTION = 1e-3, 0.05
STEPS = 4  # training steps of the correctness runs (a replica check on steps 0 and 2)
#: The compact wire's configuration (``ddphooks.fleet``): the torch path with gather_max_world=1.
COMPACT = "torch+compact"
FAKE_WORLD = 64  # the sync part's compact-wire world (rank 0 of it, on the fake process group)
BUCKET_CAP_MB = 0.1  # correctness model: 3 buckets
#: Records of the device run against the CPU run: fp32 rounding of reductions in another order.
RTOL, ATOL = 1e-4, 1e-5
GOAL_X_READ, GOAL_LAUNCHES, GOAL_STEP_FRACTION = 2.0, 8, 0.01
STATS_MB, STATS_ROUNDS = (25, 100), 20
COST_ROUNDS, COST_WARMUP = 15, 3
#: ~1.1B parameters (TinyLlama-1.1B's shape), bf16; 4 x 1024 tokens a step (a small micro-batch:
#: the hook's share of the step is larger than with more tokens).
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4)
LLAMA_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
COST_BATCH = {"full": (4, 1024), "small": (2, 32)}
COST_BUCKET_MB = {"full": 25.0, "small": 0.05}  # DDP's default; tiny buckets for the tiny model


# -- shared pieces ---------------------------------------------------------------------------------
class Net(torch.nn.Module):
    """A small MLP (about 75 K parameters): three DDP buckets of BUCKET_CAP_MB."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(32, 192)
        self.hidden = torch.nn.Linear(192, 256)
        self.out = torch.nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank, made on the CPU (the same numbers whatever the device)."""
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank)
    x = torch.randn(64, 32, generator=generator) + 0.3 * rank
    return x.to(device), torch.randn(64, 16, generator=generator).to(device)


def train_steps(model: torch.nn.Module, state, optimizer: torch.optim.Optimizer, rank: int, device: torch.device) -> list:
    """STEPS steps of ``model`` on ``batch``'s data with the MSE loss; ``state.latest`` after each
    step (``state``: ddphooks' state, or None for the plain run, which records nothing)."""
    published = []
    for step in range(STEPS):
        x, y = batch(rank, step, device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if state is not None:
            state.observe_loss(loss)
        loss.backward()
        if state is not None:
            state.flush()
            published.append(state.latest)
        optimizer.step()
        optimizer.zero_grad()
    return published


def the_device(small: bool) -> torch.device:
    """The device under test: the GPU (both ranks on cuda:0), or the CPU in the small form."""
    if small:
        return torch.device("cpu")
    from ddphooks.devices import set_device

    device = torch.device("cuda", 0)
    set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attach_settings(config: str) -> dict:
    """``attach``'s settings of a configuration: a stats_kernel, "+compact" for the compact wire."""
    kernel, _, wire = config.partition("+")
    return {"stats_kernel": kernel, **({"gather_max_world": 1} if wire == "compact" else {})}


def error_text(error: BaseException, limit: int = 600) -> str:
    text = f"{type(error).__name__}: {error}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compare_records(got, expected, rtol: float = RTOL, atol: float = ATOL, path: str = "") -> dict:
    """Two records (nested dicts / lists) field by field: the same keys, lengths, strings and
    integers, floats within ``atol + rtol * |expected|``. Returns ``ok``, the floats compared, the
    largest absolute and relative differences and the first mismatch (its path)."""
    found = {"ok": True, "compared": 0, "max_abs": 0.0, "max_rel": 0.0, "mismatch": None, "worst": None}

    def fail(where: str, why: str) -> None:
        if found["ok"]:
            found["mismatch"] = f"{where or '.'}: {why}"
        found["ok"] = False

    def walk(a, b, where: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                return fail(where, f"keys {sorted(set(a) ^ set(b))} on one side only")
            for key in a:
                walk(a[key], b[key], f"{where}.{key}")
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            if len(a) != len(b):
                return fail(where, f"lengths {len(a)} != {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]")
        elif isinstance(a, float) and isinstance(b, float) and not isinstance(a, bool):
            found["compared"] += 1
            if math.isnan(a) or math.isnan(b):
                return None if math.isnan(a) and math.isnan(b) else fail(where, f"{a} != {b}")
            diff = abs(a - b)
            if diff > found["max_abs"]:
                found["max_abs"], found["worst"] = diff, where
            if b != 0:
                found["max_rel"] = max(found["max_rel"], diff / abs(b))
            if diff > atol + rtol * abs(b):
                fail(where, f"{a!r} != {b!r} (diff {diff:.2e})")
        elif type(a) is not type(b) or a != b:
            fail(where, f"{a!r} != {b!r}")

    walk(got, expected, path)
    return found


def bitwise(got: list, expected: list) -> dict:
    """Parameters after training (numpy arrays): how many are bitwise equal, the largest difference."""
    import numpy as np

    equal = sum(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(got, expected))
    worst = max((float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) for a, b in zip(got, expected) if a.size), default=0.0)
    return {"ok": equal == len(expected) == len(got), "tensors": len(expected), "bitwise_equal": equal, "max_abs_diff": worst}


def row(part: str, name: str, kind: str, status: str, reason: str = "", **figures) -> dict:
    return {"part": part, "name": name, "kind": kind, "status": status, "reason": reason, "figures": figures}


# -- correctness: DDP and FSDP2 on the device against the CPU ------------------------------------------
def _train(rank: int, device: torch.device, hook: str, kernel: str | None, sharded: bool) -> dict:
    """STEPS SGD steps of Net under DDP or FSDP2 on ``device`` (``hook``: "silent" attaches
    ddphooks, "plain" is allreduce_hook / plain FSDP2): the records, the parameters, the kernels."""
    import ddphooks
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model: torch.nn.Module = Net().to(device)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for layer in (model.inp, model.hidden):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    state = None
    if hook == "silent":
        state = ddphooks.attach(model, check_replicas_every=2, **attach_settings(kernel))
    elif not sharded:
        model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    records = [stats.to_dict() for stats in train_steps(model, state, optimizer, rank, device)]
    kernels = []
    if state is not None:
        kernels = sorted({type(k).__name__ for k in state._kernels.values()})
        state.close()
    # numpy, not tensors: a tensor crosses the result queue as shared memory the exiting worker frees
    params = [(full_parameter(p) if sharded else p.detach().cpu().numpy().copy()) for p in model.parameters()]
    return {"records": records, "params": params, "kernels": kernels}


def full_parameter(param) -> "np.ndarray":
    """An FSDP2 parameter (a DTensor sharded on dim 0) whole, on every rank: the local shards
    through the host (``all_gather_object``), not ``full_tensor()``, whose all-gather of CUDA
    tensors over gloo crashed the process on the GPU (torch 2.11, device run of 2026-12-04)."""
    shards = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shards, param.to_local().detach().cpu().numpy().copy())
    return np.concatenate(shards, axis=0)


def correctness_runs(configs: list[str]) -> list[tuple[str, str, str | None]]:
    """The runs of a correctness part: the CPU references (the compact wire's too, where it is
    checked), the plain device run, then ddphooks on the device."""
    references = [("cpu", "silent", config) for config in ("torch", COMPACT) if config == "torch" or config in configs]
    return references + [("device", "plain", None)] + [("device", "silent", config) for config in configs]


def part_configs(part: str, kernels: list[str]) -> list[str]:
    """The configurations a correctness part checks: the kernels, the compact wire, and for DDP
    the default ("auto": the Triton kernel on CUDA once it passes its check, else the torch path)."""
    return [*kernels, COMPACT] if part == "fsdp" else [*kernels, "auto", COMPACT]


def expected_kernel(config: str, device_name: str, kernels: list[str]) -> str:
    """The kernel class a configuration must run: "auto" picks Triton on CUDA where it is installed."""
    triton = config == "triton" or (config == "auto" and device_name == "cuda" and "triton" in kernels)
    return "TritonBucketStats" if triton else "BucketStatsKernel"


def _correctness_worker(rank: int, world: int, small: bool, run: tuple[str, str, str | None], sharded: bool) -> dict:
    """One run on every rank (the CPU reference, the plain device run or ddphooks on the device).
    A run that raises is reported (every rank raises alike: the same code on the same shapes); a
    crash (a signal) is reported by ``run_part``, which starts each run in its own processes, with
    Python's traceback of the crash on stderr (faulthandler)."""
    import faulthandler

    faulthandler.enable()
    device = the_device(small)
    where, hook, kernel = run
    try:
        return _train(rank, torch.device("cpu") if where == "cpu" else device, hook, kernel, sharded)
    except Exception as error:
        return {"error": error_text(error), "traceback": traceback.format_exc()[-3000:]}


def correctness_rows(part: str, ranks: list[dict], kernels: list[str], device_name: str, backend: str) -> list[dict]:
    """The rows of one correctness part from every rank's runs."""
    transport = "fsdp2" if part == "fsdp" else "ddp"
    rows = []
    first = ranks[0]
    reference, plain = first["cpu/silent/torch"], first["device/plain/None"]
    if "error" in reference:
        return [row(part, f"{transport}: the CPU reference run", "correctness", "fail", "error: " + reference["error"])]
    if "error" in plain:
        if part == "fsdp":  # the backend cannot run FSDP2 here at all: nothing of ddphooks to check
            reason = f"plain FSDP2 does not run with gloo on {device_name} tensors: {plain['error']}"
            return [row(part, f"fsdp2 records {device_name} vs cpu, stats_kernel={k}", "correctness", "skipped", reason) for k in kernels]
        return [row(part, f"{transport}: plain allreduce_hook run on {device_name}", "correctness", "fail", "error: " + plain["error"])]
    for kernel in kernels:
        name = f"{transport} records {device_name} vs cpu ({backend}, 2 ranks), stats_kernel={kernel}"
        runs = [rank[f"device/silent/{kernel}"] for rank in ranks]
        reference_key = f"cpu/silent/{COMPACT if kernel == COMPACT else 'torch'}"
        broken = next((run for run in runs if "error" in run), None)
        if broken is not None:
            rows.append(row(part, name, "correctness", "fail", "error: " + broken["error"], traceback=broken["traceback"]))
            rows.append(row(part, f"{transport} training bitwise = plain on {device_name}, stats_kernel={kernel}", "correctness", "fail", "the run failed"))
            continue
        if "error" in ranks[0][reference_key]:
            rows.append(row(part, name, "correctness", "fail", f"error in the CPU reference ({reference_key}): " + ranks[0][reference_key]["error"]))
            continue
        found = [compare_records(run["records"], rank[reference_key]["records"]) for run, rank in zip(runs, ranks)]
        used = sorted({k for run in runs for k in run["kernels"]})
        ok = all(f["ok"] for f in found) and used == [expected_kernel(kernel, device_name, kernels)] and len(runs[0]["records"]) == STEPS
        reason = "" if ok else next((f["mismatch"] for f in found if not f["ok"]), f"kernels {used}, {len(runs[0]['records'])} records")
        rows.append(row(
            part, name, "correctness", "pass" if ok else "fail", reason, steps=len(runs[0]["records"]), floats_compared=sum(f["compared"] for f in found),
            max_abs_diff=max(f["max_abs"] for f in found), max_rel_diff=max(f["max_rel"] for f in found), worst=max(found, key=lambda f: f["max_abs"])["worst"], rtol=RTOL, atol=ATOL, kernels=used,
        ))  # fmt: skip
        same = [bitwise(run["params"], rank["device/plain/None"]["params"]) for run, rank in zip(runs, ranks)]
        ok = all(s["ok"] for s in same)
        baseline = "plain FSDP2" if part == "fsdp" else "allreduce_hook"
        rows.append(row(
            part, f"{transport} training bitwise = {baseline} on {device_name}, stats_kernel={kernel}", "correctness", "pass" if ok else "fail",
            "" if ok else f"{sum(s['tensors'] - s['bitwise_equal'] for s in same)} tensors differ", tensors=same[0]["tensors"],
            bitwise_equal=min(s["bitwise_equal"] for s in same), max_abs_diff=max(s["max_abs_diff"] for s in same),
        ))  # fmt: skip
    return rows


# -- patterns: issue 41's rows that need a GPU ----------------------------------------------------------
class BatchNormNet(torch.nn.Module):
    """Net with a BatchNorm between its layers, made SyncBatchNorm before wrapping."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


def _sync_batchnorm_worker(rank: int, world: int, small: bool) -> dict:
    """STEPS SGD steps of BatchNormNet with SyncBatchNorm under DDP (BatchNorm in the small form:
    torch refuses SyncBatchNorm on the CPU), plain allreduce_hook and then ddphooks at its
    defaults: each run's parameters, records and alerts, or its error."""
    import ddphooks
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = the_device(small)
    runs = {}
    for hook in ("plain", "silent"):
        try:
            torch.manual_seed(0)
            module = BatchNormNet() if small else torch.nn.SyncBatchNorm.convert_sync_batchnorm(BatchNormNet())
            model = DDP(module.to(device))
            state = ddphooks.attach(model) if hook == "silent" else None
            if state is None:
                model.register_comm_hook(None, allreduce_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            published = train_steps(model, state, optimizer, rank, device)
            records = sum(stats is not None and stats.step == step for step, stats in enumerate(published))
            alerts = len(state.alerts) if state is not None else 0
            if state is not None:
                state.close()
            runs[hook] = {"params": [p.detach().cpu().numpy().copy() for p in model.parameters()], "records": records, "alerts": alerts}
        except Exception as error:
            runs[hook] = {"error": error_text(error)}
    return runs


def sync_batchnorm_rows(ranks: list[dict], device_name: str, small: bool) -> list[dict]:
    norm = "BatchNorm (the small form: torch refuses SyncBatchNorm on the CPU)" if small else "SyncBatchNorm"
    name = f"ddp with {norm}: training bitwise = allreduce_hook on {device_name} (gloo, 2 ranks), a record every step, no alert"
    plain = next((r["plain"] for r in ranks if "error" in r["plain"]), None)
    if plain is not None:
        return [row("patterns", name, "correctness", "skipped", f"plain DDP with {norm} does not run with gloo on {device_name} tensors: {plain['error']}")]
    broken = next((r["silent"] for r in ranks if "error" in r["silent"]), None)
    if broken is not None:
        return [row("patterns", name, "correctness", "fail", "error: " + broken["error"])]
    same = [bitwise(r["silent"]["params"], r["plain"]["params"]) for r in ranks]
    records, alerts = min(r["silent"]["records"] for r in ranks), max(r["silent"]["alerts"] for r in ranks)
    ok = all(s["ok"] for s in same) and records == STEPS and alerts == 0
    reason = "" if ok else f"{sum(s['tensors'] - s['bitwise_equal'] for s in same)} tensors differ, {records} records, {alerts} alerts"
    return [row("patterns", name, "correctness", "pass" if ok else "fail", reason, tensors=same[0]["tensors"],
                bitwise_equal=min(s["bitwise_equal"] for s in same), max_abs_diff=max(s["max_abs_diff"] for s in same), steps=records, alerts=alerts)]  # fmt: skip


def small_step_rows(small: bool, budget: float) -> list[dict]:
    """``overhead.py --small`` on one rank of the GPU (torchrun, NCCL), read from its JSON."""
    import subprocess
    import tempfile

    name = "small steps (tiny-gpt, overhead.py --small, 1 rank): defaults + JsonlSink + summary() against allreduce_hook"
    if small:
        return [row("patterns", name, "goal", "skipped", "no CUDA: on the CPU it is `python benchmarks/overhead.py --small` (benchmarks/README.md, Small steps)")]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "small.json")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overhead.py")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", script, "--device", "cuda", "--small", "--json", out]
        done = subprocess.run(command, capture_output=True, text=True, timeout=budget)
        if done.returncode != 0:
            return [row("patterns", name, "goal", "fail", f"error: overhead.py exited {done.returncode}: {done.stderr[-600:]}")]
        with open(out) as file:
            return [small_step_row(name, json.load(file))]


def small_step_row(name: str, results: list[dict]) -> dict:
    """The small-step row from ``overhead.py --small``'s results, against issue 41's goals."""
    user = next(r for r in results if r["config"]["hook"] == "silent_sink")
    plain = next(r for r in results if r["config"]["hook"] == "allreduce")
    cpu, step = user["thread_cpu_s_vs_allreduce_less_pass"], user["overhead_vs_allreduce"]
    misses = [what for what, missed in ((f"CPU {1e3 * cpu['median']:.2f} ms", cpu["median"] > GOAL_SMALL_CPU_S), (f"step {100 * step:+.1f}%", step > GOAL_SMALL_STEP_FRACTION)) if missed]
    return row("patterns", name, "goal", "fail" if misses else "pass", "goal missed: " + ", ".join(misses) if misses else "",
               cpu_beyond_allreduce_less_pass_s=cpu, step_over_allreduce=step, step_over_allreduce_iqr=user["overhead_vs_allreduce_iqr"],
               allreduce_step_s=plain["median_step_s"], breakdown=user.get("breakdown"))  # fmt: skip


# -- sync: no host synchronisation on the hook path ------------------------------------------------------
class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:300])


def single_rank_group(device: torch.device):
    """The group of the one-rank parts: NCCL on CUDA where torch has it (gloo would copy every
    bucket through the host), else the default gloo group."""
    import torch.distributed as dist

    if device.type == "cuda" and dist.is_nccl_available():
        return dist.new_group([0], backend="nccl"), "nccl"
    return None, "gloo"


def fake_group(world: int) -> str:
    """Replace this one-rank process's default group by rank 0 of ``world`` on PyTorch's fake
    process group (``launch.spawn`` destroys the default group when the worker returns)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return f"fake group, rank 0 of {world}"


def _sync_worker(rank: int, world: int, small: bool, configs: list[str], warmup: int, steps: int, fake_world: int | None = None) -> dict:
    """The backward of ``warmup + steps`` steps per configuration (allreduce_hook first, the
    control) on one rank, or as rank 0 of ``fake_world`` on the fake process group with
    scale.py's FakeCollectives standing in for the other ranks."""
    import contextlib

    device = the_device(small)
    collectives = None
    if fake_world is None:
        group, backend = single_rank_group(device)
        backend += ", 1 rank"
    else:
        from scale import FakeCollectives

        group, backend = None, fake_group(fake_world)
        collectives = FakeCollectives(fake_world, device)
    results = {"backend": backend}
    with collectives if collectives is not None else contextlib.nullcontext():
        for config in ["allreduce_hook", *configs]:
            results[config] = _sync_config(config, rank, device, group, collectives, warmup, steps)
    return results


def _sync_config(config: str, rank: int, device: torch.device, group, collectives, warmup: int, steps: int) -> dict:
    """One configuration of the sync part (see ``_sync_worker``): its steps, the warm-up's
    synchronisations, what ddphooks logged, whether its statistics came out finite."""
    import ddphooks
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = device.type == "cuda"
    logged = _Logged()
    logging.getLogger("ddphooks").addHandler(logged)
    syncs: list[str] = []
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # where a warm-up step synchronised
        if "synchroniz" in str(message):
            syncs.append(f"{threading_name()}: {str(message)[:120]} at {filename}:{lineno}")

    try:
        torch.manual_seed(0)
        model = DDP(Net().to(device), process_group=group, bucket_cap_mb=BUCKET_CAP_MB)
        state = None
        if config == "allreduce_hook":
            model.register_comm_hook(group, allreduce_hook)
        else:
            state = ddphooks.attach(model, check_replicas_every=3, **attach_settings(config))  # a replica check on a checked step
            if collectives is not None:
                watch_statistics(state, collectives)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        checked = 0
        for step in range(warmup + steps):
            x, y = batch(rank, step, device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if state is not None:
                state.observe_loss(loss)
            mode = "error" if step >= warmup else "warn"
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                if cuda:
                    torch.cuda.set_sync_debug_mode(mode)
                try:
                    loss.backward()  # only the backward, where DDP calls the hook, runs under the mode
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
                    warnings.showwarning = shown
            checked += step >= warmup
            if state is not None:
                # Outside the mode: the step's record, detector and alerts run on ddphooks'
                # pipeline thread, off the hook path; done here, none of it overlaps the next
                # backward (the debug mode is process-wide and would count that thread too).
                state.flush()
            optimizer.step()
            optimizer.zero_grad()
        summary_ok, wire = None, None
        if state is not None:
            state.flush()
            summary = state.latest.summary()
            summary_ok = math.isfinite(summary["grad_norm_mean"]) and math.isfinite(summary["loss_mean"])
            wire = state.latest.to_dict().get("wire", "whole slots")
            state.close()
        return {"ok": True, "checked_steps": checked, "warmup_syncs": syncs[:8], "warmup_sync_count": len(syncs),
                "summary_ok": summary_ok, "wire": wire, "logged": logged.messages[:5]}  # fmt: skip
    except Exception as error:
        return {"ok": False, "error": error_text(error, 1500), "warmup_syncs": syncs[:8], "logged": logged.messages[:5]}
    finally:
        logging.getLogger("ddphooks").removeHandler(logged)


def watch_statistics(state, collectives) -> None:
    """Point scale.py's FakeCollectives at ``state``'s statistics: each step's buffer, so the
    fake all-reduce fills the other ranks' part of it (as scale.py's measure does)."""
    pack = state._pack

    def packed(record, slots, *args):
        collectives.state, collectives.record, collectives.wire = state, record, slots.numel()
        pack(record, slots, *args)

    state._pack = packed


def threading_name() -> str:
    import threading

    return threading.current_thread().name


def sync_rows(result: dict, kernels: list[str], small: bool) -> list[dict]:
    part, backend = "sync", result["backend"]
    control = result["allreduce_hook"]
    rows = [row(
        part, f"control: allreduce_hook backward under sync debug mode 'error' ({backend})", "correctness",
        "skipped" if small else "pass" if control["ok"] else "skipped",
        "no CUDA: the steps ran without the debug mode (the code path only)" if small else "" if control["ok"]
        else "the control synchronises by itself under this backend, so the ddphooks rows say nothing: " + control["error"],
        **{k: v for k, v in control.items() if k != "ok"},
    )]  # fmt: skip
    for kernel in kernels:
        got = result[kernel]
        name = f"no host sync in the hook: ddphooks backward under 'error', stats_kernel={kernel}"
        if kernel == COMPACT:
            name += f" ({backend})"
        figures = {k: v for k, v in got.items() if k != "ok"}
        if not got["ok"]:
            status, reason = "fail", "error: " + got["error"]
        elif got["logged"] or not got["summary_ok"]:
            status, reason = "fail", f"ddphooks reported: {got['logged']}" if got["logged"] else "no valid statistics after the steps"
        elif got["wire"] != ("compact" if kernel == COMPACT else "whole slots"):
            status, reason = "fail", f"the statistics travelled in the {got['wire']} wire"
        elif small:
            status, reason = "skipped", "no CUDA: the steps ran without the debug mode (the code path only)"
        elif not control["ok"]:
            status, reason = "skipped", "the control failed under the same mode (see the control row): inconclusive"
        else:
            status, reason = "pass", f"{got['checked_steps']} instrumented steps after 2 warm-up steps"
        rows.append(row(part, name, "correctness", status, reason, **figures))
    return rows


# -- stats: the statistics pass per bucket -----------------------------------------------------------------
def _stats_worker(rank: int, world: int, small: bool, with_triton: bool, sizes: list[float], rounds: int) -> list[dict]:
    from triton_sketch import measure_layout

    device = the_device(small)
    results = []
    for size_mb in sizes:
        for dtype in (torch.float32, torch.bfloat16):
            for n_params in (8, 160):
                key = {"bucket_mb": size_mb, "dtype": str(dtype).removeprefix("torch."), "params": n_params}
                try:
                    result = {**key, **measure_layout(device, size_mb, dtype, n_params, rounds, 256, with_triton=with_triton)}
                    if with_triton:
                        result["division"] = divides_like_torch(device, size_mb, dtype, n_params)
                    results.append(result)
                except Exception as error:
                    results.append({**key, "error": error_text(error)})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return results


def divides_like_torch(device: torch.device, size_mb: float, dtype: torch.dtype, n_params: int) -> dict:
    """The Triton pass's division by W (``run(divide_by=...)``, allreduce_hook's division done in
    the statistics pass) on one bucket layout: whether the kernel's probe accepts it for this dtype
    (``divides_like_torch``; else the hook divides with torch), and whether the bucket is then
    bitwise equal to ``torch.div``."""
    from triton_sketch import bucket_layout

    from ddphooks.sketch import BucketPlan, SignTable, sketch_bins
    from ddphooks.triton_stats import TritonBucketStats

    bins, world = sketch_bins(256), 3
    lengths = bucket_layout(size_mb, dtype, n_params)
    plan = BucketPlan(lengths, bins, 0, device, 1 << 23)
    flat = torch.randn(plan.numel, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    kernel = TritonBucketStats(bins, device, SignTable(0, bins, device))
    if not kernel.divides_like_torch(dtype, world):
        return {"accepted": False, "bitwise": None}
    divided = flat.clone()
    kernel.run(divided, plan, torch.zeros(bins, device=device), torch.empty(n_params, device=device), divide_by=world)
    return {"accepted": True, "bitwise": torch.equal(divided, torch.div(flat, world))}


def stats_rows(results: list[dict], small: bool, triton_reason: str | None) -> list[dict]:
    rows = []
    for r in results:
        if "division" in r:
            name = f"triton pass divides by W like torch.div, bitwise: {r['bucket_mb']:g} MB {r['dtype']} {r['params']} params"
            accepted, bitwise = r["division"]["accepted"], r["division"]["bitwise"]
            if not accepted:  # the hook divides with torch: a launch more, nothing wrong
                refused = "the kernel's probe found it does not divide like torch here, so the hook divides with torch"
                if small and r["dtype"] != "float32":
                    rows.append(row("stats", name, "goal", "skipped", refused + " (Triton's interpreter truncates fp32 to bf16)", **r["division"]))
                else:
                    rows.append(row("stats", name, "goal", "fail", refused, **r["division"]))
            else:
                rows.append(row("stats", name, "correctness", "pass" if bitwise else "fail", "" if bitwise else "the probe accepted a division that is not bitwise", **r["division"]))
        name = f"statistics pass {r['bucket_mb']:g} MB {r['dtype']} {r['params']} params: torch path, triton vs a read"
        if "error" in r:
            rows.append(row("stats", name, "goal", "fail", "error: " + r["error"]))
            continue
        misses = [f"{path} {r['x_read'][path]['median']:.2f}x read" for path in r["x_read"] if r["x_read"][path]["median"] > GOAL_X_READ]
        misses += [f"{path} {n} launches" for path, n in r["launches"].items() if n > GOAL_LAUNCHES]
        figures = {k: v for k, v in r.items() if k not in ("bucket_mb", "dtype", "params", "division")}
        figures.update(bucket_mb=r["bucket_mb"], dtype=r["dtype"], params=r["params"], read_gb_s=r["bytes"] / r["read_s"] / 1e9)
        if small:
            status, reason = "skipped", "no CUDA: the CPU (and Triton's interpreter) only exercise the code"
        else:
            status, reason = ("fail", "goal missed: " + ", ".join(misses)) if misses else ("pass", "")
        if triton_reason and not small:
            reason = (reason + "; " if reason else "") + triton_reason
        rows.append(row("stats", name, "goal", status, reason, **figures))
    return rows


# -- cost: what a user pays on a ~1B Llama --------------------------------------------------------------------
def llama(device: torch.device, shape: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


class _Clock:
    """Marks on the device's timeline: CUDA events, or host time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks (after the device finished)."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def memory_allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


class _PartTimer:
    """Host seconds of the hook's two parts in the current step: the statistics pass (the
    kernel's ``accumulate``, per bucket) and the reduced buckets' norms, kept with the slots
    (``SilentState._keep_slots``, once a step in the last bucket's communication callback, which
    runs on the training thread under NCCL). The device run of 2026-12-04 needed a separate script
    to find that these, not the GPU, bound the step."""

    PARTS = ("statistics_pass", "reduced_norms")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return timed

    def install(self, kernels: list[str]) -> None:
        import ddphooks.hook
        from ddphooks.sketch import BucketStatsKernel

        BucketStatsKernel.accumulate = self.wrap("statistics_pass", BucketStatsKernel.accumulate)
        if "triton" in kernels:
            from ddphooks.triton_stats import TritonBucketStats

            TritonBucketStats.accumulate = self.wrap("statistics_pass", TritonBucketStats.accumulate)
        ddphooks.hook.SilentState._keep_slots = self.wrap("reduced_norms", ddphooks.hook.SilentState._keep_slots)


def _cost_worker(rank: int, world: int, small: bool, kernels: list[str], rounds: int, warmup: int) -> dict:
    import gc

    from overhead import HookTimer, persistent_bytes
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddphooks import SilentState, silent_hook

    form = "small" if small else "full"
    device = the_device(small)
    group, backend = single_rank_group(device)
    configs = ["allreduce_hook", *kernels]
    batch_size, tokens = COST_BATCH[form]
    ids = torch.randint(0, (LLAMA_TINY if small else LLAMA_1B)["vocab_size"], (batch_size, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    models, states, timers, memory = {}, {}, {}, {}
    for config in configs:
        before = memory_allocated(device)
        model = DDP(llama(device, LLAMA_TINY if small else LLAMA_1B), process_group=group, bucket_cap_mb=COST_BUCKET_MB[form])
        built = memory_allocated(device)
        timers[config] = HookTimer()
        if config == "allreduce_hook":
            model.register_comm_hook(group, timers[config].wrap(allreduce_hook))
        else:  # what attach registers, with the hook's host time measured (the defaults: sketch_dim=256, every=1)
            states[config] = SilentState(model=model, stats_kernel=config)
            model.register_comm_hook(states[config], timers[config].wrap(silent_hook))
        for _ in range(2):  # DDP rebuilds its buckets after the first step; ddphooks builds its plans
            loss = model(input_ids=ids, labels=ids).loss
            if config in states:
                states[config].observe_loss(loss)
            loss.backward()
            model.zero_grad(set_to_none=False)
        synchronize(device)
        after = memory_allocated(device)
        memory[config] = {"model_bytes": None if built is None else built - before, "step_state_bytes": None if after is None else after - built}
        models[config] = model
    parts = _PartTimer()
    parts.install(kernels)
    samples = {config: {"forward": [], "backward": [], "hook_host": [], "peak": [], **{part: [] for part in parts.PARTS}} for config in configs}
    gc.disable()
    for round_index in range(warmup + rounds):
        order = [configs[(round_index + i) % len(configs)] for i in range(len(configs))]  # rotate: no config always follows another
        for config in order:
            model, state, timer = models[config], states.get(config), timers[config]
            synchronize(device)
            base = memory_allocated(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            timer.seconds = 0.0
            parts.seconds = dict.fromkeys(parts.PARTS, 0.0)
            clock = _Clock(device)
            clock.mark()
            loss = model(input_ids=ids, labels=ids).loss
            if state is not None:
                state.observe_loss(loss)
            clock.mark()
            loss.backward()
            clock.mark()
            forward, backward = clock.spans()
            peak = None if base is None else torch.cuda.max_memory_allocated(device) - base
            model.zero_grad(set_to_none=False)
            if round_index >= warmup:
                for key, value in (("forward", forward), ("backward", backward), ("hook_host", timer.seconds), ("peak", peak), *parts.seconds.items()):
                    samples[config][key].append(value)
        gc.collect()
    gc.enable()
    result = {"backend": backend, "parameters": sum(p.numel() for p in models[configs[0]].parameters()), "tokens": batch_size * tokens,
              "bucket_mb": COST_BUCKET_MB[form], "samples": samples, "memory": memory}  # fmt: skip
    result["buckets"] = {config: len(state._buckets) for config, state in states.items()}
    result["state_bytes"] = {config: persistent_bytes(state) for config, state in states.items()}
    for state in states.values():
        state.close()
    return result


def spread(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "iqr": [q[0], q[2]]}


def cost_rows(result: dict, kernels: list[str], small: bool) -> list[dict]:
    samples, memory = result["samples"], result["memory"]
    plain = samples["allreduce_hook"]
    steps = [f + b for f, b in zip(plain["forward"], plain["backward"])]
    step = statistics.median(steps)
    shape = "tiny Llama" if small else "~1.1B Llama"
    rows = []
    for kernel in kernels:
        got = samples[kernel]
        # Per round, against the plain step of the same round (cancels slow drift).
        extra_gpu = spread([(b - p) / s for b, p, s in zip(got["backward"], plain["backward"], steps)])
        extra_host = spread([(h - p) / s for h, p, s in zip(got["hook_host"], plain["hook_host"], steps)])
        peaks = [p for p in got["peak"] if p is not None]
        plain_peaks = [p for p in plain["peak"] if p is not None]
        figures = dict(
            backend=result["backend"], parameters=result["parameters"], tokens=result["tokens"], bucket_mb=result["bucket_mb"],
            buckets=result["buckets"][kernel], step_s=step, backward_s_plain=statistics.median(plain["backward"]),
            backward_s=statistics.median(got["backward"]), extra_gpu_fraction_of_step=extra_gpu, hook_host_s=statistics.median(got["hook_host"]),
            allreduce_hook_host_s=statistics.median(plain["hook_host"]), extra_host_fraction_of_step=extra_host,
            extra_step_state_bytes=None if memory[kernel]["step_state_bytes"] is None else memory[kernel]["step_state_bytes"] - memory["allreduce_hook"]["step_state_bytes"],
            extra_peak_bytes=max(peaks) - max(plain_peaks) if peaks and plain_peaks else None, state_persistent_bytes=result["state_bytes"][kernel],
            rounds=len(got["backward"]), host_statistics_pass_s=statistics.median(got["statistics_pass"]),
            host_reduced_norms_s=statistics.median(got["reduced_norms"]),
        )  # fmt: skip
        name = f"what a user pays: {shape} bf16 DDP backward, stats_kernel={kernel}"
        if small:
            status, reason = "skipped", "no CUDA: a tiny Llama on the CPU, the figures only exercise the code (no device memory)"
        else:
            misses = [f"{what} {100 * value['median']:.2f}% of the step" for what, value in (("GPU", extra_gpu), ("host", extra_host)) if value["median"] > GOAL_STEP_FRACTION]
            status, reason = ("fail", "goal missed: " + ", ".join(misses)) if misses else ("pass", "")
        rows.append(row("cost", name, "goal", status, reason, **figures))
    return rows


# -- the run -------------------------------------------------------------------------------------------------
def decide(rows: list[dict], small: bool, triton_reason: str | None) -> dict:
    """The default stats_kernel on CUDA the figures support: Triton if it is equal (its correctness
    rows pass) and faster (every statistics layout, and the user's cost where measured)."""
    if small:
        return {"stats_kernel": None, "reason": "no CUDA (the small form)"}
    if triton_reason:
        return {"stats_kernel": "torch", "reason": triton_reason}
    triton_rows = [r for r in rows if r["kind"] == "correctness" and r["name"].endswith("stats_kernel=triton") and r["part"] in ("correctness", "fsdp", "sync")]
    if not triton_rows or any(r["status"] == "fail" for r in triton_rows):
        return {"stats_kernel": "torch", "reason": "the Triton kernel's correctness rows did not all pass (or did not run)"}
    layouts = [r["figures"]["x_read"] for r in rows if r["part"] == "stats" and "x_read" in r["figures"]]
    if not layouts:
        return {"stats_kernel": None, "reason": "the stats part did not run"}
    slower = [i for i, x in enumerate(layouts) if x["triton"]["median"] >= x["torch"]["median"]]
    if slower:
        return {"stats_kernel": "torch", "reason": f"Triton is not faster on {len(slower)} of {len(layouts)} bucket layouts"}
    costs = {r["name"].rsplit("=", 1)[1]: r["figures"]["extra_gpu_fraction_of_step"]["median"] for r in rows if r["part"] == "cost" and "extra_gpu_fraction_of_step" in r["figures"]}
    if len(costs) == 2 and costs["triton"] > costs["torch"]:
        return {"stats_kernel": "torch", "reason": "Triton is faster per bucket but costs the user more per step"}
    return {"stats_kernel": "triton", "reason": "equal (correctness rows pass) and faster on every bucket layout"}


def exit_code(rows: list[dict]) -> int:
    """1 if a correctness row fails or any row broke (an error or a timeout), else 0."""
    broken = any(r["status"] == "fail" and (r["kind"] == "correctness" or r["reason"].startswith(("error", "timeout"))) for r in rows)
    return 1 if broken else 0


WIDTHS = (11, 84, 7, 58)


def figures_cell(r: dict) -> str:
    """A few figures of a row, short."""
    f = r["figures"]
    if "max_rel_diff" in f:
        return f"{f['floats_compared']} floats, max diff {f['max_abs_diff']:.1e} (rel {f['max_rel_diff']:.1e})"
    if "bitwise_equal" in f:
        return f"{f['bitwise_equal']}/{f['tensors']} tensors bitwise equal"
    if "x_read" in f:
        cells = [f"{path} {x['median']:.2f}x [{x['iqr'][0]:.2f}-{x['iqr'][1]:.2f}] {f['launches'][path]}L" for path, x in f["x_read"].items()]
        return ", ".join(cells) + f"; read {f['read_gb_s']:.0f} GB/s"
    if "extra_gpu_fraction_of_step" in f:
        memory = "" if f["extra_peak_bytes"] is None else f", +{f['extra_step_state_bytes'] / 2**20:.0f}/{f['extra_peak_bytes'] / 2**20:.0f} MiB kept/peak"
        return (f"device {100 * f['extra_gpu_fraction_of_step']['median']:+.2f}%, host {100 * f['extra_host_fraction_of_step']['median']:+.2f}% "
                f"of {1e3 * f['step_s']:.1f} ms, {f['buckets']} buckets{memory}; host pass / reduced norms "
                f"{1e3 * f['host_statistics_pass_s']:.1f} / {1e3 * f['host_reduced_norms_s']:.1f} ms")  # fmt: skip
    if "step_over_allreduce" in f:
        return f"CPU {1e3 * f['cpu_beyond_allreduce_less_pass_s']['median']:+.2f} ms, step {100 * f['step_over_allreduce']:+.1f}% of {1e3 * f['allreduce_step_s']:.1f} ms"
    if "checked_steps" in f:
        return f"{f['checked_steps']} steps checked, {f['warmup_sync_count']} syncs in warm-up"
    return ""


def print_row(r: dict) -> None:
    cells = (r["part"], r["name"], r["status"], figures_cell(r))
    line = " ".join(f"{cell:<{width}}" for cell, width in zip(cells, WIDTHS))
    print(f"{line} {r['reason']}".rstrip(), flush=True)


def run_part(part: str, small: bool, kernels: list[str], triton_reason: str | None, args) -> list[dict]:
    from ddphooks.launch import WorkerError, spawn

    device_name = "cpu" if small else "cuda"
    budget = args.budget_scale * BUDGET_S[part]
    try:
        if part in ("correctness", "fsdp"):
            # Each run in its own two processes, within the part's budget: a run that crashes its
            # processes (a signal, not an exception) is named, and the others still run.
            ranks: list[dict] = [{}, {}]
            deadline = time.monotonic() + budget
            configs = part_configs(part, kernels)
            for run in correctness_runs(configs):
                key = "/".join(map(str, run))
                try:
                    results = spawn(_correctness_worker, 2, args=(small, run, part == "fsdp"), timeout=max(1.0, deadline - time.monotonic()), threads=1)
                except WorkerError as error:
                    results = [{"error": "the run's processes failed: " + error_text(error), "traceback": str(error)[-3000:]}] * 2
                for rank, result in enumerate(results):
                    ranks[rank][key] = result
            rows = correctness_rows(part, ranks, configs, device_name, "gloo")
        elif part == "sync":
            deadline = time.monotonic() + budget
            configs = [*kernels, "auto"]
            rows = sync_rows(spawn(_sync_worker, 1, args=(small, configs, 2, 3), timeout=budget)[0], configs, small)
            # The compact wire as rank 0 of FAKE_WORLD: its own processes (the fake group replaces gloo's).
            fake = spawn(_sync_worker, 1, args=(small, [COMPACT], 2, 3, FAKE_WORLD), timeout=max(1.0, deadline - time.monotonic()))[0]
            rows += sync_rows(fake, [COMPACT], small)
        elif part == "patterns":
            deadline = time.monotonic() + budget
            rows = sync_batchnorm_rows(spawn(_sync_batchnorm_worker, 2, args=(small,), timeout=budget, threads=1), device_name, small)
            rows += small_step_rows(small, max(1.0, deadline - time.monotonic()))
        elif part == "stats":
            sizes = args.stats_mb or ((0.02,) if small else STATS_MB)
            rounds = args.rounds or (2 if small else STATS_ROUNDS)
            rows = stats_rows(spawn(_stats_worker, 1, args=(small, "triton" in kernels, list(sizes), rounds), timeout=budget)[0], small, triton_reason)
        else:
            rounds = args.rounds or (3 if small else COST_ROUNDS)
            rows = cost_rows(spawn(_cost_worker, 1, args=(small, kernels, rounds, 1 if small else COST_WARMUP), timeout=budget)[0], kernels, small)
    except (TimeoutError, WorkerError, Exception) as error:
        why = f"timeout: past its budget of {budget:.0f} s" if isinstance(error, TimeoutError) else "error: " + error_text(error)
        return [row(part, f"{part}: the part itself", "correctness", "fail", why, traceback=traceback.format_exc()[-3000:])]
    if triton_reason and part != "stats":
        rows.append(row(part, f"{part}: stats_kernel=triton", "correctness", "skipped", triton_reason))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--small", action="store_true", help="the CPU form (automatic without CUDA)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts (a rerun can skip what passed)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--rounds", type=int, help="timing rounds of the stats and cost parts (default 20 / 15 on a GPU, 2 / 3 small)")
    parser.add_argument("--stats-mb", type=float, nargs="+", help="bucket sizes of the stats part (default 25 100 on a GPU, 0.02 small)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    args = parser.parse_args()

    small = args.small or not torch.cuda.is_available()
    triton_reason = None
    if importlib.util.find_spec("triton") is None:
        triton_reason = "skipped: triton is not installed (the Linux x86-64 test extra)"
    if small:
        os.environ["TRITON_INTERPRET"] = "1"  # before any worker imports triton: the kernel runs on the CPU
    elif os.environ.pop("TRITON_INTERPRET", None) is not None:
        print("TRITON_INTERPRET was set: unset for the GPU run", file=sys.stderr)
    kernels = ["torch"] if triton_reason else ["torch", "triton"]
    device = "cpu (small form)" if small else torch.cuda.get_device_name(0)
    triton_version = None if triton_reason else __import__("importlib.metadata").metadata.version("triton")
    header = {"date": datetime.date.today().isoformat(), "device": device, "small": small, "torch": torch.__version__, "triton": triton_version,
              "parts": args.parts, "goals": {"x_read": GOAL_X_READ, "launches_per_bucket": GOAL_LAUNCHES, "fraction_of_step": GOAL_STEP_FRACTION}}  # fmt: skip
    print(f"ddphooks device check, {header['date']}: {device}, torch {torch.__version__}, triton {triton_version}; parts {' '.join(args.parts)}")
    if small:
        print("small form: the CPU plays the device, Triton runs in its interpreter; timing rows only exercise the code")
    print(" ".join(f"{title:<{width}}" for title, width in zip(("part", "check", "status", "figures"), WIDTHS)) + " reason", flush=True)
    rows, seconds = [], {}
    started = time.perf_counter()
    for part in args.parts:
        begin = time.perf_counter()
        got = run_part(part, small, kernels, triton_reason, args)
        seconds[part] = time.perf_counter() - begin
        for r in got:
            r["figures"].setdefault("part_seconds", seconds[part])
            print_row(r)
        rows += got
        if args.json:  # after every part: a run killed later still leaves what it measured
            write(args.json, header, rows, seconds, None)
    decision = decide(rows, small, triton_reason)
    code = exit_code(rows)
    print(f"default stats_kernel on CUDA: {decision['stats_kernel'] or 'not decided'} ({decision['reason']}); "
          f"{time.perf_counter() - started:.0f} s; exit {code}")  # fmt: skip
    if args.json:
        write(args.json, header, rows, seconds, decision)
    return code


def write(path: str, header: dict, rows: list[dict], seconds: dict, decision: dict | None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump({**header, "seconds": seconds, "decision": decision, "rows": rows}, file, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
