"""``ddphooks detect``: the offline detector over run files, as a user runs it."""

import dataclasses
import json
import math

import numpy as np
from test_cli import _user_errors_in_one_line  # noqa: F401  (the autouse fixture applies here too)

from ddphooks import cli
from ddphooks.detect import DetectorConfig

FAULT_STEP, FAULT_RANK, WORLD, STEPS = 30, 2, 4, 60
SKETCH_DIM = 256


def planted_records(world=WORLD, steps=STEPS, fault_rank=FAULT_RANK, fault_step=FAULT_STEP, seed=0, sketches=True):
    """Records of a healthy run with step-to-step noise, except that from ``fault_step`` on rank
    ``fault_rank`` has a loss 0.6 higher, a gradient norm 1.8x larger and a leave-one-out cosine
    near zero (from about 0.5): what a rank fed wrong labels looks like. ``fault_rank=None``: healthy."""
    rng = np.random.default_rng(seed)
    records = []
    for step in range(steps):
        trend = 2.5 * math.exp(-step / 40) + 1.0  # the loss falls, as in training
        losses = trend + 0.05 * rng.standard_normal(world)
        norms = np.exp(0.05 * rng.standard_normal(world)) * (1.0 + 0.5 * math.exp(-step / 20))
        loo = 0.5 + 0.04 * rng.standard_normal(world)
        if fault_rank is not None and step >= fault_step:
            losses[fault_rank] += 0.6
            norms[fault_rank] *= 1.8
            loo[fault_rank] = 0.02 * rng.standard_normal()
        record = {
            "step": step, "world_size": world, "sketch_dim": SKETCH_DIM, "cosine_noise": 1 / math.sqrt(SKETCH_DIM),
            "losses": losses.tolist(), "loss_mean": float(losses.mean()), "loss_std": float(losses.std()),
            "grad_norms": norms.tolist(), "grad_norm_mean": float(norms.mean()), "grad_norm_std": float(norms.std()),
            "cosine_to_others": (loo * 0.5).tolist(), "mean_cosine": float((loo * 0.5).mean()),
        }  # fmt: skip
        if sketches:
            record["cosine_loo"] = loo.tolist()
        records.append(record)
    return records


def write_run(path, records, header=None):
    lines = [json.dumps({"header": header or {"setting": "fault", "world_size": WORLD, "fault_step": FAULT_STEP}})]
    path.write_text("\n".join(lines + [json.dumps(r) for r in records]) + "\n")
    return path


def _detect(argv, capsys):
    """Exit status, stdout and stderr of ``ddphooks detect ARGV``, run in this process."""
    try:
        status = cli.main(["detect", *argv])
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _alert_rows(out: str) -> list[list[str]]:
    """The alert lines of the printed tables, split into columns (step, rank, kind, since, score, ...)."""
    return [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]


def test_detect_names_the_planted_rank_and_when_it_started(tmp_path, capsys):
    path = write_run(tmp_path / "run.jsonl", planted_records())
    status, out, err = _detect([str(path)], capsys)
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"{path}: fault x{WORLD}, {STEPS} steps, ") and "alert" in lines[0]
    assert lines[1].split() == ["step", "rank", "kind", "since", "score", "parameters", "message"]
    rows = _alert_rows(out)
    assert rows, out
    assert {int(row[1]) for row in rows} == {FAULT_RANK}  # the planted rank, and only it
    step, since = int(rows[0][0]), int(rows[0][3])
    assert FAULT_STEP <= step <= FAULT_STEP + 10 and FAULT_STEP - 2 <= since <= step  # soon after the fault, dated to it
    assert f"rank {FAULT_RANK}" in out.splitlines()[2]  # the message names it too
    assert lines[-1] == f"{len(rows)} alert{'s' * (len(rows) > 1)} in 1 run"


def test_detect_reports_each_run_and_the_total(tmp_path, capsys):
    healthy = write_run(tmp_path / "healthy.jsonl", planted_records(fault_rank=None, seed=1), {"setting": "sync", "world_size": WORLD})
    faulty = write_run(tmp_path / "faulty.jsonl", planted_records(seed=2))
    status, out, err = _detect([str(healthy), str(faulty)], capsys)
    assert status == 0 and err == ""
    assert f"{healthy}: sync x{WORLD}, {STEPS} steps, no alerts" in out
    rows = _alert_rows(out)
    assert rows and {int(row[1]) for row in rows} == {FAULT_RANK}
    assert out.splitlines()[-1] == f"{len(rows)} alert{'s' * (len(rows) > 1)} in 2 runs"


