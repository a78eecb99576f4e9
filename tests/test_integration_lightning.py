"""Lightning integration: a real 2-process DDP Trainer run (tests/scripts/lightning_train.py)."""

from __future__ import annotations

import csv
import json
import math
import os
import pickle
import subprocess
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lightning")

SCRIPT = Path(__file__).parent / "scripts" / "lightning_train.py"


def read_records(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line for line in lines if "header" not in line]


def step_losses(out: Path, fit: str, world_size: int = 2) -> dict[int, list[float]]:
    """Per optimizer step, each rank's mean of the micro-batch losses its training_step computed."""
    per_step = defaultdict(lambda: [None] * world_size)
    for rank in range(world_size):
        grouped = defaultdict(list)
        for step, loss in json.loads((out / f"losses-{fit}-rank{rank}.json").read_text()):
            grouped[step].append(loss)
        for step, losses in grouped.items():
            per_step[step][rank] = float(np.mean(losses))
    return dict(per_step)


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)  # Lightning would take it for an external launcher
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], cwd=out, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


def test_records_match_training_step_losses_and_resume(lightning_run):
    out = lightning_run
    records = read_records(out / "csv" / "version_0" / "ddphooks" / "stats.jsonl")
    # fit a ran steps 0, 1, 2 and was checkpointed after step 1 (global_step 2); fit b resumed
    # there: the file holds every step once, step 2 from the resumed run.
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["world_size"] == 2 for r in records)
    computed = {**{s: v for s, v in step_losses(out, "a").items() if s < 2}, **step_losses(out, "b")}
    assert sorted(computed) == [0, 1, 2, 3]
    for record in records:
        # accumulate_grad_batches=2: the mean of the 2 micro-batch losses; validation (10x the
        # loss, sanity check and every 2 batches) must not count.
        np.testing.assert_allclose(record["losses"], computed[record["step"]], rtol=1e-5, err_msg=f"step {record['step']}")
    # the resumed step 2 is not the one the interrupted run wrote
    assert not np.allclose(step_losses(out, "a")[2], computed[2])
    assert json.loads((out / "hooks-a-rank0.json").read_text()) == ["silent_hook"]
    # detail records name the LightningModule's parameters (as DDP's module holds them)
    assert [p["name"] for p in records[0]["parameters"]] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


def test_logger_gets_the_summary(lightning_run):
    out = lightning_run
    records = {r["step"]: r for r in read_records(out / "csv" / "version_0" / "ddphooks" / "stats.jsonl")}
    with open(out / "csv" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("ddphooks/step")]
    assert rows, "no ddphooks/ metrics in the CSVLogger output"
    for key in ("loss_mean", "loss_std", "loss_cv", "grad_norm_cv", "mean_cosine", "weighted_mean_cosine", "reduced_grad_norm", "alerts"):
        assert f"ddphooks/{key}" in rows[0], key
    assert {float(row["ddphooks/alerts"]) for row in rows} == {0.0}  # a healthy run
    logged_steps = set()
    for row in rows:
        step = int(float(row["ddphooks/step"]))
        logged_steps.add(step)
        for key in ("loss_mean", "loss_std", "mean_cosine", "reduced_grad_norm"):
            assert math.isclose(float(row[f"ddphooks/{key}"]), records[step][key], rel_tol=1e-6), (step, key)
    assert logged_steps == {2, 3}  # the resumed fit's CSVLogger (same version) rewrote metrics.csv


def test_state_registered_by_the_strategy_is_not_registered_twice(lightning_run):
    """Fit c: DDPStrategy(ddp_comm_state=state, ddp_comm_hook=silent_hook) as on CUDA + SilentCallback(state)."""
    out = lightning_run
    for rank in range(2):
        assert json.loads((out / f"hooks-c-rank{rank}.json").read_text()) == ["silent_hook"]
    records = read_records(out / "c.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    computed = step_losses(out, "c")
    for record in records:
        np.testing.assert_allclose(record["losses"], computed[record["step"]], rtol=1e-5)


def test_stop_on_alert_ends_the_fit_after_the_same_step_on_every_rank(lightning_run):
    """Fit d: rank 1's replica diverges after step 2; the replica check alerts, the fit stops early."""
    out = lightning_run
    stopped = [json.loads((out / f"stop-rank{rank}.json").read_text()) for rank in range(2)]
    assert stopped[0] == stopped[1] and 3 <= stopped[0] < 10, stopped
    records = read_records(out / "d.jsonl")
    alerts = [alert for record in records for alert in record["alerts"]]
    assert alerts and {a["kind"] for a in alerts} == {"replica"} and alerts[0]["step"] == 2, alerts
    assert records[-1]["step"] == stopped[0] - 1  # state steps count from 0, global steps from 1
    # The alert of step 2 reaches on_train_batch_end two steps later (the detector runs in between).
    assert stopped[0] == 2 + 3


def test_single_device_warns_once_and_trains(tmp_path):
    import lightning.pytorch as L
    import torch

    from ddphooks.integrations.lightning import SilentCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = SilentCallback(sketch_dim=16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, callbacks=[callback], default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Tiny(), loader)
        trainer.fit(Tiny(), loader)  # a second fit: no second warning
    ours = [w for w in caught if "SilentCallback" in str(w.message)]
    assert len(ours) == 1 and "ddphooks is off" in str(ours[0].message)
    assert trainer.global_step == 2 and callback.state is None
    assert not (tmp_path / "ddphooks").exists()


def test_callback_pickles_and_checks_arguments():
    from ddphooks import SilentState
    from ddphooks.integrations.lightning import SilentCallback

    copy = pickle.loads(pickle.dumps(SilentCallback(sketch_dim=32, every=2)))
    assert copy.settings == {"sketch_dim": 32, "every": 2}
    state = SilentState(sketch_dim=32)
    assert not state.bound
    copy = pickle.loads(pickle.dumps(SilentCallback(state=state)))
    assert copy.state.config.sketch_dim == 32
    with pytest.raises(TypeError, match="either state= or SilentState settings"):
        SilentCallback(state=state, every=2)
    with pytest.raises(TypeError, match="SilentState"):
        SilentCallback(state={"sketch_dim": 32})


def test_checkpoint_state_before_the_state_exists():
    from ddphooks.integrations.lightning import SilentCallback

    callback = SilentCallback()
    assert callback.state_dict() == {}
    callback.load_state_dict({"silent_state": {"format": 1, "step": 7, "every": 1}})
    assert callback.state_dict()["silent_state"]["step"] == 7  # kept for on_fit_start, saved as is


def test_resume_drops_records_from_the_checkpoint_on(tmp_path):
    from ddphooks.sinks.jsonl import drop_records_from

    path = tmp_path / "stats.jsonl"
    lines = [json.dumps({"header": {"w": 2}})] + [json.dumps({"step": s, "loss_mean": s}) for s in range(5)]
    path.write_text("\n".join(lines) + '\n{"step": 5, "loss_')  # an interrupted write at the end
    drop_records_from(path, 2)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == [{"header": {"w": 2}}, {"step": 0, "loss_mean": 0}, {"step": 1, "loss_mean": 1}]
    drop_records_from(tmp_path / "missing.jsonl", 2)  # nothing to do
