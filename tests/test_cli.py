"""The command line, run as a user runs it."""

import json
import re
import subprocess
import sys

import pytest

from ddphooks import cli, demo
from ddphooks.experiment import report


def test_demo_shows_the_fault_in_the_statistics_and_the_detector_names_the_rank(tmp_path):
    jsonl = tmp_path / "demo.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "ddphooks", "demo", "--steps", "36", "--fault-step", "28", "--jsonl", str(jsonl)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "rank 1 gets corrupted labels from here on" in result.stdout
    records = [json.loads(line) for line in jsonl.read_text().splitlines()[1:]]
    assert [r["step"] for r in records] == list(range(36))
    before = [r["loss_std"] for r in records[:28]]
    after = [r["loss_std"] for r in records[28:]]
    assert min(after) > 5 * max(before), (before, after)
    alerts = re.findall(r"^  step (\d+): global rank \d+ on [^:]+: check [^:]+ first: rank (\d+) has diverged since step (\d+)", result.stdout, re.MULTILINE)
    assert alerts and alerts[0][1] == "1" and 28 <= int(alerts[0][0]) <= 31 and int(alerts[0][2]) >= 27, result.stdout
    assert "<- alert: rank 1 (" in result.stdout
    assert "ddphooks alert: global rank 1 on " in result.stderr and " first: rank 1 has diverged" in result.stderr  # logged by the log rank as it came


def test_demo_says_when_the_fault_is_inside_the_detectors_warm_up():
    assert demo.warmup_note(2) == (
        "(the detector learns each signal's baseline over the first 24 steps and raises no alert before: a fault at step 2 is in its baseline)"
    )
    assert demo.warmup_note(24) is None


def test_demo_rejects_a_single_process_in_one_line():
    result = subprocess.run([sys.executable, "-m", "ddphooks", "demo", "--nproc", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "ddphooks demo: error: --nproc 1: the demo needs at least 2 processes to compare ranks\n"


@pytest.fixture(autouse=True)
def _user_errors_in_one_line(monkeypatch):
    monkeypatch.delenv(cli.DEBUG_VARIABLE, raising=False)  # set in the caller's shell, it would re-raise them


def _cli(argv, capsys):
    """Exit status and stderr of ``ddphooks ARGV``, run in this process as ``sys.exit(main())`` would."""
    try:
        status = cli.main(argv)
    except SystemExit as exit_:
        status = exit_.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--setting", "nonsense"], "--setting 'nonsense' is not one of sync, desync-shuffle"),
        (["--setting", "sync,fualt"], "--setting 'fualt' is not one of sync"),
        (["--nproc", "1"], "--nproc 1: comparing ranks needs at least 2 processes"),
        (["--fault-rank", "5"], "--fault-rank 5 is not a rank of 2 processes"),
        (["--max-steps", "0"], "--max-steps 0 must be >= 1"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
        (["--fault-kind", "bitflip"], "--fault-kind 'bitflip' is not one of labels, sdc, stuck, replica"),
        (["--check-replicas-every", "-1"], "--check-replicas-every -1 must be >= 0 (0: never)"),
    ],
    ids=[
        "unknown setting", "one bad setting of several", "one process", "fault rank", "zero steps", "device", "nproc not a number",
        "fault kind", "replica check period",
    ],  # fmt: skip
)
def test_experiment_rejects_bad_inputs_in_one_line_before_any_work(tmp_path, capsys, flags, expected):
    status, err = _cli(["experiment", "--out", str(tmp_path / "runs"), *flags], capsys)
    assert status == 2
    assert err.startswith("ddphooks experiment: error: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("bug", [KeyError("loss_mean"), TypeError("unsupported operand"), RuntimeError("rank 1 failed")])
def test_an_internal_error_keeps_its_traceback(tmp_path, monkeypatch, bug):
    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(report, "write_report", broken)
    with pytest.raises(type(bug)):  # propagates out of main: the interpreter prints the traceback
        cli.main(["report", "run.jsonl", "-o", str(tmp_path)])


def test_the_traceback_variable_shows_a_user_error_in_full(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(cli.DEBUG_VARIABLE, "1")
    with pytest.raises(FileNotFoundError):
        cli.main(["report", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out")])
    monkeypatch.delenv(cli.DEBUG_VARIABLE)
    assert _cli(["report", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out")], capsys)[0] == 2


def test_help_and_exit_statuses_pass_through(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["report", "--help"])
    assert exit_.value.code == 0 and "usage: ddphooks report" in capsys.readouterr().out
