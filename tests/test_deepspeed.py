"""DeepSpeed ZeRO: each rank's statistics against its local gradient computed the slow way.

Two spawned gloo ranks with DeepSpeed's CPU accelerator. One spawn runs every configuration
(ZeRO stages 1, 2, 3; accumulation 1 and 2; fp32 and bf16; overlap_comm / contiguous_gradients
on and off), each twice from the same seed: without ddphooks, and with ``ddphooks.attach(engine)``.
For the second run, every step, a plain torch copy of the model is loaded with the engine's
full parameters (ZeRO-3: gathered) and runs the same micro-batches with plain autograd: that is
the rank's local gradient, all-gathered, the reference for loss, per-parameter norms, reduced
norm and cosines. The parameters after the steps must be bitwise equal to the run without
ddphooks.
"""

import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

import ddphooks  # noqa: E402
from ddphooks.launch import spawn  # noqa: E402
from test_hook import _assert_step_1_unmeasured, _broken, _Messages  # noqa: E402

TIMEOUT = 240
STEPS = 2
MICRO = 4  # samples per micro-batch
SKETCH_DIM = 128

#: (name, stage, gradient_accumulation_steps, bf16, overlap_comm, contiguous_gradients)
CONFIGS = [
    ("zero1", 1, 1, False, False, True),
    ("zero1_ga2", 1, 2, False, True, False),
    ("zero2", 2, 1, False, True, True),
    ("zero2_ga2", 2, 2, False, False, False),
    ("zero3", 3, 1, False, True, True),
    ("zero3_ga2_bf16", 3, 2, True, False, True),
    ("zero2_bf16", 2, 1, True, True, True),
    ("zero1_ga2_bf16", 1, 2, True, False, True),
    ("zero1_ga2_bf16_fp32acc", 1, 2, True, False, True),  # grad_accum_dtype fp32: BF16_Optimizer, the local sum kept apart
]


def _config(stage: int, ga: int, bf16: bool, overlap: bool, contiguous: bool, **zero) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "overlap_comm": overlap, "contiguous_gradients": contiguous, **zero},
        "steps_per_print": 10**9,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))


