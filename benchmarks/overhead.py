"""End-to-end DDP training-step time with silent_hook, against every alternative, in one run.

All configurations train their own replica of the same model on the same data; each timed round
runs one step of every configuration in turn (A B C, then B C A, ...), so machine drift hits them
alike, and overheads are medians of the per-round ratios to the baseline of the same round. With
``--block B`` (``--small``: 10) a round runs B consecutive steps of each configuration instead,
after every state's background work of earlier steps has finished (its detector's process caught
up, its writer's records written), and the first of the B is untimed: what a step's detector and
writer do after it lands on the same configuration's next step, as in a run of its own, never on
another configuration's (with one step each, a configuration's detector worked through the next
configuration's step). Overheads then pair the j-th timed step of each block.
"in hook ms" is the time spent inside the hook's calls on the training thread per step (median,
slowest rank): a far less noisy view of the hook's own work than step times on a shared machine.
"kept MB" is what the state keeps on its device between steps (sign tables, scratch, plans,
norms and slot buffers), rank 0.

"silent + JsonlSink + summary()" is what a user runs: a default SilentState writing records to a
JSONL file (a temporary one here), the loop recording each step's loss (``observe_loss``) and reading ``state.latest.summary()["mean_cosine"]``
every step. For it the script also times, by wrapping the pieces of that one state, where the
milliseconds of an instrumented step go: the statistics pass over each bucket, the squared norms
of the reduced buckets (gloo's thread), the piggyback division and slot packing of the last
bucket, publishing the step's SilentStats, processing it at the next step's first bucket (within
it, sending its slots to the detector's process, reading back the alerts of the step before, and
on rank 0 submitting that step to the writer), summary(), the synchronisation watchdog's forward
pre-hook and sentinel gradient hook; and on rank 0's writer thread the building and the writing of
each record. The detector itself runs in a process of its own (``ddphooks.detect.process``).

With ``--deepspeed`` the rounds compare plain DeepSpeed ZeRO-2 and ZeRO-3 engines (fp32, SGD, no
accumulation) with ``ddphooks.attach`` on each (the defaults, a JsonlSink and summary() every
step); the breakdown covers the statistics pass in the gradient hooks and the end of backward
(reduced partition norms, the slot all-reduce and SilentStats).

With ``--small`` the rounds run a 2-layer character-level GPT (``tiny-gpt``: steps of tens of
milliseconds, where a fixed cost per step shows) with ``allreduce_hook`` and the user's
configuration, detector on and off, 200 timed steps in blocks of 10; every mode also prints the training thread's CPU
time per step (``thread_time``) over ``allreduce_hook``'s in the same round, and for a breakdown
that less its statistics pass.

With ``--fsdp`` the same rounds compare plain FSDP2 (``fully_shard`` on every decoder layer and
the root) with ``ddphooks.attach`` on it: the default state with a JsonlSink and summary() every
step, and every=10; the breakdown then covers the statistics pass inside each reduce-scatter and
the end of backward (the slot all-reduce and SilentStats).

    python benchmarks/overhead.py --quick                            # CPU, spawns 2 gloo workers
    python benchmarks/overhead.py --small                            # CPU, small steps (tiny-gpt), 2 gloo workers
    python benchmarks/overhead.py --small --models cnn --steps 100   # the same for a ResNet-style CNN (~100 ms steps)
    python benchmarks/overhead.py --fsdp --steps 30                  # CPU, FSDP2 on 2 gloo workers
    python benchmarks/overhead.py --json results.json                # CPU, the full table
    torchrun --nproc-per-node 8 benchmarks/overhead.py --device cuda # 8 GPUs, NCCL
    torchrun --nproc-per-node 8 benchmarks/overhead.py --device npu  # 8 Ascend NPUs, HCCL
    torchrun --nproc-per-node 8 benchmarks/overhead.py --device cuda --fsdp   # FSDP2 on 8 GPUs
    python benchmarks/overhead.py --deepspeed --steps 30             # CPU, DeepSpeed ZeRO-2/3 on 2 gloo workers
    torchrun --nproc-per-node 8 benchmarks/overhead.py --device cuda --deepspeed   # DeepSpeed on 8 GPUs
"""

import argparse
import gc
import json
import os
import platform
import select
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import date

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ddphooks import JsonlSink, SilentState, attach, silent_hook
from ddphooks.detect.process import _HEADER, DetectorProcess
from ddphooks.devices import set_device
from ddphooks.launch import spawn
from ddphooks.models import mlp, parameter_count, small_resnet, tiny_gpt, tiny_llama

