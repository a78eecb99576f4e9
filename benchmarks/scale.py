"""Per-rank cost of ddphooks from W = 8 to 4096 ranks, through the real DDP code path, in one process.

Only a few processes fit on a development machine, so this runs rank 0 of a W-rank job alone, on
PyTorch's fake process group (``init_process_group("fake", ...)``): DDP, its buckets and reducer,
``ddphooks.attach`` with its defaults (sketch_dim 256, the detector on, the replica check every 100
steps, the sync watchdog) and ``silent_hook`` run as they do in a real job; only the collectives
are simulated. ``dist.all_reduce`` is wrapped to return a completed future holding its tensor,
after writing what a real all-reduce would: the sum of W ranks' averaged gradients (W times this
rank's share: all ranks alike) and, in the buffer that carries the statistics, the other W - 1
ranks' slots (this rank's slot with losses, per-parameter norms and sketches varied per rank:
losses +- 2%, norms x exp(0.1 N(0, 1)), sketches with pairwise cosines ~0.4; replica fingerprints
equal). That writing is timed and left out of every figure.

Each W runs twice: with every rank's whole slot (``gather_max_world=None``; the default up to W =
16) and with the compact wire (``gather_max_world=1``, ``ddphooks.fleet``, the default above 16;
the fake all-reduce then fills the other ranks' rows, sampled rows and sums alike); the table
marks the default's row. Each run builds the model twice (same weights): one DDP with
``allreduce_hook``, one with ``attach``; every step runs both, forward and backward, on the same
random tokens. The step's
statistics are then handed to the detector (``state.flush()``, untimed), so it never
competes with the timed hook calls. Figures, medians over the timed steps (after the detector's
warm-up, so it scores):

  in-hook ms       training thread: time inside the hook's calls per step (the futures complete at
                   once, so their callbacks, the reduced norms and building SilentStats, run inside
                   them as well), ddphooks minus allreduce_hook; "slots": the part that handles the
                   W slots (the last bucket's division into the piggyback buffer, the zeroed slots
                   and this rank's slot; its callback: the copy of the W slots and the bucket's
                   reduced norms; building SilentStats)
  detector ms      the detector's round trip a step: sending the step's slots (the W whole slots,
                   or the compact wire's buffer) and reading its alerts back, on the training
                   thread, the child's reading of the step and Detector.update in between
  statistics bytes what the statistics add to the step's all-reduce (the W slots, W x slot x 4 B,
                   or the compact wire), and that against the gradient bytes; "with replica
                   and detail steps": averaged with one replica-check step in
                   check_replicas_every (100), whose fingerprints add 8 B per parameter and
                   buffer and rank (measured on step 0, a replica-check and detail step, less
                   the detail step's share), and one detail step in detail_every (100), whose
                   cosine matrix adds to the compact wire W x k x 4 B up to detail_max_world
                   ranks, H x (k + 1) x 4 B above (H hosts: the identity table names 8 ranks a
                   host on the fake group); in brackets that share of the average (measured on
                   a detail step after the timed ones; the timed steps are ordinary steps)
  record bytes     RecordBuilder.build on the last step's SilentStats (with its cosine_previous,
                   a detail step), serialised as JsonlSink writes it: compact, and detail (one
                   every 100 steps), built as the state's writer builds it: with the identity
                   table (its bytes in brackets) and the cosine matrix (W x W up to
                   detail_max_world, the host-by-host cosine_hosts above; its bytes)
  detail build ms  building and serialising that detail record (the writer thread's work, off the
                   training thread), median of 5; in brackets the thread's CPU time (numpy's
                   BLAS threads left out), what it costs where other work shares the cores
  kept MB          everything the state keeps between steps (ddphooks.memory.retained_bytes: sign
                   tables, buffers, plans, the latest statistics, the detector's windows)
  replica check    replica_differences on W x (the model's parameters and buffers) fingerprints
                   with three ranks differing (the check every 100 steps; off the training thread)

A second table runs the same model under FSDP2 (``fully_shard`` on every decoder layer and the
root, a W-shard mesh, ``attach`` with the detector and the replica check off: the fake collectives
leave FSDP2's buffers and the other ranks' slots as they are), each W twice like the DDP rows
(whole slots, ``gather_max_world=None``, and the compact wire, ``gather_max_world=1``):
the statistics pass inside the reduce-scatters per step (training thread), the end of backward
(packing this rank's share, the statistics' all-reduce, a no-op here, this rank's own values with
the compact wire and building the step's statistics), FSDP2's reduce-scatter input per step (each
parameter padded to a multiple of W rows: it grows with W on a small model), the elements the
pass reads (the bands of rows and columns that hold gradient, FSDP2's padding left out) and its
time per element read, what the statistics add to the step's communication (the W rows of slot and
reduced shard norms, W x (slot + parameters) x 4 B, or the compact wire with its P reduced
norms; "with replica and detail steps" averages in step 0, a replica-check step, with HSDP's
all-reduce of the parameters' histograms over each replica group, and a detail step's cosine
matrix, as the DDP table), the state's kept memory (as above), and the step (forward and backward, no
communication) for scale.

    python benchmarks/scale.py                  # W = 8, 64, 256, 1024, 4096, a 16 M-parameter tiny Llama (273 tensors)
    python benchmarks/scale.py --quick          # W = 8, 64 and 512, a 2-layer tiny Llama (seconds)
    python benchmarks/scale.py --worlds 8 1024 --steps 5 --json scale.json
    python benchmarks/scale.py --only fsdp2 --worlds 2 8 64 256 1024   # the FSDP2 table alone
    python benchmarks/scale.py --only fsdp2 --worlds 8 1024 --model hidden=1024 --model layers=2
                                                # a 42 M-parameter model whose parameters have >= 1024 rows: no padding
    python benchmarks/scale.py --only fsdp2 --hsdp 2 --worlds 8 4096 --fsdp-max-world 4096
                                                # HSDP: 2 replicas of 4 and of 2048 shards
    python benchmarks/scale.py --only fsdp2 --worlds 8 4096 --fsdp-max-world 4096 --plain-read
                                                # and a plain read of the elements the pass reads, where it reads them
    python benchmarks/scale.py --device cuda --worlds 8 1024 4096   # the hook's host time on a GPU (DDP only)
"""