class _Loss(torch.nn.Module):
    """The model with its loss in the forward output (``output.loss``), as attach captures it."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x, y):
        from types import SimpleNamespace

        out = self.net(x)
        return SimpleNamespace(loss=torch.nn.functional.mse_loss(out.float(), y.float()))


def _batches(rank: int, steps: int, ga: int, dtype: torch.dtype) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [[(torch.randn(MICRO, 24, generator=generator).to(dtype), torch.randn(MICRO, 6, generator=generator)) for _ in range(ga)] for _ in range(steps)]


def _full_parameters(engine, stage: int) -> dict[str, torch.Tensor]:
    params = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().clone() for name, p in params.items()}
    return {name: p.detach().clone() for name, p in params.items()}


def _reference_step(plain: torch.nn.Module, full: dict, micro_batches, ga: int, world: int) -> dict:
    """The rank's local gradient of one step the obvious way, then every rank's, all-gathered."""
    import torch.distributed as dist

    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(full[name])
    plain.zero_grad(set_to_none=True)
    losses, micro_sq = [], []
    for x, y in micro_batches:
        before = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in plain.named_parameters()}
        loss = plain(x, y).loss
        (loss / ga).backward()  # engine.backward divides by the accumulation steps
        losses.append(float(loss.detach()))
        micro_sq.append([float((p.grad.float() - before[n].float()).pow(2).sum()) for n, p in plain.named_parameters()])
    local = torch.cat([p.grad.detach().float().reshape(-1) for p in plain.parameters()])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    numels = [p.numel() for p in plain.parameters()]
    return {
        "loss": float(np.mean(losses)),
        "param_sq": [[float(piece.pow(2).sum()) for piece in g.split(numels)] for g in gathered],
        "micro_sq": np.sum(micro_sq, axis=0).tolist(),
        "gradients": torch.stack(gathered).double().numpy(),
        "numels": numels,
    }


def _run(rank: int, world: int, name: str, stage: int, ga: int, bf16: bool, overlap: bool, contiguous: bool, measured: bool) -> dict:
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = _Loss(_model())
    plain = copy.deepcopy(model).to(dtype)
    config = _config(stage, ga, bf16, overlap, contiguous)
    if name.endswith("fp32acc"):
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert type(engine.optimizer).__name__ == ("BF16_Optimizer" if name.endswith("fp32acc") else "DeepSpeedZeroOptimizer" if stage < 3 else "DeepSpeedZeroOptimizer_Stage3")
    state = ddphooks.attach(engine, sketch_dim=SKETCH_DIM, check_replicas_every=1) if measured else None
    batches = _batches(rank, STEPS, ga, dtype)
    out = {"steps": [], "grad_norm": []}
    for micro_batches in batches:
        reference = _reference_step(plain, _full_parameters(engine, stage), micro_batches, ga, world) if measured else None
        for x, y in micro_batches:
            engine.backward(engine(x, y).loss)
            engine.step()
        out["grad_norm"].append(float(engine.get_global_grad_norm()))
        if measured:
            stats = state.latest
            record = stats.to_dict()
            out["steps"].append({
                "reference": reference, "step": stats.step, "losses": stats.losses.tolist(), "param_sq": stats.param_sq.tolist(),
                "reduced_sq": stats.reduced_param_sq.tolist(), "weighted": stats.weighted_mean_cosine,
                "cosine": stats.cosine.tolist(), "record": {k: record[k] for k in ("transport", "accumulation", "replicas", "world_size")},
            })  # fmt: skip
    out["parameters"] = {k: v.float().numpy() for k, v in _full_parameters(engine, stage).items()}
    if state is not None:
        state.close()
    return out


def _no_shm_op() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce op (for inference) when its
    process group starts: a minute of g++ on a fresh machine, and a compiler to have. Training
    never uses it (ZeRO reduces through torch.distributed): the tests go without."""
    import importlib

    # the module itself: the attribute deepspeed.comm.torch is the torch package
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def _all_configs(rank: int, world: int) -> dict:
    import os

    os.environ["LOCAL_RANK"] = str(rank)  # what DeepSpeed's launcher or torchrun would set
    _no_shm_op()
    results = {}
    for config in CONFIGS:
        started = time.perf_counter()
        results[config[0]] = {"plain": _run(rank, world, *config, measured=False), "measured": _run(rank, world, *config, measured=True)}
        results[config[0]]["seconds"] = time.perf_counter() - started
    return results


@pytest.fixture(scope="module")
def runs():
    return spawn(_all_configs, 2, timeout=TIMEOUT)


def _exact_cosines(gradients: np.ndarray) -> tuple[float, float]:
    """(cos(G_0, G_1), norm-weighted mean pairwise cosine) of two ranks' gradients."""
    a, b = gradients
    cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    return cosine, cosine  # at W = 2 the weighted mean of the one pair is the pair's cosine


@pytest.mark.parametrize("name", [c[0] for c in CONFIGS])
def test_training_is_bitwise_unchanged(runs, name):
    for rank in range(2):
        plain, measured = runs[rank][name]["plain"]["parameters"], runs[rank][name]["measured"]["parameters"]
        assert plain.keys() == measured.keys()
        for key in plain:
            assert np.array_equal(plain[key], measured[key]), (name, rank, key)


