"""Dispatched torch operations that ddphooks adds beyond DDP's allreduce_hook (issue 59).

Two gloo ranks on the CPU; rank 0's counts. For each configuration the same model trains a few
steps with the plain communication (DDP's ``allreduce_hook``, FSDP2's or DeepSpeed's own
reduction) and with ddphooks (``ddphooks.attach``, default settings), and the difference is split
into a part per unit (a DDP bucket, an FSDP2 reduce-scatter, a DeepSpeed gradient hook) and a part
per step by counting the same layout at N and 2N units: per unit = (extra(2N) - extra(N)) / N,
per step = extra(N) - N * per unit. A step is the forward and the backward (and DeepSpeed's
``engine.step``), after warm-up steps (buckets rebuilt, plans made); not a detail or replica-check
step (every 100th).

How ops are counted: ``torch.profiler.profile(activities=[CPU])`` with
``_ExperimentalConfig(profile_all_threads=True)`` over the profiled steps; every ``aten::`` and
``c10d::`` event that no other such event encloses is one dispatched op (what a caller asked for:
``torch.stack`` is one op, its ``aten::cat`` inside is not another), on every thread of the
process. Views and allocations (``aten::slice``, ``aten::empty``, ...: no kernel on a device) are
counted apart, as "+N views"; a no-op ``aten::to`` or ``reshape`` is a view, one that copies is an
op. Why not a ``TorchDispatchMode``: its mode stack is thread-local and ``Future.then`` does not
carry it over, so the ops in the communication callbacks, which gloo runs on its own threads (the
reduced bucket's norms, the step's statistics), are not seen, except where the all-reduce had
completed before ``.then`` and the callback ran inline on the training thread: a count that
depends on timing (2 to 2.04 of the 3 ops a bucket in the reference rows). The
default profiler misses them too (its callbacks are thread-local as well); ``profile_all_threads``
registers them globally. What this may miss: work done outside the profiled steps (the background
pipeline thread's detector and sinks run when the next step hands the record over, so some of it
may land in the window and some not: counts that are not whole numbers show it), and Triton kernel
launches, which are not torch ops: under ``TRITON_INTERPRET=1`` each launch of the interpreter's
``GridExecutor`` is wrapped in a ``triton::launch`` record here and counted as one op (the numpy
work it interprets is not counted).

Rows: references that check the counter (a hook that only returns the bucket, allreduce_hook, and
allreduce_hook with one op in its callback); DDP with 48 buckets of 4 KB (1 parameter each) and 6
of 1 MB (4 parameters each) for the default torch path on the CPU, the torch path as it runs on an
accelerator (``BucketStatsKernel(fused=True)``, which the code picks from the device type, forced
here on the CPU; ``chunk_elems=ACCELERATOR_CHUNK_ELEMS``) and ``sketch_dim=0``; the Triton kernel
under ``TRITON_INTERPRET=1`` (4 KB buckets); FSDP2 (``fully_shard`` per Linear, and per group of four) and DeepSpeed ZeRO-2. Then DDP at W = 64, above ``gather_max_world``,
where the statistics travel in the compact wire (``ddphooks.fleet``: each rank packs its parts and,
after the all-reduce, keeps the step and sends it to the host in one copy, where it computes its own
values of the step in numpy at its next step): on PyTorch's fake process
group in the main process, where the collectives complete at once and every callback runs inline
on the training thread, so a ``TorchDispatchMode`` sees all of it.

Then the time: the wall time of ``loss.backward()`` with ddphooks minus with allreduce_hook, per
bucket (and the same in the training thread's CPU time, its own work without its waits for the GIL), 64 buckets of 1K elements, median over interleaved rounds [IQR], on PyTorch's fake process
group (one process, W = 2, the real DDP reducer, collectives that complete at once, one intra-op
thread): no peer and no network to wait for, so what is left is the host's own work, the
callbacks included, as a GPU host pays it. Between configurations each one's threads finish what
it handed them (untimed), so that no configuration's background work lands in another's time. Four
rows: the defaults, where the detector runs in a
process of its own, the same with a ``JsonlSink`` (a record built and written a step on the writer
thread), the same with the detector on the pipeline's thread, where its Python shares the GIL with
the training thread (as before 1337100), and ``detect=False``.

    python benchmarks/launches.py            # the table
    python benchmarks/launches.py --quick    # fewer units and timing rounds (tests/test_launches.py)
"""

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import ddphooks
from ddphooks.launch import spawn

