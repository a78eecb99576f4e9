"""Does the compact wire still name a corrupted layer at large W? (issue 42)

The compact wire (``gather_max_world``, ``ddphooks.fleet``) carries every rank's losses, norms and
cosines, but the per-parameter norms of only ``sampled_ranks`` ranks a step: half a rotating window, half the ranks
with the highest layer levels two steps before (``choose_sampled``); each rank runs the detector's
layer CUSUM on itself and sends its level and parameter. Whether a rank whose one layer computes a
wrong gradient is named among thousands is what this measures, with the real detector (``Detector.update``), the real ``choose_sampled`` and the
ranks' layer CUSUMs as each rank's ``own_values`` runs them (``fleet.layer_levels``), on synthetic steps:

- P = 32 parameters with log-normal typical norms, a shared trend (every rank alike), and per rank
  and parameter a log-normal factor of spread SIGMA (the zoo's healthy runs at W = 4: 0.15-0.38,
  0.65 for its heavy-tailed workload); ``--noise t3``: the log factor is SIGMA times a Student t
  with 3 degrees of freedom scaled to variance 1 (heavy tails: a 4-sigma step every ~200 draws
  where the normal has one in 16,000);
- losses 2 +- 0.05, leave-one-out cosines 0.3 +- 0.05, cosines to the previous step 0.15 +- 0.1;
  a rank's gradient norm is that of its parameters;
- a fault from step FAULT_STEP on: rank W // 3's parameter P // 2 has its norm multiplied by the
  factor, every step.

Each run is read twice, by a detector of every rank's whole slot and by one of the compact wire
(the sampled rows, the exact mean norms, the cosines and layer levels one step late, as
``as_compact_records`` gives them). Per W, noise and fault: runs where the faulty rank is named within HORIZON steps (any
alert on it; "layer": with the faulty parameter among the alert's parameters), the median delay,
and with the compact wire the share of those steps where the faulty rank was sampled. Healthy runs
give the false alarms (alerts in all).

    python benchmarks/compact_detection.py                    # W = 64, 1024, 4096; 3 seeds
    python benchmarks/compact_detection.py --worlds 16 64 --seeds 1 --factors 3   # quick
    python benchmarks/compact_detection.py --worlds 4 --sampled 2 --noise t3 --seeds 30   # layer levels at small W
"""

import argparse
import statistics
import time
from datetime import date

import numpy as np

from ddphooks.config import SilentConfig
from ddphooks.detect import Detector, DetectorConfig, Observation
from ddphooks.fleet import choose_sampled, layer_levels

PARAMETERS, FAULT_STEP, HORIZON = 32, 40, 60
SIGMAS = (0.15, 0.3)
NAMES = [f"model.layers.{p // 4}.weight{p % 4}" for p in range(PARAMETERS)]


def log_noise(rng: np.random.Generator, noise: str, shape: tuple[int, int]) -> np.ndarray:
    """Per rank and parameter, the log factor's unit-variance noise."""
    if noise == "t3":
        return rng.standard_t(3, size=shape) / np.sqrt(3.0)
    return rng.standard_normal(shape)


