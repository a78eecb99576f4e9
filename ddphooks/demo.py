"""``ddphooks demo``: watch one rank go silently out of step on a real multi-process DDP run.

Every rank trains the same small classifier on its own shard of a synthetic task (labels from a
fixed random "teacher" network). Half-way through, one rank starts receiving corrupted labels.
The per-rank statistics show the fault at once, and the online detector (on by default) names
the rank a few steps later.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddphooks.detect import DetectorConfig
from ddphooks.hook import SilentState, silent_hook
from ddphooks.launch import spawn
from ddphooks.sinks import JsonlSink

FEATURES, CLASSES, HIDDEN, BATCH = 32, 10, 256, 64


def _teacher_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def run_rank(rank: int, world: int, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Train on this rank's shard; return the per-step records (rank 0 only) and the alerts."""
    x, y = _teacher_data(BATCH * world * args.steps, args.seed)
    shard_x, shard_y = x[rank::world], y[rank::world]  # disjoint shards, as a DistributedSampler gives
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts them anyway)
    model = DDP(_model(), bucket_cap_mb=0.1)
    settings = {key: getattr(args, key) for key in ("nproc", "steps", "fault_step", "fault_rank", "sketch_dim", "seed")}
    sinks = [JsonlSink(args.jsonl, header={"demo": settings})] if args.jsonl else []
    state = SilentState(model=model, sketch_dim=args.sketch_dim, sinks=sinks)
    model.register_comm_hook(state, silent_hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    corruption = torch.Generator().manual_seed(1234 + rank)
    rows = []
    for step in range(args.steps):
        inputs = shard_x[step * BATCH : (step + 1) * BATCH]
        labels = shard_y[step * BATCH : (step + 1) * BATCH]
        if rank == args.fault_rank and step >= args.fault_step:
            labels = torch.randint(0, CLASSES, labels.shape, generator=corruption)  # the silent fault
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rows.append(state.latest.to_dict(detail=False))
    state.close()
    return (rows if rank == 0 else []), state.alerts


def _fmt(value: float | None) -> str:
    return "     n/a" if value is None else f"{value:8.4f}"


def print_table(rows: list[dict], fault_step: int, fault_rank: int, alerts: list[dict]) -> None:
    print(f"{'step':>4} {'loss mean':>9} {'loss std':>8} {'gnorm std':>9} {'mean cos':>8} {'wtd cos':>8}   per-rank loss")
    alerted = {alert["step"]: alert for alert in alerts}
    for row in rows:
        marker = " <- rank %d gets corrupted labels from here on" % fault_rank if row["step"] == fault_step else ""
        if row["step"] in alerted:
            marker += " <- alert: rank %d (%s)" % (alerted[row["step"]]["rank"], alerted[row["step"]]["kind"])
        losses = " ".join(f"{v:.3f}" for v in row["losses"])
        print(
            f"{row['step']:>4} {_fmt(row['loss_mean']):>9} {_fmt(row['loss_std'])} {_fmt(row['grad_norm_std']):>9} "
            f"{_fmt(row['mean_cosine'])} {_fmt(row['weighted_mean_cosine'])}   [{losses}]{marker}"
        )


def _mean(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if row[key] is not None]
    return sum(values) / len(values) if values else float("nan")


def warmup_note(fault_step: int) -> str | None:
    """What to expect of the detector when the fault comes before its warm-up ends (None otherwise)."""
    warmup = DetectorConfig().warmup
    if fault_step >= warmup:
        return None
    return f"(the detector learns each signal's baseline over the first {warmup} steps and raises no alert before: a fault at step {fault_step} is in its baseline)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="number of gloo worker processes (default 2)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--fault-step", type=int, default=None, help="first step with corrupted labels (default: half-way)")
    parser.add_argument("--fault-rank", type=int, default=None, help="rank that gets corrupted labels (default: the last)")
    parser.add_argument("--sketch-dim", type=int, default=256, help="sketch entries per rank (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", default=None, help="also write every record to this JSON-lines file")


def main(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise SystemExit(f"--nproc {args.nproc}: the demo needs at least 2 processes to compare ranks")
    args.fault_step = args.steps // 2 if args.fault_step is None else args.fault_step
    args.fault_rank = args.nproc - 1 if args.fault_rank is None else args.fault_rank
    if not 0 <= args.fault_rank < args.nproc:
        raise SystemExit(f"--fault-rank {args.fault_rank} is not a rank of --nproc {args.nproc}")
    print(f"ddphooks demo: {args.nproc} gloo processes, {args.steps} steps, rank {args.fault_rank} corrupted from step {args.fault_step}\n")
    note = warmup_note(args.fault_step)
    if note:
        print(note + "\n")
    rows, alerts = spawn(run_rank, args.nproc, args=(args,), timeout=600)[0]
    print_table(rows, args.fault_step, args.fault_rank, alerts)
    before, after = rows[: args.fault_step], rows[args.fault_step :]
    print("\nmean over steps          before fault   after fault")
    for key in ("loss_mean", "loss_std", "grad_norm_std", "mean_cosine", "weighted_mean_cosine"):
        print(f"  {key:<22} {_mean(before, key):12.4f}  {_mean(after, key):12.4f}")
    print("\nalerts of the online detector (the same on every rank; the log rank also logged each one as it came):")
    for alert in alerts:
        print(f"  step {alert['step']}: {alert['message']}")
    if not alerts:
        print("  none")
    return 0
