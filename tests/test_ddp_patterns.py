"""ddphooks dropped into DDP code it never saw: every documented DDP pattern is measured correctly
or refused clearly, on real gloo process groups, against the same loop without ddphooks.

Each ``_check_*(rank, world, ...)`` runs on every rank (``ddphooks.launch.spawn``) and trains the
same model twice from the same seed: once as plain DDP would (no hook, or ``allreduce_hook``),
once with ``ddphooks.attach``; parameters are compared bitwise (W = 2, or ``allreduce_hook``'s
division) or to fp32 rounding where the reference divides in another order.
"""

import json
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from test_hook import _Messages, _Net, _spawn_cases

import ddphooks
from ddphooks import JsonlSink
from ddphooks.launch import spawn

TIMEOUT = 180
BUCKET_CAP_MB = 0.002  # about 500 fp32 elements a bucket: three buckets in the small model


def _make(seed: int = 0, **ddp_kwargs) -> DDP:
    torch.manual_seed(seed)
    return DDP(_Net(), bucket_cap_mb=BUCKET_CAP_MB, **ddp_kwargs)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank)
    return torch.randn(16, 16, generator=generator) + 0.3 * rank, torch.randn(16, 8, generator=generator)


def _parameters(model: DDP) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters()]


def _read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


