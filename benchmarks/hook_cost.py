"""Cost of silent_hook's statistics work on one bucket, against the memory-bandwidth floor.

For each bucket size and sketch_dim, in one process and one thread, interleaved round by round:
  read pass    torch.dot(buf, buf): reads the bucket once (the floor for anything that looks at it)
  divide       buf.div_(W): the pass allreduce_hook itself makes (context, not statistics work)
  statistics   per-parameter squared norms + sketch + packing of the rank's slot (before the allreduce)
  reduced      squared norms of the reduced bucket (after the allreduce, for the exact cosine)
Ratios are medians of per-round ratios to the read pass of the same round. "ops" counts the ops
the statistics work dispatches per bucket on the accelerator path (fused norms, 8 M-element
chunks), each a kernel launch on a GPU or NPU; the torch profiler sees them on the CPU too, so
they are counted here whatever --device is. Memory: what the statistics keep between steps on
the device, split into a fixed part (sign tables, scratch) and a part per gradient element
(plans), and the per-rank totals this implies for 135M, 1B and 7B parameters.

    python benchmarks/hook_cost.py            # 1, 25, 100 MB buckets
    python benchmarks/hook_cost.py --quick    # 1 and 25 MB, fewer rounds
    python benchmarks/hook_cost.py --device cuda --buckets 25 100   # one GPU (fused norms)

On an accelerator every timed call is bracketed by device synchronisations, so times are
device times plus one launch latency; transient memory is the allocator's peak above what was
allocated before the call.
"""

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ddphooks.sketch import ACCELERATOR_CHUNK_ELEMS, CPU_CHUNK_ELEMS, BucketPlan, BucketStatsKernel, SignTable, sketch_bins, squared_norms
from ddphooks.stats import slot_size

# -- config ----------------------------------------------------------------------------------------
BUCKET_MB = (1, 25, 100)
SKETCH_DIMS = (0, 64, 256, 1024)
PARAMS_PER_BUCKET = 8  # a bucket holds several parameters; norms are per parameter
WORLD = 8  # only sets the divisor and the slot count; nothing is communicated
ROUNDS, WARMUP = 15, 3
MODEL_SIZES = {"135M": 135e6, "1B": 1e9, "7B": 7e9}
# Not counted as ops: views and allocations launch no kernel.
VIEWS = {"aten::slice", "aten::view", "aten::as_strided", "aten::select", "aten::alias", "aten::t", "aten::transpose",
         "aten::split", "aten::split_with_sizes", "aten::empty"}


def synchronize(device):
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def timed(fn, device):
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def bytes_allocated(fn, device):
    """Bytes torch allocates during one call (an upper bound on its transient peak); on an
    accelerator, the allocator's peak above what was allocated before the call."""
    if device.type != "cpu":
        backend = getattr(torch, device.type)
        synchronize(device)
        before = backend.memory_allocated(device)
        backend.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return backend.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, event.self_cpu_memory_usage) for event in prof.key_averages())


