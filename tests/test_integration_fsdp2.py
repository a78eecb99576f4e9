"""ddphooks under FSDP2 in the Hugging Face Trainer, Accelerate and Lightning: 2 processes under torchrun (gloo, CPU).

The runs are in tests/scripts/fsdp2_train.py, all in one torchrun launch. Each rank writes its own
records and what the run computed itself (the losses, the norm of the averaged gradient), so the
records are checked against the training run, and the FSDP2 runs' statistics against those of the
same run under DDP (same seed, same data, same batches).

What does not run on the CPU, and why (Accelerate 1.15, transformers 5.24):

- Accelerate's FSDP plugin: ``AcceleratorState.__init__`` (accelerate/state.py) sets
  ``DistributedType.FSDP`` only in its branch for accelerator device types (``MULTI_GPU``,
  ``MULTI_XPU``, ``MULTI_NPU`` ...); on the CPU the type stays ``MULTI_CPU``, the plugin is dropped
  without a message and ``accelerator.prepare(model)`` returns DDP. The same holds for the Trainer's
  ``fsdp=True, fsdp_config={"version": 2}``, which builds that plugin. Both are run here and must
  still be measured (as DDP): if Accelerate starts sharding on the CPU, those tests fail and
  should then expect FSDP2.
- ``accelerator.prepare`` of a model already ``fully_shard``-ed: on the CPU Accelerate wraps it in
  DDP, whose parameter broadcast fails on the DTensors ("Operator c10d.broadcast_.default does not
  have a sharding strategy registered"). The Accelerate FSDP2 loop here shards the model itself and
  prepares the optimizer and data loader.
- The Trainer's FSDP2 that does run on the CPU is transformers' own sharding at load time,
  ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``; transformers cannot
  resume such a run ("Resuming is not supported for models sharded at load time"), so the
  checkpoints are ``save_only_model`` and only saving the ddphooks state is checked.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None

SCRIPT = Path(__file__).parent / "scripts" / "fsdp2_train.py"
TIMEOUT_S = 300
MICRO = 2  # micro-batches per optimizer step in every scenario
LLAMA_PARAMETERS = 21  # the script's tiny Llama: embeddings, 2 x 9 in the layers, the final norm, the head


def _records(path: Path) -> list[dict]:
    return [line for line in map(json.loads, path.read_text().splitlines()) if "header" not in line]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    scenarios = ["accelerate-plugin", "accelerate-plugin-forced", "accelerate-sharded", "trainer-config", "trainer-native"] + (["lightning"] if HAS_LIGHTNING else [])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(out), *scenarios]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return out


def _run(out: Path, scenario: str, stats: str | None = None) -> tuple[list[dict], list[list[dict]]]:
    """Both ranks' results and both ranks' records, after checking the records are the same on each."""
    results = [json.loads((out / f"{scenario}-rank{rank}.json").read_text()) for rank in (0, 1)]
    stats = stats or f"{scenario}-stats-rank{{rank}}.jsonl"
    records = [_records(out / stats.format(rank=rank)) for rank in (0, 1)]
    assert records[0] == records[1]  # every rank computed the same statistics
    assert records[0] and all(r["world_size"] == 2 and not r["alerts"] for r in records[0])
    return results, records[0]


def _per_step(micro: list[float]) -> np.ndarray:
    return np.asarray(micro).reshape(-1, MICRO).mean(axis=1)


def _assert_same_statistics(fsdp2: list[dict], ddp: list[dict], by_parameter: bool) -> None:
    """The same run under FSDP2 and under DDP: the same exact statistics (the sketch-based cosine
    estimates differ: the sketch signs sit at other positions of another gradient layout)."""
    assert [r["step"] for r in fsdp2] == [r["step"] for r in ddp]
    # (rtol, atol): fp32 sums in another order
    tolerances = {"losses": (1e-6, 0), "grad_norms": (1e-5, 0), "reduced_grad_norm": (1e-5, 0), "weighted_mean_cosine": (0, 1e-6)}
    for key, (rtol, atol) in tolerances.items():
        values = [np.array([r[key] for r in records], dtype=float) for records in (fsdp2, ddp)]  # null: NaN
        np.testing.assert_allclose(*values, rtol=rtol, atol=atol, equal_nan=True, err_msg=key)
    # The noise scale W (S - B) / (W B - S), S the ranks' mean squared norm and B the average's, is
    # a difference of close terms (null where negative): fp32 rounding of the squared norms (1e-6
    # relative, generously) moves it by up to 1e-6 (S + W B) / |W B - S| relative, its condition.
    for a, b in zip(fsdp2, ddp):
        small, big, world = np.mean(np.square(b["grad_norms"])), b["reduced_grad_norm"] ** 2, len(b["grad_norms"])
        condition = (small + world * big) / abs(world * big - small)
        np.testing.assert_allclose(a["noise_scale"] or np.nan, b["noise_scale"] or np.nan, rtol=max(1e-3, 1e-6 * condition), equal_nan=True)
    if by_parameter:
        for a, b in zip(fsdp2, ddp):
            norms = [{p["name"]: p["grad_norms"] for p in r["parameters"]} for r in (a, b)]
            assert sorted(norms[0]) == sorted(norms[1])
            for name in norms[0]:
                np.testing.assert_allclose(norms[0][name], norms[1][name], rtol=1e-5, err_msg=name)


def test_accelerate_loop_on_an_fsdp2_root_records_each_optimizer_step(out):
    results, records = _run(out, "accelerate-sharded")
    assert [r["wrapped"] for r in results] == ["FSDPBigramLM"] * 2
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # one per optimizer step, not per micro-batch
    for rank, result in enumerate(results):
        assert result["syncs"] == [False, True] * 4 and result["state_step"] == 4
        np.testing.assert_allclose([r["losses"][rank] for r in records], _per_step(result["losses"]), rtol=1e-6)
        # the norm of the gradient the optimizer got, computed by the loop from the full gradient
        np.testing.assert_allclose([r["reduced_grad_norm"] for r in records], result["grad_norms"], rtol=1e-5)
    assert records[0]["losses"][0] != pytest.approx(records[0]["losses"][1], rel=1e-4)  # the ranks saw different data
    assert {p["name"] for p in records[0]["parameters"]} == {"embed.weight", "head.weight", "head.bias"}


def test_accelerate_fsdp_plugin_on_the_cpu_runs_ddp_and_is_measured(out):
    results, records = _run(out, "accelerate-plugin")
    # Accelerate drops FullyShardedDataParallelPlugin(fsdp_version=2) on the CPU (MULTI_CPU, see above)
    got = [(r["wrapped"], r["distributed_type"], r["is_fsdp2"]) for r in results]
    assert got == [("DistributedDataParallel", "DistributedType.MULTI_CPU", False)] * 2
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for rank, result in enumerate(results):
        np.testing.assert_allclose([r["losses"][rank] for r in records], _per_step(result["losses"]), rtol=1e-6)
    _assert_same_statistics(_run(out, "accelerate-sharded")[1], records, by_parameter=True)


def test_accelerate_fsdp_plugin_preparation_is_measured(out):
    """Accelerate's own FSDP2 preparation and accumulation, with its device gate opened (see the script)."""
    results, records = _run(out, "accelerate-plugin-forced")
    got = [(r["wrapped"], r["distributed_type"], r["is_fsdp2"]) for r in results]
    assert got == [("FSDPBigramLM", "DistributedType.FSDP", True)] * 2
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # accumulate() skipped the reduce-scatter of every first micro-batch
    for rank, result in enumerate(results):
        assert result["syncs"] == [False, True] * 4 and result["state_step"] == 4
        np.testing.assert_allclose([r["losses"][rank] for r in records], _per_step(result["losses"]), rtol=1e-6)
        np.testing.assert_allclose([r["reduced_grad_norm"] for r in records], result["grad_norms"], rtol=1e-5)
    _assert_same_statistics(_run(out, "accelerate-sharded")[1], records, by_parameter=True)