@pytest.mark.parametrize("name", [c[0] for c in CONFIGS])
def test_statistics_match_the_local_gradients(runs, name):
    stage, ga, bf16 = next((c[1], c[2], c[3]) for c in CONFIGS if c[0] == name)
    rtol = 3e-2 if bf16 else 1e-4
    steps = runs[0][name]["measured"]["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    exact = ga == 1 or (stage == 1 and not name.endswith("fp32acc"))
    for t, step in enumerate(steps):
        assert step["record"]["transport"] == f"deepspeed-zero{stage}" and step["record"]["world_size"] == 2
        assert step["record"]["accumulation"] == ("exact" if exact else "micro_batch_norms")
        losses = [runs[rank][name]["measured"]["steps"][t]["reference"]["loss"] for rank in range(2)]
        np.testing.assert_allclose(step["losses"], losses, rtol=1e-5 if not bf16 else 1e-2)
        reference = step["reference"]
        if exact:
            np.testing.assert_allclose(step["param_sq"], reference["param_sq"], rtol=rtol, atol=1e-9)
        else:  # the micro-batches' norms in quadrature, each rank's
            micro = [runs[rank][name]["measured"]["steps"][t]["reference"]["micro_sq"] for rank in range(2)]
            np.testing.assert_allclose(step["param_sq"], micro, rtol=rtol, atol=1e-9)
        gradients = reference["gradients"]
        mean = gradients.mean(axis=0)
        reduced = [float(piece @ piece) for piece in np.split(mean, np.cumsum(reference["numels"])[:-1])]
        if not name.endswith("fp32acc"):
            np.testing.assert_allclose(step["reduced_sq"], reduced, rtol=rtol * 3, atol=1e-9)
        # else: DeepSpeed 0.19.8's BF16_Optimizer with accumulation reduces something else than the
        # mean of the local gradients (its own global norm, checked below, agrees with ddphooks')
        cosine, weighted = _exact_cosines(gradients)
        if exact:
            assert math.isclose(step["weighted"], weighted, rel_tol=rtol * 10, abs_tol=1e-3), (step["weighted"], weighted)
        # the sketch of the summed local gradients: cosine within the sketch's error
        assert abs(step["cosine"][0][1] - cosine) <= 4 / math.sqrt(SKETCH_DIM), (step["cosine"][0][1], cosine)
        replicas = step["record"]["replicas"]  # ZeRO-3: no two ranks hold the same partition, and no buffers here
        assert replicas is None if stage == 3 else replicas["ranks"] == [], replicas
    # DeepSpeed's own global norm is the norm of the reduced gradient, before clipping
    for t, step in enumerate(steps):
        assert math.isclose(math.sqrt(sum(step["reduced_sq"])), runs[0][name]["measured"]["grad_norm"][t], rel_tol=rtol * 3)


def test_ranks_agree(runs):
    for name in (c[0] for c in CONFIGS):
        a, b = runs[0][name]["measured"]["steps"], runs[1][name]["measured"]["steps"]
        assert [s["param_sq"] for s in a] == [s["param_sq"] for s in b]
        assert [s["cosine"] for s in a] == [s["cosine"] for s in b]


def _faults(rank: int, world: int) -> dict:
    """ZeRO-2: a drifting replica, a corrupted gradient on one rank; refusals at attach."""
    import os

    os.environ["LOCAL_RANK"] = str(rank)
    _no_shm_op()
    out = {}
    # attach(engine.module) and a stage-0 engine are refused with the fix, on every rank
    model = _Loss(_model())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(0, 1, False, False, False))
    zero2, *_ = deepspeed.initialize(model=_Loss(_model()), config=_config(2, 1, False, True, True), model_parameters=None)
    for key, target in (("module", zero2.module), ("stage0", engine)):
        try:
            ddphooks.attach(target)
            out[key] = None
        except (TypeError, ValueError) as error:
            out[key] = f"{type(error).__name__}: {error}"
    model = _Loss(_model())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(2, 1, False, True, True))
    params = dict(engine.module.named_parameters())
    if rank == 1:  # a faulty rank: registered before ddphooks, so its hook sees the corrupted gradient
        params["net.2.weight"].register_hook(lambda grad: grad * 30)
    state = ddphooks.attach(engine, sketch_dim=SKETCH_DIM, check_replicas_every=1)
    records = []
    for t, micro_batches in enumerate(_batches(rank, 3, 1, torch.float32)):
        if t == 2 and rank == 1:
            with torch.no_grad():
                params["net.0.bias"].add_(1e-3)  # this replica drifts from the others
        for x, y in micro_batches:
            engine.backward(engine(x, y).loss)
            engine.step()
        stats = state.latest
        ratio = stats.param_sq[1] / stats.param_sq[0]
        records.append({"replicas": stats.to_dict()["replicas"], "worst": stats.parameter_names[int(np.argmax(ratio))], "ratio": float(ratio.max())})
    out["records"] = records
    state.close()
    state.detach()  # hooks removed, the engine's own backward epilogue back
    steps = state.step
    for x, y in _batches(rank, 1, 1, torch.float32)[0]:
        engine.backward(engine(x, y).loss)
        engine.step()
    out["detached"] = ("_backward_epilogue" not in vars(engine), state.step == steps)
    # rank 1's statistics pass fails on step 1 of 3: the step is not measured on either rank
    model = _Loss(_model())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(2, 1, False, True, True))
    state = ddphooks.attach(engine, sketch_dim=SKETCH_DIM, check_replicas_every=0)
    log, steps = _Messages(), []
    for t, micro_batches in enumerate(_batches(rank, 3, 1, torch.float32)):
        with _broken("kernel") if rank == 1 and t == 1 else contextlib.nullcontext():
            for x, y in micro_batches:
                engine.backward(engine(x, y).loss)  # must not raise
                engine.step()
        state.flush()
        try:
            steps.append(state.latest.step)
        except RuntimeError as error:
            steps.append(str(error))
    after = state.latest.to_dict()["cosine_previous"]  # step 2, compared with the failed step's slots
    state.close()
    out["failure"] = {"steps": steps, "messages": log.messages, "after": after}
    return out