# -- config ----------------------------------------------------------------------------------------
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
#: Seconds ``settle`` waits for a state's background work before it gives up (raises).
SETTLE_TIMEOUT_S = 120.0
LLAMA_BATCH, LLAMA_TOKENS = 8, 128
MLP_BATCH = 64
GPT_BATCH, GPT_TOKENS = 8, 64  # tiny-gpt: character-level, steps of tens of milliseconds
CNN_BATCH = 6  # cnn: 32 x 32 images, about 100 ms a step on one core of the 2-core CPU machine
SILENT_SKETCH_DIMS, SILENT_EVERY = (0, 64, 256, 1024), (1, 10)
SINK_CONFIG = ("silent_sink", 256, 1)  # SilentState's defaults, with a JsonlSink and summary() every step
QUICK_CONFIGS = [("none", None, None), ("allreduce", None, None), ("norms_separate", None, None), ("silent", 256, 1), SINK_CONFIG, ("silent", 256, 10), ("silent", 0, 1)]


#: ``--small``: a model whose steps take tens of milliseconds (tiny-gpt), where a fixed cost per step shows.
SMALL_CONFIGS = [("allreduce", None, None), ("silent_sink_nodetect", 256, 1), SINK_CONFIG]
FSDP_CONFIGS = [("fsdp", None, None), ("fsdp_silent_sink", 256, 1), ("fsdp_silent", 256, 10)]
#: ``--deepspeed``: plain ZeRO-2 and ZeRO-3 engines against ``attach`` with a JsonlSink and summary().
DEEPSPEED_CONFIGS = [("ds2", None, None), ("ds2_silent_sink", 256, 1), ("ds3", None, None), ("ds3_silent_sink", 256, 1)]


def deepspeed_engine(model, stage):
    """A ZeRO engine of ``stage`` around ``model`` with SGD (as the other rows), fp32, no accumulation."""
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
    }  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-5), config=config)
    return engine


def all_configs():
    base = [("none", None, None), ("allreduce", None, None), ("fp16_compress", None, None), ("noop", None, None), ("norms_separate", None, None)]
    return base + [("silent", k, e) for e in SILENT_EVERY for k in SILENT_SKETCH_DIMS] + [SINK_CONFIG]


class NormsSeparateState:
    """The anchor: local and global squared norms per bucket, exchanged in one extra allreduce
    per step from the training loop (what k-diffusion's DDPGradientStatsHook does with
    get_stats()), no per-rank view, no direction."""

    def __init__(self, group):
        self.group = group
        self.local, self.reduced = [], []

    def exchange(self):
        """After backward, on the training thread: collectives issued from future callbacks
        would run in a different order on different ranks."""
        stats = torch.stack([torch.stack(self.local).sum(), torch.stack(self.reduced).sum()])
        dist.all_reduce(stats, group=self.group)
        self.local, self.reduced = [], []
        return stats


def norms_separate_hook(state: NormsSeparateState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.local.append(bucket.buffer().pow(2).sum())

    def reduced(fut):
        tensor = fut.value()
        state.reduced.append(tensor.pow(2).sum())
        return tensor

    return allreduce_hook(state.group, bucket).then(reduced)


def build(name, device):
    if name == "tiny-llama":
        return tiny_llama().to(device)
    if name == "mlp":
        return mlp().to(device)
    if name == "tiny-gpt":  # small steps: a fixed cost per step shows
        return tiny_gpt().to(device)
    if name == "cnn":  # the shape of issue 59's CNN client: 4.9 M parameters in 86 tensors, BatchNorm
        return small_resnet().to(device)
    if name == "tiny-mlp":  # seconds-long smoke runs of this script
        return mlp(width=64, depth=3).to(device)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name).to(device)


def make_batch(name, model, rank, device):
    generator = torch.Generator().manual_seed(rank)
    module = getattr(model, "module", model)  # DDP wraps, FSDP2 does not
    if name in ("mlp", "tiny-mlp"):
        return {"x": torch.randn(MLP_BATCH, module[0].in_features, generator=generator).to(device)}
    if name == "cnn":
        images = torch.randn(CNN_BATCH, 3, 32, 32, generator=generator).to(device)
        return {"images": images, "labels": torch.randint(0, 10, (CNN_BATCH,), generator=generator).to(device)}
    if name == "tiny-gpt":
        ids = torch.randint(0, module.vocab_size, (GPT_BATCH, GPT_TOKENS + 1), generator=generator).to(device)
        return {"ids": ids[:, :-1], "targets": ids[:, 1:]}
    vocab = module.config.vocab_size
    ids = torch.randint(0, vocab, (LLAMA_BATCH, LLAMA_TOKENS), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}


def loss_of(name, model, batch):
    if name in ("mlp", "tiny-mlp"):
        return model(batch["x"]).pow(2).mean()
    if name == "tiny-gpt":
        return model(batch["ids"], batch["targets"])
    if name == "cnn":
        return torch.nn.functional.cross_entropy(model(batch["images"]), batch["labels"])
    return model(**batch).loss


