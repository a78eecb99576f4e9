"""``ddphooks report`` as a user runs it: without matplotlib, and every mistake answered in one line."""

import json
import os
import subprocess
import sys

import pytest
from test_cli import _cli, _user_errors_in_one_line  # noqa: F401  (the autouse fixture applies here too)


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
    rows = json.loads((out / "summary.json").read_text())
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
    assert json.loads((tmp_path / "out" / "summary.json").read_text())[0]["n"] == 9  # steps 1..9; the truncated step is not read
    assert sorted(f.name for f in (tmp_path / "out").glob("*.png")) == ["cosine-sync-x2.png", "signals.png"]


def test_no_heatmaps_with_heatmaps_zero(tmp_path, capsys):
    status, err = _cli(["report", str(_write_run(tmp_path / "run.jsonl")), "-o", str(tmp_path / "out"), "--heatmaps", "0"], capsys)
    assert status == 0 and err == ""
    assert [f.name for f in (tmp_path / "out").glob("*.png")] == ["signals.png"]
