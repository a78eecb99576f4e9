"""``silent_hook``: a DDP communication hook that measures silent inconsistency between ranks.

This is the only module that talks to ``torch.distributed``; the numerical work lives in
``ddphooks.sketch`` (local statistics) and ``ddphooks.stats`` (reconstruction).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime
# (bucket must be dist.GradBucket, the return torch.futures.Future[torch.Tensor]).
import sys
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddphooks.config import SilentConfig
from ddphooks.detect import DetectorConfig
from ddphooks.devices import PendingHost, match_intra_op_threads
from ddphooks.identity import model_device
from ddphooks.replicas import ReplicaTensors
from ddphooks.sinks import Sink
from ddphooks.sketch import BucketPlan, BucketStatsKernel, squared_norms_of_buffers
from ddphooks.state import BaseSilentState, StepRecord, agree_across_ranks, stats_kernel_problem
from ddphooks.stats import ABSENT, REPLICA_CHECK_REQUESTED, BucketLayout, HostParts, KeptSlots, SilentStats, slot_size
from ddphooks.watchdog import SyncWatchdog

CommHook = Callable[[object, dist.GradBucket], torch.futures.Future]

#: Why compiled DDP's python reducer is refused, and what to use instead.
PYTHON_REDUCER = (
    "compiled DDP with torch._dynamo.config.optimize_ddp = {mode!r} calls communication hooks once per parameter "
    "with (grad, param) and ignores what they return, so silent_hook cannot carry or measure the step there; use "
    "the default optimize_ddp = True ('ddp_optimizer', which keeps DDP's buckets and works with ddphooks) or eager "
    "DistributedDataParallel"
)


#: Why DDP's own mixed precision is refused.
DDP_MIXED_PRECISION = (
    "DistributedDataParallel(mixed_precision=...) cannot be measured: DDP registers its own communication hook for it "
    "in its constructor (_reducer_allreduce_and_upcast_hook, which all-reduces in reduce_dtype, then upcasts parameters "
    "and gradients back), and a DDP model takes one communication hook, registered once, so silent_hook can neither "
    "replace nor wrap it. Keep the DDP model in fp32 and use torch.autocast for mixed precision (measured), or FSDP2's "
    "fully_shard(model, mp_policy=MixedPrecisionPolicy(...)) with ddphooks.attach on the root"
)


def python_reducer() -> str | None:
    """The mode of compiled DDP's python reducer if it is set (ddphooks cannot measure it), else None."""
    # Only set if the user imported dynamo's config: nothing is imported here to find out.
    mode = getattr(sys.modules.get("torch._dynamo.config"), "optimize_ddp", True)
    return mode if isinstance(mode, str) and mode.startswith("python_reducer") else None


@dataclass
class _BucketEntry:
    """What the hook keeps per bucket layout: its chunk plan, names and a norms buffer."""

    key: tuple
    plan: BucketPlan
    layout: BucketLayout
    sq_norms: torch.Tensor  # fp32, one per parameter, rewritten on every instrumented step
    final: bool = False  # built after DDP rebuilt its buckets, which it does once: the layout never changes again
    data_ptr: int = 0  # where the bucket's buffer lives (DDP keeps it from step to step)
    kernel: object = None  # the statistics kernel of the bucket's device
    end: int = 0  # plan.end: where the next bucket's positions start


class _Step(StepRecord):
    """One instrumented step, from its first bucket's hook call to its statistics.

    Every bucket but the last returns its communication future unchanged (no callback a bucket);
    the last bucket's future waits for all of them (``torch.futures.collect_all``), so the step's
    statistics are built once, in one callback, when every bucket is reduced.
    """

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.futures: list[torch.futures.Future] = []  # the buckets' communication futures, in bucket order
        self.plans: list[BucketPlan] = []


