"""How to carry the statistics under FSDP2: one small all-reduce per step, or riding on a reduce-scatter.

A reduce-scatter hands each rank 1/W of its input, so to bring every rank's slot to every rank
inside one, each of the W rows of the last group's ``(W, C)`` input must grow by all W slots:
the input is copied into a ``(W, C + W * slot)`` buffer and the larger buffer is reduce-scattered.
ddphooks instead all-reduces the ``W x slot`` buffer once at the end of backward. This script
times both on the real layout: tiny Llama ``fully_shard``-ed per decoder layer and at the root,
2 gloo ranks, the slot size of the default state (sketch_dim 256), the root group (the last one
reduce-scattered). Rounds alternate the two, medians and IQR over the rounds, slowest rank.

    python benchmarks/fsdp_transport.py               # spawns 2 gloo workers, ~1 minute here
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ddphooks
from ddphooks.launch import spawn
from ddphooks.models import tiny_llama
from ddphooks.stats import slot_size


# torch 2.13 renamed reduce_scatter_tensor (same arguments); FSDP2's default comm calls the new name.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def quartiles(samples):
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return statistics.median(samples), q[0], q[2]


def run(rank, world, rounds):
    model = tiny_llama()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = ddphooks.attach(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()  # one step: the layouts and the slot size
    n_params = sum(len(layout.names) for layout in state.latest.buckets)
    slot = slot_size(n_params, state.bins) + n_params  # what ShardedSilentState all-reduces per rank
    root = max(state._entries.values(), key=lambda entry: entry.layout.index)  # the last group reduce-scattered
    columns = sum(root.shard_lengths)
    state.close()
    gradient = torch.randn(world * columns)
    output = torch.empty(columns)
    slots = torch.zeros(world * slot)
    wide = torch.empty(world, columns + world * slot)
    wide_output = torch.empty(columns + world * slot)
    times = {"plain reduce-scatter": [], "separate: all-reduce of W slots": [], "piggyback: copy + wider reduce-scatter": []}
    for r in range(rounds + 2):
        for name in (list(times) if r % 2 else list(times)[::-1]):
            dist.barrier()
            start = time.perf_counter()
            if name == "plain reduce-scatter":
                reduce_scatter(output=output, input=gradient, op=dist.ReduceOp.AVG)
            elif name.startswith("separate"):
                dist.all_reduce(slots)
            else:
                wide[:, :columns].copy_(gradient.view(world, columns))
                wide[:, columns:].zero_()
                reduce_scatter(output=wide_output, input=wide.view(-1), op=dist.ReduceOp.AVG)
            if r >= 2:
                times[name].append(time.perf_counter() - start)
    slowest = torch.tensor(list(times.values()), dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"slot": slot, "columns": columns, "world": world, "times": dict(zip(times, slowest.tolist()))}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    result = spawn(run, 2, args=(args.rounds,), timeout=1800)[0]
    world, slot, columns = result["world"], result["slot"], result["columns"]
    print(f"\nFSDP2 statistics transport, tiny Llama, {world} gloo ranks, root group {world} x {columns} fp32, slot {slot} fp32, "
          f"{args.rounds} rounds\n")
    print(f"{'what':<42} {'median ms':>10} {'IQR ms':>16}")
    for name, samples in result["times"].items():
        median, q1, q3 = quartiles(samples)
        print(f"{name:<42} {1e3 * median:10.3f} {f'{1e3 * q1:.3f}-{1e3 * q3:.3f}':>16}")
    plain = statistics.median(result["times"]["plain reduce-scatter"])
    piggyback = statistics.median(result["times"]["piggyback: copy + wider reduce-scatter"]) - plain
    separate = statistics.median(result["times"]["separate: all-reduce of W slots"])
    print(f"\nextra per step: separate {1e3 * separate:.3f} ms; piggyback {1e3 * piggyback:.3f} ms "
          f"(and a {4 * world * (columns + world * slot) / 2**20:.1f} MB buffer)")


if __name__ == "__main__":
    main()