class HookTimer:
    """Seconds spent inside a hook's calls on the training thread (not in its future callbacks).

    Far less noisy than step times on a shared machine, so it shows the hook's own work directly.
    """

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, hook):
        def timed_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            start = time.perf_counter()
            future = hook(state, bucket)
            self.seconds += time.perf_counter() - start
            return future

        timed_hook.__name__ = hook.__name__
        return timed_hook

    def wrap_call(self, fn):
        """Time any call on the training thread (the FSDP2 state's measurement and end of backward)."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


class Breakdown:
    """Where the milliseconds of an instrumented step go, for one SilentState with a JsonlSink.

    Light instrumentation: the pieces are wrapped with timers on this state's own objects (its
    kernel, its methods, its writer and sink). Step parts are summed over the buckets of a step
    (gloo's callbacks finish before backward returns); writer parts are per record, on rank 0
    (the log rank) only. On an accelerator these are host times: kernels run asynchronously.
    """

    STEP_PARTS = (
        ("statistics pass", "training"),  # the kernel's accumulate on every bucket
        ("last bucket: division into piggyback buffer + slot", "training"),  # _stats_buffer .. _pack_slot
        ("reduced norms + SilentStats", "gloo"),  # _step_reduced, once a step, in the last bucket's callback
        ("processing: the step to the detector, the one before's alerts and record", "training"),  # the previous step's, at the first bucket
        ("summary()", "training"),
        ("sync watchdog: forward pre-hook + sentinel gradient hook", "training"),
    )
    # Within "processing", once per step, all on the training thread (the detector itself runs in a
    # process of its own, ddphooks.detect.process); the submit on rank 0 only.
    THREAD_PARTS = (("sending the step's slots to the detector's process", "training"), ("reading the alerts back", "training"), ("submit to the writer", "training"))
    RECORD_PARTS = (("record building", "writer"), ("writing (JsonlSink)", "writer"))

    def _time_kernel(self, state, device, method: str = "run") -> None:
        """The timing tables of every part, and the statistics pass timed: the kernel of ``device``
        (cached per device: the hook or transport gets this instance back)."""
        self.state = state
        self.lock = threading.Lock()  # parts are timed on the training, gloo, pipeline and writer threads
        self.current = {part: 0.0 for part, _ in self.STEP_PARTS}
        self.samples = {part: [] for part, _ in self.STEP_PARTS + self.THREAD_PARTS + self.RECORD_PARTS}
        kernel = state._kernel(device)
        run = self._timed("statistics pass", getattr(kernel, method))
        self.kernel_cpu, self._kernel_cpu_step = [], 0.0  # the pass's thread CPU (thread_time) per timed step

        def timed_run(*args, **kwargs):
            start = time.thread_time()
            try:
                return run(*args, **kwargs)
            finally:
                self._kernel_cpu_step += time.thread_time() - start

        setattr(kernel, method, timed_run)

    def __init__(self, state, device):
        self._time_kernel(state, device, "accumulate")  # what silent_hook calls on every bucket
        self._pack_start = 0.0
        stats_buffer, pack_slot = state._stats_buffer, state._pack_slot
        state._stats_buffer = self._start_packing(stats_buffer)
        state._pack_slot = self._end_packing(pack_slot)
        state._step_reduced = self._timed("reduced norms + SilentStats", state._step_reduced)
        watchdog = state._watchdog  # its hooks call these attributes
        watchdog._forward = self._timed("sync watchdog: forward pre-hook + sentinel gradient hook", watchdog._forward)
        watchdog._gradient_arrived = self._timed("sync watchdog: forward pre-hook + sentinel gradient hook", watchdog._gradient_arrived)
        self._time_pipeline(state)

    def _time_pipeline(self, state):
        """Time what follows a step, on every transport: hand-off, detector, writer, sink."""
        pipeline = state._pipeline
        # The reads are meant to happen within processing, on the thread that processes.
        self.processing, self.reads_outside_processing = None, 0
        process = self._timed("processing: the step to the detector, the one before's alerts and record", pipeline.process)

        def flagged_process(*args, **kwargs):
            self.processing = threading.get_ident()
            try:
                return process(*args, **kwargs)
            finally:
                self.processing = None

        pipeline.process = flagged_process
        pipeline._send = self._timed("sending the step's slots to the detector's process", pipeline._send)
        if pipeline.detector is not None:  # detect=False: no detector to send to
            receive = self._timed("reading the alerts back", pipeline.detector.receive)

            def counted_receive(*args):
                self.reads_outside_processing += self.processing != threading.get_ident()
                return receive(*args)

            pipeline.detector.receive = counted_receive
        if pipeline.writer is not None:  # the log rank
            pipeline.writer.submit = self._timed("submit to the writer", pipeline.writer.submit)
            pipeline.writer.build = self._timed("record building", pipeline.writer.build)
            for sink in state.sinks:
                sink.write = self._timed("writing (JsonlSink)", sink.write)

    def _add(self, part, seconds):
        with self.lock:
            if part in self.current:
                self.current[part] += seconds
            else:
                self.samples[part].append(seconds)

    def _timed(self, part, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(part, time.perf_counter() - start)

        return timed

    def _start_packing(self, stats_buffer):
        def timed(*args, **kwargs):
            self._pack_start = time.perf_counter()
            return stats_buffer(*args, **kwargs)

        return timed

    def _end_packing(self, pack_slot):
        def timed(*args, **kwargs):
            pack_slot(*args, **kwargs)
            self._add("last bucket: division into piggyback buffer + slot", time.perf_counter() - self._pack_start)

        return timed

    def summary(self):
        """What the README's loop does after every step."""
        start = time.perf_counter()
        self.state.latest.summary()["mean_cosine"]
        self._add("summary()", time.perf_counter() - start)

    def end_step(self, timed, warmup=False):
        if timed:
            self.kernel_cpu.append(self._kernel_cpu_step)
        self._kernel_cpu_step = 0.0
        with self.lock:
            for part in self.current:
                if timed:
                    self.samples[part].append(self.current[part])
                self.current[part] = 0.0
            if warmup:  # warm-up steps detected and records built so far
                for part, _ in self.THREAD_PARTS + self.RECORD_PARTS:
                    self.samples[part].clear()

    def close(self):
        """Close the state (flushes the sink); return the lines its file got and the records dropped.

        What close() does on the training thread (its final process() waits for the detector's
        last answers) is the run's end, not a step's: those samples are dropped."""
        with self.lock:
            kept = {part: len(self.samples[part]) for part, _ in self.THREAD_PARTS}
        self.state.close()
        with self.lock:
            for part, count in kept.items():
                del self.samples[part][count:]
        path = self.state.sinks[0].path
        written = len(path.read_text().splitlines()) if path.exists() else 0  # only rank 0 writes
        shutil.rmtree(path.parent, ignore_errors=True)
        return written, self.state.dropped_records

    def result(self):
        """Median and IQR in seconds of every part this rank timed."""
        threads = dict(self.STEP_PARTS + self.THREAD_PARTS + self.RECORD_PARTS)
        per = {part: "step" for part, _ in self.STEP_PARTS + self.THREAD_PARTS} | {part: "record" for part, _ in self.RECORD_PARTS}
        return {part: {"thread": threads[part], "per": per[part], **spread(samples)} for part, samples in self.samples.items() if samples}


class FsdpBreakdown(Breakdown):
    """The same parts for ``attach`` on an FSDP2 model: the statistics pass runs inside each
    reduce-scatter, the slot all-reduce and SilentStats at the end of backward."""

    STEP_PARTS = (
        ("statistics pass", "training"),  # BucketStatsKernel.run on each reduce-scatter input
        ("end of backward: slot all-reduce + SilentStats", "training"),  # ShardedSilentState._gather
        ("processing: the step to the detector, the one before's alerts and record", "training"),
        ("summary()", "training"),
    )

    def __init__(self, state, device):
        self._time_kernel(state, device)
        state._gather = self._timed("end of backward: slot all-reduce + SilentStats", state._gather)
        self._time_pipeline(state)


class DeepSpeedBreakdown(Breakdown):
    """The same parts for ``attach`` on a DeepSpeed engine: the statistics pass runs in each
    parameter's gradient hook; the reduced norms, slot all-reduce and SilentStats at the end of
    the boundary's backward."""

    STEP_PARTS = (
        ("statistics pass", "training"),  # BucketStatsKernel.run in each parameter's tensor hook
        ("hooks: rest (cross terms, bookkeeping)", "training"),  # DeepSpeedSilentState._measure minus the pass
        ("end of backward: reduced norms + slot all-reduce + SilentStats", "training"),  # DeepSpeedSilentState._gather
        ("processing: the step to the detector, the one before's alerts and record", "training"),
        ("summary()", "training"),
    )

    def __init__(self, state, device):
        self._time_kernel(state, device)
        measure = state._measure

        def timed_measure(*args):
            start, before = time.perf_counter(), self.current["statistics pass"]
            try:
                return measure(*args)
            finally:
                rest = time.perf_counter() - start - (self.current["statistics pass"] - before)
                self._add("hooks: rest (cross terms, bookkeeping)", rest)

        state._measure = timed_measure
        state._gather = self._timed("end of backward: reduced norms + slot all-reduce + SilentStats", state._gather)
        self._time_pipeline(state)


def persistent_bytes(state):
    """What the state keeps between steps on its device: sign tables and scratch, the plans (a
    few integers per chunk), the norms buffers and the communication buffers of its slots."""
    if state is None:
        return None
    total = sum(kernel.persistent_bytes() for kernel in state._kernels.values())
    entries = getattr(state, "_entries", None) or getattr(state, "_buckets", {})
    for entry in entries.values():
        bands = getattr(entry, "bands", None)  # FSDP2: a plan per band of rows, each with its norms but the first
        plans = [band.plan for band in bands] if bands is not None else [entry.plan]
        band_norms = sum(band.sq_norms.numel() for band in bands or [] if band.sq_norms is not None)
        total += sum(plan.persistent_bytes() for plan in plans) + 4 * (entry.sq_norms.numel() + band_norms)
    total += sum(plan.persistent_bytes() for plan in getattr(state, "_plans", None) or [] if plan is not None)  # DeepSpeed
    for name in ("_slots", "_piggyback", "_separate", "_sketch", "_local_sq", "_scratch", "_shard_counts"):
        buffer = getattr(state, name, None)
        if buffer is not None:
            total += buffer.numel() * buffer.element_size()
    return total


def spread(samples):
    """Median and interquartile range of a list of seconds."""
    quartiles = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) >= 2 else [samples[0]] * 3
    return {"median": statistics.median(samples), "iqr": [quartiles[0], quartiles[2]]}


