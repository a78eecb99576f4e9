"""Detection delay and false alarms of ddphooks.detect, measured offline on experiment run files.

The detector is fed each run's records in order (``detect_run``), exactly as it runs inside
training. For fault runs (header ``fault_kind``), the delay is the number of instrumented steps
from the fault step to the first alert that names the faulty rank; an alert before the fault, or
one naming another rank, counts as a false alarm. Healthy runs (every other setting) must raise
none. The runs come from ``ddphooks experiment`` (commands in benchmarks/README.md):

    python benchmarks/detection.py runs/healthy runs/faults            # folders searched for run-*.jsonl
    python benchmarks/detection.py runs/faults --json detection.json
    python benchmarks/detection.py runs/heldout --set recent=32            # another DetectorConfig
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from ddphooks.detect import DetectorConfig, detect_run
from ddphooks.experiment.report import read_run

HEALTHY_POOL = ("sync", "desync-shuffle", "desync-all", "group-sync")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("folders", nargs="+", help="folders searched (recursively) for run-*.jsonl files")
parser.add_argument("--json", default=None, help="also write the results to this file")
parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override one DetectorConfig field (repeatable), e.g. --set recent=32")
args = parser.parse_args()
try:
    config = DetectorConfig.from_overrides(args.set)
except ValueError as error:
    parser.error(str(error))

delays = defaultdict(list)  # (kind, W, fault step) -> delays (None: missed)
false_alarms = defaultdict(lambda: [0, 0])  # (setting, W) -> [alerts, steps]
wrong = defaultdict(int)
for path in sorted(p for folder in args.folders for p in Path(folder).rglob("run-*.jsonl")):
    run = read_run(path)
    world = run.header.get("world_size") or run.records[0]["world_size"]
    alerts = detect_run(run.records, config)
    kind = run.header.get("fault_kind") if run.header.get("setting") == "fault" else None
    if kind is None:
        false_alarms[(run.header.get("setting", "?"), world)][0] += len(alerts)
        false_alarms[(run.header.get("setting", "?"), world)][1] += len(run.records)
        continue
    fault_step, fault_rank = run.fault_step, run.header.get("config", {}).get("fault_rank")
    named = [a["step"] - fault_step for a in alerts if a["step"] >= fault_step and a["rank"] == fault_rank]
    delays[(kind, world, fault_step)].append(min(named) if named else None)
    early = [a for a in alerts if a["step"] < fault_step]
    false_alarms[("fault, before the fault", world)][0] += len(early)
    false_alarms[("fault, before the fault", world)][1] += sum(1 for r in run.records if r["step"] < fault_step)
    wrong[(kind, world, fault_step)] += sum(1 for a in alerts if a["step"] >= fault_step and a["rank"] != fault_rank)

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
pooled = defaultdict(lambda: [0, 0])
for (setting, world), (count, steps) in sorted(false_alarms.items()):
    healthy.append({"setting": setting, "world": world, "steps": steps, "alerts": count})
    if setting in HEALTHY_POOL:
        pooled[world][0] += count
        pooled[world][1] += steps
    print(f"{setting:<24} {world:>2} {steps:>6} {count:>6} {1000 * count / max(steps, 1):>14.2f}")
for world, (count, steps) in sorted(pooled.items()):
    print(f"{'pooled (' + ', '.join(HEALTHY_POOL) + ')':<24} {world:>2} {steps:>6} {count:>6} {1000 * count / max(steps, 1):>14.2f}")

if args.json:
    Path(args.json).write_text(json.dumps({"config": vars(config), "delays": rows, "healthy": healthy}, indent=1))
