"""Memory per rank with ddphooks against plain DDP, as a user sees it and as the allocator counts it.

2 gloo ranks, a stack of Linear(width, width) layers, SGD, zero_grad() (set_to_none), STEPS steps;
each configuration in fresh processes, REPEATS times, interleaved. Rank 0's figures after the last
step, as the extra over plain DDP of the same round:

  rss          VmRSS: what `top` shows (includes memory the C allocator freed but keeps)
  peak         VmHWM: the high-water mark of resident memory, what decides an out-of-memory kill
  live heap    glibc mallinfo2 blocks in use (heap + mapped): bytes actually allocated
  free kept    mallinfo2 free bytes the allocator keeps in its heap (not returned to the system)
  rss trimmed  VmRSS after malloc_trim(0) hands that free memory back: what the process holds
  ddphooks     bytes of every tensor the state holds between steps (ddphooks.memory.retained_tensors)

    python benchmarks/memory.py                        # 84 M and 168 M parameters (width 2048, 20 / 40 layers)
    python benchmarks/memory.py --layers 4 8 --width 1024 --repeats 1   # quick
    python benchmarks/memory.py --accounting           # what each state holds, by part (DDP and FSDP2 settings)

"--accounting" lists, for each transport and setting, every storage the state keeps between steps
(``retained_tensors``) grouped by what it is for, at two model sizes: the gradient-sized entries are
the piggyback copy (DDP's last bucket, at most piggyback_limit_mb) and nothing else.
"""

import argparse
import ctypes
import gc
import json
import statistics

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddphooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ddphooks.launch import spawn
from ddphooks.memory import retained_tensors

STEPS = 4
CONFIGS = {
    "plain DDP": None,
    "attach, defaults": {},
    "attach, sketch_dim=0": {"sketch_dim": 0},
    "attach, transport=separate": {"transport": "separate"},
}


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def measure(rank, world, layers, width, settings):
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]))
    state = None if settings is None else ddphooks.attach(ddp, **settings)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(STEPS):
        loss = ddp(torch.randn(8, width) * (rank + 1)).square().mean()
        if state is not None:
            state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if state is not None:
        state.flush()
    gc.collect()
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    kept = retained_tensors(state) if state is not None else []
    libc.malloc_trim(0)
    trimmed = [line for line in open("/proc/self/status") if line.startswith("VmRSS")][0].split(":", 1)[1]
    result = {
        "rss": int(status["VmRSS"].split()[0]) * 1024, "peak": int(status["VmHWM"].split()[0]) * 1024,
        "live heap": info.uordblks + info.hblkhd, "free kept": info.fordblks, "rss trimmed": int(trimmed.split()[0]) * 1024,
        "ddphooks": sum(t.nbytes for t in kept), "piggyback": sum(t.nbytes for t in kept if t.path == "state._piggyback"),
    }  # fmt: skip
    if state is not None:
        state.close()
    return result


#: What each retained storage is for, by the first key found in its path.
PARTS = (
    ("signs.", "sign tables"), ("_product", "scratch"), ("_partials", "scratch"), ("_prepared", "plans"),
    ("plan.", "plans"), ("sq_", "norms buffers"), ("_piggyback", "piggyback copy of the last bucket"),
    ("_separate", "slot buffers"), ("_slots", "slot buffers"), ("_sketch", "slot buffers"), ("_loss", "slot buffers"),
    ("_latest", "latest statistics"), ("_previous", "latest statistics"), ("detector", "detector windows"),
    ("_records", "record builder"),
)  # fmt: skip
ACCOUNTING = {
    "DDP, defaults (piggyback), JsonlSink": ("ddp", {}),
    "DDP, transport=separate": ("ddp", {"transport": "separate"}),
    "DDP, every=10": ("ddp", {"every": 10}),
    "DDP, no sink, detect=False": ("ddp-nosink", {"detect": False}),
    "FSDP2, defaults, JsonlSink": ("fsdp2", {}),
}


def account(rank, world, layers, width, stack, settings, folder):
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if stack == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for layer in module:
            fully_shard(layer, mesh=mesh)
        model = fully_shard(module, mesh=mesh)
    else:
        model = DDP(module)
    sinks = [] if stack == "ddp-nosink" else [ddphooks.JsonlSink(f"{folder}/stats-{rank}.jsonl")]
    state = ddphooks.attach(model, sinks=sinks, **settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(12):
        loss = model(torch.randn(8, width) * (rank + 1)).square().mean()
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state.flush()
    parts = {}
    for tensor in retained_tensors(state):
        part = next((name for key, name in PARTS if key in tensor.path), tensor.path)
        parts[part] = parts.get(part, 0) + tensor.nbytes
    state.close()
    return parts, sum(p.numel() for p in model.parameters())  # FSDP2: DTensors count the whole parameter


def accounting(args):
    import tempfile

    print("what the state keeps per rank between steps, KB (rank 0, after 12 steps)")
    table = {}
    for name, (stack, settings) in ACCOUNTING.items():
        for layers in args.layers:
            with tempfile.TemporaryDirectory() as folder:
                table[name, layers] = spawn(account, 2, args=(layers, args.width, stack, settings, folder), timeout=900)[0]
    parts = sorted({part for parts, _ in table.values() for part in parts})
    print(" | ".join(["configuration", "params"] + parts + ["total"]))
    for (name, layers), (values, params) in table.items():
        cells = [f"{values.get(part, 0) / 1024:,.1f}" for part in parts] + [f"{sum(values.values()) / 1024:,.1f}"]
        print(" | ".join([name, f"{params / 1e6:.0f}M"] + cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[20, 40])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--accounting", action="store_true", help="list what each state holds, by part, instead")
    args = parser.parse_args()
    if args.accounting:
        return accounting(args)

    rows = []
    for layers in args.layers:
        params = layers * (args.width * args.width + args.width)
        samples = {name: [] for name in CONFIGS}
        for _ in range(args.repeats):  # interleaved: each round measures every configuration once
            for name, settings in CONFIGS.items():
                samples[name].append(spawn(measure, 2, args=(layers, args.width, settings), timeout=900)[0])
        for name, runs in samples.items():
            row = {"params": params, "config": name}
            for key in ("rss", "peak", "live heap", "free kept", "rss trimmed", "ddphooks", "piggyback"):
                extra = [run[key] - (plain[key] if key not in ("ddphooks", "piggyback") else 0) for run, plain in zip(runs, samples["plain DDP"])]
                row[key] = {"median": statistics.median(extra), "min": min(extra), "max": max(extra)}
            rows.append(row)

    mb = lambda value: f"{value / 2**20:+.0f}"  # noqa: E731
    print(f"extra MB per rank over plain DDP (median of {args.repeats}, min..max), after {STEPS} steps")
    keys = ("rss", "free kept", "rss trimmed", "peak", "live heap")
    print(f"{'params':>8} {'configuration':<28} " + " ".join(f"{k:>16}" for k in keys) + f" {'ddphooks':>9} {'of it piggyback':>16}")
    for row in rows:
        cells = [f"{mb(row[k]['median'])} ({mb(row[k]['min'])}..{mb(row[k]['max'])})" for k in keys]
        print(f"{row['params'] / 1e6:7.0f}M {row['config']:<28} " + " ".join(f"{c:>16}" for c in cells)
              + f" {row['ddphooks']['median'] / 2**20:9.1f} {row['piggyback']['median'] / 2**20:16.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