@pytest.fixture(scope="module")
def faults():
    return spawn(_faults, 2, timeout=TIMEOUT)


def test_a_statistics_bug_leaves_the_step_unmeasured(faults):
    _assert_step_1_unmeasured(faults[1]["failure"], faults[0]["failure"])


def test_engine_module_and_stage0_are_refused_with_the_fix(faults):
    for rank in range(2):
        assert "pass the DeepSpeedEngine deepspeed.initialize returns, not engine.module" in faults[rank]["module"]
        assert faults[rank]["stage0"].startswith("ValueError: invalid SilentState arguments on rank 0: ValueError: ZeRO stage 0")
        assert "ddphooks measures DeepSpeed ZeRO stages 1, 2 and 3" in faults[rank]["stage0"]


def test_corrupted_gradient_and_drifting_replica_are_named(faults):
    records = faults[0]["records"]
    for record in records:  # rank 1's gradient of net.2.weight is 30 times its own
        assert record["worst"] == "net.2.weight" and record["ratio"] > 100
    assert records[0]["replicas"]["ranks"] == [] and records[1]["replicas"]["ranks"] == []
    assert faults[0]["detached"] == (True, True)
    drifted = records[2]["replicas"]
    assert drifted["ranks"] == [0, 1] and [p["name"] for p in drifted["parameters"]] == ["net.0.bias"]  # W = 2: no majority


class _Engine:
    """Only the configuration getters ``unsupported_configuration`` reads."""

    def __init__(self, stage=2, offload=None, hpz=1, quantized=False, fp16=False, moe=False) -> None:
        self._values = dict(stage=stage, offload=offload, hpz=hpz, quantized=quantized, fp16=fp16)
        self.has_moe_layers = moe
        self.optimizer = object()

    def zero_optimization_stage(self):
        return self._values["stage"]

    def zero_offload_optimizer(self):
        return self._values["offload"]

    def zero_offload_param(self):
        return None

    def zero_hpz_partition_size(self):
        return self._values["hpz"]

    def zero_quantized_gradients(self):
        return self._values["quantized"]

    def fp16_enabled(self):
        return self._values["fp16"]

    def _backward_epilogue(self):
        pass


