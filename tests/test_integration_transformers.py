"""SilentCallback in real Trainer and TRL SFTTrainer runs: 2 processes under torchrun (gloo, CPU).

The runs are in tests/scripts/hf_train.py. The script computes each rank's own mean token loss of
every micro-batch itself (cross-entropy from the logits and labels, in float64), so the records'
losses are checked against the loss the run computed, not against anything ddphooks produced.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

SCRIPT = Path(__file__).parent / "scripts" / "hf_train.py"
TIMEOUT_S = 300
ACCUMULATION = 2
SUMMARY_KEYS = (
    "loss_mean", "loss_std", "loss_range", "loss_cv", "grad_norm_mean", "grad_norm_std", "grad_norm_cv",
    "reduced_grad_norm", "mean_cosine", "weighted_mean_cosine", "noise_scale",
)  # fmt: skip


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _torchrun(out: Path, *scenarios: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(out), *scenarios])


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _result(out: Path, scenario: str, rank: int) -> dict:
    return json.loads((out / f"{scenario}-rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch 1: the interrupted Trainer run (steps 1-4, checkpoint at 3). Launch 2: its resumption
    from step 3 to 6, the SFTTrainer run, then the run that stops on an alert. Also returns the records launch 1 wrote."""
    out = tmp_path_factory.mktemp("hf")
    _torchrun(out, "trainer-first")
    first = _records(out / "trainer" / "ddphooks" / "stats.jsonl")
    _torchrun(out, "trainer-resume", "sft", "trainer-stop")
    return out, first


def _training_step_means(result: dict) -> list[float]:
    """The rank's loss per optimizer step: mean over the step's training micro-batches."""
    training = [m["loss"] for m in result["micro_batches"] if m["training"] and m["grad"]]
    assert len(training) % ACCUMULATION == 0
    return [float(np.mean(training[i : i + ACCUMULATION])) for i in range(0, len(training), ACCUMULATION)]


def _assert_losses_match(records: list[dict], results: list[dict]) -> None:
    for rank, result in enumerate(results):
        expected = _training_step_means(result)
        assert len(expected) == len(records)
        got = [record["losses"][rank] for record in records]
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=f"rank {rank}")


def test_trainer_records_each_ranks_own_mean_token_loss_per_step(runs):
    out, first = runs
    records = _records(out / "trainer" / "ddphooks" / "stats.jsonl")
    assert all(r["world_size"] == 2 for r in first + records)
    for scenario, launch_records in (("trainer-first", first), ("trainer-resume", records[3:])):
        results = [_result(out, scenario, rank) for rank in (0, 1)]
        _assert_losses_match(launch_records, results)
        # The ranks' label-token counts differ, so the Trainer's output.loss (token-loss sum over the
        # count of both ranks) is not the rank's mean: the check above fails without the rescaling.
        tokens = [[m["tokens"] for m in r["micro_batches"] if m["training"]] for r in results]
        assert tokens[0] != tokens[1]


def test_evaluation_during_training_adds_no_loss(runs):
    out, first = runs
    for rank in (0, 1):
        micro = _result(out, "trainer-first", rank)["micro_batches"]
        # eval_steps=2: the Trainer evaluates after optimizer steps 2 and 4, without grad, in eval mode
        evals = [i for i, m in enumerate(micro) if not m["training"]]
        assert evals == [2 * ACCUMULATION, 4 * ACCUMULATION + 1] and not any(micro[i]["grad"] for i in evals)
        # the evaluation forward comes right before step index 2's micro-batches, and is not among its losses
        step2 = [m["loss"] for m in micro[evals[0] + 1 : evals[0] + 1 + ACCUMULATION]]
        assert first[2]["losses"][rank] == pytest.approx(np.mean(step2), rel=1e-5)
        with_eval = np.mean(step2 + [micro[evals[0]]["loss"]])
        assert first[2]["losses"][rank] != pytest.approx(with_eval, rel=1e-5)


def test_resume_continues_numbering_and_appends(runs):
    out, first = runs
    assert [r["step"] for r in first] == [0, 1, 2, 3]  # interrupted one step after checkpoint-3
    records = _records(out / "trainer" / "ddphooks" / "stats.jsonl")
    # every step exactly once: the interrupted run's step 3 made way for the resumed run's
    assert [r["step"] for r in records] == list(range(6))
    assert records[:3] == first[:3]
    for rank in (0, 1):
        saved = json.loads((out / "trainer" / "checkpoint-3" / f"ddphooks_state_{rank}.json").read_text())
        assert saved["step"] == 3
    assert json.loads((out / "trainer" / "checkpoint-6" / "ddphooks_state_0.json").read_text())["step"] == 6


