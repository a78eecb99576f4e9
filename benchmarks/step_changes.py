"""The delay of a lasting step change, on every signal, against its bound, at W = 2 and 4.

Synthetic streams, numpy only (seconds): every rank's log loss and log gradient norm follow one
shared trend (a warm-up, then a decay, as a learning-rate schedule moves them) plus the rank's own
noise; its leave-one-out cosine and its cosine to its previous step (on Fisher's scale) are noise
about a level. From ``FAULT_STEP`` on, rank 1's value of one signal steps by ``size`` standard
deviations of its own noise in the suspicious direction (loss and gradient norm up, cosine down,
cosine to the previous step up) and stays there: a lasting fault, which must never become the
rank's new normal.

For each signal, W and size it reports the runs named (an alert naming rank 1 at or after the
fault), the median and worst delay, alerts before the fault or naming another rank, and the Lorden
bound ``ln(30,000) / (d'^2 / 2)`` steps, d' the measured separation of the shift in the rank's
value minus the mean of the other ranks' (the 60 steps after the fault against the 100 before,
over their spread before): no detector with one false alarm per 30,000 steps is faster on average.

    python benchmarks/step_changes.py                       # the table (W = 2 and 4, sizes 2 and 4, 10 seeds)
    python benchmarks/step_changes.py --set threshold=25    # with a DetectorConfig field changed
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np

from ddphooks.detect import Detector, DetectorConfig, Observation

SIGNALS = ("loss", "grad_norm", "cosine", "cosine_previous")
STEPS = 300
FAULT_STEP = 150
FAULT_RANK = 1
SKETCH_DIM = 256
#: Per-rank noise of each signal, in the units the detector reads it (log loss, log norm, cosine,
#: atanh of the cosine to the previous step); the cosine's is larger than the sketch's own noise.
NOISE = {"loss": 0.03, "grad_norm": 0.1, "cosine": 0.08, "cosine_previous": 0.15}
DIRECTION = {"loss": +1, "grad_norm": +1, "cosine": -1, "cosine_previous": +1}
ARL0 = 30_000


def stream(world: int, seed: int, signal: str | None, size: float) -> tuple[list[dict], np.ndarray]:
    """A run's records and, per step, the signal's values as the detector reads them (steps x W)."""
    rng = np.random.default_rng(seed)
    steps = np.arange(STEPS)
    schedule = np.where(steps < 20, steps / 20, 0.55 + 0.45 * np.cos(np.pi * np.clip((steps - 20) / (STEPS - 20), 0, 1)))
    shared = {
        "loss": np.log(3.0 * np.exp(-steps / 120) + 1.2),
        "grad_norm": 0.4 * schedule - steps / 400,
        "cosine": np.full(STEPS, 0.35),
        "cosine_previous": np.full(STEPS, 0.15),
    }
    values = {name: shared[name][:, None] + NOISE[name] * rng.standard_normal((STEPS, world)) for name in SIGNALS}
    if signal is not None:
        values[signal][FAULT_STEP:, FAULT_RANK] += DIRECTION[signal] * size * NOISE[signal]
    records = []
    for step in range(STEPS):
        records.append({
            "step": step, "world_size": world, "sketch_dim": SKETCH_DIM, "cosine_noise": 1 / math.sqrt(SKETCH_DIM),
            "losses": np.exp(values["loss"][step]).tolist(), "grad_norms": np.exp(values["grad_norm"][step]).tolist(),
            "cosine_loo": np.clip(values["cosine"][step], -1, 1).tolist(),
            "cosine_previous": None if step == 0 else np.tanh(values["cosine_previous"][step]).tolist(),
        })  # fmt: skip
    return records, values[signal] if signal is not None else None


def dprime(series: np.ndarray) -> float:
    """The faulty rank's value minus the mean of the others', in the suspicious direction: the
    60 steps from the fault against the 100 before, over the spread before."""
    others = np.delete(series, FAULT_RANK, axis=1).mean(axis=1)
    gap = series[:, FAULT_RANK] - others
    before, after = gap[FAULT_STEP - 100 : FAULT_STEP], gap[FAULT_STEP : FAULT_STEP + 60]
    return float(abs(after.mean() - before.mean()) / before.std(ddof=1))


def run(world: int, seed: int, signal: str | None, size: float, config: DetectorConfig | None) -> dict:
    records, series = stream(world, seed, signal, size)
    detector = Detector(config)
    for record in records:
        detector.update(Observation.from_record(record))
    start = FAULT_STEP if signal is not None else STEPS
    named = [a["step"] - FAULT_STEP for a in detector.alerts if a["step"] >= start and a["rank"] == FAULT_RANK]
    return {
        "delay": named[0] if named else None,
        "kind": next((a["kind"] for a in detector.alerts if a["step"] >= start and a["rank"] == FAULT_RANK), None),
        "early": sum(1 for a in detector.alerts if a["step"] < start),
        "other": sum(1 for a in detector.alerts if a["step"] >= start and a["rank"] != FAULT_RANK),
        "dprime": dprime(series) if series is not None else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=float, nargs="+", default=[2.0, 4.0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args()
    config = DetectorConfig.from_overrides(args.set) if args.set else None
    print("| signal | W | step (sd) | named | median / worst delay | first kind | d' | bound | alerts before / other rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        healthy = [run(world, 1000 + seed, None, 0.0, config) for seed in range(args.seeds)]
        print(f"| (healthy, {args.seeds} x {STEPS} steps) | {world} | - | - | - | - | - | - | {sum(r['early'] for r in healthy)} / - |")
        for signal in SIGNALS:
            for size in args.sizes:
                rows = [run(world, seed, signal, size, config) for seed in range(args.seeds)]
                delays = [r["delay"] for r in rows if r["delay"] is not None]
                d = statistics.median(r["dprime"] for r in rows)
                kinds = sorted({r["kind"] for r in rows if r["kind"]})
                delay = f"{statistics.median(delays):g} / {max(delays)}" if delays else "-"
                print(
                    f"| {signal} | {world} | {size:g} | {len(delays)} of {len(rows)} | {delay} | {', '.join(kinds) or '-'} | {d:.2f} | "
                    f"{math.log(ARL0) / (d * d / 2):.1f} | {sum(r['early'] for r in rows)} / {sum(r['other'] for r in rows)} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