def split(numel, n_params):
    lengths = [numel // n_params] * (n_params - 1)
    return lengths + [numel - sum(lengths)]


def launches(fn):
    """Ops dispatched by one call (after a warm-up call): aten ops not called by another aten op,
    views and allocations excluded, plus Inductor's compiled kernels (``cpp_fused_*``)."""
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += (event.name.startswith("aten::") and event.name not in VIEWS and parent is None) or "cpp_fused" in event.name
    return count


def plan_bytes_per_element(bins, chunk_elems):
    """Memory a plan keeps per gradient element: its segment arrays (a few integers per chunk; the
    scratch views are two per plan), for a 1 G-element layout of 64 parameters."""
    numel = 1 << 30
    return BucketPlan(split(numel, 64), bins, 0, torch.device("cpu"), chunk_elems).persistent_bytes() / numel


def accelerator_path(numel, bins, n_params, table):
    """The accelerator path (fused norms, accelerator chunks) run on the CPU: ops per bucket, and
    the fixed bytes kept between steps."""
    if not bins:
        return 0, 0
    flat, sketch, sq = torch.randn(numel), torch.zeros(bins), torch.empty(n_params)
    plan = BucketPlan(split(numel, n_params), bins, 0, torch.device("cpu"), ACCELERATOR_CHUNK_ELEMS)
    kernel = BucketStatsKernel(bins, torch.device("cpu"), table, fused=True)
    return launches(lambda: kernel.run(flat, plan, sketch, sq)), kernel.persistent_bytes()


def measure(bucket_mb, sketch_dim, rounds, chunk_elems, device):
    numel = bucket_mb * 2**20 // 4
    lengths = split(numel, PARAMS_PER_BUCKET)
    bins = sketch_bins(sketch_dim)
    buffer = torch.randn(numel, device=device)
    table = SignTable(0, bins, device, window=chunk_elems) if bins else None  # as the state makes it: T and one chunk again
    plan = BucketPlan(lengths, bins, 0, device, chunk_elems)
    kernel = BucketStatsKernel(bins, device, table)  # fused multi-tensor norms on accelerators, as in the hook
    sketch = torch.zeros(max(bins, 1), device=device)
    sq = torch.empty(len(lengths), device=device)
    slot = torch.empty(slot_size(len(lengths), bins), device=device)
    loss = torch.zeros(2, device=device)
    reduced_sq = torch.empty(len(lengths), device=device)

    def statistics_work():
        sketch.zero_()
        kernel.run(buffer, plan, sketch if bins else None, sq)
        torch.cat([loss, sq, sketch] if bins else [loss, sq], out=slot)

    work = {
        "read": lambda: torch.dot(buffer, buffer),
        "divide": lambda: buffer.div_(1.0),
        "statistics": statistics_work,
        "reduced": lambda: squared_norms(buffer, lengths, reduced_sq, fused=kernel.fused),
    }
    samples = {name: [] for name in work}
    for round_index in range(WARMUP + rounds):
        for name, fn in work.items():
            elapsed = timed(fn, device)
            if round_index >= WARMUP:
                samples[name].append(elapsed)
    ratio = lambda name: statistics.median(t / r for t, r in zip(samples[name], samples["read"]))
    fixed = kernel.persistent_bytes()  # sign tables and scratch: the same for any model
    accelerator_table = SignTable(0, bins, torch.device("cpu"), window=ACCELERATOR_CHUNK_ELEMS) if bins else None
    accelerator_ops, accelerator_fixed = accelerator_path(numel, bins, PARAMS_PER_BUCKET, accelerator_table)
    per_element = plan_bytes_per_element(bins, chunk_elems) if bins else 0.0
    accelerator_per_element = plan_bytes_per_element(bins, ACCELERATOR_CHUNK_ELEMS) if bins else 0.0
    return {
        "device": device.type,
        "bucket_mb": bucket_mb,
        "sketch_dim": sketch_dim,
        "bins": bins,
        "read_ms": 1e3 * statistics.median(samples["read"]),
        "statistics_ms": 1e3 * statistics.median(samples["statistics"]),
        "statistics_x_read": ratio("statistics"),
        "reduced_x_read": ratio("reduced"),
        "divide_x_read": ratio("divide"),
        "persistent_fixed_bytes": fixed,
        "persistent_bytes_per_element": per_element,
        "transient_bytes_per_call": bytes_allocated(statistics_work, device) + bytes_allocated(work["reduced"], device),
        "accelerator_ops": accelerator_ops,
        "accelerator_ops_64_params": accelerator_path(numel, bins, 64, accelerator_table)[0],
        "accelerator_fixed_bytes": accelerator_fixed,
        "accelerator_bytes_per_element": accelerator_per_element,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 25 MB buckets, 8 rounds")
    parser.add_argument("--buckets", type=int, nargs="+", default=None, help="bucket sizes in MB")
    parser.add_argument("--sketch-dims", type=int, nargs="+", default=SKETCH_DIMS)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15, 8 with --quick)")
    parser.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu")
    parser.add_argument("--chunk-elems", type=int, default=None, help="elements per chunk of the pass (default: the hook's for the device)")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one rank's view: DDP ranks share the cores
    if args.device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device; only imported when asked for)
    device = torch.device(args.device, 0) if args.device != "cpu" else torch.device("cpu")
    chunk_elems = args.chunk_elems or (CPU_CHUNK_ELEMS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMS)
    buckets = args.buckets or ((1, 25) if args.quick else BUCKET_MB)
    rounds = args.rounds or (8 if args.quick else ROUNDS)
    print(f"statistics work per bucket on {device}, 1 thread, torch {torch.__version__}, chunks of {chunk_elems} elements, "
          f"{PARAMS_PER_BUCKET} parameters per bucket, medians of {rounds} interleaved rounds\n")
    print(f"{'bucket':>7} {'sketch':>6} {'read ms':>8} {'stats ms':>9} {'stats/read':>10} {'reduced/read':>12} "
          f"{'(divide/read)':>13} {'ops (8/64 params)':>17} {'fixed MB':>8} {'B/elem':>8} {'transient B/call':>16}")
    results = []
    for bucket_mb in buckets:
        for sketch_dim in args.sketch_dims:
            r = measure(bucket_mb, sketch_dim, rounds, chunk_elems, device)
            results.append(r)
            ops = f"{r['accelerator_ops']}/{r['accelerator_ops_64_params']}"
            print(f"{bucket_mb:>5}MB {sketch_dim:>6} {r['read_ms']:8.2f} {r['statistics_ms']:9.2f} {r['statistics_x_read']:9.2f}x "
                  f"{r['reduced_x_read']:11.2f}x {r['divide_x_read']:12.2f}x {ops:>17} {r['persistent_fixed_bytes'] / 2**20:8.1f} "
                  f"{r['persistent_bytes_per_element']:8.1e} {r['transient_bytes_per_call']:16,d}")
    largest = max(r["bucket_mb"] for r in results)
    print(f"\npersistent statistics memory per rank, sketch_dim 256, from the {largest} MB bucket's fixed and per-element "
          f"costs (the piggyback copy of the last bucket, <= piggyback_limit_mb = 32 MB, comes on top)")
    for r in results:
        if r["bucket_mb"] == largest and r["sketch_dim"] == 256:
            for path, fixed, per_element in ((f"{device.type} path", r["persistent_fixed_bytes"], r["persistent_bytes_per_element"]),
                                             ("accelerator path", r["accelerator_fixed_bytes"], r["accelerator_bytes_per_element"])):
                sizes = {name: (fixed + per_element * n) / 2**20 for name, n in MODEL_SIZES.items()}
                r.setdefault("per_model_mb", {})[path] = sizes
                print(f"  {path:<17} fixed {fixed / 2**20:5.1f} MB + {per_element:.2e} B/elem: "
                      + ", ".join(f"{name} {mb:,.1f} MB" for name, mb in sizes.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