# -- config ----------------------------------------------------------------------------------------
QUICK = "--quick" in sys.argv
WARMUP, STEPS = 3, 2  # steps before counting, steps counted (the counts are per step)
SMALL = (32, 1, 48)  # 4 KB buckets: Linear(32, 32) weights, 1 per bucket, 48 buckets
LARGE = (256, 4, 6)  # 1 MB buckets: 4 Linear(256, 256) weights per bucket, 6 buckets
TRITON_BUCKETS = 4 if QUICK else 8  # the interpreter runs the kernel in numpy
SHARDED_LAYERS = 4 if QUICK else 8  # FSDP2 reduce-scatters, DeepSpeed gradient hooks
TIMED_BUCKETS, ROUNDS, REPEAT = 64, 5 if QUICK else 40, 4
COMPACT_WORLD = 64  # above gather_max_world (16): the compact wire
# The timed configurations, each its attach() settings given a directory for records: the defaults
# (the detector in a process of its own), the same with a JsonlSink (what a user who keeps records
# pays: the writer thread builds and writes one a step), the same with the detector on the
# pipeline's thread as it ran before 1337100 (its Python holds the GIL the training thread needs),
# and without the detector (the hook, its callbacks and the records alone).
TIMED = {
    "default": lambda directory: {},
    "with_a_JsonlSink": lambda directory: dict(sinks=[ddphooks.JsonlSink(os.path.join(directory, "records.jsonl"))]),
    "detector_on_a_thread": lambda directory: {},
    "no_detector": lambda directory: dict(detect=False),
}
TIMEOUT = 300
COUNTED = ("aten::", "c10d::", "triton::")
# Views, allocations and pass-throughs: no kernel of their own on a device.
NO_KERNEL = {"aten::" + n for n in (
    "slice", "view", "as_strided", "select", "alias", "t", "transpose", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "empty", "empty_like", "empty_strided", "detach", "expand", "unsqueeze", "squeeze", "reshape", "_reshape_alias", "permute",
    "flatten", "unflatten", "_unsafe_view", "view_as", "resolve_conj", "resolve_neg", "to", "contiguous", "lift_fresh", "numpy_T",
    "diagonal",
)}  # fmt: skip
GOALS = {"bucket": "<= 4 ops a unit", "step": "<= 12 ops a step, none per parameter", "triton": "<= 1 launch a bucket (CUDA default path)",
         "time": "<= 40 us a bucket"}  # fmt: skip


# -- counting ----------------------------------------------------------------------------------------
def _launches(event) -> bool:
    """Whether an op runs a kernel: not a view or allocation, or one that calls an op that does."""
    return event.name not in NO_KERNEL or any(_launches(c) for c in event.cpu_children if c.name.startswith(COUNTED))


def count(step, steps=STEPS) -> tuple[float, float, float]:
    """(ops, views, Triton launches among the ops) per step of ``step()``: the top-level
    dispatched ops on every thread."""
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        for _ in range(steps):
            step()
    ops = views = triton = 0
    for event in prof.events():
        if not event.name.startswith(COUNTED):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(COUNTED):
            parent = parent.cpu_parent
        if parent is None:
            launches = _launches(event)
            ops, views, triton = ops + launches, views + (not launches), triton + event.name.startswith("triton::")
    return ops / steps, views / steps, triton / steps


class ThreadLocalCount(TorchDispatchMode):
    """The alternative: a dispatch mode, entered on the training thread (the ops it sees, and apart
    the views and allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.views, self.lock = 0, 0, threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.__name__.startswith("_record_function"):
            launches = "aten::" + func.__name__.split(".")[0] not in NO_KERNEL
            with self.lock:
                self.ops, self.views = self.ops + launches, self.views + (not launches)
        return func(*args, **(kwargs or {}))


# -- models --------------------------------------------------------------------------------------------
def _mlp(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _ddp(width: int, per_bucket: int, buckets: int) -> DDP:
    return DDP(_mlp(width, per_bucket * buckets), bucket_cap_mb=per_bucket * width * width * 4 / 2**20)


def _null_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _one_op_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return allreduce_hook(state, bucket).then(lambda f: f.value().mul_(1.0))  # in a gloo thread


class _Fused(ddphooks.sketch.BucketStatsKernel):
    """The torch path as on an accelerator: fused multi-tensor norms (the CPU picks per-segment dots)."""

    def __init__(self, bins, device, signs=None, fused=None) -> None:
        super().__init__(bins, device, signs, fused=True)


def _as_on_accelerator(on: bool) -> None:
    """Force the torch path's device-type branch (the kernel's fused norms) to the accelerator's."""
    import ddphooks.state

    ddphooks.state.BucketStatsKernel = _Fused if on else ddphooks.sketch.BucketStatsKernel


