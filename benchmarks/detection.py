"""Detection delay and false alarms of ddphooks.detect, measured offline on experiment run files.

The detector is fed each run's records in order (as ``detect_run`` does), exactly as it runs inside
training. For fault runs (header ``fault_kind``), the delay is the number of instrumented steps
from the fault step to the first alert that names the faulty rank; an alert before the fault, or
one naming another rank, counts as a false alarm (fault runs that differ only in their fault kind
are the same run before their fault: those steps count once). Healthy runs (every other setting)
must raise none. The runs come from ``ddphooks experiment`` (commands in benchmarks/README.md):

    python benchmarks/detection.py runs/healthy runs/faults            # folders searched for run-*.jsonl
    python benchmarks/detection.py runs/faults --json detection.json
    python benchmarks/detection.py runs/heldout --set recent=32            # another DetectorConfig
    python benchmarks/detection.py runs/healthy runs/faults --levels 1 1.25 1.5 2   # per alert level
    python benchmarks/detection.py runs/healthy runs/faults --ablations             # each rule switched off

With ``--levels`` every run is detected once per ``DetectorConfig.alert_level``; the tables give,
per level, the false alarms per 30,000 healthy steps (pooled over the healthy settings, per world
size) and each fault kind's median delay next to the sequential-detection bound ``ln(ARL0) /
(d'^2 / 2)`` (Lorden; ARL0 = healthy steps per false alarm at that level and world size, or at least
the steps seen where there was none): d' is the per-step separation of the signal that fired,
``(mean score of the faulty rank over the first 10 steps from the fault - mean score of every rank
before the fault) / their standard deviation``, from the scores the detector keeps (``keep_scores``), the
median over the runs whose alert named the faulty rank. The signal is the part of that CUSUM that
crossed: for a ``layer`` alert the corrupted parameter's own scores, not the rank's strongest
parameter on each step (which would count the largest of every healthy rank's parameters as its
noise).

Every table also gives the highest CUSUM reached on any healthy step, over its level-1 threshold
(``Detector.evidence()`` times the alert level). An alert needs more than the alert level, so this
is the margin left before a false alarm: at the default level, 1.25, a highest CUSUM of 1.07
leaves 17%. False alarms are rare events; a rule switched off in ``--ablations`` may leave their
count on the runs at hand unchanged and still move this margin, which is what longer runs spend.

With ``--oracle`` it also asks how much of the gap to that bound is the detector's: for each fault
kind and world size, the best CUSUM over the very scores of the signal that fired (per rank and
part, as the detector accumulates them), with the allowance and the cap chosen with hindsight from
``ORACLE_DRIFTS`` x ``ORACLE_CAPS`` (with the detector's own allowance and cap, and no cap) and the
threshold just above the highest level it reaches on every healthy step of that world size (no
false alarm there, the same ARL0 as the bound's), then the allowance and cap with the smallest
median delay. Its choice includes the detector's own allowance and cap, so on runs where the
detector raised no false alarm it alerts no later than the detector; where it still needs more
than 1.5x the bound, no CUSUM on that signal meets the bound on these runs (the healthy scores'
tails, not the detector's settings, set the delay). Its table also gives the bound for a detector
that must say which of M streams changed, ``(ln(ARL0) + ln(M)) / (d'^2 / 2)`` (design notes,
section 11), M every rank's every part of that CUSUM (W x P for a ``layer`` alert).
"""

import argparse
import dataclasses
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

from ddphooks.detect import Detector, DetectorConfig, Observation
from ddphooks.experiment.report import read_run

