"""The statistics under DeepSpeed ZeRO (stages 1, 2 and 3): a third transport.

DeepSpeed has no communication-hook API: it reduces gradients from post-accumulate-grad hooks it
registers in ``deepspeed.initialize`` (``stage_1_and_2.py`` ``create_gradient_handling_hooks``,
``stage3.py`` ``create_reduce_and_remove_grad_hooks``), through its IPG buckets. What sees each
rank's own, unreduced gradient under every stage is a tensor hook on the parameter
(``param.register_hook``): autograd runs it before accumulating into ``param.grad``, so before any
of DeepSpeed's hooks, with the full-shape local gradient even under ZeRO-3. ddphooks measures
there with the same kernel as the DDP hook and the FSDP2 transport, and at the end of the
backward that closes a gradient-accumulation step (after DeepSpeed's own backward epilogue has
reduced the last bucket) one small all-reduce of the W per-rank slots gathers the step, as under
FSDP2. Nothing of DeepSpeed's gradient path is replaced: the tensor hooks return nothing (the
gradient is unchanged) and the end of the step wraps the engine's ``_backward_epilogue`` (run by
``engine.backward`` and by a plain ``loss.backward()`` alike) without changing what it does.

Gradient accumulation (``gradient_accumulation_steps`` > 1), what a record means:

- A record is one optimizer step (one accumulation boundary). The loss is the mean of the
  micro-batches' losses; the sketch is that of the step's local gradient ``G_i = sum_m g_i,m``
  (the sketch is linear: micro-batch sketches add up exactly), so the sketched cosines are those
  of the summed local gradients; the reduced norms are those of DeepSpeed's reduced gradient
  ``gbar = (1/W) sum_i G_i``, read from each rank's partition.
- The per-parameter norms ``|G_i,p|`` need the local sum, which DeepSpeed keeps only under ZeRO-1
  (in ``param.grad``, reduced at the boundary): there each micro-batch adds
  ``|g|^2 + 2 <A, g>`` with ``A`` the sum so far, which is exact (``accumulation: "exact"``).
  ZeRO-2 and ZeRO-3 reduce every micro-batch and never hold the local sum: their norms are
  those of the micro-batches in quadrature, ``sqrt(sum_m |g_i,m,p|^2)`` (``accumulation:
  "micro_batch_norms"``), and the values derived from norms alone (``weighted_mean_cosine``,
  ``noise_scale``, the per-parameter exact cosines) then treat every micro-batch of every rank
  as its own worker against the ranks' quadrature norms: an approximation, said in the record.
  With one micro-batch per step every stage is exact.

Example::
    >>> engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    >>> state = ddphooks.attach(engine, sinks=[JsonlSink("runs/stats.jsonl")])
    >>> engine.backward(engine(**batch).loss); engine.step()
    >>> state.latest.summary()["mean_cosine"]
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ddphooks.detect import DetectorConfig
from ddphooks.identity import model_device
from ddphooks.replicas import ReplicaTensors
from ddphooks.sinks import Sink
from ddphooks.sketch import BucketPlan
from ddphooks.state import BaseSilentState, StepRecord, agree_across_ranks, stats_kernel_problem
from ddphooks.stats import BucketLayout, SilentStats

#: What this transport measures, for the one-line refusals.
SUPPORTED = (
    "ddphooks measures DeepSpeed ZeRO stages 1, 2 and 3 with fp32 or bf16 gradients kept on the device (no offload, "
    "no ZeRO++), in plain data parallelism (no pipeline, MoE or sequence parallelism)"
)
#: Record values of ``accumulation``.
EXACT, MICRO_BATCH_NORMS = "exact", "micro_batch_norms"


def deepspeed_engine(model: object) -> torch.nn.Module | None:
    """``model`` if it is a ``DeepSpeedEngine`` (or a subclass such as ``PipelineEngine``), else
    None. By class name, so nothing imports deepspeed to find out."""
    if any(cls.__name__ == "DeepSpeedEngine" for cls in type(model).__mro__):
        return model
    return None


def managed_by_deepspeed(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters belong to a DeepSpeed ZeRO optimizer (``engine.module``)."""
    return any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in module.parameters())