import argparse
import copy
import dataclasses
import gc
import importlib
import json
import os
import platform
import statistics
import time
from datetime import date
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.distributed.fake_pg import FakeStore

import ddphooks
from ddphooks import fleet_stats
from ddphooks.config import SilentConfig
from ddphooks.detect import DetectorConfig
from ddphooks.hook import silent_hook
from ddphooks.identity import RankIdentity
from ddphooks.memory import retained_bytes, retained_tensors
from ddphooks.models import parameter_count, tiny_llama
from ddphooks.records import RecordBuilder
from ddphooks.stats import PARAMS_BEGIN, replica_differences

ATTACH = importlib.import_module("ddphooks.attach")  # the module (ddphooks.attach is the function)
HOOK = importlib.import_module("ddphooks.hook")

# -- config ----------------------------------------------------------------------------------------
WORLDS, QUICK_WORLDS = (8, 64, 256, 1024, 4096), (8, 64, 512)
# 30 layers x 9 tensors + embedding, norm and head: 273 parameter tensors, 16.4 M parameters.
MODEL = dict(vocab_size=8192, hidden=192, layers=30, heads=8)
QUICK_MODEL = dict(vocab_size=512, hidden=64, layers=2, heads=4)
BATCH, TOKENS = 2, 64
STEPS, QUICK_STEPS = 9, 3  # timed steps, after the warm-up
WARMUP = DetectorConfig().warmup + 2  # DDP rebuilds its buckets after step 0; the detector scores from its warm-up on
RANKS_PER_HOST = 8  # the identity table's hosts on the fake group: 8-accelerator nodes
BUILDS = 5  # detail records built to time one (median)
DEFAULTS = SilentConfig()
# What a real all-reduce would leave in the other ranks' slots (see the docstring).
LOSS_SPREAD, NORM_SPREAD, SKETCH_SHARED = 0.02, 0.1, 0.4