#: Each rule of the detector switched off through its settings, for --ablations.
ABLATIONS = {
    "defaults": [],
    "no combined CUSUM (W >= 3)": ["combined_drift=1e9"],
    "no combined CUSUM at W = 2": ["pair_combined_drift=1e9"],
    "no cross-rank repeat CUSUM": ["repeat_threshold=1e9"],
    "no loss term in the repeat score": ["repeat_loss_cap=0"],
    "no per-parameter CUSUM": ["layer_threshold=1e9"],
    "no step cap": ["step_cap=1e9"],
    "per-parameter cap 10, threshold 20 (before)": ["layer_cap=10", "layer_threshold=20"],
    "no cosine floor": ["cosine_floor=1e-9"],
    "no growth power (combined)": ["combined_growth=0"],
    "no gradient-norm level CUSUM": ["level_threshold=1e9"],
}
#: Config fields in which fault runs may differ and still be the same run before their fault.
PREFIX_FREE = ("fault_kind", "out", "progress", "detect")
#: The allowances and caps the --oracle CUSUM chooses from (in the scores' standard deviations; the
#: caps also include the detector's own and none).
ORACLE_DRIFTS = (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12)
ORACLE_CAPS = (2, 3, 4, 5, 6, 8, 12, 16)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("folders", nargs="+", help="folders searched (recursively) for run-*.jsonl files")
parser.add_argument("--json", default=None, help="also write the results to this file")
parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override one DetectorConfig field (repeatable), e.g. --set recent=32")
parser.add_argument("--levels", nargs="+", type=float, default=None, metavar="L", help="alert levels to compare (DetectorConfig.alert_level), with d' and the bound")
parser.add_argument("--dprime-steps", type=int, default=10, help="steps from the fault over which the faulty rank's scores are averaged for d'")
parser.add_argument("--ablations", action="store_true", help="also detect every run with each rule of the detector switched off (ABLATIONS)")
parser.add_argument("--oracle", action="store_true", help="also the best CUSUM over the scores of the signal that fired, its threshold chosen with hindsight (see the module docstring)")
args = parser.parse_args()
try:
    config = DetectorConfig.from_overrides(args.set)
except ValueError as error:
    parser.error(str(error))

def dprime(scores: list[dict], fault_step: int, fault_rank: int, key: tuple[str, str], part: int) -> float | None:
    """Per-step separation of the signal behind the first alert naming the faulty rank (see the
    module docstring): the part of its CUSUM that crossed (the parameter of a ``layer`` alert, the
    direction of a signal scored either way), against the same part on every rank before the
    fault; None where it cannot be computed."""
    rows = [(number, row[key][:, part]) for number, row in scores if key in row and row[key].shape[1] > part]
    faulty = [z[fault_rank] for number, z in rows if fault_step <= number < fault_step + args.dprime_steps]
    # The healthy reference: every rank before the fault (after it, at W = 2 the other rank's
    # scores mirror the faulty rank's and would widen the separation).
    others = np.concatenate([z for number, z in rows if number < fault_step] or [np.array([])])
    others = others[np.isfinite(others)]
    faulty = [z for z in faulty if math.isfinite(z)]
    if not faulty or len(others) < 2 or others.std() == 0:
        return None
    return float((np.mean(faulty) - others.mean()) / others.std())


def series(scores: list[tuple[int, dict]], key: tuple[str, str], rank: int) -> tuple[np.ndarray, np.ndarray]:
    """One rank's scores of one CUSUM over a run: its steps and a steps x parts array (zeros where
    the detector scored nothing, as before its warm-up)."""
    parts = max((row[key].shape[1] for _, row in scores if key in row), default=1)
    z = np.zeros((len(scores), parts))
    for index, (_, row) in enumerate(scores):
        if key in row:
            z[index, : row[key].shape[1]] = row[key][rank]
    return np.array([number for number, _ in scores]), z


def cusum_levels(z: np.ndarray, drifts: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Steps x settings: per step, the highest of the parts' CUSUMs ``S <- max(0, S + min(z, cap)
    - drift)``, for every (drift, cap) pair of ``drifts`` and ``caps`` at once."""
    level, out = np.zeros((len(drifts), z.shape[1])), np.empty((len(z), len(drifts)))
    for index, row in enumerate(z):
        level = np.maximum(0.0, level + np.minimum(row[None, :], caps[:, None]) - drifts[:, None])
        out[index] = level.max(axis=1)
    return out


def oracle(runs: list[dict]) -> list[dict]:
    """Per fault kind and world size, the best CUSUM over the scores of the signal that fired
    (see the module docstring), from ``measure``'s kept scores."""
    results = []
    groups = defaultdict(list)
    for run in runs:
        if run["fault_step"] is not None:
            groups[(run["kind"], run["world"], run["fault_step"])].append(run)
    for (kind, world, fault_step), members in sorted(groups.items()):
        fired = [run["fired"] for run in members if run["fired"] is not None]
        if not fired:
            continue
        key = max(set(fired), key=fired.count)
        # The detector's own allowance and cap for this key and W are among the choices.
        allowance, cap = next((run["allowance"], run["cap"]) for run in members if run["fired"] == key)
        settings = [(drift, step_cap) for drift in sorted({*ORACLE_DRIFTS, allowance}) for step_cap in sorted({*ORACLE_CAPS, cap, math.inf}) if step_cap > drift]
        drifts, caps = np.array([d for d, _ in settings]), np.array([c for _, c in settings])
        # Every healthy step of this world size: the healthy runs, and the fault runs before their
        # fault (once per run that differs only in its fault kind).
        thresholds = np.zeros(len(settings))
        for run in runs:
            if run["world"] != world or not run["prefix_counted"]:
                continue
            for rank in range(world):
                steps, z = series(run["scores"], key, rank)
                if run["fault_step"] is not None:
                    z = z[steps < run["fault_step"]]
                if len(z):
                    thresholds = np.maximum(thresholds, cusum_levels(z, drifts, caps).max(axis=0))
        delays, parts = [], 1
        for run in members:
            steps, z = series(run["scores"], key, run["fault_rank"])
            parts = max(parts, z.shape[1])
            over = (cusum_levels(z, drifts, caps) > thresholds) & (steps >= fault_step)[:, None]
            delays.append([int(steps[over[:, index].argmax()] - fault_step) if over[:, index].any() else None for index in range(len(settings))])
        medians = [statistics.median(math.inf if run[index] is None else run[index] for run in delays) for index in range(len(settings))]
        best = min(range(len(settings)), key=lambda index: (medians[index], index))
        drift, step_cap = settings[best]
        results.append({
            "kind": kind, "world": world, "fault_step": fault_step, "key": list(key), "median": medians[best], "drift": drift,
            "cap": None if math.isinf(step_cap) else step_cap, "threshold": float(thresholds[best]), "delays": [run[best] for run in delays],
            "streams": world * parts,  # the CUSUMs that could have named the fault: one per rank and part
        })  # fmt: skip
    return results