# -- Join: uneven inputs ---------------------------------------------------------------------------
def _train_join(rank: int, model: DDP, batches: int, divide_by_initial_world_size: bool, state=None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with Join([model], divide_by_initial_world_size=divide_by_initial_world_size):
        for step in range(batches):
            x, y = _batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            losses.append(loss.item())
            if state is not None:
                state.observe_loss(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _check_join(rank: int, world: int, counts: list[int], divide_by_initial_world_size: bool, settings: dict, path: str) -> dict:
    """Uneven inputs under Join: training as without ddphooks, joined ranks absent from the statistics."""
    reference = _make()
    if divide_by_initial_world_size:
        reference.register_comm_hook(None, allreduce_hook)  # silent_hook divides as allreduce_hook does
    _train_join(rank, reference, counts[rank], divide_by_initial_world_size)
    if not divide_by_initial_world_size:  # the flag matters: a comm hook that ignores it trains otherwise
        ignored = _make()
        ignored.register_comm_hook(None, allreduce_hook)
        _train_join(rank, ignored, counts[rank], divide_by_initial_world_size)
        assert max((a - b).abs().max().item() for a, b in zip(_parameters(ignored), _parameters(reference))) > 1e-3

    messages = _Messages()
    model = _make()
    state = ddphooks.attach(model, sinks=[JsonlSink(path)], check_replicas_every=2, **settings)
    losses = _train_join(rank, model, counts[rank], divide_by_initial_world_size, state)
    state.close()
    logging.getLogger("ddphooks").removeHandler(messages)  # the next case in this process counts its own
    got, expected = _parameters(model), _parameters(reference)
    if divide_by_initial_world_size and world == 2:
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), "training changed under Join"
    else:
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return {"alerts": state.alerts, "losses": losses, "messages": messages.messages, "steps": state.step}


JOIN_CASES = {
    "6-1": ([6, 1], True, {}),
    "6-0": ([6, 0], True, {}),
    "8-5-1-divide-by-present": ([8, 5, 1], False, {}),
    "8-5-1-compact-wire": ([8, 5, 1], True, {"gather_max_world": 2, "sampled_ranks": 2}),
}


@pytest.fixture(scope="module")
def join_runs(tmp_path_factory) -> dict:
    """Every Join case, the cases of one world size in one spawn; per case its results and file."""
    runs = {}
    for world in sorted({len(counts) for counts, _, _ in JOIN_CASES.values()}):
        cases = [(name, counts, divide, settings) for name, (counts, divide, settings) in JOIN_CASES.items() if len(counts) == world]
        paths = {name: tmp_path_factory.mktemp(f"join-{name}") / "stats.jsonl" for name, *_ in cases}
        results = _spawn_cases(world, [(name, _check_join, (counts, divide, settings, str(paths[name]))) for name, counts, divide, settings in cases], TIMEOUT)
        runs.update({name: (results[name], paths[name]) for name, *_ in cases})
    return runs


@pytest.mark.parametrize("case", list(JOIN_CASES))
def test_join_with_uneven_inputs_trains_as_plain_ddp_and_leaves_joined_ranks_out(join_runs, case):
    counts, divide, settings = JOIN_CASES[case]
    results, path = join_runs[case]
    steps = max(counts)
    assert all(r["steps"] == steps for r in results), "every rank counts the steps the others trained"
    assert all(r["alerts"] == [] for r in results), results[0]["alerts"]
    assert not any("no loss was recorded" in m for r in results for m in r["messages"]), results
    records = _read(path)
    assert [r["step"] for r in records] == list(range(steps))
    for record in records:
        step = record["step"]
        absent = [rank for rank, count in enumerate(counts) if step >= count]
        assert record["absent"] == absent, (step, record["absent"])
        present = [rank for rank in range(len(counts)) if rank not in absent]
        for rank in range(len(counts)):
            if rank in absent:
                assert record["losses"] is None or record["losses"][rank] is None
                assert record["grad_norms"][rank] is None
            else:
                assert record["losses"][rank] == pytest.approx(results[rank]["losses"][step], rel=1e-6)
        norms = [record["grad_norms"][rank] for rank in present]
        assert record["grad_norm_mean"] == pytest.approx(sum(norms) / len(norms), rel=1e-6)
        if len(present) == 1:
            assert record["grad_norm_std"] == 0.0 and record["loss_std"] == 0.0
        if record["replicas"] is not None:  # a check while a rank has joined is not a comparison
            assert record["replicas"]["ranks"] == []
            assert record["replicas"].get("absent", []) == absent
        if settings:  # the compact wire: a joined rank's cosines are unknown, the others' one step late
            assert record["wire"] == "compact" and record["cosines_step"] == (step - 1 if step else None)
            if step:
                assert all(record["cosine_loo"][rank] is None for rank in absent)
                before = [rank for rank in present if step - 1 < counts[rank]]
                assert all(record["cosine_loo"][rank] is not None for rank in before if len(before) >= 2), (step, record["cosine_loo"])


# -- two data-parallel groups in one job ------------------------------------------------------------
def _check_subgroups(rank: int, world: int, folder: str) -> dict:
    """Ranks {0, 1} and {2, 3} train two DDP models in two groups; each group's log rank writes
    (the record files of every topology: tests/test_operations.py)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    group = groups[rank // 2]
    reference = _make(seed=rank // 2, process_group=group)
    reference.register_comm_hook(group, allreduce_hook)
    model = _make(seed=rank // 2, process_group=group)
    state = ddphooks.attach(model, sinks=[JsonlSink(f"{folder}/stats-{{global_rank}}.jsonl")])
    for ddp in (reference, model):
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(4):
            x, y = _batch(rank, step)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if ddp is model:
                state.observe_loss(loss)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    state.close()
    assert all(torch.equal(a, b) for a, b in zip(_parameters(model), _parameters(reference)))
    return {"rank": state.rank, "global_ranks": state.global_ranks}


def test_two_data_parallel_groups_train_as_without_ddphooks_and_write_their_own_records(tmp_path):
    results = spawn(_check_subgroups, 4, args=(str(tmp_path),), timeout=TIMEOUT)
    for rank, result in enumerate(results):
        assert result["rank"] == rank % 2 and result["global_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats-0.jsonl", "stats-2.jsonl"]
    for first in (0, 2):
        records = _read(tmp_path / f"stats-{first}.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2, 3]  # nothing lost, nothing torn
        assert all(r["global_ranks"] == [first, first + 1] and r["world_size"] == 2 for r in records)
        assert all(r["losses"][0] > 0 for r in records)


# -- what is taken for the loss ---------------------------------------------------------------------
class _TupleLoss(torch.nn.Module):
    """nanoGPT's convention, ``(logits, loss)``, or transformers' ``return_dict=False``, ``(loss, logits)``."""

    def __init__(self, loss_first: bool) -> None:
        super().__init__()
        self.net = _Net()
        self.loss_first = loss_first

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        logits = self.net(x)
        loss = torch.nn.functional.mse_loss(logits, y)
        return (loss, logits) if self.loss_first else (logits, loss)


class _ValueHead(torch.nn.Module):
    """A value head: at batch size 1 its prediction has one element but is no loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _check_loss_capture(rank: int, world: int, kind: str) -> dict:
    messages = _Messages()
    torch.manual_seed(0)
    module = _ValueHead() if kind == "value_head" else _TupleLoss(loss_first=kind == "loss_first")
    model = DDP(module, bucket_cap_mb=BUCKET_CAP_MB)
    state = ddphooks.attach(model)
    losses = []
    for step in range(3):
        x, y = _batch(rank, step)
        if kind == "value_head":
            prediction = model(x[:1])
            loss = torch.nn.functional.mse_loss(prediction, y[:1, :1] * 10)
        else:
            output = model(x, y)
            loss = output[0] if kind == "loss_first" else output[1]
        losses.append(loss.item())
        loss.backward()
        state.flush()
        recorded = state.latest.losses
        assert recorded is None if kind == "value_head" else recorded[rank] == pytest.approx(losses[-1], rel=1e-6), (kind, recorded, losses)
    state.close()
    logging.getLogger("ddphooks").removeHandler(messages)  # the next case in this process counts its own
    return {"messages": [m for m in messages.messages if "no loss was recorded" in m]}


LOSS_KINDS = ["logits_loss", "loss_first", "value_head"]


@pytest.fixture(scope="module")
def loss_captures() -> dict:
    """Every ``_check_loss_capture`` kind on two ranks, in one spawn."""
    return _spawn_cases(2, [(kind, _check_loss_capture, (kind,)) for kind in LOSS_KINDS], TIMEOUT)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_the_loss_is_taken_only_where_it_is_unambiguous(loss_captures, kind):
    assert len(loss_captures[kind]) == 2, kind
    for rank, result in enumerate(loss_captures[kind]):
        if kind == "value_head":  # a (1, 1) prediction is not recorded as the loss, and the warning says what it was
            assert len(result["messages"]) == 1, result
            assert "a float32 tensor of shape (1, 1), requires grad: one element but not 0-dim" in result["messages"][0]
            assert "state.observe_loss(loss)" in result["messages"][0] and "unscaled" in result["messages"][0]
        else:
            assert result["messages"] == [], (kind, result)


# -- DDP's own mixed precision ----------------------------------------------------------------------
def _check_ddp_mixed_precision(rank: int, world: int) -> list[str]:
    from torch.nn.parallel.distributed import _MixedPrecision

    said = []
    for how in ("attach", "state"):
        torch.manual_seed(0)
        policy = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        model = DDP(_Net(), mixed_precision=policy)  # builds on the CPU; its forward needs an accelerator's events
        with pytest.raises(ValueError) as caught:
            ddphooks.attach(model) if how == "attach" else ddphooks.SilentState(model=model)
        said.append(str(caught.value))
    return said


def test_ddp_mixed_precision_is_refused_with_the_true_reason():
    for said in spawn(_check_ddp_mixed_precision, 2, timeout=TIMEOUT):
        for message in said:
            assert "DistributedDataParallel(mixed_precision=...) cannot be measured" in message
            assert "_reducer_allreduce_and_upcast_hook" in message and "torch.autocast" in message
            assert "comm_hook=your_hook" not in message  # the advice that cannot work


# -- decisions that size a collective are the same on every rank -----------------------------------
def _check_one_rank_unsynchronised(rank: int, world: int, path: str) -> dict:
    """Rank 0 alone runs one backward around the DDP module (its watchdog notices, and asks for a
    replica check); the replica check that follows widens every rank's slot at once."""
    model = _make()
    state = ddphooks.attach(model, sinks=[JsonlSink(path)], check_replicas_every=1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        x, y = _batch(rank, step)
        if rank == 0 and step == 2:  # a stray backward outside DDP, its gradient thrown away
            torch.nn.functional.mse_loss(model.module(x), y).backward()
            optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state.close()
    return {"alerts": [(a["kind"], a["rank"]) for a in state.alerts]}


def test_a_replica_check_one_rank_asks_for_is_made_by_every_rank(tmp_path):
    path = tmp_path / "stats.jsonl"
    results = spawn(_check_one_rank_unsynchronised, 2, args=(str(path),), timeout=TIMEOUT)
    assert results[0]["alerts"] == [("unsynchronised", 0)] and results[1]["alerts"] == [], results
    checked = [r["step"] for r in _read(path) if r["replicas"] is not None]
    assert checked == [0, 3], checked  # step 0 on schedule; rank 0 asked in step 2's slot, so step 3
    assert all(r["replicas"]["ranks"] == [] for r in _read(path) if r["replicas"] is not None)


# -- the common DDP patterns: statistics against each rank's local gradient, training unchanged ----
class _LocalNorms:
    """``allreduce_hook`` that first records this rank's local squared gradient norm per step:
    the slow, obvious reference for ``grad_norms`` (the gradient DDP hands over, accumulated
    micro-steps included)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._sum = 0.0

    @staticmethod
    def hook(state: "_LocalNorms", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        state._sum += bucket.buffer().double().pow(2).sum().item()
        if bucket.is_last():
            state.steps.append(state._sum)
            state._sum = 0.0
        return allreduce_hook(None, bucket)


class _Checkpointed(torch.nn.Module):
    """_Net with its hidden layer under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.net = _Net()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.net.inp(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.net.hidden(t)), h, use_reentrant=self.reentrant)
        return self.net.out(h)


def _pattern_model(pattern: str) -> DDP:
    torch.manual_seed(0)
    if pattern in ("reentrant_checkpoint", "checkpoint"):
        return DDP(_Checkpointed(reentrant=pattern == "reentrant_checkpoint"), bucket_cap_mb=BUCKET_CAP_MB)
    if pattern == "bf16_parameters":
        return DDP(_Net().to(torch.bfloat16), bucket_cap_mb=BUCKET_CAP_MB)
    if pattern == "compile_before_wrap":
        # DDP's default buckets: dynamo's DDPOptimizer wants the first bucket no larger than the others
        return DDP(torch.compile(_Net(), backend="aot_eager"))
    return DDP(_Net(), bucket_cap_mb=BUCKET_CAP_MB)


def _pattern_steps(rank: int, pattern: str, models: list[DDP], observe) -> list[float]:
    """Four optimizer steps of ``pattern``; returns this rank's loss of each (the micro-steps' mean)."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    micro_steps = 2 if pattern == "require_backward_grad_sync" else 1
    dtype = torch.bfloat16 if pattern == "bf16_parameters" else torch.float32
    losses = []
    for step in range(4):
        step_losses = []
        for micro in range(micro_steps):
            for index, (model, optimizer) in enumerate(zip(models, optimizers)):
                model.require_backward_grad_sync = micro == micro_steps - 1  # gradient accumulation as nanoGPT does it
                x, y = _batch(rank, 10 * step + micro + 100 * index)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=pattern == "autocast"):
                    loss = torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).float()
                observe(index, loss)
                if index == 0:
                    step_losses.append(loss.item())
                loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(sum(step_losses) / len(step_losses))
    return losses


def _check_pattern(rank: int, world: int, pattern: str) -> dict:
    count = 2 if pattern == "two_models" else 1
    references = [_pattern_model(pattern) for _ in range(count)]
    recorders = [_LocalNorms() for _ in range(count)]
    for model, recorder in zip(references, recorders):
        model.register_comm_hook(recorder, _LocalNorms.hook)
    _pattern_steps(rank, pattern, references, lambda index, loss: None)

    models = [_pattern_model(pattern) for _ in range(count)]
    states = [ddphooks.attach(model, sketch_dim=64) for model in models]
    seen = [[] for _ in range(count)]

    def observe(index: int, loss: torch.Tensor) -> None:
        states[index].observe_loss(loss)

    original_publish = [state._publish for state in states]
    for index, state in enumerate(states):  # keep every step's statistics, as the sinks would see them
        state._publish = lambda step, result, index=index: (seen[index].append(result), original_publish[index](step, result))
    losses = _pattern_steps(rank, pattern, models, observe)
    for state in states:
        state.close()
    for model, reference in zip(models, references):
        assert all(torch.equal(a, b) for a, b in zip(_parameters(model), _parameters(reference))), f"{pattern}: training changed"
    for index in range(count):
        assert [s.step for s in seen[index]] == [0, 1, 2, 3]
        got = [s.grad_norms[rank] ** 2 for s in seen[index]]
        assert got == pytest.approx(recorders[index].steps, rel=1e-4), (pattern, got, recorders[index].steps)
    assert [s.losses[rank] for s in seen[0]] == pytest.approx(losses, rel=1e-5)
    return {"alerts": [a for state in states for a in state.alerts]}


PATTERNS = ["require_backward_grad_sync", "two_models", "autocast", "bf16_parameters", "checkpoint", "reentrant_checkpoint", "compile_before_wrap"]


@pytest.fixture(scope="module")
def pattern_runs() -> dict:
    """Every pattern on two ranks, in one spawn (``_check_pattern`` asserts inside, per pattern)."""
    return _spawn_cases(2, [(pattern, _check_pattern, (pattern,)) for pattern in PATTERNS], TIMEOUT)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_common_ddp_patterns_are_measured_correctly(pattern_runs, pattern):
    assert len(pattern_runs[pattern]) == 2, pattern
    for result in pattern_runs[pattern]:
        assert result["alerts"] == [], (pattern, result["alerts"])