class SilentState(BaseSilentState):
    r"""State of :func:`silent_hook`: settings, per-bucket plans, and the latest statistics.

    Construct it on every rank with the same arguments. It may be created before
    ``init_process_group`` and before the DDP wrap exists (Lightning builds its strategy, and
    pickles it for spawned workers, before the process group), like PyTorch's ``PowerSGDState``:
    it then binds to its process group and model lazily, on ``bind(ddp_model)`` (``attach`` and
    the integrations call it) or on the first hook call. Created after ``init_process_group`` it
    binds at once. Binding compares the settings across ranks (one small ``all_gather_object``),
    so a mismatched value raises the same ``ValueError`` on every rank instead of hanging the
    first backward. A value that is invalid in itself raises at construction.

    Records go to the sinks from a background writer thread on the log rank (``ddphooks.writer``):
    the training thread never waits for serialisation or I/O, and a failing or slow sink is
    reported and counted (``dropped_records``), never raised into training.

    Args:
        process_group: the DDP model's process group (None: the model's, else the default group).
        model: the ``DistributedDataParallel`` module; gives parameter names and lets binding
            check the process group and the gradient dtypes.
        sketch_dim: entries of each rank's gradient sketch (0: norms and losses only).
        every: instrument steps 0, every, 2*every, ...
        seed: seed of the random projection, identical on every rank.
        transport: "auto", "piggyback" or "separate" (see :class:`SilentConfig`).
        piggyback_limit_mb: with "auto", a last bucket above this size uses the separate transport.
        sinks: where records go (``JsonlSink`` ...); written on ``log_rank`` only.
        log_rank: rank that writes to the sinks (None: every rank).
        comm_hook: another DDP hook that does the gradient communication (e.g.
            ``fp16_compress_hook``); statistics then travel separately and the reduced norms are
            those of what ``comm_hook`` returns.
        comm_state: the state ``comm_hook`` is called with (e.g. its process group).
        chunk_elems: elements per chunk of the statistics pass (None: a device default).
        stats_kernel: "auto" (the default: Triton on CUDA where it passes its check, else the
            torch path), "torch" (every device) or "triton" (one Triton kernel per bucket, CUDA
            only; see ``SilentConfig``).
        detail_every: every N-th instrumented step writes a detail record (see ``SilentConfig``).
        detail_max_world: largest world size whose detail records keep per-rank tables and the W x W
            cosine matrix (256; above it a host-by-host matrix; see ``SilentConfig``).
        per_rank_max_world: largest world size whose compact records keep one value per rank of
            each per-rank signal; above it, quantiles over ranks and the ranks that stand out (see
            ``SilentConfig``).
        gather_max_world: above this world size the statistics travel in the compact wire
            (``ddphooks.fleet``; 16 by default, None: every rank's whole slot at any W; see ``SilentConfig``).
        sampled_ranks: with the compact wire, the ranks per step whose per-parameter norms travel.
        max_pending_records: records waiting for the writer thread at most (see ``SilentConfig``).
        detect: run the online detector (``ddphooks.detect``; a ``DetectorConfig`` to set its
            thresholds) on a background thread; alerts go to ``state.alerts``, the records'
            ``alerts`` and one ``logging`` warning each on the log rank.
        check_replicas_every: every N-th instrumented step, compare fingerprints of every rank's
            parameters and buffers (carried in the statistics slot, no extra collective); the
            record's ``replicas`` says which ranks differ where (0: never).
        on_alert: called with each alert on every rank, on a thread of its own as soon as the
            detector finds it (an exception in it is logged, never raised into training). An
            ``unsynchronised`` alert reaches it where the rank notices it.
        stop_on: alert kinds (or ``"all"``) after which ``should_stop()`` turns True on every
            rank at the same step (see ``SilentConfig.stop_on``).
        watch_sync: alert (kind ``unsynchronised``) when the model gets gradients DDP should
            have synchronised but did not (see ``ddphooks.watchdog``); needs the DDP model.

    Example::
        >>> state = SilentState(model=ddp_model, sketch_dim=256, sinks=[JsonlSink("stats.jsonl")])
        >>> ddp_model.register_comm_hook(state, silent_hook)
        >>> loss = ddp_model(x).loss
        >>> state.observe_loss(loss)
        >>> loss.backward()
        >>> state.latest.summary()["mean_cosine"]
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        model: torch.nn.Module | None = None,
        sketch_dim: int = 256,
        every: int = 1,
        seed: int = 0,
        transport: str = "auto",
        piggyback_limit_mb: float = 32.0,
        sinks: Sink | list[Sink] | tuple[Sink, ...] = (),
        log_rank: int | None = 0,
        comm_hook: CommHook | None = None,
        comm_state: object = None,
        chunk_elems: int | None = None,
        stats_kernel: str = "auto",
        detail_every: int = 100,
        detail_max_world: int = 256,
        per_rank_max_world: int = 256,
        gather_max_world: int | None = 16,
        sampled_ranks: int = 16,
        max_pending_records: int = 1024,
        detect: bool | DetectorConfig = True,
        check_replicas_every: int = 100,
        on_alert: Callable[[dict], object] | None = None,
        stop_on: tuple[str, ...] | str = (),
        watch_sync: bool = True,
    ) -> None:
        settings = dict(
            sketch_dim=sketch_dim, every=every, seed=seed, transport=transport, piggyback_limit_mb=piggyback_limit_mb,
            log_rank=log_rank, chunk_elems=chunk_elems, stats_kernel=stats_kernel, detail_every=detail_every, detail_max_world=detail_max_world, per_rank_max_world=per_rank_max_world,
            gather_max_world=gather_max_world, sampled_ranks=sampled_ranks, max_pending_records=max_pending_records, detect=detect, check_replicas_every=check_replicas_every, stop_on=stop_on,
            watch_sync=watch_sync,
        )  # fmt: skip
        super().__init__(settings, sinks=sinks, on_alert=on_alert)
        # -- user knobs ------------------------------------------------------------------------
        self.process_group = process_group
        self.comm_hook = comm_hook
        self.comm_state = comm_state
        if dist.is_available() and dist.is_initialized():
            self._bind(model, self._problem)

    # -- binding -------------------------------------------------------------------------------
    def bind(self, model: torch.nn.Module | None = None) -> "SilentState":
        """Bind to the process group (and the DDP ``model``, for parameter names and checks).

        A collective: call it on every rank, after ``init_process_group``. Binding twice is a
        no-op for the same model and an error for another one.
        """
        if self._bound:
            if model is None or model is self._model:
                return self
            if self._model is not None:
                raise RuntimeError("this SilentState is already bound to another DDP model: create one SilentState per model")
            # Bound without a model (created after init_process_group): adopt its parameter names.
            _resolve_group(self.process_group, model, self.config, self.comm_hook)
            self._model = model
            self._names = {id(p): name for name, p in model.module.named_parameters()}
            self._replica_tensors = self._replica_set(model)
            self._watchdog = self._watch(model)
            self._watch_forwards(model)
            return self
        self._bind(model, None)
        return self

    def _bind(self, model: torch.nn.Module | None, problem: str | None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group(...) and wrap the "
                "model in DistributedDataParallel before the SilentState is bound (its first backward, or bind/attach)"
            )
        group = self.process_group
        if problem is None:
            try:
                group = _resolve_group(self.process_group, model, self.config, self.comm_hook)
            except (TypeError, ValueError) as error:
                problem = f"{type(error).__name__}: {error}"
            problem = problem or stats_kernel_problem(self.config, model)
        settings = dict(self._settings, comm_hook=None if self.comm_hook is None else getattr(self.comm_hook, "__qualname__", repr(self.comm_hook)))
        # With the model the slot carries replica fingerprints: every rank must have it, or none.
        settings["model"] = None if model is None else type(model).__name__
        # Exchange over a group every rank derives the same way, even where its own checks failed.
        exchange_group = self.process_group if self.process_group is not None else getattr(model, "process_group", None)
        ranks = agree_across_ranks(exchange_group, settings, problem, model_device(model))

        self._bind_common(group if group is not None else dist.group.WORLD, ranks)
        self._model = model
        self._names = {} if model is None else {id(p): name for name, p in model.module.named_parameters()}
        self._buckets: dict[int, _BucketEntry] = {}
        self._piggyback: torch.Tensor | None = None  # last bucket / W followed by W slots
        self._separate: torch.Tensor | None = None  # W slots, for the separate transport
        self._current: _Step | None = None
        self._replica_tensors = self._replica_set(model)
        self._replica_warned = False
        self._watchdog = self._watch(model)
        # -- the step's ranks: DDP's Join ----------------------------------------------------------
        self._synced_steps = 0  # steps this state has seen DDP synchronise (the same on every rank)
        self._forward_since_step = False  # a training forward ran on this rank since the last step
        self._joined = False  # this rank has joined under Join: DDP's join hook reduces zeros for it
        self._divisor: torch.Tensor | None = None  # the ranks present this step, where the average is over them
        self._watch_forwards(model)
        self._bound = True

    def _watch_forwards(self, model: torch.nn.Module | None) -> None:
        """Note every training forward of ``model``: under DDP's ``Join`` a rank whose hook runs
        with no forward since the last step has joined (DDP's join hook reduces zeros for it)."""
        if model is not None:
            model.register_forward_pre_hook(torch.compiler.disable(lambda module, args: self._note_forward()))

    def _note_forward(self) -> None:
        if torch.is_grad_enabled():
            self._forward_since_step = True

    def _start_step(self, bucket: dist.GradBucket) -> None:
        """At a step's first bucket: whether this rank has joined, and what the gradients are
        divided by (every step, instrumented or not: it is part of the training).

        Under ``Join`` a joined rank's hook is called by DDP's join hook with zero buckets for
        every step the others train. With ``divide_by_initial_world_size=False`` plain DDP averages
        over the ranks that have not joined, a number it does not hand to a communication hook:
        one 1-element all-reduce of each rank's presence gives it (only in that configuration).
        """
        model = self._model
        join = model is not None and getattr(getattr(model, "_join_config", None), "enable", False)
        self._joined = join and not self._forward_since_step
        self._divisor = None
        if join and self.comm_hook is None and not getattr(model, "_divide_by_initial_world_size", True):
            buffer = bucket.buffer()  # asked only here: the hook's hot path reads it once, later
            present = torch.full((1,), 0.0 if self._joined else 1.0, dtype=buffer.dtype, device=buffer.device)
            dist.all_reduce(present, group=self.process_group)
            self._divisor = present

    def _watch(self, model: torch.nn.Module | None) -> SyncWatchdog | None:
        """The synchronisation watchdog of ``model`` (None without a model or with watch_sync off)."""
        if model is None or not self.config.watch_sync:
            return None
        return SyncWatchdog(model, self._pipeline.raise_alert, self._pipeline.warn, self.rank, lambda: self.step)

    def _replica_set(self, model: torch.nn.Module | None) -> ReplicaTensors | None:
        """What the replica check fingerprints (see ``ddphooks.replicas``): every parameter, and
        the buffers as DDP broadcast them at the start of the forward (captured by a forward
        pre-hook of the wrapped module) or, with ``broadcast_buffers=False``, those that did not
        change. None with the check off or without a model."""
        if not self.config.check_replicas_every or model is None:
            return None
        broadcast = bool(model.broadcast_buffers) and getattr(model, "buffer_hook", None) is None
        replicas = ReplicaTensors(list(model.module.named_parameters()), model.module, broadcast)
        if broadcast and replicas.buffer_names:
            model.module.register_forward_pre_hook(self._capture_broadcast_buffers)
        return replicas

    def _capture_broadcast_buffers(self, module: torch.nn.Module, args: tuple) -> None:
        """Forward pre-hook of the wrapped module: DDP has just broadcast rank 0's buffers."""
        if self._replica_tensors is not None and self._replica_due(self.step):
            try:
                self._replica_tensors.capture_broadcast(self.step)
            except Exception as error:  # never raise into the forward: this step compares unchanged buffers only
                self._warn("ddphooks: the replica check could not fingerprint the broadcast buffers at step %d: %r", self.step, error)

    def _before_flush(self) -> None:
        if self._watchdog is not None:
            self._watchdog.check()  # the last backward, if nothing came after it

    # -- helpers used by silent_hook -----------------------------------------------------------
    def _replica_due(self, step: int) -> bool:
        """Whether ``step`` checks the replicas (no side effect). The same on every rank by
        construction, since it changes the slot's size: on schedule, or when a rank asked for it
        in the previous instrumented step's slot (every rank holds the same gathered slots)."""
        every = self.config.check_replicas_every
        if not (every and self._instrumented(step)):
            return False
        requested = self._previous_stats is not None and self._previous_stats.replica_check_requested
        return requested or (step // self.config.every) % every == 0

    def _slot_status(self, record: "_Step") -> int:
        """The status flags of this rank's slot: absent (joined), and a replica check asked for
        when the watchdog saw DDP synchronise again after unsynchronised backward passes (the
        replicas may have drifted: every rank checks them on the instrumented step after this one)."""
        status = ABSENT if record.absent else 0
        if self._watchdog is not None and self._watchdog.replica_check_due:
            self._watchdog.replica_check_due = False
            status |= REPLICA_CHECK_REQUESTED
        return status

    def _replica_check(self, step: int) -> bool:
        if not self._replica_due(step):
            return False
        if self._replica_tensors is None and not self._replica_warned:
            self._replica_warned = True
            self._warn(
                "ddphooks: the replica check (check_replicas_every=%d) needs the DDP model to fingerprint its parameters "
                "and buffers; it is off for this state: use ddphooks.attach(model, ...), SilentState(model=...) or "
                "check_replicas_every=0", self.config.check_replicas_every,
            )  # fmt: skip
        return self._replica_tensors is not None

    def _buckets_final(self) -> bool:
        """Whether DDP's bucket layout is the one it keeps: DDP rebuilds its buckets once, in the
        forward after the first synchronised backward (in the order the gradients became ready;
        a joined rank in DDP's join hook), unless it finds unused parameters without a static
        graph. It decides the transport, so the size of a collective: it is read from what every
        rank shares (the steps this state has seen synchronised, the model's settings), never
        from DDP's own flag, which a rank that has joined under ``Join`` never sets."""
        model = self._model
        if self._synced_steps >= 1:
            return True
        return model is not None and bool(model.find_unused_parameters and not model.static_graph)

    def _communicate(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """The gradient communication itself: ``allreduce_hook`` or the wrapped hook."""
        if self.comm_hook is not None:
            return self.comm_hook(self.comm_state, bucket)
        if self._divisor is None:
            return allreduce_hook(self.process_group, bucket)
        # allreduce_hook's steps with the present ranks' count for W (see _start_step).
        buffer = bucket.buffer().div_(self._divisor)
        return dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future().then(lambda future: future.value()[0])

    def _piggybacks(self, buffer: torch.Tensor) -> bool:
        """Whether the last bucket, ``buffer``, carries the slots in its own all-reduce (see
        ``SilentConfig.transport``); raises for a "piggyback" it cannot carry."""
        transport = self.config.transport
        piggyback = self.comm_hook is None and transport != "separate" and buffer.dtype == torch.float32
        if transport == "piggyback" and not piggyback:
            raise ValueError(f"transport='piggyback' needs fp32 gradient buckets, got {buffer.dtype}; use transport='auto'")
        if transport == "auto" and buffer.numel() * buffer.element_size() > self.config.piggyback_limit_mb * 2**20:
            piggyback = False  # keep the persistent copy of the last bucket bounded (a large embedding, say)
        if transport == "auto" and not self._buckets_final():
            piggyback = False  # DDP rebuilds its buckets after the first step: size the copy once, for the final last bucket
        return piggyback

    def _divides_in_pass(self, kernel: object, buffer: torch.Tensor) -> bool:
        """Whether ``kernel`` does allreduce_hook's division by W in its statistics pass: a kernel
        that can (the Triton kernel) and does it bitwise as torch does on this device for this
        dtype and W (checked once, ``divides_like_torch``), for the plain average (no comm_hook,
        not the present ranks' count under Join)."""
        divides_like_torch = getattr(kernel, "divides_like_torch", None)
        return divides_like_torch is not None and self.comm_hook is None and self._divisor is None and divides_like_torch(buffer.dtype, self.world_size)

    def _entry(self, bucket: dist.GradBucket, buffer: torch.Tensor, index: int | None = None) -> _BucketEntry:
        """The plan of this bucket's layout; rebuilt when DDP rebuilds its buckets."""
        index = bucket.index() if index is None else index
        # Positions in the model: the buckets one after the other. DDP reduces its buckets in index
        # order on every rank, so bucket index - 1 has its plan already and the positions agree.
        previous = self._buckets.get(index - 1)
        if index and previous is None:
            raise RuntimeError(f"silent_hook saw bucket {index} before bucket {index - 1}; DDP reduces its buckets in order")
        base = previous.end if index else 0
        entry = self._buckets.get(index)
        if entry is not None and entry.final and entry.data_ptr == buffer.data_ptr() and entry.key[-1] == base and entry.key[0] == buffer.numel() and entry.key[1] == buffer.dtype:
            # DDP rebuilds its buckets once: after that, the same buffer (its address: the same
            # device) holds the same parameters, and bucket.parameters() (a new Python tensor for
            # each parameter) is not asked again.
            return entry
        params = bucket.parameters()
        key = (buffer.numel(), buffer.dtype, buffer.device, tuple(map(id, params)), base)
        final = self._model is not None and bool(getattr(self._model, "_has_rebuilt_buckets", False))
        if entry is not None and entry.key == key:
            entry.final, entry.data_ptr = final, buffer.data_ptr()
            return entry
        lengths = [p.numel() for p in params]
        if sum(lengths) != buffer.numel():
            raise RuntimeError(f"bucket {index} holds {buffer.numel()} elements but its parameters have {sum(lengths)}")
        kernel = self._kernel(buffer.device)
        if entry is not None:
            kernel.forget(entry.plan)
        chunk = self._chunk_elems(buffer.device)
        plan = BucketPlan(lengths, self.bins, base, buffer.device, chunk)
        names = tuple(self._names.get(id(p), f"bucket{index}.param{j}") for j, p in enumerate(params))
        sq = torch.zeros(len(lengths), dtype=torch.float32, device=buffer.device)  # zero: the Triton kernel adds into it
        entry = _BucketEntry(key, plan, BucketLayout(index, names, tuple(lengths)), sq, final, buffer.data_ptr(), kernel, plan.end)
        self._buckets[index] = entry
        return entry

    def _pack(self, record: _Step, slots: torch.Tensor, slot: int, status: int) -> None:
        """Write ``slots``: this rank's slot at its row and zeros elsewhere, or the compact wire."""
        if record.fleet is None:
            slots.zero_()
            self._pack_slot(record.local_sq, record.fingerprint, slots[self.rank * slot : (self.rank + 1) * slot], status)
            return
        self._pack_fleet(record, slots, status)

    def _open_step(self, device: torch.device, kernel: BucketStatsKernel) -> _Step:
        """At the step's first instrumented bucket: its record, and the kernel's work before the
        buckets (zeroing the sketch, or the Triton kernel's sketch copies and norms)."""
        self._current = _Step(self.step)
        self._current.absent = self._joined
        self._current.divided_by_present = self._divisor is not None
        if self.bins and (self._sketch is None or self._sketch.device != device):
            self._sketch = torch.zeros(self.bins, dtype=torch.float32, device=device)
        kernel.start_step(self._sketch if self.bins else None, [entry.sq_norms for entry in self._buckets.values()])
        return self._current

    def _end_step(self, last_index: int) -> None:
        """After the last bucket: advance the step, reset the loss, drop stale bucket plans."""
        self.step += 1
        self._synced_steps += 1
        self._forward_since_step = False
        self._current = None
        self._losses.reset()
        for index in [i for i in self._buckets if i > last_index]:
            stale = self._buckets.pop(index)
            self._kernel(stale.plan.device).forget(stale.plan)

    def _step_reduced(self, record: _Step, reduced: list[torch.Tensor], slots: torch.Tensor, slot: int) -> None:
        """Every bucket of the step is reduced (``reduced``: each bucket's averaged gradient), and
        the statistics with them (``slots``: every rank's slot of ``slot`` numbers, or the compact
        wire): copy them off the buffer (reused next step), build and publish the step's
        statistics (a communication callback: nothing raises out of it)."""
        if record.error is None:
            try:
                if record.fleet is not None:  # the wire, this rank's own inputs and the reduced norms in one array and one copy
                    self._keep_fleet(record, slots, reduced=(reduced, [layout.numels for layout in record.layouts]))
                    result = self._fleet_stats(record)
                else:  # the slots and the reduced norms in one array and one copy
                    result = SilentStats(
                        record.step,
                        self.world_size,
                        record.layouts,
                        self._keep_slots(record, slots, slot, reduced),
                        None,
                        self.bins,
                        record.transport,
                        record.fingerprinted,
                        previous=self._previous_stats,
                        divided_by_present=record.divided_by_present,
                    )
            except Exception as error:  # never let a statistics bug break the gradient future
                result = error
        else:
            result = record.error
        self._publish(record.step, result)

    def _keep_slots(self, record: _Step, slots: torch.Tensor, slot: int, reduced: list[torch.Tensor]) -> HostParts:
        """The whole slots copied off the buffer (reused next step) into one array, the reduced
        gradients' norms stacked after them (one multi-tensor norm over every bucket's averaged
        gradient, unsquared: ``KeptSlots`` squares them on the host), and that array on its way to
        the host in one copy. The parameters' views are made again every step: kept, they would
        hold a rebuilt bucket's old buffer, or a ``comm_hook``'s output, alive."""
        gathered = self.world_size * slot
        kept = torch.empty(gathered + sum(len(layout.numels) for layout in record.layouts), dtype=torch.float32, device=slots.device)
        kept[:gathered].copy_(slots)
        squared_norms_of_buffers(reduced, [layout.numels for layout in record.layouts], kept[gathered:], squared=False)
        return HostParts(PendingHost([kept]), KeptSlots(self.world_size, slot).cut)


def _resolve_group(
    process_group: dist.ProcessGroup | None, model: torch.nn.Module | None, config: SilentConfig, comm_hook: CommHook | None
) -> dist.ProcessGroup | None:
    """Check the model and process group; return the group the hook must use."""
    if model is None:
        return process_group
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"model must be the DistributedDataParallel module the hook is registered on, got {type(model).__name__}; "
            "pass model=DistributedDataParallel(module)"
        )
    if getattr(model, "mixed_precision", None) is not None:
        raise ValueError(DDP_MIXED_PRECISION)
    if process_group is not None and process_group is not model.process_group:
        raise ValueError(
            f"process_group {process_group!r} is not the process group of the DDP model ({model.process_group!r}); "
            "pass process_group=None to use the model's group"
        )
    if config.transport == "piggyback":
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        if comm_hook is not None:
            raise ValueError("transport='piggyback' cannot carry statistics through comm_hook; use transport='separate' or 'auto'")
        if dtypes - {torch.float32}:
            raise ValueError(
                f"transport='piggyback' needs fp32 gradients to carry fp32 statistics, but the model has "
                f"{sorted(str(d) for d in dtypes)}; use transport='auto' or 'separate'"
            )
    return model.process_group


def silent_hook(state: SilentState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""DDP communication hook that averages gradients exactly like ``allreduce_hook`` and
    measures how much the ranks' local gradients and losses disagree.

    On an instrumented step (``state.step % every == 0``), for every bucket:

    1. One chunked pass over the local gradient ``g`` computes ``|g_p|`` for each parameter
       ``p`` and adds the bucket's sketch ``s_c += sum_{i mod P = c} sigma_i g_i`` (P prime, signs
       shared by every rank) into the step's sketch (three or four operations a bucket on the
       torch path, one launch with the Triton kernel; the norms of all buckets are squared at
       once at the last bucket).
    2. Every bucket but the last is averaged like ``allreduce_hook``: divide by W first (to avoid
       overflow), allreduce (SUM); its future is returned as it is, with no callback of ours.
       (With the Triton kernel, step 1's pass divides, where a one-time probe shows it
       bitwise equal to ``torch.div`` on the device.)
    3. The last bucket also carries every rank's slot ``[loss_sum, loss_count, status, |g_p|^2, s]``:
       with the fp32 "piggyback" transport the allreduce runs on one persistent buffer
       ``[bucket / W | W slots]`` where each rank filled its own slot and zeroed the rest, so the
       sum gathers all slots in the same collective; otherwise one small allreduce of the slots
       follows the bucket's (the "separate" transport). Above ``gather_max_world`` ranks the
       same collective carries the compact wire instead (``ddphooks.fleet``): each rank's few
       numbers, sums over the ranks and the sampled ranks' per-parameter norms.
    4. The last bucket's future waits for every bucket's (``collect_all``); its one callback
       takes ``|gbar_p|^2`` of every parameter in one multi-tensor norm, and ``state.latest``
       becomes the step's ``SilentStats``: dispersion of losses and norms, the exact norm-weighted mean cosine from
       ``sum_{i!=j} <g_i,g_j> = W^2 |gbar|^2 - sum_i |g_i|^2``, and the sketched cosine matrix.

    Other steps take the plain ``allreduce_hook`` path with no statistics work. The step counter
    advances on ``bucket.is_last()``. Gradients are never modified beyond the average, and nothing
    in the statistics raises inside the hook: non-finite values are reported in the record, and a
    bug in a rank's pass or packing sends its slot as ``FAILED``, which leaves the step unmeasured
    on every rank (``state.latest`` raises saying so).

    Example::
        >>> state = SilentState(model=ddp_model)
        >>> ddp_model.register_comm_hook(state, silent_hook)
    """
    if not isinstance(state, SilentState):
        raise TypeError(f"silent_hook needs a SilentState as its state, got {type(state).__name__}")
    if not isinstance(bucket, dist.GradBucket):
        mode = python_reducer() or "python_reducer"
        raise TypeError(f"silent_hook received {type(bucket).__name__} instead of a GradBucket: " + PYTHON_REDUCER.format(mode=mode))
    if not state._bound:
        state.bind()  # created before the process group: bind on the first hook call (every rank is here too)
    if state._watchdog is not None:
        state._watchdog.hook_called()
    index, last = bucket.index(), bucket.is_last()
    if index == 0:
        if state._current is not None:
            raise RuntimeError(
                f"silent_hook received bucket 0 of a new step before the last bucket of step {state._current.step}: "
                "use one SilentState per DDP model"
            )
        state._pipeline.process()  # the previous step to the detector, alerts of the one before
        state._start_step(bucket)
    if not state._instrumented(state.step):
        future = state._communicate(bucket)
        if last:
            state._end_step(index)
        return future

    buffer = bucket.buffer()
    if buffer.is_sparse:
        raise NotImplementedError("silent_hook does not handle sparse gradients (nn.Embedding(sparse=True)); use dense gradients")
    entry = state._entry(bucket, buffer, index)
    kernel = entry.kernel
    record = state._current or state._open_step(buffer.device, kernel)
    piggyback = last and state._piggybacks(buffer)
    # The Triton kernel divides by W in its pass, bitwise as allreduce_hook would (one launch fewer:
    # on a GPU the host's launches bound the step); the piggyback divides into its own buffer.
    divided = not piggyback and state._divides_in_pass(kernel, buffer)
    sketch = state._sketch if state.bins else None
    if divided:
        # Not guarded: a pass that failed may or may not have divided the bucket, and training must
        # stay what allreduce_hook gives (the kernel passed its check against torch on this device).
        kernel.accumulate(buffer, entry.plan, sketch, entry.sq_norms, divide_by=state.world_size)
    else:
        try:  # a statistics bug fails the step's statistics, never the backward (_pack_or_fail)
            kernel.accumulate(buffer, entry.plan, sketch, entry.sq_norms)
        except Exception as error:
            record.error = record.error or error
    record.plans.append(entry.plan)
    record.layouts.append(entry.layout)
    record.local_sq.append(entry.sq_norms)

    if not last:
        future = _all_reduce_divided(state, buffer) if divided else state._communicate(bucket)
        record.futures.append(future)
        return future

    # The last bucket: every other bucket's statistics are known, pack this rank's slot.
    try:
        record.local_sq, record.local_norms = kernel.finish_step(sketch, record.local_sq)  # the step's squared norms and sketch, once for all buckets
    except Exception as error:
        record.error = record.error or error
    world = state.world_size
    if not record.absent and state._losses.first_missing():
        state._warn_no_loss(record.step)
    if state._replica_check(record.step):
        record.fingerprinted = state._replica_tensors.names
        record.fingerprint = state._replica_tensors.fingerprint(record.step)
    n_params = sum(len(layout.numels) for layout in record.layouts)
    record.fleet = state._fleet_layout(record, n_params)
    if record.fleet is None:
        slot = slot_size(n_params, state.bins, len(record.fingerprinted))
        wire, widest = world * slot, world * slot_size(n_params, state.bins, len(state._replica_tensors or ()))
    else:  # the compact wire
        slot = wire = record.fleet.size
        widest = state._fleet_capacity(record.fleet)
    record.transport = "piggyback" if piggyback else "separate"
    status = state._slot_status(record)

    if piggyback:
        numel = buffer.numel()
        # A replica check's wider slots are the buffer's capacity, so that it is sized once.
        combined = state._stats_buffer("_piggyback", numel + wire, buffer.dtype, buffer.device, numel + widest)
        # Same division as allreduce_hook (divide first to avoid overflow), into the big buffer.
        torch.div(buffer, world if state._divisor is None else state._divisor, out=combined[:numel])
        state._pack_or_fail(record, combined[numel:], slot, status)
        future = dist.all_reduce(combined, group=state.process_group, async_op=True).get_future()
        future = torch.futures.collect_all([*record.futures, future]).then(partial(_reduced_piggyback, state, record, numel, slot))
    else:
        gradient_future = _all_reduce_divided(state, buffer) if divided else state._communicate(bucket)
        slots = state._stats_buffer("_separate", wire, torch.float32, buffer.device, widest)
        state._pack_or_fail(record, slots, slot, status)
        slots_future = dist.all_reduce(slots, group=state.process_group, async_op=True).get_future()
        every = torch.futures.collect_all([*record.futures, gradient_future, slots_future])
        future = every.then(partial(_reduced_separate, state, record, slot))
    state._end_step(index)
    return future


def _all_reduce_divided(state: SilentState, buffer: torch.Tensor) -> torch.futures.Future:
    """allreduce_hook's all-reduce of a bucket the statistics pass has already divided by W."""
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def _reduced_piggyback(state: SilentState, record: _Step, numel: int, slot: int, future: torch.futures.Future) -> torch.Tensor:
    """The step's last callback with the piggyback: the other buckets' futures, then the last
    bucket's all-reduce of ``[bucket / W | W slots]``; returns the last bucket's average."""
    match_intra_op_threads()  # gloo may run this on its own thread
    record.futures = []  # read from the collected future: the record keeps no bucket alive
    *others, own = future.value()
    combined = own.value()[0]
    gradient = combined[:numel]
    state._step_reduced(record, [other.value() for other in others] + [gradient], combined[numel:], slot)
    return gradient


def _reduced_separate(state: SilentState, record: _Step, slot: int, future: torch.futures.Future) -> torch.Tensor:
    """The step's last callback with the separate transport: the other buckets' futures, the last
    bucket's, then the slots' all-reduce; returns the last bucket's average."""
    match_intra_op_threads()  # gloo may run this on its own thread
    record.futures = []  # read from the collected future: the record keeps no bucket alive
    *buckets, slots_future = future.value()
    gradient = buckets[-1].value()
    state._step_reduced(record, [bucket.value() for bucket in buckets], slots_future.value()[0], slot)
    return gradient