class FakeCollectives:
    """``dist.all_reduce`` on the fake group, made to return what W ranks would: a completed
    future holding the tensor, summed over W ranks alike, with the other ranks' slots filled in
    where the statistics travel. Time spent writing them is counted in ``excluded``."""

    def __init__(self, world: int, device: str | torch.device = "cpu") -> None:
        self.world = world
        self.device = torch.device(device)  # where the other ranks' values are drawn (no copy to a GPU)
        self.state = None  # the SilentState whose buffers carry slots
        self.record = None  # the step being reduced (its compact-wire layout, if any)
        self.wire = None  # numel of the statistics in the step's all-reduce (W slots, or the compact wire)
        self.excluded = 0.0
        self.generator = torch.Generator(self.device).manual_seed(0)
        self._all_reduce, self._all_gather_object = dist.all_reduce, dist.all_gather_object

    def __enter__(self):
        dist.all_reduce, dist.all_gather_object = self.all_reduce, self.all_gather_object
        return self

    def __exit__(self, *exc):
        dist.all_reduce, dist.all_gather_object = self._all_reduce, self._all_gather_object

    def all_gather_object(self, output: list, obj, group=None) -> None:
        """Every rank agrees (binding compares the settings across ranks); the identity table
        names ``RANKS_PER_HOST`` ranks a host (``node0000``, ...), as a job of 8-accelerator nodes
        would (on the fake group every rank is this process, on one host)."""
        if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[2], RankIdentity):
            settings, problem, identity = obj
            output[:] = [
                (settings, problem, dataclasses.replace(identity, global_rank=r, group_rank=r, host=f"node{r // RANKS_PER_HOST:04d}", local_rank=r % RANKS_PER_HOST))
                for r in range(len(output))
            ]  # fmt: skip
            return
        output[:] = [obj] * len(output)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        start = time.perf_counter()
        slots = self._slots_of(tensor)
        if slots is None:
            tensor.mul_(self.world)  # W ranks' averaged gradients, all alike
        else:
            tensor[: tensor.numel() - slots.numel()].mul_(self.world)  # the piggyback buffer's gradient part
            self._fill(slots)
        self.excluded += time.perf_counter() - start
        if not async_op:
            return None
        future = torch.futures.Future()
        future.set_result([tensor])
        return _DoneWork(future)

    def _slots_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The W slots at the end of ``tensor`` if it is a buffer of the state's slots."""
        state = self.state
        if state is None or self.wire is None:
            return None
        for name in ("_piggyback", "_separate"):
            buffer = getattr(state, name, None)
            if buffer is not None and buffer.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                return tensor[tensor.numel() - self.wire :]
        return None

    def _fill(self, slots: torch.Tensor) -> None:
        if self.record.fleet is not None:
            self._fill_compact(slots, self.record.fleet)
            return
        slots = slots.view(self.world, -1)
        # Rows 1..W-1: rank 0's slot, varied per rank (losses, norms, sketches; fingerprints equal).
        state, others = self.state, slots[1:]
        n_params = sum(len(entry.layout.numels) for entry in state._buckets.values())
        norms = slice(PARAMS_BEGIN, PARAMS_BEGIN + n_params)
        sketch = slice(norms.stop, norms.stop + state.bins)
        others.copy_(slots[:1].expand_as(others))
        normal = partial(torch.randn, generator=self.generator, device=self.device)
        others[:, 0] *= 1 + LOSS_SPREAD * normal(len(others))
        others[:, norms] *= torch.exp(NORM_SPREAD * normal(len(others), n_params))
        if state.bins:
            own = slots[0, sketch]
            scale = own.norm() / own.numel() ** 0.5
            shared = SKETCH_SHARED**0.5
            others[:, sketch] = shared * own + (1 - SKETCH_SHARED) ** 0.5 * scale * normal(len(others), state.bins)


    def _fill_compact(self, wire: torch.Tensor, layout) -> None:
        """The compact wire summed over W ranks like rank 0: rows 1..W-1 rank 0's row varied (loss,
        squared norm; its cosines as they are), every sampled row rank 0's norms varied, the sums W
        times rank 0's part (the sketches' sums with pairwise cosines ~0.4; fingerprints all equal)."""
        normal = partial(torch.randn, generator=self.generator, device=self.device)
        rows = wire[layout.part("per_rank")].view(self.world, -1)
        rows[1:] = rows[:1]
        rows[1:, fleet_stats.WIRE_LOSS] *= 1 + LOSS_SPREAD * normal(self.world - 1)
        rows[1:, fleet_stats.WIRE_RANK_SQ] *= torch.exp(2 * NORM_SPREAD * normal(self.world - 1))
        own = torch.cat(self.record.local_sq)
        sampled = wire[layout.part("sampled")].view(layout.rows, layout.n_params)
        sampled.copy_(own * torch.exp(NORM_SPREAD * normal(layout.rows, layout.n_params)))
        for name in ("param_sq", "param_norms", "rise_sum", "rise_count", "bucket_norms", "present"):
            wire[layout.part(name)] *= self.world
        for name in ("sketch_sum", "unit_sum"):
            wire[layout.part(name)] *= 1 + SKETCH_SHARED * (self.world - 1)
        wire[layout.part("fingerprints")] *= self.world  # every rank's fingerprint in rank 0's bins
        if layout.matrix_rows:  # a detail step: every rank's sketch, or each host's unit sketches summed
            rows = wire[layout.part("matrix")].view(layout.matrix_rows, layout.bins)
            shared, rest = SKETCH_SHARED**0.5, (1 - SKETCH_SHARED) ** 0.5
            if not layout.host_form:
                own = rows[0].clone()
                rows[1:] = shared * own + rest * own.norm() / layout.bins**0.5 * normal(self.world - 1, layout.bins)
            else:
                hosts = self.state.hosts
                own = rows[hosts.of_rank[0]].clone()  # rank 0's unit sketch, alone in its row
                counts = torch.bincount(torch.tensor(hosts.of_rank), minlength=layout.matrix_rows).to(wire.dtype)
                units = shared * own + rest * normal(layout.matrix_rows, layout.bins) / layout.bins**0.5
                rows.copy_(counts[:, None] * units)
                wire[layout.part("matrix_present")] = counts


