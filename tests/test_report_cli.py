"""``ddphooks report`` as a user runs it: without matplotlib, every mistake answered in one line, the
alerts, and the statistics over seeds."""

import json
import math
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest
from test_cli import _cli, _user_errors_in_one_line  # noqa: F401  (the autouse fixture applies here too)
from test_detect_cli import FAULT_RANK, WORLD, planted_records, write_run

from ddphooks.detect import detect_run
from ddphooks.experiment import report
from ddphooks.experiment.report import read_run
from ddphooks.identity import RankIdentity, RankTable


LOSSES = [3.0, 2.6, 2.4, 2.1, 2.0, 1.8, 1.9, 1.7, 1.6, 1.5]


def _write_run(path):
    """A two-rank run of ten steps: a header, then one record per step, as ddphooks experiment writes."""
    lines = [json.dumps({"header": {"setting": "sync", "world_size": 2}})]
    for step, loss in enumerate(LOSSES):
        record = {"step": step, "world_size": 2, "loss_mean": loss, "losses": [loss - 0.1, loss + 0.1], "loss_std": 0.1}
        lines.append(json.dumps({**record, "grad_norms": [1.0, 1.0], "grad_norm_mean": 1.0, "cosine": [[1.0, 0.5], [0.5, 1.0]]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_report_without_matplotlib_writes_the_summaries_and_names_the_plot_extra(tmp_path):
    stub = tmp_path / "stub" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    path, out = _write_run(tmp_path / "run.jsonl"), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "ddphooks", "report", str(path), "-o", str(out), "--skip", "0.2"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    [message] = result.stderr.splitlines()
    assert message.startswith("ddphooks report: warning: figures skipped: matplotlib could not be imported"), message
    assert "pip install 'ddphooks[plot]'" in message and "summary.md and summary.json are written" in message
    rows = json.loads((out / "summary.json").read_text())["runs"]
    # --skip 0.2 of 10 steps leaves steps 2..9 in the means.
    assert rows[0]["n"] == 8 and rows[0]["loss_mean"] == pytest.approx(sum(LOSSES[2:]) / 8)
    assert "Skipped: matplotlib could not be imported" in (out / "summary.md").read_text()
    assert not list(out.glob("*.png"))


BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe"
ERRORS = {
    "missing file": (None, [], "missing.jsonl: No such file or directory"),
    "binary file": (BINARY, [], "not UTF-8 text (invalid start byte at byte 0); a run file is JSON lines"),
    "JSON that is not a run": ('{"model": "tiny", "lr": 0.001}\n', [], "run.jsonl:1: expected a step record (an object with an integer 'step')"),
    "malformed line": ('{"step": 0}\n{broken\n{"step": 2}\n', [], "run.jsonl:2: not valid JSON"),
    "a folder": ("folder", [], "run.jsonl: Is a directory"),
    "not a number": ("run", ["--skip", "x"], "argument --skip: invalid float value: 'x' (see ddphooks report --help)"),
    "skip out of range": ("run", ["--skip", "1.5"], "--skip 1.5 must be in [0, 1)"),
    "window of zero": ("run", ["--window", "0"], "--window 0 must be >= 1"),
    "negative heatmaps": ("run", ["--heatmaps", "-1"], "--heatmaps -1 must be >= 0"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_report_errors_are_one_line_without_a_traceback(tmp_path, capsys, case):
    content, flags, expected = ERRORS[case]
    path = tmp_path / ("missing.jsonl" if content is None else "run.jsonl")
    if content == "run":
        _write_run(path)
    elif content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    status, err = _cli(["report", str(path), "-o", str(tmp_path / "out"), *flags], capsys)
    assert status == 2
    assert err.startswith("ddphooks report: error: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_a_missing_run_file_is_one_line_from_the_installed_command(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ddphooks", "report", "missing.jsonl", "-o", "out"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr == "ddphooks report: error: missing.jsonl: No such file or directory\n"
    assert not (tmp_path / "out").exists()


def test_a_truncated_last_line_is_a_one_line_warning(tmp_path, capsys):
    path = _write_run(tmp_path / "run.jsonl")
    path.write_text(path.read_text() + '{"step": 10, "loss_me')
    status, err = _cli(["report", str(path), "-o", str(tmp_path / "out")], capsys)
    assert status == 0
    assert err == f"ddphooks report: warning: {path}:12: skipping a truncated last line (the run was probably interrupted)\n"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["runs"][0]["n"] == 9  # steps 1..9; the truncated step is not read
    assert sorted(f.name for f in (tmp_path / "out").glob("*.png")) == ["cosine-sync-x2.png", "signals.png"]


def test_no_heatmaps_with_heatmaps_zero(tmp_path, capsys):
    status, err = _cli(["report", str(_write_run(tmp_path / "run.jsonl")), "-o", str(tmp_path / "out"), "--heatmaps", "0"], capsys)
    assert status == 0 and err == ""
    assert [f.name for f in (tmp_path / "out").glob("*.png")] == ["signals.png"]


# -- alerts --------------------------------------------------------------------------------------
def _signals_figure(monkeypatch, run):
    """Run ``run()`` with pyplot.close recording the figures it closes; return the first (signals.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    closed, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda figure=None: (closed.append(figure), close(figure)))
    run()
    return closed[0]


def _markers(figure):
    """x positions of the alert triangles on the mean-cosine panel (the last one)."""
    axis = figure.axes[len(report.SIGNALS) - 1]
    return sorted(float(x) for collection in axis.collections for x, _ in collection.get_offsets())


def test_report_lists_and_marks_the_alerts_the_records_carry(tmp_path, monkeypatch, capsys):
    records = planted_records(world=2, steps=20)
    raised = {"rank": 1, "kind": "loss", "since": 9, "score": 31.5, "signals": ["loss (own)"], "parameters": ["w"], "message": "rank 1 has diverged"}
    for record in records:
        record["alerts"] = [dict(raised, step=record["step"])] if record["step"] in (12, 17) else []
    path = write_run(tmp_path / "run.jsonl", records, {"setting": "fault", "world_size": 2, "fault_step": 9})
    figure = _signals_figure(monkeypatch, lambda: report.write_report([str(path)], tmp_path / "out"))
    assert _markers(figure) == [12.0, 17.0]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "- fault x2: 2 alerts, recorded during training" in summary
    assert "| fault x2 | 12 | 1 | - | - | - | loss | rank 1 has diverged |" in summary and "| fault x2 | 17 | 1 | - | - | - | loss |" in summary
    [entry] = json.loads((tmp_path / "out" / "summary.json").read_text())["alerts"]
    assert entry["source"] == "recorded during training" and [a["step"] for a in entry["alerts"]] == [12, 17]
    # --alerts offline: the detector of this version instead of the records' own alerts.
    expected = detect_run(records)
    assert _cli(["report", str(path), "-o", str(tmp_path / "again"), "--alerts", "offline", "--heatmaps", "0"], capsys)[0] == 0
    [entry] = json.loads((tmp_path / "again" / "summary.json").read_text())["alerts"]
    assert entry["source"] == "detected offline" and [a["step"] for a in entry["alerts"]] == [a["step"] for a in expected] != [12, 17]


def test_report_detects_alerts_offline_when_the_records_have_none(tmp_path, monkeypatch):
    path = write_run(tmp_path / "run.jsonl", planted_records())  # cosine_loo, no 'alerts' key
    old = write_run(tmp_path / "old.jsonl", planted_records(sketches=False), {"setting": "sync", "world_size": WORLD})
    expected = detect_run(read_run(path).records)
    assert expected and {a["rank"] for a in expected} == {FAULT_RANK}
    figure = _signals_figure(monkeypatch, lambda: report.write_report([str(path), str(old)], tmp_path / "out"))
    assert _markers(figure) == sorted(float(a["step"]) for a in expected)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"- fault x{WORLD}: {len(expected)} alert{'s' * (len(expected) > 1)}, detected offline" in summary
    assert f"| fault x{WORLD} | {expected[0]['step']} | {FAULT_RANK} | - | - | - | {expected[0]['kind']} |" in summary
    assert f"- sync x{WORLD}: 0 alerts, not available (the run's records have no sketches" in summary


def test_report_names_the_host_and_device_of_each_rank_and_of_each_alert(tmp_path, monkeypatch):
    records = planted_records()
    identity = [
        {"global_rank": 4 + r, "group_rank": r, "host": f"node-{r // 2}", "local_rank": r % 2, "pid": 100 + r, "device": f"cuda:{r % 2}",
         "device_uuid": f"GPU-{r}", "pci_bus_id": None}
        for r in range(WORLD)
    ]
    table = RankTable([RankIdentity.from_dict(row) for row in identity], subgroup=True)
    records[0]["identity"] = table.to_record()  # the first record carries the table, as a run's does
    path = write_run(tmp_path / "run.jsonl", records)
    expected = detect_run(read_run(path).records)
    assert expected and expected[0]["host"] == f"node-{FAULT_RANK // 2}" and expected[0]["global_rank"] == 4 + FAULT_RANK
    _signals_figure(monkeypatch, lambda: report.write_report([str(path)], tmp_path / "out"))
    summary = (tmp_path / "out" / "summary.md").read_text()
    first = expected[0]
    assert (
        f"| fault x{WORLD} | {first['step']} | {FAULT_RANK} | {4 + FAULT_RANK} | node-{FAULT_RANK // 2} | cuda:{FAULT_RANK % 2} | {first['kind']} | "
        f"global rank {4 + FAULT_RANK} (rank {FAULT_RANK} of its group) on node-{FAULT_RANK // 2}, cuda:{FAULT_RANK % 2} (GPU-{FAULT_RANK}): "
        f"check "
    ) in summary
    assert f"fault x{WORLD}: {WORLD} ranks on {len({r['host'] for r in identity})} host(s)" in summary
    assert "| 1 | 5 | node-0 | 1 | 101 | cuda:1 | GPU-1 |" in summary


# -- over seeds ----------------------------------------------------------------------------------


def _t_closed_form(p, df):
    """Student t quantiles in closed form (Hill 1970, Shaw 2006): independent of report.t_quantile."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    alpha = 4 * p * (1 - p)  # df == 4
    return math.copysign(2 * math.sqrt(math.cos(math.acos(math.sqrt(alpha)) / 3) / math.sqrt(alpha) - 1), p - 0.5)


T_975 = {df: _t_closed_form(0.975, df) for df in (2, 4)}  # 4.3027, 2.7764 as in the tables
T_80 = {df: _t_closed_form(0.8, df) for df in (2, 4)}  # 1.0607, 0.9410
SEED_MEANS = {  # per setting: loss_std and mean_cosine run means of seeds 0, 1, 2
    "sync": {"loss_std": [0.20, 0.23, 0.26], "mean_cosine": [0.30, 0.31, 0.32]},
    "desync-shuffle": {"loss_std": [0.25, 0.28, 0.31], "mean_cosine": [0.10, 0.20, 0.36]},
}


def _seed_runs(tmp_path):
    """3 seeds x 2 settings of 12 steps each; per step the signal is the run's mean plus zero-sum
    noise, so each run's mean is its SEED_MEANS entry (up to rounding)."""
    paths, noise = [], np.array([0.03, -0.01, 0.02, -0.04, 0.0, 0.01, -0.02, 0.03, -0.01, 0.0, -0.02, 0.01])
    for setting, means in SEED_MEANS.items():
        for seed in range(3):
            header = {"setting": setting, "world_size": 2, "config": {"seed": seed, "model": "embedded", "lr": 0.003, "out": f"runs/{seed}"}}
            records = [
                {"step": step, "world_size": 2, "loss_std": means["loss_std"][seed] + noise[step], "mean_cosine": means["mean_cosine"][seed] - noise[step]}
                for step in range(len(noise))
            ]
            paths.append(write_run(tmp_path / f"run-{setting}-w2-s{seed}.jsonl", records, header))
    return paths


def test_report_over_seeds_gives_intervals_and_the_minimum_detectable_effect(tmp_path):
    report.write_report([str(p) for p in _seed_runs(tmp_path)], tmp_path / "out", skip=0.0, heatmaps=0)
    document = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["run"] for r in document["runs"]][:3] == ["sync x2 seed 0", "sync x2 seed 1", "sync x2 seed 2"]
    groups = {g["setting"]: g for g in document["seeds"]}
    assert set(groups) == {"sync", "desync-shuffle"} and groups["sync"]["seeds"] == [0, 1, 2] and groups["sync"]["differs"] == []
    for setting, means in SEED_MEANS.items():
        for key, values in means.items():
            entry = groups[setting]["signals"][key]
            half = T_975[2] * statistics.stdev(values) / math.sqrt(3)
            assert entry["n"] == 3 and entry["mean"] == pytest.approx(statistics.mean(values), abs=1e-12)
            assert entry["half_width"] == pytest.approx(half, rel=1e-9)
            assert entry["ci_low"] == pytest.approx(statistics.mean(values) - half, rel=1e-9)
    [comparison] = document["comparisons"]
    assert (comparison["setting"], comparison["baseline"], comparison["world_size"]) == ("desync-shuffle", "sync", 2)
    # loss_std: equal seed-to-seed variances, so Welch's df is exactly 2 (n - 1) + 2 = 4.
    entry = comparison["signals"]["loss_std"]
    a, b = np.array(SEED_MEANS["desync-shuffle"]["loss_std"]), np.array(SEED_MEANS["sync"]["loss_std"])
    se = math.sqrt(a.var(ddof=1) / 3 + b.var(ddof=1) / 3)
    assert entry["difference"] == pytest.approx(0.05, abs=1e-12) and entry["df"] == pytest.approx(4.0, rel=1e-9)
    assert entry["mde"] == pytest.approx((T_975[4] + T_80[4]) * se, rel=1e-9)
    assert entry["ci_high"] == pytest.approx(0.05 + T_975[4] * se, rel=1e-9)
    # mean_cosine: unequal variances, Welch-Satterthwaite df between 2 and 4; the MDE's t factors with it.
    entry = comparison["signals"]["mean_cosine"]
    a, b = np.array(SEED_MEANS["desync-shuffle"]["mean_cosine"]), np.array(SEED_MEANS["sync"]["mean_cosine"])
    va, vb = a.var(ddof=1) / 3, b.var(ddof=1) / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    assert entry["se"] == pytest.approx(math.sqrt(va + vb), rel=1e-9) and entry["df"] == pytest.approx(df, rel=1e-9)
    assert 2 < df < 3 and T_975[4] + T_80[4] < entry["mde"] / entry["se"] < T_975[2] + T_80[2]
    assert entry["p_value"] > 0.05 and abs(entry["difference"]) < entry["mde"]  # a measured "no effect larger than the MDE"
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "### sync x2, all (seeds 0, 1, 2)" in summary and "#### desync-shuffle - sync, x2 (3 and 3 seeds)" in summary
    low, high = 0.23 - T_975[2] * 0.03 / math.sqrt(3), 0.23 + T_975[2] * 0.03 / math.sqrt(3)
    assert f"| loss_std | 3 | 0.2300 | [{low:.4f}, {high:.4f}] | 0.0300 |" in summary
    assert f"| loss_std | 0.0500 | [{0.05 - T_975[4] * se:.4f}, {0.05 + T_975[4] * se:.4f}] |" in summary


def test_one_seed_per_setting_has_no_seed_section_and_one_seed_is_n_a(tmp_path):
    paths = _seed_runs(tmp_path)
    report.write_report([str(paths[0]), str(paths[3])], tmp_path / "single", skip=0.0, heatmaps=0)
    assert "## Over seeds" not in (tmp_path / "single" / "summary.md").read_text()
    assert json.loads((tmp_path / "single" / "summary.json").read_text())["seeds"] == []
    report.write_report([str(p) for p in paths[:4]], tmp_path / "mixed", skip=0.0, heatmaps=0)  # 3 sync seeds, 1 desync-shuffle
    document = json.loads((tmp_path / "mixed" / "summary.json").read_text())
    single = next(g for g in document["seeds"] if g["setting"] == "desync-shuffle")["signals"]["loss_std"]
    assert single["n"] == 1 and single["ci_low"] is None and single["sd"] is None  # strict JSON: null, not NaN
    assert document["comparisons"][0]["signals"]["loss_std"]["mde"] is None
    assert "| loss_std | 1 | 0.2500 | n/a | n/a |" in (tmp_path / "mixed" / "summary.md").read_text()


def test_t_quantiles_match_the_tables():
    for df, value in T_975.items():
        assert report.t_quantile(0.975, df) == pytest.approx(value, rel=1e-9)
        assert report.t_quantile(0.025, df) == pytest.approx(-value, rel=1e-9)
    for df, value in T_80.items():
        assert report.t_quantile(0.8, df) == pytest.approx(value, rel=1e-9)
    assert report.t_quantile(0.975, 1) == pytest.approx(_t_closed_form(0.975, 1), rel=1e-9) == pytest.approx(12.7062, abs=1e-4)
    assert (round(T_975[2], 4), round(T_975[4], 4), round(T_80[2], 4), round(T_80[4], 4)) == (4.3027, 2.7764, 1.0607, 0.9410)  # printed tables
    assert report.t_quantile(0.975, 1e6) == pytest.approx(statistics.NormalDist().inv_cdf(0.975), rel=1e-5)


def test_the_report_opens_with_which_runs_were_healthy_and_when_the_fault_was_named(tmp_path):
    records = planted_records(world=2, steps=20)
    named = {"rank": 1, "kind": "layer", "since": 9, "score": 31.5, "signals": ["layer"], "parameters": ["w", "b"], "message": "rank 1 ..."}
    other = dict(named, rank=0, parameters=[])
    for record in records:
        record["alerts"] = {11: [dict(other, step=11)], 12: [dict(named, step=12)], 17: [dict(named, step=17)]}.get(record["step"], [])
    header = {"setting": "fault", "fault_kind": "sdc", "world_size": 2, "fault_step": 9, "fault_rank": 1, "fault_parameter": "w"}
    fault = write_run(tmp_path / "run-fault-sdc.jsonl", records, header)
    quiet = [dict(r, alerts=[]) for r in planted_records(world=2, steps=20)]
    healthy = write_run(tmp_path / "run-sync.jsonl", quiet, {"setting": "sync", "world_size": 2})
    noisy = write_run(tmp_path / "run-group-sync.jsonl", [dict(r, alerts=[dict(other, step=r["step"])] if r["step"] == 5 else []) for r in quiet], {"setting": "group-sync", "world_size": 2})
    missed = write_run(tmp_path / "run-fault.jsonl", quiet, dict(header, fault_kind="labels", fault_parameter=None))
    summary = report.write_report([str(p) for p in (healthy, noisy, fault, missed)], tmp_path / "out", heatmaps=0)
    text = summary.read_text()
    # The first screen: right under the title, before any table of means.
    assert text.index("## At a glance") < text.index("## Signals") < text.index("## Per rank")
    assert "| sync x2 | none (healthy) | 0 | healthy: no alert | - | - |" in text
    assert "| group-sync x2 | none (healthy) | 1 | healthy: 1 false alarm | - | - |" in text
    # The rank-0 alert at step 11 does not count: the first naming rank 1 is step 12, 3 steps after the fault.
    assert "| fault-sdc x2 | sdc on rank 1 from step 9 | 3 | named rank 1 after 3 steps | step 12 (layer) | w (w) |" in text
    # A miss says whether any detector could have named it; 20 steps are fewer than the detector's warm-up.
    assert "| fault x2 | labels on rank 1 from step 9 | 0 | not named (too few steps to measure what the records could tell) | - | - |" in text
    glance = json.loads((tmp_path / "out" / "summary.json").read_text())["glance"]
    assert [(g["run"], g["delay"]) for g in glance] == [("sync x2", None), ("group-sync x2", None), ("fault-sdc x2", 3), ("fault x2", None)]


def test_a_fault_run_gets_a_figure_of_the_parameter_its_first_alert_named(tmp_path):
    pytest.importorskip("matplotlib")
    records = planted_records(world=2, steps=20)
    for record in records:
        hit = 4.0 if record["step"] >= 9 else 1.0  # rank 1's weight from step 9
        record["parameters"] = [{"name": "w", "grad_norms": [1.0, hit]}, {"name": "b", "grad_norms": [0.5, 0.5]}]
        record["alerts"] = [{"rank": 1, "kind": "layer", "since": 9, "score": 25.0, "parameters": ["w"], "message": "rank 1 ..."}] if record["step"] == 11 else []
    fault = write_run(tmp_path / "run-fault.jsonl", records, {"setting": "fault", "world_size": 2, "fault_step": 9, "fault_rank": 1})
    healthy = write_run(tmp_path / "run-sync.jsonl", [dict(r, alerts=[]) for r in records], {"setting": "sync", "world_size": 2})
    summary = report.write_report([str(healthy), str(fault)], tmp_path / "out", heatmaps=0)
    assert (tmp_path / "out" / "alert-fault-x2.png").stat().st_size > 0
    assert not list((tmp_path / "out").glob("alert-sync*"))  # no alert, no figure
    assert "![alert-fault-x2](alert-fault-x2.png)" in summary.read_text()