def unsupported_configuration(engine: torch.nn.Module) -> str | None:
    """Why ddphooks cannot measure ``engine`` (one line naming what is supported), or None.

    Read from the engine's configuration alone, so every rank finds the same answer."""

    def refuse(what: str) -> str:
        return f"ValueError: {what} is not supported: {SUPPORTED}"

    if type(engine).__name__ == "PipelineEngine" or any(c.__name__ == "PipelineEngine" for c in type(engine).__mro__):
        return refuse("DeepSpeed pipeline parallelism (PipelineEngine)")
    if getattr(engine, "has_moe_layers", False):
        return refuse("DeepSpeed MoE (expert parallelism, other data-parallel groups per expert)")
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3):
        return refuse(f"ZeRO stage {stage} (plain data parallelism: wrap the model in DistributedDataParallel instead)")
    for name, offload in (("offload_optimizer", engine.zero_offload_optimizer()), ("offload_param", engine.zero_offload_param())):
        device = str(getattr(getattr(offload, "device", None), "value", getattr(offload, "device", "none")))
        if offload is not None and device != "none":
            return refuse(f"ZeRO-Offload / ZeRO-Infinity (zero_optimization.{name}.device = {device!r})")
    if (engine.zero_hpz_partition_size() or 1) > 1:
        return refuse(f"ZeRO++ hierarchical partitioning (zero_hpz_partition_size = {engine.zero_hpz_partition_size()})")
    if engine.zero_quantized_gradients():
        return refuse("ZeRO++ quantized gradients (zero_quantized_gradients = true)")
    if engine.fp16_enabled():
        return refuse("fp16 with loss scaling (the local gradients carry the loss scale)")
    if getattr(engine, "optimizer", None) is None:
        return refuse("an engine without optimizer (deepspeed.initialize without an optimizer or model_parameters)")
    if hasattr(engine, "managed_gradient_accumulation") and not engine.managed_gradient_accumulation():
        return refuse("managed_gradient_accumulation = false (the boundary exists only inside step())")
    sequence = getattr(engine, "seq_parallel_group", None)
    if sequence is not None and dist.get_world_size(sequence) > 1:
        return refuse("sequence parallelism (Ulysses)")
    if getattr(engine, "is_deepcompile_enabled", lambda: False)():
        return refuse("DeepCompile (compiled graphs may bypass the Python gradient hooks)")
    if not callable(getattr(engine, "_backward_epilogue", None)):
        return refuse("this DeepSpeed version (no DeepSpeedEngine._backward_epilogue; tested with 0.19): upgrade deepspeed")
    return None


class _Step(StepRecord):
    """One optimizer step (all its micro-batches, up to the accumulation boundary)."""

    def __init__(self, step: int, instrumented: bool) -> None:
        super().__init__(step)
        self.instrumented = instrumented
        self.seen: list[bool] | None = None  # per parameter: measured once already this step
        self.accumulation = EXACT


