"""The statistics pass as one Triton kernel (``ddphooks.triton_stats``, ``stats_kernel="triton"``)
against the shipped torch path.

First a check: the kernel against BucketStatsKernel on four bucket layouts (13 to 1021 bins), the
same sketch and norms to fp32 rounding. On the CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported); its speed needs a GPU:

    TRITON_INTERPRET=1 python benchmarks/triton_sketch.py      # compares with BucketStatsKernel
    python benchmarks/triton_sketch.py --time                   # on a GPU: the comparison, then one table

With ``--time`` (on a GPU; under the interpreter only to exercise the code) it also times, per bucket
size, dtype and number of parameters, interleaved round by round and bracketed by device
synchronisations (CUDA events on a GPU): one read pass (``torch.dot``), the shipped torch path (``BucketStatsKernel``, fused
norms, 8 M-element chunks) and the Triton kernel, as medians of per-round ratios to the read pass with
their IQR, and the kernels each launches per bucket (the profiler's device kernels; on the CPU, its
dispatched ops).
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ddphooks.sketch import ACCELERATOR_CHUNK_ELEMS, BucketPlan, BucketStatsKernel, SignTable, sketch_bins


def compare() -> None:
    """The Triton kernel against BucketStatsKernel on four layouts (CPU, or the interpreter)."""
    from ddphooks.triton_stats import TritonBucketStats

    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    print(f"{'bins':>5} {'elements':>9} {'params':>6} {'tiles':>10} {'max sketch diff':>15} {'max norm diff':>13}")
    cases = ((61, [1000, 70_001, 5, 30_000, 17, 1], 3), (251, [300_000, 251, 4_000], 40_000), (1021, [50_000, 9], 70_000), (13, [3000, 7], 0))
    for bins, lengths, base_rows in cases:
        table = SignTable(3, bins, cpu)
        plan = BucketPlan(lengths, bins, base_rows * bins, cpu, 1 << 16)
        flat = torch.randn(plan.numel, generator=generator)
        expected_sketch, expected_sq = torch.zeros(bins), torch.empty(len(lengths))
        BucketStatsKernel(bins, cpu, table).run(flat, plan, expected_sketch, expected_sq)
        kernel = TritonBucketStats(bins, cpu, table)
        sketch, sq = torch.zeros(bins), torch.empty(len(lengths))
        kernel.run(flat, plan, sketch, sq)
        sketch_diff = ((sketch - expected_sketch).abs().max() / expected_sketch.abs().max()).item()
        sq_diff = ((sq - expected_sq).abs() / expected_sq).max().item()
        tiles = -(-plan.numel // (kernel.rows * bins))
        print(f"{bins:>5} {plan.numel:>9} {len(lengths):>6} {tiles:>10} {sketch_diff:15.1e} {sq_diff:13.1e}")
        assert sketch_diff < 1e-5 and sq_diff < 1e-5, "the Triton kernel disagrees with BucketStatsKernel"


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def kernels_launched(fn, device: torch.device) -> int:
    """Device kernels one call launches (after a warm-up call); on the CPU, the top-level ops."""
    fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    if device.type == "cuda":
        return sum(1 for event in prof.events() if event.device_type.name == "CUDA" and "memcpy" not in event.name.lower())
    return sum(1 for event in prof.events() if event.cpu_parent is None and not event.name.startswith("ProfilerStep"))


def bucket_layout(size_mb: float, dtype: torch.dtype, n_params: int) -> list[int]:
    """Parameter lengths of a bucket of ``size_mb`` MB of ``dtype`` split into ``n_params`` parameters."""
    numel = int(size_mb * 2**20) // torch.tensor([], dtype=dtype).element_size()
    lengths = [numel // n_params] * (n_params - 1)
    lengths.append(numel - sum(lengths))
    return lengths


def _elapsed(fn, device: torch.device) -> float:
    """Seconds one call takes: CUDA events around it on a GPU, else bracketed by synchronisations."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    synchronize(device)
    begin = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - begin