def measure(config: DetectorConfig, keep: bool = False) -> dict:
    """Every run through a detector with ``config``: delays, false alarms, other-rank alerts, d',
    the highest CUSUM on a healthy step per world size (``peaks``, in level-1 thresholds); with
    ``keep``, every run's scores too (``runs``, for ``oracle``)."""
    found = {"delays": defaultdict(list), "false_alarms": defaultdict(lambda: [0, 0]), "wrong": defaultdict(int), "dprimes": defaultdict(list), "peaks": defaultdict(float), "runs": [], "prefixes": set()}
    for path in paths:
        run = read_run(path)
        world = run.header.get("world_size") or run.records[0]["world_size"]
        kind = run.header.get("fault_kind") if run.header.get("setting") == "fault" else None
        fault_step = run.fault_step if kind is not None else None
        # Fault runs that differ only in their fault kind are one run before their fault: count
        # those steps (and any alert or CUSUM level there) once.
        prefix = json.dumps({name: value for name, value in run.header.get("config", {}).items() if name not in PREFIX_FREE}, sort_keys=True)
        counted = kind is None or (world, prefix) not in found["prefixes"]
        if kind is not None:
            found["prefixes"].add((world, prefix))
        detector, scores = Detector(config, keep_scores=True), []
        for record in run.records:
            detector.update(Observation.from_record(record))
            scores.append((record["step"], dict(detector.step_scores)))
            if counted and (fault_step is None or record["step"] < fault_step):
                # This step's highest CUSUM over its level-1 threshold: the margin left.
                found["peaks"][world] = max(found["peaks"][world], float(detector.evidence().max(initial=0.0)) * config.alert_level)
        alerts = detector.alerts
        if kind is None:
            found["false_alarms"][(run.header.get("setting", "?"), world)][0] += len(alerts)
            found["false_alarms"][(run.header.get("setting", "?"), world)][1] += len(run.records)
            if keep:
                found["runs"].append({"world": world, "fault_step": None, "prefix_counted": True, "scores": scores})
            continue
        fault_rank = run.header.get("config", {}).get("fault_rank")
        named = [a for a in alerts if a["step"] >= fault_step and a["rank"] == fault_rank]
        first = min(named, key=lambda a: a["step"]) if named else None
        # The CUSUM behind that alert, and the part of it that crossed.
        key, part = next(((key, part) for step, rank, key, part in detector.fired if first is not None and (step, rank) == (first["step"], fault_rank)), (None, None))
        found["delays"][(kind, world, fault_step)].append(None if first is None else first["step"] - fault_step)
        if key is not None:
            separation = dprime(scores, fault_step, fault_rank, key, part)
            if separation is not None:
                found["dprimes"][(kind, world, fault_step)].append(separation)
        if keep:
            allowance, cap = (detector.cusums.allowance[key], detector.cusums.cap[key]) if key is not None else (None, None)
            found["runs"].append({"world": world, "kind": kind, "fault_step": fault_step, "fault_rank": fault_rank, "fired": key, "allowance": allowance, "cap": cap, "prefix_counted": counted, "scores": scores})
        if counted:
            early = [a for a in alerts if a["step"] < fault_step]
            found["false_alarms"][("fault, before the fault", world)][0] += len(early)
            found["false_alarms"][("fault, before the fault", world)][1] += sum(1 for r in run.records if r["step"] < fault_step)
        found["wrong"][(kind, world, fault_step)] += sum(1 for a in alerts if a["step"] >= fault_step and a["rank"] != fault_rank)
    return found