@pytest.mark.parametrize(("engine", "why"), [
    (_Engine(offload=type("Offload", (), {"device": "cpu"})()), "ZeRO-Offload / ZeRO-Infinity (zero_optimization.offload_optimizer.device = 'cpu')"),
    (_Engine(hpz=8), "ZeRO++ hierarchical partitioning (zero_hpz_partition_size = 8)"),
    (_Engine(quantized=True), "ZeRO++ quantized gradients (zero_quantized_gradients = true)"),
    (_Engine(moe=True), "DeepSpeed MoE"),
    (_Engine(fp16=True), "fp16 with loss scaling"),
    (type("PipelineEngine", (_Engine,), {})(), "DeepSpeed pipeline parallelism (PipelineEngine)"),
])  # fmt: skip
def test_unsupported_configurations_name_what_is_supported(engine, why):
    from ddphooks.deepspeed import SUPPORTED, unsupported_configuration

    problem = unsupported_configuration(engine)
    assert problem.startswith("ValueError: " + why) and problem.endswith("is not supported: " + SUPPORTED) and "\n" not in problem
    assert unsupported_configuration(_Engine()) is None and unsupported_configuration(_Engine(offload=type("O", (), {"device": "none"})())) is None


def test_import_ddphooks_imports_no_deepspeed():
    import subprocess
    import sys

    code = "import sys, ddphooks, ddphooks.attach; assert not [m for m in sys.modules if m.startswith('deepspeed')], 'deepspeed imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_train.py"


def _torchrun(out: Path, *scenarios: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(out), *scenarios]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


@pytest.fixture(scope="module")
def integrations(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("deepspeed")
    _torchrun(out, "trainer", "trainer-json")
    _torchrun(out, "accelerate")  # Accelerate takes one DeepSpeed plugin per process
    return out


@pytest.mark.parametrize(("scenario", "stage", "accumulation"), [("trainer", 2, "micro_batch_norms"), ("trainer-json", 3, "exact")])
def test_trainer_with_deepspeed_config(integrations, scenario, stage, accumulation):
    result = json.loads((integrations / f"{scenario}-rank0.json").read_text())
    assert (result["engine"], result["state"]) == ("DeepSpeedEngine", "DeepSpeedSilentState")
    records = [json.loads(line) for line in (integrations / scenario / "ddphooks" / "stats.jsonl").read_text().splitlines()]
    logs = [entry for entry in result["log_history"] if "grad_norm" in entry]
    assert [r["step"] for r in records] == [0, 1, 2] and len(logs) == 3
    for record, log in zip(records, logs):
        assert (record["transport"], record["accumulation"]) == (f"deepspeed-zero{stage}", accumulation)
        # the Trainer logs DeepSpeed's global norm: the reduced gradient's, before clipping
        assert math.isclose(record["reduced_grad_norm"], log["grad_norm"], rel_tol=1e-5)
        assert math.isclose(log["ddphooks/reduced_grad_norm"], log["grad_norm"], rel_tol=1e-5)
        assert all(math.isfinite(x) for x in record["losses"] + record["grad_norms"]) and record["world_size"] == 2


def test_accelerate_with_deepspeed_plugin(integrations):
    results = [json.loads((integrations / f"accelerate-rank{rank}.json").read_text()) for rank in range(2)]
    assert (results[0]["engine"], results[0]["state"]) == ("DeepSpeedEngine", "DeepSpeedSilentState")
    assert results[0]["num_processes"] == 2 and results[0]["losses"] != results[1]["losses"]  # the loader is sharded
    records = [json.loads(line) for line in (integrations / "accelerate.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for t, record in enumerate(records):
        assert record["transport"] == "deepspeed-zero3"
        assert math.isclose(record["reduced_grad_norm"], results[0]["grad_norms"][t], rel_tol=1e-5)
        for rank in range(2):  # the mean of the step's two micro-batch losses, as the loop saw them
            np.testing.assert_allclose(record["losses"][rank], np.mean(results[rank]["losses"][2 * t : 2 * t + 2]), rtol=1e-6)


def test_lightning_deepspeed_strategy_warns_and_does_nothing():
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from ddphooks.integrations.lightning import SilentCallback

    callback = SilentCallback()
    engine = type("DeepSpeedEngine", (torch.nn.Module,), {})()
    with pytest.warns(UserWarning, match="Lightning's DeepSpeedStrategy is not measured by this callback") as caught:
        callback.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=engine)), None)
    assert "training is unchanged" in str(caught[0].message) and callback.state is None