class DeepSpeedSilentState(BaseSilentState):
    r"""``SilentState`` for a DeepSpeed ZeRO engine: the same statistics, records, detector, alerts
    and sinks as under DDP and FSDP2, measured in tensor hooks and carried in one small
    all-reduce per optimizer step.

    ``stats_kernel="auto"`` keeps the torch path here: the pass runs once per parameter, where
    the Triton kernel's launches would not pay, and the kernel is untested under DeepSpeed.

    ``ddphooks.attach(engine)`` creates it for what ``deepspeed.initialize`` returns; the arguments
    are those of :class:`ddphooks.SilentState` without the DDP-only ones.

    Per micro-batch, for every parameter ``p`` (the tensor hook, before DeepSpeed's own hooks):

    1. The local gradient ``g`` (full shape under every stage) goes through the shared kernel
       with parameter ``p``'s fixed plan (its position in the model, so every rank uses the same
       signs): ``|g|^2`` and ``s += sum_{i mod P = c} sigma_i g_i`` into the step's sketch.
    2. With an earlier micro-batch's sum ``A`` still in ``param.grad`` (ZeRO-1), the step's
       squared norm grows by ``|g|^2 + 2 <A, g>``, i.e. becomes ``|A + g|^2``; without it
       (ZeRO-2/3 reduced ``A`` away) by ``|g|^2`` (see the module docstring).

    At the end of the backward of the accumulation boundary (after DeepSpeed's backward epilogue):

    3. Each rank squares its partition of DeepSpeed's reduced gradient per parameter, in one
       multi-tensor norm (``_hp_mapping`` fragments under ZeRO-1/2, the grad partitions of
       ``safe_get_local_grad`` under ZeRO-3); the partitions are disjoint, so their sum over
       ranks is ``|gbar_p|^2``.
    4. Each rank packs ``[loss_sum, loss_count, status, |G_p|^2, sketch, fingerprints | partition
       |gbar_p|^2]`` into its row of a ``W x slot`` buffer, zeros elsewhere; one all-reduce (SUM)
       over ZeRO's data-parallel group gathers them, and ``state.latest`` becomes the step's
       ``SilentStats`` before ``backward()`` returns. The step count advances.

    Gradients are never modified and nothing of the statistics raises into backward (a failure
    is published as the step's error). The replica check compares what ZeRO keeps identical:
    the full parameters under ZeRO-1/2 (every rank holds them) and the buffers that never change
    (DeepSpeed does not synchronise buffers: see ``ddphooks.replicas``), the buffers only under ZeRO-3
    (each rank holds a different partition and nothing of it is replicated; gathered parameters
    are identical by construction, and gathering them costs an all-gather of the whole model:
    measured 65 ms per check for a 12 M-parameter model on 2 CPU ranks, 6% of its step).

    Example::
        >>> state = DeepSpeedSilentState(engine=engine, sinks=[JsonlSink("stats.jsonl")])
        >>> loss = engine(x).loss
        >>> state.observe_loss(loss)
        >>> engine.backward(loss); engine.step()
        >>> state.latest.summary()["mean_cosine"]
    """

    AUTO_TRITON = False  # see above: "auto" is the torch path under DeepSpeed

    def __init__(
        self,
        *,
        engine: torch.nn.Module | None = None,
        sketch_dim: int = 256,
        every: int = 1,
        seed: int = 0,
        sinks: Sink | list[Sink] | tuple[Sink, ...] = (),
        log_rank: int | None = 0,
        chunk_elems: int | None = None,
        stats_kernel: str = "auto",
        detail_every: int = 100,
        detail_max_world: int = 256,
        per_rank_max_world: int = 256,
        max_pending_records: int = 1024,
        detect: bool | DetectorConfig = True,
        check_replicas_every: int = 100,
        on_alert: Callable[[dict], object] | None = None,
        stop_on: tuple[str, ...] | str = (),
    ) -> None:
        settings = dict(
            sketch_dim=sketch_dim, every=every, seed=seed, log_rank=log_rank, chunk_elems=chunk_elems, stats_kernel=stats_kernel,
            detail_every=detail_every, detail_max_world=detail_max_world, per_rank_max_world=per_rank_max_world, max_pending_records=max_pending_records,
            detect=detect, check_replicas_every=check_replicas_every, stop_on=stop_on, watch_sync=False,
            gather_max_world=None,  # no compact wire for DeepSpeed's reduction yet: every rank's whole slot at any W
        )  # fmt: skip
        super().__init__(settings, sinks=sinks, on_alert=on_alert)
        self._engine = None
        if engine is not None and dist.is_available() and dist.is_initialized():
            self.bind(engine)

    def bind(self, engine: torch.nn.Module) -> "DeepSpeedSilentState":
        """Bind to the ``DeepSpeedEngine`` and register the gradient hooks.

        A collective over ZeRO's data-parallel group: call it on every rank after
        ``deepspeed.initialize``. Unsupported configurations raise the same one-line
        ``ValueError`` on every rank. Binding twice is a no-op for the same engine and an error
        for another one.
        """
        if self._bound:
            if engine is self._engine:
                return self
            raise RuntimeError("this SilentState is already bound to another DeepSpeed engine: create one state per engine")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized: call deepspeed.initialize(...) (or init_process_group) first")
        if deepspeed_engine(engine) is None:
            raise TypeError(f"DeepSpeedSilentState needs the DeepSpeedEngine deepspeed.initialize returns, got {type(engine).__name__}")
        problem = self._problem or unsupported_configuration(engine) or stats_kernel_problem(self.config, engine.module)
        group = getattr(getattr(engine, "optimizer", None), "dp_process_group", None) or getattr(engine, "seq_data_parallel_group", None)
        ranks = agree_across_ranks(group, self._settings, problem, model_device(engine.module))
        self._bind_common(group if group is not None else dist.group.WORLD, ranks)
        self._engine = engine
        self._stage = engine.zero_optimization_stage()
        named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._names = tuple(name for name, _ in named)
        self._numels = tuple(int(p.ds_numel) if hasattr(p, "ds_numel") else p.numel() for p in self._params)
        self._layout = BucketLayout(0, self._names, self._numels)
        # The local sum of earlier micro-batches stays in param.grad only under ZeRO-1's own
        # optimizer (BF16_Optimizer and the fp16 grad_accum attribute keep it elsewhere).
        optimizer = engine.optimizer
        self._local_sum_in_grad = (
            self._stage == 1 and type(optimizer).__name__ == "DeepSpeedZeroOptimizer" and not getattr(optimizer, "use_grad_accum_attribute", False)
        )  # fmt: skip
        # Made at the first step on the gradients' device (and again only if it changes): each
        # parameter's plan and its one-element views of the norms, so that a hook only indexes.
        self._plans: list[BucketPlan] = []
        self._per_param: list[tuple[BucketPlan, torch.Tensor, torch.Tensor]] = []
        self._step_kernel = None  # the statistics kernel of that device
        self._local_sq: torch.Tensor | None = None  # fp32, |G_p|^2 of this step per parameter
        self._scratch: torch.Tensor | None = None  # fp32, one micro-batch's |g_p|^2 per parameter
        self._partition_index: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last _reduced_partitions indices, as a tensor
        self._slots: torch.Tensor | None = None
        self._current: _Step | None = None
        self._said: set[str] = set()
        # Replica check: ZeRO-1/2 hold the full parameters on every rank, ZeRO-3 one partition each;
        # DeepSpeed never synchronises buffers: only those that do not change are compared (ddphooks.replicas).
        self._replica_tensors = None if not self.config.check_replicas_every else ReplicaTensors(
            list(engine.module.named_parameters()) if self._stage < 3 else [], engine.module, broadcast_buffers=False,
        )  # fmt: skip
        self._handles = [p.register_hook(self._hook(j)) for j, p in enumerate(self._params)]
        epilogue = engine._backward_epilogue

        def backward_epilogue(*args, **kwargs):
            result = epilogue(*args, **kwargs)
            self._after_backward()
            return result

        engine._backward_epilogue = backward_epilogue
        self._bound = True
        return self

    # -- per parameter, per micro-batch ---------------------------------------------------------
    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def measure(grad: torch.Tensor) -> None:
            self._measure(index, grad)  # returns None: the gradient is unchanged

        return measure

    def _open(self, device: torch.device) -> _Step:
        """The current step; opens it (and hands the previous one to the pipeline) at its first hook."""
        record = self._current
        if record is None:
            self._pipeline.process()  # the previous step to the detector, alerts of the one before
            record = self._current = _Step(self.step, self._instrumented(self.step))
            if record.instrumented:
                record.seen = [False] * len(self._params)
                if self._local_sq is None or self._local_sq.device != device:
                    self._prepare_device(device)
                    self._reset_sketch(device)
                else:  # the step's norms and sketch zeroed in one operation
                    torch._foreach_zero_([self._local_sq, *([self._sketch] if self.bins else [])])
        return record

    def _prepare_device(self, device: torch.device) -> None:
        """The per-parameter plans and norms of ``device``, once: parameter ``j``'s plan starts
        where parameter ``j - 1``'s ends (the same positions, so the same signs, on every rank)."""
        n_params = len(self._params)
        self._local_sq = torch.zeros(n_params, dtype=torch.float32, device=device)
        self._scratch = torch.zeros(n_params, dtype=torch.float32, device=device)
        chunk = self._chunk_elems(device)
        plans, base = [], 0
        for numel in self._numels:
            plans.append(BucketPlan([numel], self.bins, base, device, chunk))
            base = plans[-1].end
        self._plans = plans
        # one-element views, made once: the hooks write each parameter's norm in place
        self._per_param = [(plans[j], self._local_sq[j : j + 1], self._scratch[j : j + 1]) for j in range(n_params)]
        self._step_kernel = self._kernel(device)

    def _measure(self, index: int, grad: torch.Tensor) -> None:
        record = self._current
        if record is None:
            record = self._open(grad.device)
        if not record.instrumented or record.error is not None:
            return
        try:
            flat = grad.reshape(-1)  # a view (a gradient handed to a hook does not require grad)
            plan, total, scratch = self._per_param[index]
            earlier = self._params[index].grad if self._local_sum_in_grad else None
            if earlier is not None and earlier.numel() != flat.numel():
                earlier = None
            first = not record.seen[index]
            # The first contribution of the step goes straight into the step's norms (the kernel
            # overwrites them); later ones (micro-batches, reentrant checkpointing) add up.
            out = total if first and earlier is None else scratch
            self._step_kernel.run(flat, plan, self._sketch, out)  # _sketch: None without a sketch
            if earlier is not None:
                # |A + g|^2 = |A|^2 + |g|^2 + 2 <A, g>, with |A|^2 already in total
                a = earlier.detach().reshape(-1)
                cross = torch.dot(a, flat) if a.dtype == flat.dtype == torch.float32 else torch.dot(a.float(), flat.float())
                out.add_(cross, alpha=2.0)
            elif not first:
                record.accumulation = MICRO_BATCH_NORMS  # the sum of earlier micro-batches was reduced away
            if out is not total:
                total.add_(out)
            record.seen[index] = True
        except Exception as error:  # never raise a statistics bug into backward
            record.error = error

    # -- the end of a backward ------------------------------------------------------------------
    def _after_backward(self) -> None:
        """After DeepSpeed's backward epilogue: at the accumulation boundary, gather and publish."""
        if not self._engine.is_gradient_accumulation_boundary():
            return
        record, self._current = self._current, None
        self.step += 1
        try:
            if record is None or not record.instrumented:
                return
            self._publish(record.step, self._gather(record))
        finally:
            self._losses.reset()

    def _reduced_partitions(self) -> tuple[list[int], list[torch.Tensor]]:
        """This rank's parts of DeepSpeed's reduced gradient, as (parameter indices, flat tensors):
        ZeRO-3's grad partition of each parameter, ZeRO-1/2's fragment (``_hp_mapping``) of the
        parameters whose optimizer partition lies (partly) on this rank. Views, no copies."""
        indices, parts = [], []
        if self._stage == 3:
            optimizer = self._engine.optimizer
            partitions = getattr(optimizer, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None)
            if partitions is not None:
                from deepspeed.accelerator import get_accelerator

                stream = getattr(optimizer, "reduce_and_partition_stream", None)
                if stream is not None and not get_accelerator().resolves_data_dependency():
                    stream.synchronize()  # once, where safe_get_local_grad would per parameter
            for j, param in enumerate(self._params):
                if partitions is not None:
                    part = partitions[param.ds_id].narrow(0, 0, param.partition_numel())
                else:
                    from deepspeed.utils import safe_get_local_grad

                    part = safe_get_local_grad(param)
                if part is not None and part.numel():
                    indices.append(j)
                    parts.append(part.reshape(-1))
            return indices, parts
        for j, param in enumerate(self._params):
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                continue
            fragment = mapping.get_lp_grad_fragment(param._index_in_param_group).reshape(-1)
            address = mapping.lp_fragment_address
            if fragment.numel() == param.numel() and address.numel != param.numel():
                fragment = fragment.narrow(0, address.start, address.numel)  # BF16_Optimizer keeps the whole parameter
            if fragment.numel():
                indices.append(j)
                parts.append(fragment)
        return indices, parts

    def _pack(self, record: _Step, slots: torch.Tensor, stride: int, status: int) -> None:
        """Write ``slots``: this rank's row of ``stride`` numbers (its whole slot, then the squared
        norms of the reduced partitions it holds) and zeros elsewhere (``_pack_or_fail``)."""
        slots.zero_()
        mine = slots[self.rank * stride : (self.rank + 1) * stride]
        n_params = len(self._params)
        slot = stride - n_params
        self._pack_slot([self._local_sq], record.fingerprint, mine[:slot], status)
        indices, parts = self._reduced_partitions()
        if parts:  # one multi-tensor norm over every partition, accumulated in fp32
            norms = torch._foreach_norm(parts, 2, dtype=torch.float32)
            if len(indices) == n_params and norms[0].device == mine.device:  # a part of every parameter, in order (ZeRO-3)
                torch.stack(norms, out=mine[slot:]).square_()
            else:
                mine[slot:].index_copy_(0, self._index_tensor(indices, mine.device), torch.stack(norms).square_().to(mine.device))

    def _index_tensor(self, indices: list[int], device: torch.device) -> torch.Tensor:
        """``indices`` as a tensor on ``device``, made again only when they change (the parameters
        whose partition lies on this rank are the same at every step)."""
        cached = self._partition_index
        if cached is None or cached[1].device != device or cached[0] != tuple(indices):
            cached = self._partition_index = (tuple(indices), torch.tensor(indices, dtype=torch.long, device=device))
        return cached[1]

    def _gather(self, record: _Step) -> SilentStats | BaseException:
        device = self._local_sq.device
        n_params = len(self._params)
        if self._losses.first_missing():
            self._warn_no_loss(record.step)
        record.fingerprinted, record.fingerprint = self._scheduled_fingerprint(record.step, device)
        slot, slots = self._whole_slots(n_params, len(record.fingerprinted), device)
        self._pack_or_fail(record, slots, slot + n_params, 0)  # a failure sends zeros and FAILED: every rank waits in the all-reduce
        dist.all_reduce(slots, group=self.process_group)
        accumulation = record.accumulation
        if accumulation == MICRO_BATCH_NORMS and accumulation not in self._said:
            self._said.add(accumulation)
            self._warn(
                "ddphooks: ZeRO-%d reduces every micro-batch, so the per-parameter norms of step %d are those of the "
                "micro-batches in quadrature (records say accumulation='micro_batch_norms'; sketched cosines and "
                "reduced norms stay exact); gradient_accumulation_steps=1 or ZeRO-1 gives exact norms. Said once.",
                self._stage, record.step,
            )  # fmt: skip
        try:
            return DeepSpeedStats(
                record.step, self.world_size, [self._layout], self._keep_slot_rows(slots, slot), None, self.bins,
                f"deepspeed-zero{self._stage}", record.fingerprinted, previous=self._previous_stats, accumulation=accumulation,
            )  # fmt: skip
        except Exception as error:
            return error

    def detach(self) -> None:
        """Remove the gradient hooks and restore the engine's backward epilogue (after ``close``)."""
        if not self._bound:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._engine.__dict__.pop("_backward_epilogue", None)


class DeepSpeedStats(SilentStats):
    """``SilentStats`` of a DeepSpeed step; its record also says what the per-parameter norms are
    with gradient accumulation (``accumulation``: ``"exact"`` or ``"micro_batch_norms"``, see
    ``ddphooks.deepspeed``), as one of its ``record_fields`` (which its slots carry to the
    detector's process, where the record is built)."""

    def __init__(self, *args, accumulation: str = EXACT, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.accumulation = accumulation
        self.record_fields = {"accumulation": accumulation}