def test_trainer_fsdp2_silent_callback_records_each_ranks_own_token_loss(out):
    results, records = _run(out, "trainer-native", stats="trainer-native/ddphooks/stats-rank{rank}.jsonl")
    for result in results:
        assert result["wrapped"] == "FSDPLlamaForCausalLM" and result["fsdp2_root"]  # trainer.model_wrapped
        assert result["state"] == "ShardedSilentState" and result["state_step"] == result["global_step"] == 4
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for rank, result in enumerate(results):
        micro = result["micro_batches"]
        assert all(m["training"] and m["grad"] for m in micro) and len(micro) == 4 * MICRO
        np.testing.assert_allclose([r["losses"][rank] for r in records], _per_step([m["loss"] for m in micro]), rtol=1e-5)
    # The ranks' label-token counts differ: the Trainer's output.loss is not the rank's own mean
    # (it is divided by both ranks' count), so the losses above hold only with the rescaling.
    assert [m["tokens"] for m in results[0]["micro_batches"]] != [m["tokens"] for m in results[1]["micro_batches"]]
    # The Trainer's grad_norm (clip_grad_norm_ over the sharded gradients) is the reduced gradient's norm.
    train_logs = [h for h in results[0]["log_history"] if "loss" in h]
    assert [h["step"] for h in train_logs] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["reduced_grad_norm"] for r in records], [h["grad_norm"] for h in train_logs], rtol=1e-5)
    for entry, record in zip(train_logs, records):  # the summary reached the logs
        assert entry["ddphooks/loss_std"] == pytest.approx(record["loss_std"], rel=1e-6)
        assert entry["ddphooks/mean_cosine"] == pytest.approx(record["mean_cosine"], rel=1e-6) and entry["ddphooks/alerts"] == 0
    assert all(len(r["parameters"]) == LLAMA_PARAMETERS for r in records)  # every parameter, once
    for rank in (0, 1):  # the checkpoints hold each rank's ddphooks state
        for step in (2, 4):
            saved = json.loads((out / "trainer-native" / f"checkpoint-{step}" / f"ddphooks_state_{rank}.json").read_text())
            assert saved["step"] == step