def register(model, config, group, timer, device):
    """Register the configuration's hook; return what must run after each backward (or None), the
    configuration's Breakdown (or None) and its SilentState (or None: it records each step's loss)."""
    hook, sketch_dim, every = config
    if hook == "allreduce":
        model.register_comm_hook(group, timer.wrap(allreduce_hook))
    elif hook == "fp16_compress":
        model.register_comm_hook(group, timer.wrap(fp16_compress_hook))
    elif hook == "noop":
        model.register_comm_hook(None, timer.wrap(noop_hook))
    elif hook == "norms_separate":
        state = NormsSeparateState(group)
        model.register_comm_hook(state, timer.wrap(norms_separate_hook))
        return state.exchange, None, None
    elif hook == "silent":
        state = SilentState(model=model, sketch_dim=sketch_dim, every=every)
        model.register_comm_hook(state, timer.wrap(silent_hook))
        return None, None, state
    elif hook in ("fsdp_silent", "fsdp_silent_sink"):
        sinks = [JsonlSink(os.path.join(tempfile.mkdtemp(prefix="ddphooks-overhead-"), "stats.jsonl"))] if hook == "fsdp_silent_sink" else []
        state = attach(model, sketch_dim=sketch_dim, every=every, sinks=sinks)
        state._measure, state._finish_step = timer.wrap_call(state._measure), timer.wrap_call(state._finish_step)
        if hook == "fsdp_silent":
            return None, None, state
        breakdown = FsdpBreakdown(state, device)
        return breakdown.summary, breakdown, state
    elif hook in ("ds2_silent_sink", "ds3_silent_sink"):
        state = attach(model, sinks=[JsonlSink(os.path.join(tempfile.mkdtemp(prefix="ddphooks-overhead-"), "stats.jsonl"))])
        breakdown = DeepSpeedBreakdown(state, device)
        state._measure, state._after_backward = timer.wrap_call(state._measure), timer.wrap_call(state._after_backward)
        return breakdown.summary, breakdown, state
    elif hook in ("silent_sink", "silent_sink_nodetect"):
        # The defaults (sketch_dim=256, every=1), as a user creates the state; rank 0 writes the file.
        sinks = [JsonlSink(os.path.join(tempfile.mkdtemp(prefix="ddphooks-overhead-"), "stats.jsonl"))]
        state = SilentState(model=model, sinks=sinks, **({"detect": False} if hook == "silent_sink_nodetect" else {}))
        model.register_comm_hook(state, timer.wrap(silent_hook))
        breakdown = Breakdown(state, device)
        return breakdown.summary, breakdown, state
    return None, None, None


