"""Small forms of the workload zoo (benchmarks/workloads.py): every family trains a few steps at
W = 2 with ddphooks attached, once healthy and once with one fault on rank 1 from step 3.

The two runs are twins (same seed, same data, same dropout streams): before the fault every rank's
statistics are bitwise identical, and on the first step the fault can show (the fault step; the
next one for a stuck loader, which repeats the fault step's own batch) rank 0's local loss and
gradient norm are still identical while rank 1's differ: the fault changes the faulty rank's local
statistics, before DDP's allreduce, and nothing else.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "workloads.py"
#: One fault per family, every fault kind at least once (the three gradient scales by one of them).
PAIRS = {
    "cnn": "eval", "gpt2": "bitflip", "bert": "labels", "lora": "stale",
    "bf16": "precision", "moe": "stuck", "heavy": "labels", "mixture": "scale1.5", "nanogpt": "stuck",
}  # fmt: skip
STEPS, FAULT_STEP = 6, 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "check.json"
    command = [sys.executable, "-W", "ignore", str(SCRIPT), "--check", *(f"{f}:{k}" for f, k in PAIRS.items())]
    command += ["--check-steps", str(STEPS), "--check-fault-step", str(FAULT_STEP), "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    return {row["family"]: (healthy, row) for healthy, row in zip(rows[0::2], rows[1::2])}


@pytest.mark.parametrize("family", list(PAIRS))
def test_fault_changes_only_the_faulty_rank(runs, family):
    healthy, faulty = runs[family]
    assert healthy["kind"] is None and faulty["kind"] == PAIRS[family] and faulty["fault_rank"] == 1
    h, f = healthy["latest"], faulty["latest"]
    assert len(h) == len(f) == STEPS
    for step in range(STEPS):  # training ran with the hook: every rank's loss and gradient norm measured
        assert all(math.isfinite(v) for v in h[step]["losses"]) and all(v > 0 for v in h[step]["grad_norms"])
    assert h[:FAULT_STEP] == f[:FAULT_STEP], "twin runs differ before the fault"
    shows = FAULT_STEP + 1 if PAIRS[family] == "stuck" else FAULT_STEP
    assert f[shows]["losses"][0] == h[shows]["losses"][0] and f[shows]["grad_norms"][0] == h[shows]["grad_norms"][0]
    changed = (f[shows]["losses"][1] != h[shows]["losses"][1], f[shows]["grad_norms"][1] != h[shows]["grad_norms"][1])
    assert any(changed), f"{family}: the {PAIRS[family]} fault left rank 1's local statistics unchanged"
    if PAIRS[family] == "bitflip" or PAIRS[family].startswith("scale"):  # the gradient, after the forward: the loss as in the twin, the norm not
        assert changed == (False, True)
    if PAIRS[family].startswith("scale"):  # every local gradient times the factor: the norm too
        factor = float(PAIRS[family].removeprefix("scale"))
        assert f[shows]["grad_norms"][1] == pytest.approx(factor * h[shows]["grad_norms"][1], rel=1e-5)
    if PAIRS[family] in ("labels", "eval", "stale"):  # the forward itself differs on that rank
        assert changed[0]


def test_redetect_tables_come_from_the_run_files_with_this_detector(tmp_path):
    # A finished campaign measured again offline (--summarize --redetect): each row's alerts are
    # those of detect_run on its run file, with --set fields applied; a missing file is an error.
    sys.path.insert(0, str(Path(__file__).parent))
    from test_detect import _stream

    from ddphooks.detect import detect_run

    records = _stream(4, 120, seed=0, fault_rank=2, fault_step=60)
    (tmp_path / "files").mkdir()
    lines = [json.dumps({"header": {"setting": "fault"}})] + [json.dumps(record) for record in records]
    (tmp_path / "files" / "run-heavy-labels-w4-s1.jsonl").write_text("\n".join(lines) + "\n")
    row = {"family": "heavy", "world": 4, "seed": 1, "kind": "labels", "steps": 120, "fault_step": 60, "fault_rank": 2,
           "name": "heavy-labels-w4-s1", "alerts": [], "healthy_steps": 60}  # fmt: skip
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    command = [sys.executable, "-W", "ignore", str(SCRIPT), "--summarize", str(tmp_path / "results.jsonl"), "--redetect", "--json", str(tmp_path / "t.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    first = detect_run(records)[0]
    delays = json.loads((tmp_path / "t.json").read_text())["delays"]
    assert [(d["kind"], d["family"], d["named"], d["median"]) for d in delays if d["family"] == "heavy"] == [("labels", "heavy", 1, first["step"] - 60)]
    # Another detector setting gives its own alerts: none at an alert level nothing reaches.
    result = subprocess.run(command + ["--set", "alert_level=1000"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and json.loads((tmp_path / "t.json").read_text())["delays"][0]["named"] == 0, result.stderr[-3000:]
    (tmp_path / "files" / "run-heavy-labels-w4-s1.jsonl").unlink()
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "run-heavy-labels-w4-s1.jsonl is missing" in result.stderr, result.stderr[-3000:]


def test_redetect_peaks_are_each_cusums_highest_healthy_level(tmp_path):
    # --peaks: per CUSUM, the highest level on the healthy runs over its alert level. Checked for
    # the W = 2 persistence CUSUM against its recursion written out here, fed the layer scores.
    sys.path.insert(0, str(Path(__file__).parent))
    from test_detect import _stream

    from ddphooks.detect import Detector, DetectorConfig, Observation

    records = _stream(2, 160, seed=3)
    for record in records[100:116]:  # a moderate rise of one layer for 16 steps
        record["parameters"][3]["grad_norms"][1] *= 1.45
    (tmp_path / "files").mkdir()
    lines = [json.dumps({"header": {"setting": "sync"}})] + [json.dumps(record) for record in records]
    (tmp_path / "files" / "run-heavy-healthy-w2-s1.jsonl").write_text("\n".join(lines) + "\n")
    row = {"family": "heavy", "world": 2, "seed": 1, "kind": None, "steps": 160, "fault_step": None, "fault_rank": None,
           "name": "heavy-healthy-w2-s1", "alerts": [], "healthy_steps": 160}  # fmt: skip
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    command = [sys.executable, "-W", "ignore", str(SCRIPT), "--summarize", str(tmp_path / "results.jsonl"), "--redetect", "--peaks", "--json", str(tmp_path / "t.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    peaks = json.loads((tmp_path / "t.json").read_text())["peaks"]
    config, detector = DetectorConfig(), Detector(keep_scores=True)
    levels, highest = {}, 0.0
    for record in records:
        detector.update(Observation.from_record(record))
        for (rank, parameter), z in np.ndenumerate(detector.step_scores.get(("own", "layer"), np.zeros((0, 0)))):
            raised = z > config.pair_persistence_score
            levels[rank, parameter] = max(0.0, levels.get((rank, parameter), 0.0) + (1.0 if raised else -config.pair_persistence_drift))
            highest = max(highest, levels[rank, parameter])
    limit = config.pair_persistence_threshold * config.alert_level
    assert 10 < highest < limit
    assert peaks["persistent/layer"] == [pytest.approx(highest / limit, rel=1e-9), "heavy-healthy-w2-s1"]
    assert set(peaks) >= {"own/layer", "own/loss", "cross/cosine_previous", "level/grad_norm"}


def test_norm_gap_dprime_against_the_plain_computation():
    # Rank 1's gradient norm times 1.5 from step 150 at W = 3; d' by hand: the gaps of its log norm
    # to the median of the others', after minus before over the spread before.
    sys.path.insert(0, str(SCRIPT.parent))
    from workloads import DPRIME_AFTER, DPRIME_BEFORE, norm_gap_dprime

    rng = __import__("numpy").random.default_rng(0)
    records = []
    for step in range(200):
        norms = [float(math.exp(0.1 * rng.standard_normal())) for _ in range(3)]
        if step >= 150:
            norms[1] *= 1.5
        records.append({"step": step, "grad_norms": norms})
    gaps = {r["step"]: math.log(r["grad_norms"][1]) - sorted([math.log(r["grad_norms"][0]), math.log(r["grad_norms"][2])])[0] * 0.5
            - sorted([math.log(r["grad_norms"][0]), math.log(r["grad_norms"][2])])[1] * 0.5 for r in records}  # fmt: skip
    before = [gaps[s] for s in range(150 - DPRIME_BEFORE, 150)]
    after = [gaps[s] for s in range(150, 150 + DPRIME_AFTER)]
    mean_before = sum(before) / len(before)
    spread = math.sqrt(sum((g - mean_before) ** 2 for g in before) / len(before))
    expected = (sum(after) / len(after) - mean_before) / spread
    assert norm_gap_dprime(records, 150, 1) == pytest.approx(expected, rel=1e-9)
    assert expected > 2  # log 1.5 = 0.41 against a spread of about 0.1 * sqrt(1.5)


def test_more_runs_than_fixed_seeds_is_a_one_line_error():
    # Fault run r of kind k uses seed FAULT_SEEDS[r] + 10 k: past the fixed seeds a run would repeat another's.
    for option, fixed in (("--healthy-runs", 70), ("--fault-runs", 20)):
        result = subprocess.run([sys.executable, str(SCRIPT), option, str(fixed + 1)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and f"{option} {fixed + 1}: at most {fixed}" in result.stderr, result.stderr


def test_every_run_of_a_campaign_has_its_own_seed():
    # Every (family, W) cell: no two runs share a seed, across kinds and repetitions, so every
    # pre-fault step is a distinct healthy step.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import workloads
    finally:
        sys.path.remove(str(SCRIPT.parent))
    specs = workloads.plan([2], len(workloads.HEALTHY_SEEDS), len(workloads.FAULT_SEEDS))
    for family in workloads.FAMILIES:
        seeds = [spec.seed for spec in specs if spec.family == family]
        assert len(seeds) == len(set(seeds)) == 70 + 20 * len(workloads.fault_kinds(family)), family  # 70 healthy seeds, 20 a fault kind