def measure_layout(device: torch.device, size_mb: float, dtype: torch.dtype, n_params: int, rounds: int, sketch_dim: int,
                   with_triton: bool = True, warmup: int = 3) -> dict:  # fmt: skip
    """One bucket layout: the read pass, the shipped torch path and (``with_triton``) the Triton
    kernel, interleaved round by round; per path the median and IQR of its per-round ratio to the
    read pass and the kernels it launches per bucket."""
    bins = sketch_bins(sketch_dim)
    table = SignTable(0, bins, device, window=ACCELERATOR_CHUNK_ELEMS)  # as the state makes it for accelerator chunks
    lengths = bucket_layout(size_mb, dtype, n_params)
    numel = sum(lengths)
    plan = BucketPlan(lengths, bins, 0, device, ACCELERATOR_CHUNK_ELEMS)
    flat = torch.randn(numel, device=device).to(dtype)
    kernel = BucketStatsKernel(bins, device, table, fused=True)
    sketch, sq = torch.zeros(bins, device=device), torch.empty(n_params, device=device)

    def shipped():
        sketch.zero_()
        kernel.run(flat, plan, sketch, sq)

    work = {"read": lambda: torch.dot(flat, flat), "torch": shipped}
    if with_triton:
        from ddphooks.triton_stats import TritonBucketStats  # triton reads TRITON_INTERPRET when imported

        triton_kernel = TritonBucketStats(bins, device, table)

        def fused():
            sketch.zero_()
            triton_kernel.run(flat, plan, sketch, sq)

        work["triton"] = fused
    ratios: dict[str, list[float]] = {name: [] for name in work if name != "read"}
    reads = []
    for round_index in range(warmup + rounds):
        elapsed = {name: _elapsed(fn, device) for name, fn in work.items()}
        if round_index >= warmup:
            reads.append(elapsed["read"])
            for name in ratios:
                ratios[name].append(elapsed[name] / elapsed["read"])
    result = {"numel": numel, "bytes": numel * flat.element_size(), "read_s": statistics.median(reads), "x_read": {}, "launches": {}}
    for name, values in ratios.items():
        q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        result["x_read"][name] = {"median": statistics.median(values), "iqr": [q[0], q[2]]}
        result["launches"][name] = kernels_launched(work[name], device)
    return result


def time_kernels(device: torch.device, sizes_mb: list[float], rounds: int, sketch_dim: int) -> None:
    """One table: the read pass, the shipped torch path and this kernel, per bucket layout."""
    bins = sketch_bins(sketch_dim)
    print(f"\n{device}, sketch_dim {sketch_dim} ({bins} bins), {rounds} rounds; ratios to one read pass, median [IQR]")
    if device.type == "cpu":
        print("(on the CPU the kernel runs in Triton's interpreter: these times and counts only exercise the code)")
    print(f"{'MB':>6} {'dtype':>8} {'params':>6} {'read us':>8} {'torch path':>18} {'triton':>18} {'launches torch / triton':>23}")
    for size_mb in sizes_mb:
        for dtype in (torch.float32, torch.bfloat16):
            for n_params in (8, 160):
                result = measure_layout(device, size_mb, dtype, n_params, rounds, sketch_dim)
                cells = []
                for name in ("torch", "triton"):
                    ratio = result["x_read"][name]
                    cells.append(f"{ratio['median']:6.2f} [{ratio['iqr'][0]:.2f}-{ratio['iqr'][1]:.2f}]")
                counts = f"{result['launches']['torch']} / {result['launches']['triton']}"
                name = str(dtype).removeprefix("torch.")
                print(f"{size_mb:>6g} {name:>8} {n_params:>6} {1e6 * result['read_s']:>8.0f} {cells[0]:>18} {cells[1]:>18} {counts:>23}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="also time both paths against a read pass (meaningful on a GPU only)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--buckets-mb", nargs="+", type=float, default=[25, 100], help="bucket sizes in MB for --time")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sketch-dim", type=int, default=256)
    args = parser.parse_args()
    compare()
    if args.time:
        time_kernels(torch.device(args.device), args.buckets_mb, args.rounds, args.sketch_dim)


if __name__ == "__main__":
    main()