class _DoneWork:
    def __init__(self, future: torch.futures.Future) -> None:
        self._future = future

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class HookTimer:
    """Seconds inside each hook's calls per step, less what the fake collectives spent."""

    def __init__(self, collectives: FakeCollectives) -> None:
        self.collectives = collectives
        self.current = {"allreduce": 0.0, "silent": 0.0}
        self.samples = {"allreduce": [], "silent": []}
        self.slot_parts, self.slot_samples = 0.0, []  # the W slots' share of the silent hook's time

    def wrap(self, name: str, hook):
        def timed(state, bucket):  # no annotations: DDP checks them only where present
            excluded = self.collectives.excluded
            start = time.perf_counter()
            try:
                return hook(state, bucket)
            finally:
                self.current[name] += time.perf_counter() - start - (self.collectives.excluded - excluded)

        return timed

    def timed_part(self, fn):
        """``fn`` with its time (less the fake collectives') added to the slot parts."""

        def timed(*args):
            excluded = self.collectives.excluded
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.slot_parts += time.perf_counter() - start - (self.collectives.excluded - excluded)

        return timed

    def end_step(self, timed: bool) -> None:
        for name, seconds in self.current.items():
            if timed:
                self.samples[name].append(seconds)
            self.current[name] = 0.0
        if timed:
            self.slot_samples.append(self.slot_parts)
        self.slot_parts = 0.0


def quartiles(samples: list[float]) -> list[float]:
    """First and third quartiles."""
    q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) >= 2 else [samples[0]] * 3
    return [q[0], q[2]]


