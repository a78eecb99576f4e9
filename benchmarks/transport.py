"""How to carry the statistics: piggyback buffer, coalesced allreduce, or a separate allreduce.

Times, on real gloo processes, the communication of one bucket plus W slots of statistics:
  bucket only   div_ + allreduce of the bucket (what allreduce_hook does; the baseline)
  piggyback     div into a persistent [bucket | W slots] buffer + one allreduce (silent_hook's default)
  coalesced     div_ + all_reduce_coalesced([bucket, slots]) (one call; gloo flattens both inside)
  separate      div_ + allreduce of the bucket, then an allreduce of the slots (two launches)
Medians of interleaved rounds; ratios are per-round ratios to "bucket only".

    python benchmarks/transport.py --nproc 2
"""

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from ddphooks.launch import spawn

# -- config ----------------------------------------------------------------------------------------
BUCKET_MB = 25
SLOT_FLOATS = 2 + 93 + 251  # tiny Llama: 93 parameters, sketch_dim=256
ROUNDS, WARMUP = 15, 3


def run(rank, world, bucket_mb, rounds):
    warnings.filterwarnings("ignore", message=".*all_reduce_coalesced.*")
    numel = bucket_mb * 2**20 // 4
    bucket = torch.randn(numel)
    slots = torch.zeros(world * SLOT_FLOATS)
    combined = torch.empty(numel + world * SLOT_FLOATS)

    def bucket_only():
        bucket.div_(world)
        dist.all_reduce(bucket)

    def piggyback():
        torch.div(bucket, world, out=combined[:numel])
        combined[numel:].zero_()
        dist.all_reduce(combined)

    def coalesced():
        bucket.div_(world)
        dist.all_reduce_coalesced([bucket, slots])

    def separate():
        bucket.div_(world)
        work = dist.all_reduce(bucket, async_op=True)
        dist.all_reduce(slots)
        work.wait()

    ways = {"bucket only": bucket_only, "piggyback": piggyback, "coalesced": coalesced, "separate": separate}
    samples = {name: [] for name in ways}
    for round_index in range(WARMUP + rounds):
        for name, fn in ways.items():
            bucket.copy_(torch.ones(()))  # keep values stable across repeated divisions
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if round_index >= WARMUP:
                samples[name].append(elapsed)
    times = torch.tensor([samples[name] for name in ways], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {name: row.tolist() for name, row in zip(ways, times)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--bucket-mb", type=int, default=BUCKET_MB)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    samples = spawn(run, args.nproc, args=(args.bucket_mb, args.rounds), timeout=1200)[0]
    base = samples["bucket only"]
    print(f"one {args.bucket_mb} MB bucket + {args.nproc} x {SLOT_FLOATS} statistics floats, {args.nproc} gloo processes, "
          f"torch {torch.__version__}, medians of {args.rounds} rounds\n")
    print(f"{'transport':<12} {'median ms':>10} {'vs bucket only':>15}")
    for name, times in samples.items():
        ratio = statistics.median(t / b for t, b in zip(times, base)) - 1
        print(f"{name:<12} {1e3 * statistics.median(times):10.2f} {100 * ratio:+14.1f}%")


if __name__ == "__main__":
    main()