def false_alarms_by_world(found: dict) -> dict[int, tuple[int, int]]:
    """Alerts and steps over every healthy step (all healthy settings and the fault runs before
    their fault), per world size."""
    totals = defaultdict(lambda: (0, 0))
    for (_, world), (count, steps) in found["false_alarms"].items():
        totals[world] = (totals[world][0] + count, totals[world][1] + steps)
    return dict(sorted(totals.items()))


paths = sorted(p for folder in args.folders for p in Path(folder).rglob("run-*.jsonl"))
result = measure(config, keep=args.oracle)
delays, false_alarms, wrong = result["delays"], result["false_alarms"], result["wrong"]

print(f"detector: {config}")
print(f"\n{'fault kind':<10} {'W':>2} {'from step':>9} {'runs':>4} {'missed':>6} {'median delay':>12} {'worst delay':>11} {'other-rank alerts':>17}")
rows = []
for (kind, world, fault_step), values in sorted(delays.items()):
    found = [v for v in values if v is not None]
    median = statistics.median(found) if found else None
    worst = max(found) if found else None
    other = wrong[(kind, world, fault_step)]
    rows.append({"kind": kind, "world": world, "fault_step": fault_step, "runs": len(values), "missed": len(values) - len(found), "median": median, "worst": worst, "delays": values, "other_rank_alerts": other})
    print(f"{kind:<10} {world:>2} {fault_step:>9} {len(values):>4} {len(values) - len(found):>6} {'-' if median is None else median:>12} {'-' if worst is None else worst:>11} {other:>17}")

print(f"\n{'healthy setting':<24} {'W':>2} {'steps':>6} {'alerts':>6} {'per 1000 steps':>14}")
healthy = []
for (setting, world), (count, steps) in sorted(false_alarms.items()):
    healthy.append({"setting": setting, "world": world, "steps": steps, "alerts": count})
    print(f"{setting:<24} {world:>2} {steps:>6} {count:>6} {1000 * count / max(steps, 1):>14.2f}")
# Pooled over every healthy step: all healthy settings and the fault runs before their fault.
for world, (count, steps) in false_alarms_by_world(result).items():
    print(f"{'pooled, every setting':<24} {world:>2} {steps:>6} {count:>6} {1000 * count / max(steps, 1):>14.2f}")
# The margin before a false alarm: over every healthy step (all healthy settings and the fault runs
# before their fault), the highest CUSUM in its level-1 threshold; an alert needs more than the level.
peaks = {world: round(peak, 3) for world, peak in sorted(result["peaks"].items())}
print(f"highest CUSUM on a healthy step, in level-1 thresholds (an alert needs more than the level, {config.alert_level:g}): " + ", ".join(f"W = {w}: {p:.2f}" for w, p in peaks.items()))

levels = []
if args.levels:
    # Per alert level: false alarms pooled over every healthy step (all healthy settings and the
    # fault runs before their fault), per world size, and each fault kind's delay against the bound.
    for level in args.levels:
        found = measure(dataclasses.replace(config, alert_level=level))
        print(f"\n{'level':>5} {'W':>2} {'healthy steps':>13} {'false alarms':>12} {'per 30,000':>10} {'ARL0':>8} {'highest CUSUM':>13}")
        arl0 = {}
        for world, (count, steps) in false_alarms_by_world(found).items():
            arl0[world] = (steps / count, "") if count else (steps, ">=")
            print(f"{level:>5g} {world:>2} {steps:>13} {count:>12} {30000 * count / max(steps, 1):>10.2f} {arl0[world][1] + format(arl0[world][0], '.0f'):>8} {found['peaks'][world]:>13.2f}")
            levels.append({"level": level, "world": world, "steps": steps, "false_alarms": count, "peak": found["peaks"][world]})
        print(f"\n{'level':>5} {'fault kind':<10} {'W':>2} {'runs':>4} {'missed':>6} {'median delay':>12} {'median d-prime':>14} {'bound':>6} {'delay / bound':>13}")
        for (kind, world, fault_step), values in sorted(found["delays"].items()):
            named = [v for v in values if v is not None]
            median = statistics.median(named) if named else None
            separations = found["dprimes"][(kind, world, fault_step)]
            d = statistics.median(separations) if separations else None
            bound = math.log(arl0[world][0]) / (d * d / 2) if d and world in arl0 and arl0[world][0] > 1 else None
            ratio = median / bound if median is not None and bound else None
            cells = ["-" if v is None else f"{v:.2f}" for v in (d, bound, ratio)]
            print(f"{level:>5g} {kind:<10} {world:>2} {len(values):>4} {len(values) - len(named):>6} {'-' if median is None else median:>12} {cells[0]:>14} {cells[1]:>6} {cells[2]:>13}")
            levels.append({"level": level, "kind": kind, "world": world, "fault_step": fault_step, "delays": values, "dprime": d, "bound": bound})

