"""``attach``: one call that turns ddphooks on for a DDP, FSDP2 or DeepSpeed model, loss included.

The integrations (``ddphooks.integrations``) are thin adapters over this function.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel

from ddphooks.deepspeed import deepspeed_engine, managed_by_deepspeed
from ddphooks.hook import DDP_MIXED_PRECISION, PYTHON_REDUCER, SilentState, python_reducer, silent_hook
from ddphooks.loss import describe_output, loss_of

#: Settings of ``SilentState`` that only DDP's hook has.
DDP_ONLY_SETTINGS = {"transport", "piggyback_limit_mb", "comm_hook", "comm_state", "watch_sync"}
#: Settings of the compact wire (``ddphooks.fleet``), built for DDP's and FSDP2's transports (not DeepSpeed's).
COMPACT_WIRE_SETTINGS = {"gather_max_world", "sampled_ranks"}

#: ``loss_from(module, args, kwargs, output)``: the rank's scalar loss of one forward, or None.
LossFrom = Callable[[torch.nn.Module, tuple, dict, object], "torch.Tensor | None"]


def _default_loss_from(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> torch.Tensor | None:
    return loss_of(output)


def ddp_module(model: torch.nn.Module) -> DistributedDataParallel:
    """The ``DistributedDataParallel`` module behind ``model`` (unwrapping ``torch.compile``).

    Raises ``ValueError`` under compiled DDP's python reducer, whose per-parameter hook calls
    silent_hook cannot measure (the default DDPOptimizer keeps DDP's buckets and works)."""
    mode = python_reducer()
    if mode is not None:
        raise ValueError("attach: " + PYTHON_REDUCER.format(mode=mode))
    inner = getattr(model, "_orig_mod", model)  # torch.compile(ddp) keeps the DDP module here
    if not isinstance(inner, DistributedDataParallel):
        raise TypeError(
            f"attach needs a DistributedDataParallel module or an FSDP2 (fully_shard) root, got {type(model).__name__}"
            f"{unsupported_wrapper(inner)}: wrap the model first (DistributedDataParallel(model), fully_shard(model), the "
            "engine deepspeed.initialize returns, or the object accelerator.prepare(model) returns in a distributed run). "
            "Under Accelerate on CPU, launch with Accelerator(cpu=True) or ACCELERATE_USE_CPU=true: otherwise every "
            "process trains alone and prepare returns the model unwrapped"
        )
    return inner


def unsupported_wrapper(model: torch.nn.Module) -> str:
    """Why a known wrapper is not measured (empty for anything else)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        return " (FSDP1, FullyShardedDataParallel, is not supported: use FSDP2's fully_shard)"
    if managed_by_deepspeed(model):
        return " (its parameters belong to a DeepSpeed ZeRO optimizer: pass the DeepSpeedEngine deepspeed.initialize returns, not engine.module)"
    return ""


def sharded_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """The FSDP2 (``fully_shard``) root behind ``model`` (unwrapping ``torch.compile``), or None."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, FSDPModule) else None


def attach(model: torch.nn.Module, *, state: SilentState | None = None, loss_from: LossFrom | None = None, **settings) -> SilentState:
    """Register ``silent_hook`` on a DDP model (or measure an FSDP2 model's reduce-scatters) and
    record each rank's loss from its forward output.

    An FSDP2 or HSDP root (a module ``fully_shard`` was applied to, or ``torch.compile`` of one)
    gets a ``ddphooks.fsdp.ShardedSilentState`` instead (same API and records; see
    ``docs/integrations/fsdp2.md``), and a ``DeepSpeedEngine`` (what ``deepspeed.initialize``,
    ``accelerator.prepare`` under its DeepSpeed plugin, or ``trainer.model_wrapped`` give) a
    ``ddphooks.deepspeed.DeepSpeedSilentState`` (``docs/integrations/deepspeed.md``): steps 2
    and 4 below apply, the DDP-only settings do not. For a DDP model:

    1. Check ``model``: a ``DistributedDataParallel`` module (or ``torch.compile`` of one) with no
       other communication hook (DDP takes one; to combine, pass it as
       ``SilentState(comm_hook=...)``) and not attached before.
    2. Bind the state (``SilentState(**settings)`` unless ``state`` is given) to the model: a
       collective that checks the settings agree on every rank.
    3. Register the hook, unless this very state is already registered with ``silent_hook``
       (Lightning's ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=silent_hook)`` does that on
       CUDA): then attaching only adds the loss capture, it never registers twice.
    4. A forward hook takes the loss of every training forward (``module.training`` and grad
       enabled, so evaluation forwards do not count): ``loss_from(module, args, kwargs, output)``,
       by default what ``ddphooks.loss.loss_of`` finds: a 0-dim tensor that requires grad,
       ``output.loss``, ``output["loss"]``, or the one such tensor of a tuple such as nanoGPT's
       ``(logits, loss)``. With gradient accumulation the step's loss is the mean over the
       micro-batches; an explicit ``state.observe_loss`` in a step wins. A forward without a
       loss records none, and the first step without one logs what the output was and the line
       to add. The capture never raises into training: a failing ``loss_from`` is
       reported once and ignored.

    Args:
        model: the DDP-wrapped model, the FSDP2 root or the DeepSpeed engine (what
            ``DistributedDataParallel(...)``, ``fully_shard``, ``deepspeed.initialize`` or
            ``accelerator.prepare`` returns).
        state: an existing ``SilentState`` (created before the process group, say); else one is
            made from ``settings``.
        loss_from: how to find the rank's loss in a forward call (see above).
        **settings: ``SilentState`` keyword arguments (``sketch_dim``, ``every``, ``sinks`` ...).

    Returns the bound ``SilentState`` (``ShardedSilentState`` for FSDP2, ``DeepSpeedSilentState``
    for DeepSpeed).

    Example::
        >>> model = DistributedDataParallel(model)
        >>> state = ddphooks.attach(model, sinks=[JsonlSink("runs/stats.jsonl")])
        >>> model(**batch).loss.backward()          # the loss is recorded, statistics computed
        >>> state.latest.summary()["loss_std"]
    """
    if sharded_root(model) is not None:
        return _attach_sharded(sharded_root(model), state, loss_from, settings)
    if deepspeed_engine(model) is not None:
        return _attach_deepspeed(model, state, loss_from, settings)
    ddp = ddp_module(model)
    if state is not None and settings:
        raise TypeError(f"attach takes either state= or SilentState settings, not both (got state and {sorted(settings)})")
    if state is not None and not isinstance(state, SilentState):
        raise TypeError(f"state must be a SilentState, got {type(state).__name__}")
    if getattr(ddp, "_ddphooks_state", None) is not None:
        raise RuntimeError("ddphooks is already attached to this model; attach once per DDP model and reuse the returned state")
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError("attach: " + DDP_MIXED_PRECISION)
    hooks = list(getattr(ddp, "_comm_hooks", []))
    registered = any(hook is silent_hook and hook_state is state for hook, hook_state in hooks) if state is not None else False
    if hooks and not registered:
        names = ", ".join(getattr(hook, "__qualname__", repr(hook)) for hook, _ in hooks)
        raise RuntimeError(
            f"the model already has a communication hook ({names}) and DDP accepts only one; register ddphooks "
            "instead and let it call yours: attach(model, comm_hook=your_hook, comm_state=your_state)"
        )
    state = state if state is not None else SilentState(model=ddp, **settings)
    state.bind(ddp)
    if not registered:
        ddp.register_comm_hook(state, silent_hook)
    ddp.register_forward_hook(partial(_capture_loss, state, loss_from or _default_loss_from, set()), with_kwargs=True)
    ddp._ddphooks_state = state
    return state


def _attach_sharded(root: torch.nn.Module, state, loss_from: LossFrom | None, settings: dict):
    """``attach`` for an FSDP2 root: a ``ShardedSilentState`` measuring its reduce-scatters."""
    from ddphooks.fsdp import ShardedSilentState

    return _attach_per_step(root, state, loss_from, settings, ShardedSilentState, "ddphooks.fsdp", "an FSDP2 model", "FSDP2", "model", compact_wire=True)


def _attach_deepspeed(engine: torch.nn.Module, state, loss_from: LossFrom | None, settings: dict):
    """``attach`` for a DeepSpeed engine: a ``DeepSpeedSilentState`` measuring in gradient hooks."""
    from ddphooks.deepspeed import DeepSpeedSilentState

    return _attach_per_step(engine, state, loss_from, settings, DeepSpeedSilentState, "ddphooks.deepspeed", "a DeepSpeed engine", "DeepSpeed", "engine")


def _attach_per_step(target: torch.nn.Module, state, loss_from, settings: dict, state_class, module: str, what: str, stack: str, noun: str, compact_wire: bool = False):
    """The shared part of ``attach`` for the transports that gather a step in one all-reduce
    (FSDP2, DeepSpeed): check the arguments (the compact wire's settings only where
    ``compact_wire``), bind ``state_class``, capture the loss."""
    if state is not None and settings:
        raise TypeError(f"attach takes either state= or settings, not both (got state and {sorted(settings)})")
    if state is not None and not isinstance(state, state_class):
        raise TypeError(f"state must be a {module}.{state_class.__name__} for {what}, got {type(state).__name__}")
    ddp_only = sorted(set(settings) & DDP_ONLY_SETTINGS)
    if ddp_only:
        raise TypeError(f"{', '.join(ddp_only)} appl{'ies' if len(ddp_only) == 1 else 'y'} to DDP only; under {stack} the statistics travel in one all-reduce per step: drop {'it' if len(ddp_only) == 1 else 'them'}")
    compact = sorted(set(settings) & COMPACT_WIRE_SETTINGS)
    if compact and not compact_wire:
        raise TypeError(
            f"{', '.join(compact)} (the compact wire, ddphooks.fleet) {'is' if len(compact) == 1 else 'are'} built for DDP and FSDP2 only so far; "
            f"under {stack} every rank's whole slot travels at any world size: drop {'it' if len(compact) == 1 else 'them'}"
        )
    if getattr(target, "_ddphooks_state", None) is not None:
        raise RuntimeError(f"ddphooks is already attached to this {noun}; attach once per {noun} and reuse the returned state")
    state = state if state is not None else state_class(**settings)
    state.bind(target)
    target.register_forward_hook(partial(_capture_loss, state, loss_from or _default_loss_from, set()), with_kwargs=True)
    target._ddphooks_state = state
    return state


def _capture_loss(
    state: SilentState, loss_from: LossFrom, warned: set, module: torch.nn.Module, args: tuple, kwargs: dict, output: object
) -> None:
    # The wrapped module's mode, not the DDP wrapper's: Lightning's validation calls .eval() on the
    # wrapper and restores only the LightningModule's mode. Evaluation runs without grad anyway.
    if not (getattr(module, "module", module).training and torch.is_grad_enabled()):
        return
    if not state._instrumented(state.step):
        return
    try:
        loss = loss_from(module, args, kwargs, output)
        if loss is not None:
            state._losses.observe(loss, explicit=False)
        elif state._losses.skipped is None:  # described once, for the warning that no loss was recorded
            default = loss_from is _default_loss_from
            state._losses.skipped = describe_output(output) if default else f"{describe_output(output)}, for which loss_from returned None"
    except Exception as error:  # the capture must never break a forward
        if not warned:
            warned.add(True)
            state._warn("ddphooks: loss capture failed (%s: %s); no loss is recorded for such forwards", type(error).__name__, error)