def test_set_reruns_the_detector_with_other_settings_and_bad_ones_are_one_line_errors(tmp_path, capsys):
    path = write_run(tmp_path / "run.jsonl", planted_records())
    assert _alert_rows(_detect([str(path)], capsys)[1])  # the defaults name the planted rank
    # Every CUSUM out of reach but cosine_previous's (no such key here) and the layer CUSUMs (no such fault here).
    status, out, err = _detect([str(path), "--set", "threshold=1e6", "--set", "level_threshold=1e6"], capsys)
    assert status == 0 and err == "" and _alert_rows(out) == []
    assert out.splitlines()[-1] == "0 alerts in 1 run (DetectorConfig with threshold=1e6, level_threshold=1e6)"
    for item, expected in (
        ("treshold=25", "--set 'treshold=25': expected NAME=VALUE with NAME one of window, warmup, threshold,"),
        ("warmup=1.5", "--set 'warmup=1.5': '1.5' is not a valid int (DetectorConfig.warmup)"),
        ("window=2", "DetectorConfig.window=2 must be >= 4"),
        ("threshold", "--set 'threshold': expected NAME=VALUE"),
    ):
        status, out, err = _detect([str(path), "--set", item], capsys)
        assert status == 2 and out == "" and err.startswith("ddphooks detect: error: ") and err.count("\n") == 1, (item, err)
        assert expected in err, (item, err)


def test_a_run_without_sketches_is_a_one_line_error(tmp_path, capsys):
    path = write_run(tmp_path / "run.jsonl", planted_records(sketches=False))
    status, out, err = _detect([str(path)], capsys)
    assert status == 2
    assert err.startswith(f"ddphooks detect: error: {path}: ") and err.count("\n") == 1, err
    assert "no sketches" in err and "Traceback" not in err
    assert out == ""  # nothing printed before the error


def test_a_missing_file_is_a_one_line_error(tmp_path, capsys):
    status, out, err = _detect([str(tmp_path / "missing.jsonl")], capsys)
    assert status == 2 and err == f"ddphooks detect: error: {tmp_path / 'missing.jsonl'}: No such file or directory\n"


def test_json_and_exit_code_serve_scripts_that_watch_many_runs(tmp_path, capsys):
    healthy = write_run(tmp_path / "healthy.jsonl", planted_records(fault_rank=None, seed=1), {"setting": "sync", "world_size": WORLD})
    faulty = write_run(tmp_path / "faulty.jsonl", planted_records(seed=2))
    report = tmp_path / "alerts.json"
    status, out, err = _detect([str(healthy), str(faulty), "--json", str(report), "--exit-code", "--set", "warmup=20"], capsys)
    assert status == 1 and err == ""  # an alert: status 1, as git diff --exit-code
    document = json.loads(report.read_text())
    assert document["detector"] == {**dataclasses.asdict(DetectorConfig()), "warmup": 20} and [run["path"] for run in document["runs"]] == [str(healthy), str(faulty)]
    assert document["runs"][0]["alerts"] == [] and document["runs"][0]["steps"] == STEPS and document["runs"][0]["name"] == f"sync x{WORLD}"
    rows = _alert_rows(out)
    assert [(a["step"], a["rank"], a["kind"]) for a in document["runs"][1]["alerts"]] == [(int(r[0]), int(r[1]), r[2]) for r in rows]
    assert document["alerts"] == len(rows) > 0
    assert _detect([str(healthy), "--exit-code"], capsys)[0] == 0  # no alert: status 0
    assert _detect([str(faulty)], capsys)[0] == 0  # without --exit-code, alerts are no failure
    status, out, err = _detect([str(faulty), "--json", str(tmp_path / "missing" / "alerts.json")], capsys)
    assert status == 2 and out == "" and err == f"ddphooks detect: error: --json {tmp_path / 'missing' / 'alerts.json'}: the folder {tmp_path / 'missing'} does not exist\n"