ablations = []
if args.ablations:
    print("\nablations: false alarms / healthy steps per W (all healthy steps) and the highest CUSUM there; per fault kind and W: missed / runs, median delay")
    for name, overrides in ABLATIONS.items():
        found = measure(dataclasses.replace(DetectorConfig.from_overrides(overrides), alert_level=config.alert_level))
        cells = []
        for world, (count, steps) in false_alarms_by_world(found).items():
            cells.append(f"W{world} {count}/{steps} {found['peaks'][world]:.2f}")
            ablations.append({"ablation": name, "world": world, "false_alarms": count, "steps": steps, "peak": found["peaks"][world]})
        for (kind, world, fault_step), values in sorted(found["delays"].items()):
            named = [v for v in values if v is not None]
            median = statistics.median(named) if named else None
            cells.append(f"{kind} W{world} {len(values) - len(named)}/{len(values)}, {'-' if median is None else f'{median:g}'}")
            ablations.append({"ablation": name, "kind": kind, "world": world, "fault_step": fault_step, "delays": values})
        print(f"{name:<34} " + " | ".join(cells))

oracles = []
if args.oracle:
    # The bound as in --levels, at this config's level.
    arl0 = {world: steps / count if count else steps for world, (count, steps) in false_alarms_by_world(result).items()}
    print(f"\nbest CUSUM over the scores of the signal that fired, threshold with hindsight (level {config.alert_level:g})")
    # Watching M streams for the one that changed adds about ln(M) / I to the bound
    # (../shared/design-notes.md section 11): M is every rank's every part of the CUSUM that fired.
    print(f"{'fault kind':<10} {'W':>2} {'signal':<24} {'detector':>8} {'best CUSUM':>10} {'allowance':>9} {'cap':>5} {'d-prime':>7} {'bound':>6} {'detector / bound':>16} {'best / bound':>12} {'M':>4} {'bound + ln M / I':>16}")
    for entry in oracle(result["runs"]):
        group = (entry["kind"], entry["world"], entry["fault_step"])
        named = [v for v in result["delays"][group] if v is not None]
        separations = result["dprimes"][group]
        d = statistics.median(separations) if separations else None
        bound = math.log(arl0[entry["world"]]) / (d * d / 2) if d and arl0.get(entry["world"], 0) > 1 else None
        streams_bound = bound + math.log(entry["streams"]) / (d * d / 2) if bound is not None else None
        entry.update(detector=statistics.median(named) if named else None, dprime=d, bound=bound, streams_bound=streams_bound)
        oracles.append(entry)
        ratios = (entry["detector"] / bound if bound and entry["detector"] is not None else None, entry["median"] / bound if bound and math.isfinite(entry["median"]) else None)
        cells = ["-" if v is None else f"{v:.2f}" for v in (d, bound, *ratios, streams_bound)]
        print(
            f"{entry['kind']:<10} {entry['world']:>2} {' '.join(entry['key']):<24} {'-' if entry['detector'] is None else entry['detector']:>8} "
            f"{entry['median']:>10} {entry['drift']:>9g} {'-' if entry['cap'] is None else format(entry['cap'], 'g'):>5} {cells[0]:>7} {cells[1]:>6} {cells[2]:>16} {cells[3]:>12} "
            f"{entry['streams']:>4} {cells[4]:>16}"
        )

if args.json:
    payload = {"config": vars(config), "delays": rows, "healthy": healthy, "peaks": peaks, "levels": levels, "ablations": ablations, "oracle": oracles}
    Path(args.json).write_text(json.dumps(payload, indent=1))