def _backward_step(model: torch.nn.Module, state, x: torch.Tensor):
    """One training step's forward and backward of ``model`` on ``x`` (its loss given to ``state`` where there is one)."""

    def step():
        loss = model(x).square().mean()
        if state is not None:
            state.observe_loss(loss)
        loss.backward()

    return step


def _warm_then_count(step, state, mode: bool = False, check=None) -> tuple:
    """``count(step)`` after WARMUP steps and ``check()`` (``mode``: a ``ThreadLocalCount`` over
    STEPS steps, for the fake group, where every callback runs on the training thread), then the
    state (if any) closed."""
    for _ in range(WARMUP):
        step()
    if check is not None:
        check()
    if mode:
        counter = ThreadLocalCount()
        with counter:
            for _ in range(STEPS):
                step()
        result = (counter.ops / STEPS, counter.views / STEPS, 0.0)
    else:
        result = count(step)
    if state is not None:
        state.close()
    return result


def _ddp_extra(rank: int, shape: tuple, hook, settings: dict | None, mode: bool = False) -> tuple:
    """(ops, views) per step of a DDP model of ``shape`` with ``hook`` (or ddphooks with ``settings``)."""
    model = _ddp(*shape)
    state = None
    if settings is None:
        model.register_comm_hook(None, hook)
    else:
        state = ddphooks.attach(model, **settings)
    step = _backward_step(model, state, torch.randn(4, shape[0], generator=torch.Generator().manual_seed(rank)))

    def check() -> None:
        if state is not None:
            assert len(state._buckets) == shape[2], f"{len(state._buckets)} buckets, expected {shape[2]}"

    return _warm_then_count(step, state, mode, check)