def replica_check_s(world: int, tensors: int, repeats: int = 5) -> float:
    """Seconds of ``replica_differences`` on W x ``tensors`` fingerprints where three ranks differ
    (one in every tensor, two in a third of them each): what a replica-check step adds where its
    statistics are read (the detector's thread). Median of ``repeats``."""
    rng = np.random.default_rng(0)
    fingerprints = np.broadcast_to(rng.random((tensors, 2)) + 1.0, (world, tensors, 2)).copy()
    fingerprints[world // 3] *= 1.001
    fingerprints[world // 2, : tensors // 3] *= 0.999
    fingerprints[world - 1, tensors // 3 : 2 * tensors // 3, 1] *= 1.01
    names = [f"t{i}" for i in range(tensors)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        found = replica_differences(fingerprints, names)
        times.append(time.perf_counter() - start)
    assert found["ranks"] == sorted({world // 3, world // 2, world - 1}), found["ranks"]
    return statistics.median(times)


def record_bytes(record: dict) -> int:
    """Bytes of the line JsonlSink writes for ``record``."""
    return len(json.dumps(record, allow_nan=False).encode()) + 1


def _detail_record(stats, state) -> tuple[dict, dict, float]:
    """The detail record of a detail step's statistics as the state's writer builds it (with the
    identity table and the hosts; ``BUILDS`` builds, the median time of building and
    serialising one, off the training thread in a run), its bytes, and those of its parts: the
    identity table and the cosine matrix (``cosine``, or ``cosine_hosts`` above
    ``detail_max_world``)."""
    builder = RecordBuilder(1, 1, DEFAULTS.detail_max_world, ranks=state.ranks, hosts=state.hosts)
    times, cpu = [], []
    for _ in range(BUILDS):
        start, start_cpu = time.perf_counter(), time.thread_time()
        record = builder.build(stats)
        line = json.dumps(record, allow_nan=False)
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    matrix = record.get("cosine") or record.get("cosine_hosts")
    sizes = {
        "detail_record_bytes": len(line.encode()) + 1,
        "detail_identity_bytes": record_bytes(record["identity"]) - 1,
        "detail_matrix_bytes": 0 if matrix is None else record_bytes(matrix) - 1,
        "detail_matrix": "cosine" if record.get("cosine") else "cosine_hosts" if matrix else None,
        # this thread's CPU time: what the build costs where the machine is shared
        "detail_build_cpu_ms": 1e3 * statistics.median(cpu),
    }
    return record, sizes, 1e3 * statistics.median(times)


def measure(world: int, model_args: dict, steps: int, gather_max_world: int | None = None, device: str = "cpu") -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with FakeCollectives(world, device) as collectives:
            return _measure(world, model_args, steps, collectives, gather_max_world)
    finally:
        dist.destroy_process_group()
        gc.collect()


def _measure(world: int, model_args: dict, steps: int, collectives: FakeCollectives, gather_max_world: int | None) -> dict:
    device = collectives.device
    module = tiny_llama(**model_args).to(device)
    plain, instrumented = DDP(copy.deepcopy(module)), DDP(module)
    timer = HookTimer(collectives)
    plain.register_comm_hook(None, timer.wrap("allreduce", allreduce_hook))
    callbacks = {name: getattr(HOOK, name) for name in ("_reduced_piggyback", "_reduced_separate")}
    for name, callback in callbacks.items():  # silent_hook looks them up when it runs
        setattr(HOOK, name, timer.timed_part(callback))
    registered = ATTACH.silent_hook
    ATTACH.silent_hook = timer.wrap("silent", silent_hook)  # attach registers the timed wrapper
    try:
        # Detail steps: step 0 (also a replica-check step) and one more after the timed steps, whose
        # wire and records are measured (the timed steps are ordinary ones, as 99 in 100 are).
        state = ddphooks.attach(instrumented, gather_max_world=gather_max_world, detail_every=WARMUP + steps)
    finally:
        ATTACH.silent_hook = registered
    collectives.state = state
    # The parts of the hook that handle the W slots: the last bucket's buffer (division, zeroed
    # slots, this rank's slot), its callback (a copy of the W slots, the bucket's reduced norms)
    # and publishing the step's SilentStats.
    stats_buffer, pack = state._stats_buffer, state._pack
    marks = {}

    def timed_stats_buffer(*args):
        marks["start"] = time.perf_counter()
        return stats_buffer(*args)

    def timed_pack(record, slots, *args):
        collectives.record, collectives.wire = record, slots.numel()
        pack(record, slots, *args)
        timer.slot_parts += time.perf_counter() - marks["start"]

    state._stats_buffer, state._pack = timed_stats_buffer, timed_pack
    # The detector's round trip per step, on the training thread: sending the step's slots and
    # reading the alerts back (the child's work in between: flush() waits).
    detector_s, this_step, pipeline = [], [0.0], state._pipeline

    def timed(call):
        def timed_call(*args):
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                this_step[0] += time.perf_counter() - start

        return timed_call

    pipeline._detect, pipeline._send, pipeline.detector.receive = timed(pipeline._detect), timed(pipeline._send), timed(pipeline.detector.receive)
    generator = torch.Generator().manual_seed(1)
    slots = []
    for step in range(WARMUP + steps + 1):
        tokens = torch.randint(0, model_args["vocab_size"], (BATCH, TOKENS), generator=generator).to(device)
        for model in (plain, instrumented) if step % 2 else (instrumented, plain):  # alternate which runs first
            model(input_ids=tokens, labels=tokens).loss.backward()
            model.zero_grad(set_to_none=True)
        collectives.state.flush()  # the detector on this step, before the next one is timed
        detector_s.append(this_step[0])
        this_step[0] = 0.0
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU's queue empty: each step's host time starts alike
        timed = WARMUP <= step < WARMUP + steps
        timer.end_step(timed)
        if step == 0:  # a replica-check step (the check runs on instrumented step 0, then every 100), and a detail step
            first_wire = collectives.wire
        if timed:
            slots.append(collectives.wire)
    detail_wire = collectives.wire  # the last step: a detail step, not a replica-check one
    detector_s = detector_s[WARMUP : WARMUP + steps]
    stats = state.latest
    compact = RecordBuilder(1, DEFAULTS.detail_every, DEFAULTS.detail_max_world).build(stats)
    detail, detail_bytes, build_ms = _detail_record(stats, state)
    # Above per_rank_max_world the compact record carries each per-rank signal over the ranks.
    previous = compact["cosine_previous" if compact["per_rank"] else "cosine_previous_over_ranks"]
    assert not compact["detail"] and detail["detail"] and previous is not None
    kept = retained_tensors(state)
    gradient_bytes = 4 * parameter_count(module)
    beyond = [s - a for s, a in zip(timer.samples["silent"], timer.samples["allreduce"])]
    slot_bytes = 4 * statistics.median(slots)
    detail_extra = 4 * detail_wire - slot_bytes  # the cosine matrix's part of a detail step
    replica_wire = first_wire - detail_extra / 4  # step 0 less its matrix: a replica-check step
    result = {
        "world_size": world,
        "wire": "whole slots" if gather_max_world is None or world <= gather_max_world else "compact",
        "parameters": parameter_count(module),
        "tensors": sum(1 for p in module.parameters() if p.requires_grad),
        "buckets": len(state._buckets),
        "transport": stats.transport,
        "steps": steps,
        "allreduce_hook_ms": 1e3 * statistics.median(timer.samples["allreduce"]),
        "silent_hook_ms": 1e3 * statistics.median(timer.samples["silent"]),
        "in_hook_ms_beyond_allreduce": 1e3 * statistics.median(beyond),
        "in_hook_ms_beyond_allreduce_iqr": [1e3 * q for q in quartiles(beyond)],
        "slot_parts_ms": 1e3 * statistics.median(timer.slot_samples),
        "detector_ms": 1e3 * statistics.median(detector_s),
        "wire_numel": statistics.median(slots),
        "slot_bytes_per_step": slot_bytes,
        "replica_step_bytes": 4 * replica_wire,
        "detail_step_bytes": 4 * detail_wire,
        "detail_bytes_per_step": detail_extra / DEFAULTS.detail_every,
        # Ordinary steps, one replica-check step in check_replicas_every and one detail step in
        # detail_every, averaged per step.
        "amortised_bytes_per_step": slot_bytes + (4 * replica_wire - slot_bytes) / DEFAULTS.check_replicas_every + detail_extra / DEFAULTS.detail_every,
        "slot_fraction_of_gradient_bytes": slot_bytes / gradient_bytes,
        "compact_record_bytes": record_bytes(compact),
        **detail_bytes,
        "detail_build_ms": build_ms,
        "kept_bytes": retained_bytes(state),
        "replica_check_ms": 1e3 * replica_check_s(world, len(state._replica_tensors.names)),
        "replica_tensors": len(state._replica_tensors.names),
        "kept_largest": [{"path": t.path, "bytes": t.nbytes, "shape": list(t.shape)} for t in kept[:5]],
        "alerts": len(state.alerts),
    }
    state.close()
    for name, callback in callbacks.items():
        setattr(HOOK, name, callback)
    return result


def measure_fsdp(world: int, model_args: dict, steps: int, gather_max_world: int | None = None, replicas: int = 1, plain_read: bool = False) -> dict:
    """The FSDP2 statistics at ``world`` ranks (HSDP: ``replicas`` x ``world / replicas`` shards)
    with either wire: ms per step inside ddphooks' reduce-scatter measurement and at the end of
    backward, the reduce-scatter input per step, the statistics' bytes per step (and on step 0,
    a replica-check step), the state's kept memory and the step itself. With ``plain_read``
    the timed steps read the elements the pass reads with one ``sum`` per band instead of
    running it (``pass_ms`` is then that read's time, and the steps are not measured)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        shape, names = ((world,), None) if replicas == 1 else ((replicas, world // replicas), ("replicate", "shard"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = tiny_llama(**model_args)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # Only the statistics' own work is timed here: the other ranks' slots stay empty on the
        # fake group, so the detector (which would score them) is off; the replica check runs at
        # its default steps (step 0 here, its bytes counted) and finds the empty slots different.
        # Detail steps (the cosine matrix in the compact wire): step 0 and one after the timed steps.
        state = ddphooks.attach(model, detect=False, gather_max_world=gather_max_world, detail_every=WARMUP + steps)
        spent, elements, gathered, wire = [], [], [], []
        measure_group, gather = state._measure, state._gather

        def timed_measure(comm, output, flat):
            entry = state._entries.get(id(comm))
            start = time.perf_counter()
            if plain_read and len(spent) > WARMUP and entry is not None:
                for band in entry.bands:  # where the pass reads, as it would find them
                    band.source(flat, entry.width).sum()
            else:
                measure_group(comm, output, flat)
            spent[-1] += time.perf_counter() - start
            elements[-1] += flat.numel()

        def timed_gather(record):
            start = time.perf_counter()
            try:
                return gather(record)
            finally:
                gathered[-1] += time.perf_counter() - start

        all_reduce = dist.all_reduce

        def counted_all_reduce(tensor, *args, **kwargs):  # the statistics' all-reduces: on the state's buffers
            for buffer in (state._slots, state._shard_counts):  # the wire; HSDP's replica-group histograms
                if buffer is not None and tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                    wire[-1] += tensor.numel()
            return all_reduce(tensor, *args, **kwargs)

        state._measure, state._gather, dist.all_reduce = timed_measure, timed_gather, counted_all_reduce
        generator = torch.Generator().manual_seed(1)
        step_s = []
        try:
            for _ in range(WARMUP + steps + 1):
                spent.append(0.0)
                gathered.append(0.0)
                elements.append(0)
                wire.append(0)
                tokens = torch.randint(0, model_args["vocab_size"], (BATCH, TOKENS), generator=generator)
                start = time.perf_counter()
                model(input_ids=tokens, labels=tokens).loss.backward()
                step_s.append(time.perf_counter() - start)
                state.flush()
        finally:
            dist.all_reduce = all_reduce
        stats = state.latest
        wire_first = wire[0]
        kept = retained_bytes(state)
        read = sum(band.plan.numel for entry in state._entries.values() for band in entry.bands)  # FSDP2's padding left out
        state.close()
        detail_step_bytes = 4 * wire[-1]  # the last step: a detail step, not a replica-check one
        timed = slice(WARMUP, WARMUP + steps)
        spent, gathered, step_s, wire = spent[timed], gathered[timed], step_s[timed], wire[timed]
        slot_bytes = 4 * statistics.median(wire)
        detail_extra = detail_step_bytes - slot_bytes
        replica_step_bytes = 4 * wire_first - detail_extra  # step 0 checks the replicas (and is a detail step)
        return {
            "world_size": world,
            "replicas": replicas,
            "wire": "compact" if isinstance(stats, fleet_stats.FleetStats) else "whole slots",
            "pass_ms": 1e3 * statistics.median(spent),
            "pass_ms_iqr": [1e3 * q for q in quartiles(spent)],
            "end_of_backward_ms": 1e3 * statistics.median(gathered),
            "input_elements": elements[-1],
            "read_elements": read,
            "pass_ns_per_element": 1e9 * statistics.median(spent) / read,
            "wire_numel": statistics.median(wire),
            "slot_bytes_per_step": slot_bytes,
            "replica_step_bytes": replica_step_bytes,
            "detail_step_bytes": detail_step_bytes,
            "detail_bytes_per_step": detail_extra / DEFAULTS.detail_every,
            "amortised_bytes_per_step": slot_bytes + (replica_step_bytes - slot_bytes) / DEFAULTS.check_replicas_every + detail_extra / DEFAULTS.detail_every,
            "slot_fraction_of_gradient_bytes": slot_bytes / (4 * parameter_count(model)),
            "kept_bytes": kept,
            "step_ms": 1e3 * statistics.median(step_s),
        }
    finally:
        dist.destroy_process_group()
        gc.collect()


def wire_label(wire: str, world: int) -> str:
    """The table's wire column: the wire, and "(default)" where attach's defaults send it at ``world``."""
    default = (wire == "compact") == (DEFAULTS.gather_max_world is not None and world > DEFAULTS.gather_max_world)
    return f"{wire} (default)" if default else wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="W = 8, 64 and 512, a 2-layer tiny Llama, 3 timed steps")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per W (after the warm-up)")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--device", default="cpu", help="where the model and the statistics live (cuda: the hook's host time on a GPU; "
                        "the FSDP2 table runs on the CPU only)")
    parser.add_argument("--only", choices=("ddp", "fsdp2"), default=None, help="run one of the two tables")
    parser.add_argument("--model", action="append", default=[], metavar="NAME=INT",
                        help="a field of the tiny Llama (vocab_size, hidden, layers, heads), repeatable, e.g. --model hidden=1024")
    parser.add_argument("--hsdp", type=int, default=1, metavar="REPLICAS",
                        help="the FSDP2 table as HSDP: REPLICAS replicas of W / REPLICAS shards each")
    parser.add_argument("--plain-read", action="store_true",
                        help="the FSDP2 table: also time a plain read (one sum a band) of the elements the pass reads, at the default wire, "
                             "in a run of its own at each W")
    parser.add_argument("--fsdp-max-world", type=int, default=1024,
                        help="largest W of the FSDP2 table (at 4096 shards every 192-row parameter is padded to 4096 rows)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # FSDP2's unfilled all-gather buffers on the fake group: no denormal slow paths
    worlds = args.worlds or (QUICK_WORLDS if args.quick else WORLDS)
    model_args = dict(QUICK_MODEL if args.quick else MODEL)
    for override in args.model:
        name, _, value = override.partition("=")
        if name not in model_args or not value.isdigit():
            parser.error(f"--model {override!r}: expected NAME=INT with NAME one of {', '.join(model_args)}")
        model_args[name] = int(value)
    if args.hsdp < 1 or any(w % args.hsdp for w in worlds if w <= args.fsdp_max_world):
        parser.error(f"--hsdp {args.hsdp}: every W of the FSDP2 table must be a multiple of the replicas, got {worlds}")
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    print(f"\nddphooks at scale, {date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, 1 thread, {args.device}{' ' + torch.cuda.get_device_name() if args.device.startswith('cuda') else ''}; one process on the fake process group (rank 0 of W), tiny Llama {model_args}, "
          f"{BATCH} x {TOKENS} tokens, attach() defaults; medians over {steps} steps after {WARMUP} warm-up steps\n")  # fmt: skip
    if args.only != "fsdp2":
        print("in-hook: median [IQR] per step of ddphooks' calls less allreduce_hook's (their medians in brackets; slots: the\n"
              "last bucket's buffer and slot, its callback with the copy of the W slots, and building SilentStats)\n")
        print("| W | wire | DDP in-hook ms beyond allreduce_hook | detector ms (round trip) | statistics bytes/step (% of gradient bytes) "
              "| with replica and detail steps (the matrix's share) | compact record bytes | detail record bytes (identity; matrix) | detail build ms (CPU) "
              "| kept MB | replica check ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for world in worlds if args.only != "fsdp2" else []:
        for gather_max_world in (None, 1):  # every rank's whole slot; the compact wire (ddphooks.fleet)
            r = measure(world, model_args, steps, gather_max_world, args.device)
            rows.append(r)
            q1, q3 = r["in_hook_ms_beyond_allreduce_iqr"]
            print(f"| {world} | {wire_label(r['wire'], world)} | {r['in_hook_ms_beyond_allreduce']:.1f} [{q1:.1f}, {q3:.1f}] ({r['silent_hook_ms']:.1f} - {r['allreduce_hook_ms']:.1f}; slots {r['slot_parts_ms']:.1f}) "
                  f"| {r['detector_ms']:.2f} | {r['slot_bytes_per_step']:,.0f} ({100 * r['slot_fraction_of_gradient_bytes']:.3f}%) "
                  f"| {r['amortised_bytes_per_step']:,.0f} ({r['detail_bytes_per_step']:,.0f}) | {r['compact_record_bytes']:,d} "
                  f"| {r['detail_record_bytes']:,d} ({r['detail_identity_bytes']:,d}; {r['detail_matrix'] or 'no matrix'} {r['detail_matrix_bytes']:,d}) "
                  f"| {r['detail_build_ms']:.1f} ({r['detail_build_cpu_ms']:.1f}) | {r['kept_bytes'] / 2**20:.1f} | {r['replica_check_ms']:.1f} |", flush=True)  # fmt: skip
    if rows:
        last = rows[-1]
        print(f"\n{last['parameters'] / 1e6:.1f} M parameters, {last['tensors']} tensors, {last['buckets']} buckets, transport "
              f"{last['transport']}; alerts raised (healthy simulated ranks): {[r['alerts'] for r in rows]}; largest kept at "
              f"W = {last['world_size']}: " + ", ".join(f"{t['path']} {t['bytes'] / 2**20:.1f} MB" for t in last["kept_largest"][:3]))  # fmt: skip
    if args.only != "ddp":
        mesh = "W shards" if args.hsdp == 1 else f"HSDP, {args.hsdp} replicas of W / {args.hsdp} shards"
        print(f"\nFSDP2 (fully_shard per decoder layer and the root, {mesh}): the statistics pass inside the reduce-scatters, "
              "median [IQR] per step; the end of backward (pack, all-reduce, statistics)\n")
        print("| W | wire | FSDP2 statistics pass ms/step | end of backward ms | reduce-scatter input elements/step | elements read | ns per element read "
              "| statistics bytes/step (% of gradient bytes) | with replica and detail steps | kept MB | step ms (no communication) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    fsdp_rows = []
    for world in worlds if args.only != "ddp" else []:
        if world > args.fsdp_max_world or args.device != "cpu":
            continue
        for gather_max_world in (None, 1):  # every rank's whole slot; the compact wire (ddphooks.fleet)
            r = measure_fsdp(world, model_args, steps, gather_max_world, args.hsdp)
            fsdp_rows.append(r)
            q1, q3 = r["pass_ms_iqr"]
            print(f"| {world} | {wire_label(r['wire'], world)} | {r['pass_ms']:.1f} [{q1:.1f}, {q3:.1f}] | {r['end_of_backward_ms']:.1f} "
                  f"| {r['input_elements']:,d} | {r['read_elements']:,d} | {r['pass_ns_per_element']:.2f} | {r['slot_bytes_per_step']:,.0f} ({100 * r['slot_fraction_of_gradient_bytes']:.3f}%) "
                  f"| {r['amortised_bytes_per_step']:,.0f} | {r['kept_bytes'] / 2**20:.1f} | {r['step_ms']:.0f} |", flush=True)  # fmt: skip
    plain_rows = []
    if args.plain_read and fsdp_rows:
        # What any reader of these elements pays where the pass reads them: FSDP2's copy-in has just
        # written the padded input (27 MB a decoder layer at 4096 shards), so they may be out of cache.
        print("\nThe pass against a plain read of the same elements (one sum a band), at the default wire, ms a step, median [IQR]\n")
        print("| W | wire | statistics pass | plain read | pass less plain read |")
        print("|---|---|---|---|---|")
        for world in sorted({r["world_size"] for r in fsdp_rows}):
            measured = next(r for r in fsdp_rows if r["world_size"] == world and wire_label(r["wire"], world).endswith("(default)"))
            plain = measure_fsdp(world, model_args, steps, DEFAULTS.gather_max_world, args.hsdp, plain_read=True)
            plain_rows.append({"world_size": world, "pass_ms": measured["pass_ms"], "read_elements": measured["read_elements"], "plain_read_ms": plain["pass_ms"],
                               "plain_read_ms_iqr": plain["pass_ms_iqr"], "plain_read_elements": plain["read_elements"]})  # fmt: skip
            q1, q3 = plain["pass_ms_iqr"]
            print(f"| {world} | {wire_label(measured['wire'], world)} | {measured['pass_ms']:.1f} | {plain['pass_ms']:.1f} [{q1:.1f}, {q3:.1f}] "
                  f"| {measured['pass_ms'] - plain['pass_ms']:.1f} |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(date.today()), "torch": torch.__version__, "model": model_args, "rows": rows, "fsdp_rows": fsdp_rows, "plain_read_rows": plain_rows}, f, indent=1)


if __name__ == "__main__":
    main()