def run(world: int, sigma: float, factor: float | None, seed: int, sampled: int, noise: str = "normal") -> dict:
    """One synthetic run read by both detectors: what each said about the faulty rank."""
    rng = np.random.default_rng(seed)
    base = np.exp(rng.standard_normal(PARAMETERS))
    faulty, layer = world // 3, PARAMETERS // 2
    detectors = {"whole": Detector(DetectorConfig()), "compact": Detector(DetectorConfig())}
    alerts = {wire: [] for wire in detectors}
    levels, state, previous, sampled_steps = [], None, None, 0
    for step in range(FAULT_STEP + HORIZON):
        trend = np.exp(-step / 200 + 0.1 * rng.standard_normal())
        norms = base * trend * np.exp(sigma * log_noise(rng, noise, (world, PARAMETERS)))
        if factor is not None and step >= FAULT_STEP:
            norms[faulty, layer] *= factor
        step_values = dict(
            losses=2.0 + 0.05 * rng.standard_normal(world),
            grad_norms=np.sqrt((norms**2).sum(axis=1)),
            cosine_loo=0.3 + 0.05 * rng.standard_normal(world),
            cosine_previous=None if step == 0 else 0.15 + 0.1 * rng.standard_normal(world),
        )
        common = dict(step=step, world_size=world, losses=step_values["losses"], grad_norms=step_values["grad_norms"], cosine_noise=1 / 16,
                      replicas=None, parameter_names=NAMES, nonfinite={})  # fmt: skip
        whole = Observation(**common, cosine_loo=step_values["cosine_loo"], cosine_previous=step_values["cosine_previous"], parameter_norms=norms)
        # The compact wire: the rows chosen from the layer levels of two steps before (sent with
        # the step before); the cosines and layer levels of the step before (sent with this one).
        rows = choose_sampled(world, sampled, step, levels[step - 2][0] if step >= 2 else None)
        step_levels, step_parameters, state = layer_levels(norms, list(range(world)), state)
        levels.append((step_levels, step_parameters))
        sampled_steps += step >= FAULT_STEP and faulty in rows
        lagged = previous or {"cosine_loo": None, "cosine_previous": None}
        own = levels[step - 1] if step >= 1 else (None, None)
        compact = Observation(**common, cosine_loo=lagged["cosine_loo"], cosine_previous=lagged["cosine_previous"], parameter_norms=norms[rows],
                              parameter_rows=rows, parameter_mean_norms=norms.mean(axis=0), layer_levels=own[0], layer_parameters=own[1])  # fmt: skip
        previous = step_values
        for wire, observation in (("whole", whole), ("compact", compact)):
            alerts[wire] += detectors[wire].update(observation)
    result = {"sampled_share": sampled_steps / HORIZON}
    for wire, found in alerts.items():
        on_faulty = [a for a in found if a["rank"] == faulty and a["step"] >= FAULT_STEP]
        with_layer = [a for a in on_faulty if NAMES[layer] in a.get("parameters", [])]
        result[wire] = {
            "alerts": len(found),
            "delay": on_faulty[0]["step"] - FAULT_STEP if on_faulty else None,
            "layer_delay": with_layer[0]["step"] - FAULT_STEP if with_layer else None,
            "false": sum(1 for a in found if a["rank"] != faulty or a["step"] < FAULT_STEP or factor is None),
        }
    return result


def cell(results: list[dict], wire: str, key: str) -> str:
    delays = [r[wire][key] for r in results if r[wire][key] is not None]
    median = f", {statistics.median(delays):g}" if delays else ""
    return f"{len(delays)}/{len(results)}{median}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--factors", type=float, nargs="+", default=[1.5, 2.0, 3.0])
    parser.add_argument("--sigmas", type=float, nargs="+", default=list(SIGMAS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sampled", type=int, default=SilentConfig().sampled_ranks, help="sampled_ranks (default: the config's)")
    parser.add_argument("--noise", choices=("normal", "t3"), default="normal", help="the per-rank log factors' noise")
    args = parser.parse_args()
    sampled = args.sampled
    print(f"\nddphooks compact wire, detection at large W, {date.today()}: synthetic runs, P = {PARAMETERS}, fault from step {FAULT_STEP} "
          f"(rank W // 3, parameter {PARAMETERS // 2}), {HORIZON} steps after it, {args.seeds} seeds, sampled_ranks = {sampled}, noise {args.noise}\n")  # fmt: skip
    print("named: runs where the faulty rank is named within the horizon (median delay in steps); layer: with the faulty parameter")
    print("among the alert's parameters; sampled: share of the steps after the fault where the compact wire sampled the faulty rank;")
    print("false alarms: alerts on other ranks or before the fault (healthy runs: every alert)\n")
    print("| sigma | W | fault | whole: named | whole: layer | compact: named | compact: layer | sampled | false alarms whole / compact | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for sigma in args.sigmas:
        for world in args.worlds:
            for factor in [None, *args.factors]:
                start = time.perf_counter()
                results = [run(world, sigma, factor, 1000 * world + seed, sampled, args.noise) for seed in range(args.seeds)]
                share = statistics.median(r["sampled_share"] for r in results)
                false = f"{sum(r['whole']['false'] for r in results)} / {sum(r['compact']['false'] for r in results)}"
                if factor is None:
                    print(f"| {sigma} | {world} | none | - | - | - | - | - | {false} | {time.perf_counter() - start:.0f} |", flush=True)
                    continue
                print(f"| {sigma} | {world} | x{factor:g} | {cell(results, 'whole', 'delay')} | {cell(results, 'whole', 'layer_delay')} "
                      f"| {cell(results, 'compact', 'delay')} | {cell(results, 'compact', 'layer_delay')} | {share:.0%} | {false} "
                      f"| {time.perf_counter() - start:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