def _fit(measure, units: int) -> dict:
    """Per unit and per step from the counts at units/2 and units (each a pair (with, without))."""
    half = [a - b for a, b in zip(*measure(units // 2))]
    full = [a - b for a, b in zip(*measure(units))]
    per_unit = [(f - h) / (units - units // 2) for f, h in zip(full, half)]
    return {"unit": per_unit, "step": [f - units * u for f, u in zip(full, per_unit)]}


def _ddp_rows(rank: int) -> dict:
    rows = {}

    def ref(hook, base=_null_hook, mode=False):
        return lambda n: (_ddp_extra(rank, (*SMALL[:2], n), hook, None, mode), _ddp_extra(rank, (*SMALL[:2], n), base, None, mode))

    rows["ref_allreduce"] = _fit(ref(allreduce_hook), SMALL[2])
    rows["ref_one_op"] = _fit(ref(_one_op_hook), SMALL[2])
    rows["ref_one_op_mode"] = _fit(ref(_one_op_hook, mode=True), SMALL[2])
    accelerator = dict(chunk_elems=ddphooks.sketch.ACCELERATOR_CHUNK_ELEMS)
    for shape, size in ((SMALL, "4KB"), (LARGE, "1MB")):
        for path, settings in (("cpu", {}), ("accelerator", accelerator), ("sketch0", dict(sketch_dim=0))):
            _as_on_accelerator(path == "accelerator")
            try:
                measure = lambda n: (_ddp_extra(rank, (*shape[:2], n), None, settings), _ddp_extra(rank, (*shape[:2], n), allreduce_hook, None))
                rows[f"ddp_{size}_{path}"] = _fit(measure, shape[2])
            finally:
                _as_on_accelerator(False)
    return rows


def _fsdp_extra(rank: int, groups: int, measured: bool, per_group: int = 1, mode: bool = False) -> tuple:
    """FSDP2 with ``groups`` reduce-scatters a step, each of ``per_group`` Linear(32, 32) weights
    (``mode``: counted on the training thread, see ``_warm_then_count``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(*[_mlp(SMALL[0], per_group) for _ in range(groups)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for group in model:
        fully_shard(group, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = ddphooks.attach(model) if measured else None
    step = _backward_step(model, state, torch.randn(4, SMALL[0], generator=torch.Generator().manual_seed(rank)))
    return _warm_then_count(step, state, mode)


def _deepspeed_extra(rank: int, layers: int, measured: bool) -> tuple:
    import deepspeed

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp(SMALL[0], layers)

        def forward(self, x):
            return SimpleNamespace(loss=self.net(x).square().mean())

    config = {
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}, "steps_per_print": 10**9,
    }  # fmt: skip
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    state = ddphooks.attach(engine) if measured else None
    x = torch.randn(4, SMALL[0], generator=torch.Generator().manual_seed(rank))

    def step():
        engine.backward(engine(x).loss)
        engine.step()

    return _warm_then_count(step, state)


def _completed(tensor: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result([tensor])
    return future


def _compact_wire() -> dict:
    """DDP and FSDP2 at W = COMPACT_WORLD, above ``gather_max_world``: the compact wire
    (``ddphooks.fleet``: its packing, and after the all-reduce the one array each rank keeps of
    the step), on PyTorch's fake process group in this one process. Its collectives complete at
    once, so every callback runs inline on the training thread, where a ``TorchDispatchMode``
    sees it: counted by one, against ``allreduce_hook`` (plain FSDP2), at SMALL's buckets
    (SHARDED_LAYERS groups) and half of them (``_fit``)."""
    from scale import _DoneWork  # the fake group's collectives as completed work (benchmarks/scale.py)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=COMPACT_WORLD)
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, op=None, group=None, async_op=False: _DoneWork(_completed(tensor))  # its future has no value
    x = torch.randn(4, SMALL[0], generator=torch.Generator().manual_seed(0))

    def extra(buckets: int, measured: bool) -> tuple:
        model = _ddp(SMALL[0], 1, buckets)
        state = ddphooks.attach(model) if measured else None
        if state is None:
            model.register_comm_hook(None, allreduce_hook)
        return _warm_then_count(_backward_step(model, state, x), state, mode=True)

    rows = {}
    try:
        for key, measure, units in (
            ("compact_4KB", lambda n: (extra(n, True), extra(n, False)), SMALL[2]),
            ("compact_fsdp2", lambda n: (_fsdp_extra(0, n, True, mode=True), _fsdp_extra(0, n, False, mode=True)), SHARDED_LAYERS),
        ):
            try:
                rows[key] = _fit(measure, units)
            except Exception as error:
                rows[key] = _skip(error)
        return rows
    finally:
        dist.all_reduce = all_reduce
        dist.destroy_process_group()


def _timed() -> dict[str, tuple[list[float], list[float]]]:
    """Per configuration and round: (backward with ddphooks - backward with allreduce_hook) /
    buckets, in seconds, on PyTorch's fake process group (W = 2 in this one process, the real DDP
    reducer, collectives that complete at once: what is left is the host's work, callbacks
    included, as on a GPU host), in wall time and in the training thread's CPU time (its own
    work: the wall time also holds its waits for the GIL while other threads of the process run
    Python). Run in the main process after the workers (no other group)."""
    from scale import _DoneWork  # the fake group's collectives as completed work (benchmarks/scale.py)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ddphooks.detect import Detector

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, op=None, group=None, async_op=False: _DoneWork(_completed(tensor))  # its future has no value
    torch.set_num_threads(1)
    shape = (SMALL[0], 1, TIMED_BUCKETS)
    models = {name: _ddp(*shape) for name in ("plain", *TIMED)}
    models["plain"].register_comm_hook(None, allreduce_hook)
    directory = tempfile.mkdtemp(prefix="ddphooks-launches-")
    states = {name: ddphooks.attach(models[name], **settings(directory)) for name, settings in TIMED.items()}
    states["detector_on_a_thread"]._pipeline.detector = Detector()  # the same detector, in this process
    x = torch.randn(4, SMALL[0], generator=torch.Generator().manual_seed(0))

    def backward(name):  # REPEAT backward passes, each after its forward: (wall, thread CPU) seconds
        wall = cpu = 0.0
        for _ in range(REPEAT):
            loss = models[name](x).square().mean()
            if name in states:
                states[name].observe_loss(loss)
            start, start_cpu = time.perf_counter(), time.thread_time()
            loss.backward()
            wall, cpu = wall + time.perf_counter() - start, cpu + time.thread_time() - start_cpu
        if name in states:
            _settle(states[name])
        return wall / REPEAT, cpu / REPEAT

    names = list(models)
    try:
        for _ in range(WARMUP):
            for name in names:
                backward(name)
        per_bucket = {name: ([], []) for name in TIMED}
        for r in range(ROUNDS):
            order = names[r % len(names) :] + names[: r % len(names)]
            times = {name: backward(name) for name in order}
            for name in TIMED:
                for kind in (0, 1):
                    per_bucket[name][kind].append((times[name][kind] - times["plain"][kind]) / TIMED_BUCKETS)
    finally:
        for state in states.values():
            state.close()
        shutil.rmtree(directory, ignore_errors=True)
        dist.all_reduce = all_reduce
        dist.destroy_process_group()
    return per_bucket


def _settle(state) -> None:
    """Wait, untimed, until the steps ``state`` handed over are processed (by its pipeline's thread)
    and written (by its writer's): none of its threads' work runs into the next configuration's
    timed backward. The step still pending is handed over by this state's next backward, which
    pays for it."""
    pipeline = state._pipeline
    with pipeline._cond:  # the steps sent to the detector's process wait for the next hand-over
        pipeline._cond.wait_for(lambda: pipeline._done + len(pipeline._sent) >= pipeline._handed, timeout=TIMEOUT)
    if pipeline.writer is not None:
        pipeline.writer.flush(TIMEOUT)


def _skip(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:90] if str(error) else ''}"


def _worker(rank: int, world: int) -> dict:
    rows = _ddp_rows(rank)
    try:
        rows["fsdp2"] = _fit(lambda n: (_fsdp_extra(rank, n, True), _fsdp_extra(rank, n, False)), SHARDED_LAYERS)
        rows["fsdp2_4"] = _fit(lambda n: (_fsdp_extra(rank, n, True, 4), _fsdp_extra(rank, n, False, 4)), SHARDED_LAYERS)
    except Exception as error:  # a skipped row says why
        rows["fsdp2"] = rows["fsdp2_4"] = _skip(error)
    try:
        os.environ.setdefault("LOCAL_RANK", str(rank))
        import importlib

        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no g++ build of an inference op
        rows["deepspeed"] = _fit(lambda n: (_deepspeed_extra(rank, n, True), _deepspeed_extra(rank, n, False)), SHARDED_LAYERS)
    except Exception as error:
        rows["deepspeed"] = _skip(error)
    return rows


def _triton_launch_counted() -> None:
    """Each launch of Triton's interpreter inside a ``triton::launch`` profiler record."""
    from triton.runtime.interpreter import GridExecutor

    call = GridExecutor.__call__

    def launch(self, *args, **kwargs):
        with torch.profiler.record_function("triton::launch"):
            return call(self, *args, **kwargs)

    GridExecutor.__call__ = launch


def _triton_worker(rank: int, world: int) -> dict:
    _triton_launch_counted()
    settings = dict(stats_kernel="triton")
    measure = lambda n: (_ddp_extra(rank, (SMALL[0], 1, n), None, settings), _ddp_extra(rank, (SMALL[0], 1, n), allreduce_hook, None))
    return {"triton_4KB": _fit(measure, TRITON_BUCKETS)}


def _triton_rows() -> dict:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return {"triton_4KB": "triton is not installed"}
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton when the workers import it
    try:
        return spawn(_triton_worker, 2, timeout=TIMEOUT)[0]
    except Exception as error:
        return {"triton_4KB": _skip(error)}
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = before


# -- the table -----------------------------------------------------------------------------------------
def _cell(counts) -> str:
    ops, views, triton = (int(v) if v == int(v) else v for v in (round(v, 2) for v in counts))
    return f"{ops} (+{views} views)" + (f", {triton} Triton" if triton else "")


if __name__ == "__main__":
    started = time.perf_counter()
    rows = spawn(_worker, 2, timeout=TIMEOUT)[0]
    rows.update(_triton_rows())
    rows.update(_compact_wire())
    d = SMALL[2]
    table = [  # (name, key, unit, goal of the unit's column, goal of the step's column)
        ("reference: allreduce_hook vs a hook returning the bucket", "ref_allreduce", "bucket", "2 (div_, allreduce_)", "0"),
        ("reference: allreduce_hook + mul_ in its callback", "ref_one_op", "bucket", "3 (div_, allreduce_, mul_)", "0"),
        ("  the same by a TorchDispatchMode (training thread)", "ref_one_op_mode", "bucket", "3: misses the callback", "0"),
        (f"DDP {d} x 4 KB (1 param), torch path, CPU", "ddp_4KB_cpu", "bucket", GOALS["bucket"], GOALS["step"]),
        (f"DDP {d} x 4 KB, torch path as on an accelerator", "ddp_4KB_accelerator", "bucket", GOALS["bucket"], GOALS["step"]),
        (f"DDP {d} x 4 KB, sketch_dim=0", "ddp_4KB_sketch0", "bucket", GOALS["bucket"], GOALS["step"]),
        (f"DDP {LARGE[2]} x 1 MB (4 params), torch path, CPU", "ddp_1MB_cpu", "bucket", GOALS["bucket"], GOALS["step"]),
        (f"DDP {LARGE[2]} x 1 MB, torch path as on an accelerator", "ddp_1MB_accelerator", "bucket", GOALS["bucket"], GOALS["step"]),
        (f"DDP {LARGE[2]} x 1 MB, sketch_dim=0", "ddp_1MB_sketch0", "bucket", GOALS["bucket"], GOALS["step"]),
        (f"DDP {TRITON_BUCKETS} x 4 KB, Triton (TRITON_INTERPRET=1)", "triton_4KB", "bucket", GOALS["triton"], GOALS["step"]),
        (f"FSDP2 fully_shard x {SHARDED_LAYERS} Linear(32, 32), one a group", "fsdp2", "reduce-scatter", GOALS["bucket"], GOALS["step"]),
        (f"FSDP2 fully_shard x {SHARDED_LAYERS} groups of 4 Linear(32, 32)", "fsdp2_4", "reduce-scatter", GOALS["bucket"], GOALS["step"]),
        (f"DeepSpeed ZeRO-2 x {SHARDED_LAYERS} Linear(32, 32)", "deepspeed", "gradient hook", GOALS["bucket"], GOALS["step"]),
        (f"DDP {d} x 4 KB at W = {COMPACT_WORLD}, compact wire, fake group", "compact_4KB", "bucket", GOALS["bucket"], GOALS["step"]),
        (f"FSDP2 x {SHARDED_LAYERS} Linear(32, 32) at W = {COMPACT_WORLD}, compact wire", "compact_fsdp2", "reduce-scatter", GOALS["bucket"], GOALS["step"]),
    ]
    lines = [f"{'rank 0, ops beyond the plain reduction':<58} {'unit':<15} {'per unit':<26} {'per step':<26} goal (unit; step)"]
    for name, key, unit, goal_unit, goal_step in table:
        row = rows.get(key)
        if isinstance(row, str) or row is None:
            lines.append(f"{name:<58} {unit:<15} skipped: {row or 'not run'}")
            continue
        lines.append(f"{name:<58} {unit:<15} {_cell(row['unit']):<26} {_cell(row['step']):<26} {goal_unit}; {goal_step}")
    for name, (wall, cpu) in _timed().items():
        times = sorted(t * 1e6 for t in wall)
        q = statistics.quantiles(times, n=4) if len(times) > 1 else times * 3
        timing = f"{statistics.median(times):.1f} us [{q[0]:.1f}-{q[2]:.1f}]"
        own = f"its thread's CPU {statistics.median(cpu) * 1e6:.1f} us"
        label = f"backward time, {TIMED_BUCKETS} x 4 KB, fake group, {name.replace('_', ' ')}"
        lines.append(f"{label:<58} {'bucket':<15} {timing:<26} {own:<26} {GOALS['time']} ({ROUNDS} rounds)")
    print("\n".join(lines))
    print(f"({'--quick, ' if QUICK else ''}torch {torch.__version__}, {time.perf_counter() - started:.0f} s)")