def settle(states):
    """Wait, untimed, until every state's background work of the steps so far is done: its
    detector's process has answered every step sent (the answers read into its inbox, not taken:
    the pipeline takes them at its next hand-over), its pipeline's thread has processed what it
    was handed and its writer has written every record submitted. Before a block of steps, so
    that none of it runs into another configuration's timed steps."""
    for state in states:
        pipeline = getattr(state, "_pipeline", None)
        if pipeline is None:
            continue
        detector = pipeline.detector
        if isinstance(detector, DetectorProcess) and detector._child is not None:
            _caught_up(detector)
        with pipeline._cond:
            pipeline._cond.wait_for(lambda: pipeline._done + len(pipeline._sent) >= pipeline._handed, timeout=SETTLE_TIMEOUT_S)
        if pipeline.writer is not None:
            pipeline.writer.flush(SETTLE_TIMEOUT_S)


def _caught_up(detector):
    """Read the detector's process's answers into its inbox until it holds one for every step
    sent (and the "ready" before them), writing what the pipe could not take before."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    expected = detector._awaited + (0 if detector._ready else 1)
    fd = detector._child.stdout.fileno()
    while True:
        detector._write_some()
        inbox, count, offset = detector._inbox, 0, 0
        while offset + _HEADER.size <= len(inbox):  # the answers complete so far
            offset += _HEADER.size + _HEADER.unpack_from(inbox, offset)[0]
            count += offset <= len(inbox)
        if count >= expected:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the detector's process answered {count} of {expected} steps in {SETTLE_TIMEOUT_S} s")
        if select.select([fd], [], [], remaining)[0]:
            detector._read_some(fd)


def synchronize(device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def bench_model(rank, world, name, configs, args, device):
    models, optimizers, after_backward, timers, breakdowns, states = [], [], [], [], [], []
    mesh = init_device_mesh(device.type, (world,)) if configs[0][0].startswith("fsdp") else None
    for config in configs:
        torch.manual_seed(0)
        model = build(name, device)
        if config[0].startswith("ds"):
            model = deepspeed_engine(model, int(config[0][2]))
        elif mesh is None:
            model = DDP(model, device_ids=None if device.type == "cpu" else [device])
        else:
            for layer in getattr(getattr(model, "model", None), "layers", None) or list(model.children()):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        timers.append(HookTimer())
        after, breakdown, state = register(model, config, None, timers[-1], device)
        after_backward.append(after)
        breakdowns.append(breakdown)
        states.append(state)
        models.append(model)
        optimizers.append(None if config[0].startswith("ds") else torch.optim.SGD(model.parameters(), lr=1e-5))
    batch = make_batch(name, models[0], rank, device)
    times = [[] for _ in configs]
    cpu_times = [[] for _ in configs]  # the training thread's CPU time (thread_time) per step
    hook_times = [[] for _ in configs]
    gc.disable()  # a collection inside one configuration's step would be charged to it
    block = args.block
    timed_per_round = block - 1 if block > 1 else 1  # a block's first step takes the spill-over of none: untimed
    for round_index in range(args.warmup + -(-args.steps // timed_per_round)):
        # Rotate the order every round so that no configuration always follows the same one.
        order = [(round_index + i) % len(configs) for i in range(len(configs))]
        for i, in_block in ((i, j) for i in order for j in range(block)):
            if block > 1 and in_block == 0:
                settle(states)
            warmup = round_index < args.warmup
            timed = not warmup and (block == 1 or in_block > 0) and len(times[i]) < args.steps
            synchronize(device)
            timers[i].seconds = 0.0
            start, cpu_start = time.perf_counter(), time.thread_time()
            loss = loss_of(name, models[i], batch)
            if states[i] is not None:
                states[i].observe_loss(loss)
            if optimizers[i] is None:  # a DeepSpeed engine: its backward and step
                models[i].backward(loss)
                if after_backward[i] is not None:
                    after_backward[i]()
                models[i].step()
            else:
                loss.backward()
                if after_backward[i] is not None:
                    after_backward[i]()
                optimizers[i].step()
                optimizers[i].zero_grad(set_to_none=False)
            synchronize(device)
            if timed:
                times[i].append(time.perf_counter() - start)
                cpu_times[i].append(time.thread_time() - cpu_start)
                hook_times[i].append(timers[i].seconds)
            if breakdowns[i] is not None:
                breakdowns[i].end_step(timed, warmup)
        gc.collect()
    gc.enable()
    # A step lasts as long as its slowest rank.
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest = slowest.cpu().tolist()
    hooks = torch.tensor(hook_times, dtype=torch.float64, device=device)
    dist.all_reduce(hooks, op=dist.ReduceOp.MAX)
    hooks = hooks.cpu().tolist()
    cpus = torch.tensor(cpu_times, dtype=torch.float64, device=device)
    dist.all_reduce(cpus, op=dist.ReduceOp.MAX)
    cpus = cpus.cpu().tolist()
    # The training thread's CPU over allreduce_hook's, rank by rank and round by round (and, for a
    # breakdown, less that step's statistics pass), pooled over the ranks.
    cpu_over = [None] * len(configs)
    if "allreduce" in [c[0] for c in configs]:
        base = [c[0] for c in configs].index("allreduce")
        kernels = [b.kernel_cpu if b is not None else None for b in breakdowns]
        gathered = [None] * world
        dist.all_gather_object(gathered, (cpu_times, kernels))
        for i in range(len(configs)):
            over = [t - b for ranks_cpu, _ in gathered for t, b in zip(ranks_cpu[i], ranks_cpu[base])]
            beyond = None
            if kernels[i] is not None:
                beyond = [t - b - k for ranks_cpu, ks in gathered for t, b, k in zip(ranks_cpu[i], ranks_cpu[base], ks[i])]
            cpu_over[i] = (spread(over), None if beyond is None else spread(beyond))
    params = parameter_count(getattr(models[0], "module", models[0]))
    kept = [persistent_bytes(state) for state in states]
    del models, optimizers
    sink_results = {}
    for i, breakdown in enumerate(breakdowns):
        if breakdown is not None:
            written, dropped = breakdown.close()
            ranks = [None] * world
            dist.all_gather_object(ranks, (breakdown.result(), breakdown.reads_outside_processing))
            # The slowest rank per part (rank 0 alone has the writer thread's parts).
            parts = {}
            for result, _ in ranks:
                for part, value in result.items():
                    if part not in parts or value["median"] > parts[part]["median"]:
                        parts[part] = value
            outside = sum(count for _, count in ranks)
            sink_results[i] = {"breakdown": parts, "records_written": written, "dropped_records": dropped, "reads_outside_processing": outside}
    results = []
    for i, (config, samples, hook_samples) in enumerate(zip(configs, slowest, hooks)):
        hook, sketch_dim, every = config
        results.append(
            {
                **sink_results.get(i, {}),
                "hook_s_per_step": statistics.median(hook_samples),
                "thread_cpu_s_per_step": statistics.median(cpus[i]),  # the training thread's CPU, slowest rank
                "persistent_bytes": kept[i],
                "config": {"hook": hook, "sketch_dim": sketch_dim, "every": every},
                "world_size": world,
                "model": name,
                "parameters": params,
                "device": device.type,
                "median_step_s": statistics.median(samples),
                "min_step_s": min(samples),
                "max_step_s": max(samples),
                "steps": len(samples),
            }
        )
    # Overheads are medians of per-round ratios: each round pairs every configuration with the
    # baseline measured seconds apart, which cancels the machine's slow drift.
    baselines = {hook: slowest[i] for i, (hook, _, _) in enumerate(configs) if hook in ("allreduce", "none", "fsdp")}
    plain_ds = {hook: slowest[i] for i, (hook, _, _) in enumerate(configs) if hook in ("ds2", "ds3")}
    for i, (r, samples) in enumerate(zip(results, slowest)):
        base = plain_ds.get(r["config"]["hook"][:3])  # the plain engine of the same ZeRO stage
        if base:
            ratios = sorted(t / b - 1 for t, b in zip(samples, base))
            r["overhead_vs_deepspeed"] = statistics.median(ratios)
            if len(ratios) >= 4:
                quartiles = statistics.quantiles(ratios, n=4)
                r["overhead_vs_deepspeed_iqr"] = [quartiles[0], quartiles[2]]
        if cpu_over[i] is not None:  # the training thread's CPU per step over allreduce_hook's, same round and rank
            r["thread_cpu_s_vs_allreduce"] = cpu_over[i][0]
            if cpu_over[i][1] is not None:  # less the statistics pass of the step
                r["thread_cpu_s_vs_allreduce_less_pass"] = cpu_over[i][1]
        for hook in ("allreduce", "none", "fsdp"):
            base = baselines.get(hook)
            ratios = sorted(t / b - 1 for t, b in zip(samples, base)) if base else None
            r[f"overhead_vs_{hook}"] = statistics.median(ratios) if base else None
            if base and len(ratios) >= 4:  # spread of the per-round ratios
                quartiles = statistics.quantiles(ratios, n=4)
                r[f"overhead_vs_{hook}_iqr"] = [quartiles[0], quartiles[2]]
    return results


def run(rank, world, args):
    device = torch.device(args.device if args.device == "cpu" else f"{args.device}:{int(os.environ.get('LOCAL_RANK', rank))}")
    if args.device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device; only imported when asked for)
    if device.type != "cpu":
        set_device(device)
    if args.deepspeed:
        os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed asks for it; spawned workers have none
    configs = DEEPSPEED_CONFIGS if args.deepspeed else FSDP_CONFIGS if args.fsdp else QUICK_CONFIGS if args.quick else SMALL_CONFIGS if args.small else all_configs()
    if args.configs:
        configs = [c for c in configs if c[0] in args.configs]
    results = []
    for name in args.models:
        results += bench_model(rank, world, name, configs, args, device)
    return results


def label(config):
    hook, sketch_dim, every = config["hook"], config["sketch_dim"], config["every"]
    if hook == "silent_sink_nodetect":
        return "silent + JsonlSink, detect=False"
    if hook.startswith("ds"):
        return f"ZeRO-{hook[2]}" + (" + silent + JsonlSink + summary()" if hook.endswith("silent_sink") else "")
    if hook.endswith("silent_sink"):
        return f"{'fsdp2 + ' if hook.startswith('fsdp') else ''}silent + JsonlSink + summary()"
    if hook == "fsdp_silent":
        return f"fsdp2 + silent k={sketch_dim} every={every}"
    return f"silent k={sketch_dim} every={every}" if hook == "silent" else hook


def percent(x):
    return "   -" if x is None else f"{100 * x:+6.1f}%"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    parser.add_argument("--nproc", type=int, default=2, help="workers to spawn on CPU when not under torchrun")
    parser.add_argument("--models", nargs="+", default=None, help="tiny-llama, mlp, tiny-gpt, cnn (a ResNet-style CNN with BatchNorm, 4.9 M parameters in 86 tensors), tiny-mlp (smoke test), or a Hugging Face causal LM path")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (30; --small: 200)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (3; --small: 2 of --block steps)")
    parser.add_argument("--block", type=int, default=None, help="consecutive steps of a configuration in a round, the first untimed (1; --small: 10)")
    parser.add_argument("--quick", action="store_true", help="a subset in under 3 minutes on a 2-core CPU")
    parser.add_argument("--configs", nargs="+", default=None, help="only these hooks (none, allreduce, fp16_compress, noop, norms_separate, silent, silent_sink)")
    parser.add_argument("--small", action="store_true", help="small steps (tiny-gpt, tens of ms): allreduce_hook against the defaults with a JsonlSink, detector on and off")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP: plain against attach")
    parser.add_argument("--deepspeed", action="store_true", help="DeepSpeed ZeRO-2 and ZeRO-3 engines: plain against attach")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    args.models = args.models or (["tiny-llama"] if args.quick else ["tiny-gpt"] if args.small else ["tiny-llama", "mlp"])
    args.steps = args.steps if args.steps is not None else 200 if args.small else 30
    args.warmup = args.warmup if args.warmup is not None else 2 if args.small else 3
    args.block = args.block if args.block is not None else 10 if args.small else 1
    if args.block < 1:
        parser.error(f"--block {args.block}: a round runs at least one step of each configuration")
    if args.quick:
        args.steps, args.warmup = min(args.steps, 12), min(args.warmup, 2)

    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(BACKENDS[args.device])
        results = run(dist.get_rank(), dist.get_world_size(), args)
        leader = dist.get_rank() == 0
        dist.destroy_process_group()
        if not leader:
            return
    else:
        if args.device != "cpu":
            sys.exit("spawning workers is for the CPU; use torchrun for cuda and npu")
        results = spawn(run, args.nproc, args=(args,), timeout=3600)[0]

    print(f"\nddphooks overhead, {date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {results[0]['world_size']} x {args.device}, {args.steps} timed steps after {args.warmup} warm-up rounds"
          f"{f', in blocks of {args.block} steps (the first untimed)' if args.block > 1 else ''}\n")
    plain = "deepspeed" if args.deepspeed else "fsdp" if args.fsdp else "allreduce"  # the baseline a user compares with
    print(f"{'model':<12} {'configuration':<36} {'median ms':>10} {'min-max ms':>12} {'vs ' + plain:>13} {'(IQR)':>17} {'vs none':>9} {'in hook ms':>11} {'kept MB':>8}")
    for r in results:
        spread = f"{1e3 * r['min_step_s']:.0f}-{1e3 * r['max_step_s']:.0f}"
        iqr = r.get(f"overhead_vs_{plain}_iqr")
        iqr = f"[{percent(iqr[0]).strip()}, {percent(iqr[1]).strip()}]" if iqr else ""
        print(f"{r['model']:<12} {label(r['config']):<36} {1e3 * r['median_step_s']:10.1f} {spread:>12} "
              f"{percent(r[f'overhead_vs_{plain}']):>13} {iqr:>17} {percent(r['overhead_vs_none']):>9} {1e3 * r['hook_s_per_step']:11.1f} "
              f"{'-' if r['persistent_bytes'] is None else format(r['persistent_bytes'] / 2**20, '.1f'):>8}")
    if any("thread_cpu_s_vs_allreduce" in r for r in results):
        print("\ntraining thread's CPU per step (thread_time; slowest rank), and over allreduce_hook's in the same round on the "
              "same rank (median [IQR] over rounds and ranks); for a breakdown also less the step's statistics pass (its thread_time)")
        print(f"{'model':<12} {'configuration':<36} {'CPU ms':>8} {'over allreduce ms (IQR)':>26} {'less statistics pass ms (IQR)':>30}")
        for r in results:
            over = r["thread_cpu_s_vs_allreduce"]
            beyond = r.get("thread_cpu_s_vs_allreduce_less_pass")
            beyond = "-" if beyond is None else f"{1e3 * beyond['median']:+.2f} [{1e3 * beyond['iqr'][0]:+.2f}, {1e3 * beyond['iqr'][1]:+.2f}]"
            over = f"{1e3 * over['median']:+.2f} [{1e3 * over['iqr'][0]:+.2f}, {1e3 * over['iqr'][1]:+.2f}]"
            print(f"{r['model']:<12} {label(r['config']):<36} {1e3 * r['thread_cpu_s_per_step']:8.2f} {over:>26} {beyond:>30}")
    for r in results:
        if "breakdown" in r:
            print(f"\n{r['model']}, {label(r['config'])}: where the time goes (slowest rank; submit and writer thread on rank 0), "
                  f"{r['records_written']} records written, dropped {r['dropped_records'] or 'none'}\n")
            print(f"{'part':<62} {'thread':<9} {'per':<7} {'median ms':>10} {'IQR ms':>15}")
            for part, value in r["breakdown"].items():
                q1, q3 = value["iqr"]
                print(f"{part:<62} {value['thread']:<9} {value['per']:<7} {1e3 * value['median']:10.2f} {f'{1e3 * q1:.2f}-{1e3 * q3:.2f}':>15}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
