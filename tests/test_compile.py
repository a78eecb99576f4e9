"""Compiled DDP: ``torch.compile(ddp_model)`` with the default DDPOptimizer gives the statistics of
eager DDP (the reference: the same model, seed and batches without compile); compiled DDP's python
reducer, which calls hooks per parameter, is refused with one clear message."""

from types import SimpleNamespace

import pytest
import torch
from test_hook import TIMEOUT, _batch, _loss, _Net
from torch.nn.parallel import DistributedDataParallel as DDP

import ddphooks
from ddphooks import SilentState, silent_hook
from ddphooks.launch import spawn

STEPS = 3


def _statistics(rank: int, compiled: bool) -> list:
    torch.manual_seed(0)
    model = DDP(_Net())  # DDP's default buckets (DDPOptimizer asserts on tiny first buckets)
    runnable = torch.compile(model) if compiled else model
    state = ddphooks.attach(runnable, sketch_dim=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for step in range(STEPS):
        loss = _loss(runnable, *_batch(rank, step))
        state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append((state.latest.step, state.latest.losses.tolist(), state.latest.grad_norms.tolist(), state.latest.weighted_mean_cosine))
    state.flush()
    return seen, state.alerts


def _check_compiled(rank: int, world: int) -> dict:
    import torch._dynamo.config

    results = {"eager": _statistics(rank, False), "compiled": _statistics(rank, True)}
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        ddphooks.attach(DDP(_Net()))
    except ValueError as error:
        results["python_reducer"] = str(error)
    finally:
        torch._dynamo.config.optimize_ddp = True
    return results


def test_compiled_ddp_gives_eager_statistics_and_the_python_reducer_is_refused():
    for results in spawn(_check_compiled, 2, timeout=TIMEOUT):
        (eager, eager_alerts), (compiled, compiled_alerts) = results["eager"], results["compiled"]
        assert [s[0] for s in compiled] == list(range(STEPS)) and compiled_alerts == eager_alerts == []
        for (_, losses, norms, cosine), (_, ref_losses, ref_norms, ref_cosine) in zip(compiled, eager):
            assert losses == pytest.approx(ref_losses, rel=1e-5) and norms == pytest.approx(ref_norms, rel=1e-5)
            assert cosine == pytest.approx(ref_cosine, rel=1e-4, abs=1e-6)
        message = results["python_reducer"]
        assert message.startswith("attach: compiled DDP with torch._dynamo.config.optimize_ddp = 'python_reducer'")
        assert "use the default optimize_ddp = True ('ddp_optimizer'" in message


def test_silent_hook_called_per_parameter_names_the_python_reducer():
    grad = torch.zeros(3)
    with pytest.raises(TypeError, match=r"silent_hook received tuple instead of a GradBucket: compiled DDP with torch._dynamo"):
        silent_hook(SilentState(), (grad, torch.nn.Parameter(grad)))


@pytest.fixture
def python_reducer():
    import torch._dynamo.config

    torch._dynamo.config.optimize_ddp = "python_reducer"
    yield
    torch._dynamo.config.optimize_ddp = True


def test_the_integrations_warn_and_stay_off_under_the_python_reducer(python_reducer, monkeypatch):
    """Monitoring never stops training: where it cannot measure, a callback says so and does nothing."""
    from ddphooks.integrations import transformers as transformers_integration
    from ddphooks.integrations.lightning import SilentCallback as LightningCallback
    from ddphooks.integrations.transformers import SilentCallback as TrainerCallback

    # A model that is no FSDP2 root (the python reducer concerns DDP only) in place of a real run.
    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(transformers_integration, "_calling_trainer", lambda: (SimpleNamespace(model_wrapped=model), None))
    trainer_callback = TrainerCallback()
    with pytest.warns(RuntimeWarning, match=r"SilentCallback does nothing for this run; training is unchanged: compiled DDP with"):
        trainer_callback.on_train_begin(None, None, None)
    lightning_callback = LightningCallback()
    with pytest.warns(UserWarning, match=r"SilentCallback: ddphooks is off for this run, training is unchanged: compiled DDP with"):
        lightning_callback.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(model=model)), None)
    assert not lightning_callback._active