def _same(a, b) -> bool:
    """Equal as logged: NaN in the Trainer's logs is null in the strict-JSON records."""
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
        return (a is None or math.isnan(a)) and (b is None or math.isnan(b))
    return a == pytest.approx(b, rel=1e-6)


def test_summary_reaches_log_history_and_report_to_integrations(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = runs
    records = _records(out / "trainer" / "ddphooks" / "stats.jsonl")
    # The resumed Trainer's history starts with the entries saved in checkpoint-3 (summaries included).
    history = _result(out, "trainer-resume", 0)["log_history"]
    train_logs = [h for h in history if "loss" in h]
    assert [h["step"] for h in train_logs] == [1, 2, 3, 4, 5, 6]  # logging_steps=1
    for entry in train_logs:
        record = records[entry["step"] - 1]
        for key in SUMMARY_KEYS:
            assert _same(entry[f"ddphooks/{key}"], record[key]), (entry["step"], key)
        assert entry["ddphooks/alerts"] == 0  # a healthy run
    assert not any(key.startswith("ddphooks/") for h in history if "loss" not in h for key in h)  # eval and final logs
    # Rank 1's Trainer logged the same summary (identical statistics on every rank).
    rank1 = [h for h in _result(out, "trainer-first", 1)["log_history"] if "loss" in h]
    assert [h["ddphooks/loss_std"] for h in rank1[:3]] == [h["ddphooks/loss_std"] for h in train_logs[:3]]

    # TensorBoardCallback (report_to) runs before user callbacks: it got the keys only because
    # SilentCallback moved itself to the front. One event file per launch.
    logged = {}  # step -> value; the resumed launch's value wins for step 4, logged by both launches
    for events in sorted((out / "trainer" / "runs").glob("*/events.out.tfevents.*"), key=lambda p: int(p.name.split(".")[3])):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        logged.update({e.step: e.value for e in accumulator.Scalars("train/ddphooks/loss_std")})
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    for step, value in logged.items():
        assert value == pytest.approx(records[step - 1]["loss_std"], rel=1e-5)


def test_stop_on_alert_saves_and_stops_after_the_same_step_on_every_rank(runs):
    # Rank 1's replica diverges after step 2: the replica check finds it on step 3 (record step 2),
    # and the alert reaches on_step_end two steps later (the detector runs in between).
    out, _ = runs
    results = [_result(out, "trainer-stop", rank) for rank in (0, 1)]
    assert [r["global_step"] for r in results] == [5, 5]  # of max_steps=10
    assert (out / "stop" / "checkpoint-5").is_dir()  # save_strategy="no": saved for the alert
    records = _records(out / "stop" / "ddphooks" / "stats.jsonl")
    alerts = [alert for record in records for alert in record.get("alerts", [])]
    assert alerts and {a["kind"] for a in alerts} == {"replica"} and alerts[0]["step"] == 2, alerts
    # logging_steps=100: the only training log is the one the alert asked for, with the count.
    train_logs = [h for h in results[0]["log_history"] if "loss" in h]
    assert [(h["step"], h["ddphooks/alerts"]) for h in train_logs] == [(5, len(alerts))]


def test_sft_trainer(runs):
    out, _ = runs
    records = _records(out / "sft" / "ddphooks" / "stats.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and all(r["world_size"] == 2 for r in records)
    results = [_result(out, "sft", rank) for rank in (0, 1)]
    _assert_losses_match(records, results)
    assert all(m["training"] for r in results for m in r["micro_batches"])
    train_logs = [h for h in results[0]["log_history"] if "loss" in h]
    assert [h["step"] for h in train_logs] == [2, 4]  # logging_steps=2
    for entry in train_logs:
        assert _same(entry["ddphooks/loss_std"], records[entry["step"] - 1]["loss_std"])
        assert "mean_token_accuracy" in entry  # SFTTrainer's own metrics are still there


def test_one_process_warns_once_and_trains_unchanged(tmp_path):
    result = _run([sys.executable, str(SCRIPT), str(tmp_path), "single", "single-plain"])
    assert result.stderr.count("SilentCallback: the Trainer's model is a LlamaForCausalLM, not DistributedDataParallel") == 1
    with_callback, plain = _result(tmp_path, "single", 0), _result(tmp_path, "single-plain", 0)
    assert with_callback["global_step"] == plain["global_step"] == 2
    losses = [[h["loss"] for h in r["log_history"] if "loss" in h] for r in (with_callback, plain)]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert not any(key.startswith("ddphooks/") for h in with_callback["log_history"] for key in h)
    assert not (tmp_path / "single" / "ddphooks").exists()