def test_trainer_fsdp_config_on_the_cpu_runs_ddp_with_the_same_statistics(out):
    results, records = _run(out, "trainer-config", stats="trainer-config/ddphooks/stats-rank{rank}.jsonl")
    # fsdp=True, fsdp_config={"version": 2}: Accelerate drops the plugin on the CPU, the Trainer runs DDP
    assert [(r["wrapped"], r["is_fsdp_enabled"], r["state"]) for r in results] == [("DistributedDataParallel", False, "SilentState")] * 2
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    native = _run(out, "trainer-native", stats="trainer-native/ddphooks/stats-rank{rank}.jsonl")[1]
    _assert_same_statistics(native, records, by_parameter=True)


def test_trainer_fsdp2_records_name_the_parameters(out):
    # FSDP2 leaves FSDPParam._param_fqn unset when transformers replaces the parameters while
    # loading the sharded model: the names come from the modules that hold them.
    records = _run(out, "trainer-native", stats="trainer-native/ddphooks/stats-rank{rank}.jsonl")[1]
    ddp = _run(out, "trainer-config", stats="trainer-config/ddphooks/stats-rank{rank}.jsonl")[1]
    assert sorted(p["name"] for p in records[0]["parameters"]) == sorted(p["name"] for p in ddp[0]["parameters"])


@pytest.mark.skipif(not HAS_LIGHTNING, reason="needs lightning")
def test_lightning_model_parallel_strategy_records_every_micro_batch(out):
    results, records = _run(out, "lightning")
    # Lightning's block_backward_sync knows DDP only: FSDP2 reduce-scatters each of the 2 micro-batches
    # of the 2 optimizer steps, and each is a synchronised step with its own record.
    assert [(r["global_step"], r["state_step"]) for r in results] == [(2, 4)] * 2
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for rank, result in enumerate(results):
        # training_step's loss, though Lightning calls backward on it divided by accumulate_grad_batches
        np.testing.assert_allclose([r["losses"][rank] for r in records], result["losses"], rtol=1e-6)
    np.testing.assert_allclose([r["reduced_grad_norm"] for r in records], results[0]["grad_norms"], rtol=1e-5)
    assert {p["name"] for p in records[0]["parameters"]} == {"0.weight", "0.bias", "2.weight", "2.bias"}  # in the root, self.net


class _Unsupported:
    """Wrapped models SilentCallback does not measure, as the Trainer would hold them."""

    @staticmethod
    def fsdp1():
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel

        fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # FSDP1 refuses the CPU: never constructed
        torch.nn.Module.__init__(fsdp1)
        fsdp1._fsdp_wrapped_module = torch.nn.Linear(1, 1)
        return fsdp1


@pytest.mark.parametrize(("wrapper", "why"), [
    ("fsdp1", "FSDP1, FullyShardedDataParallel, is not supported: use FSDP2's fully_shard"),
])  # fmt: skip
def test_callback_names_fsdp1_and_does_nothing(tmp_path, wrapper, why):
    from types import SimpleNamespace

    from transformers import Trainer, TrainerControl, TrainerState

    from ddphooks.integrations.transformers import SilentCallback

    class Running(Trainer):
        def __init__(self, wrapped) -> None:  # only what on_train_begin reads
            self.model_wrapped = wrapped

        def begin(self, callback) -> None:
            callback.on_train_begin(SimpleNamespace(world_size=2, output_dir=str(tmp_path)), TrainerState(), TrainerControl())

    callback = SilentCallback()
    with pytest.warns(RuntimeWarning) as caught:
        Running(getattr(_Unsupported, wrapper)()).begin(callback)
    message = str(caught[0].message)
    assert why in message and "not DistributedDataParallel or an FSDP2 (fully_shard) root" in message
    assert "FSDP1 is not supported" in message and "training is unchanged" in message
    assert callback.state is None and not (tmp_path / "ddphooks").exists()
