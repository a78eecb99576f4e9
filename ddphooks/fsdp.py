"""The statistics under FSDP2 and HSDP (``torch.distributed.fsdp.fully_shard``).

Every rank still computes its own local gradient before FSDP2 reduce-scatters it, so the same
statistics as under DDP exist; only how they are carried differs. ddphooks replaces each
``FSDPModule``'s reduce-scatter by one that first measures its input (this rank's unreduced
gradient of the module's parameter group) with the same kernel as the DDP hook, then runs the
default reduce-scatter unchanged. At the end of the backward pass one small all-reduce gathers
every rank's slot over the whole data-parallel mesh (the shard group under FSDP2; replicas and
shards under HSDP, whose reduce-scatter spans the shard group only).

Why a separate all-reduce rather than riding on the reduce-scatter: a reduce-scatter hands each
rank 1/W of its input, so carrying every rank's slot to every rank would need ``W`` slot copies
in each row of the last group's ``(W, C)`` buffer (a copy of the buffer, and W^2 slots), and
under HSDP the reduce-scatter does not reach the other replicas at all. One all-reduce of ``W``
slots per step (a few KB) costs no copy of any gradient. Above ``gather_max_world`` ranks FSDP2
and HSDP send the compact wire (``ddphooks.fleet``) in that all-reduce instead, whose size does not
grow with W (see ``ShardedSilentState``).

Example::
    >>> fully_shard(layer) for layer in model.layers; fully_shard(model)
    >>> state = ddphooks.attach(model, sinks=[JsonlSink("runs/stats.jsonl")])
    >>> model(**batch).loss.backward()
    >>> state.latest.summary()["mean_cosine"]
"""

import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from ddphooks import fleet, fleet_stats
from ddphooks.detect import DetectorConfig
from ddphooks.identity import model_device
from ddphooks.replicas import ReplicaTensors
from ddphooks.sinks import Sink
from ddphooks.sketch import BucketPlan, squared_norms_of_buffers
from ddphooks.state import BaseSilentState, StepRecord, agree_across_ranks, stats_kernel_problem
from ddphooks.stats import BucketLayout, SilentStats

@dataclass
class _Band:
    """Rows ``[first_row, first_row + plan.rows)`` of a group's reduce-scatter input, in the
    columns of the parameters ``params`` (from column ``column``): one run of the kernel."""

    plan: BucketPlan
    first_row: int
    params: slice
    column: int
    sq_norms: torch.Tensor | None  # the band's norms, added into the group's; None: the first band's rows, whole, write them

    def source(self, flat: torch.Tensor, width: int) -> torch.Tensor:
        """The band in ``flat`` (the group's input, rows of ``width``): the whole first rows as one
        contiguous run, or a ``(rows, columns)`` view through the row stride."""
        if self.sq_norms is None:
            return flat[: self.plan.numel]
        offset = flat.storage_offset() + self.first_row * width + self.column
        return flat.as_strided((self.plan.rows, self.plan.row_width), (width, 1), offset)


@dataclass
class _GroupEntry:
    """The plan of one FSDPModule's reduce-scatter input: ``(S, C)`` rows, each holding every
    parameter's padded shard one after the other (``S`` the shard group size), read as bands of
    rows that hold gradient (``_bands``)."""

    key: tuple
    bands: list[_Band]
    width: int  # C, the elements of one row
    layout: BucketLayout
    shard_lengths: list[int]  # padded shard of each parameter: its columns in a row, its part of the output
    sq_norms: torch.Tensor  # fp32, one per parameter (summed over the rows), rewritten on every instrumented step
    # One band of several rows and parameters (BucketStatsKernel.takes_row_norms): each parameter's
    # norm in each row, parameter by parameter, summed at the step's end with the reduced norms
    # (ShardedSilentState._shard_norms: one operation a step, not one a reduce-scatter); None: the
    # bands write sq_norms.
    row_norms: torch.Tensor | None = None


class _ShardedStep(StepRecord):
    """One synchronised backward: what each reduce-scatter measured, in call order."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.transport = "separate"  # the statistics' own all-reduce, after the reduce-scatters
        self.outputs: list[tuple[torch.Tensor, list[int]]] = []  # reduced shard, its lengths
        self.streams: list[object] = []  # where the measurements ran (accelerators)
        self.by_row: list[tuple[int, _GroupEntry]] = []  # groups measured by row: their index in local_sq
        self.sketch_written = False  # a band wrote the step's sketch (over the step before's: no zeroing)


class _MeasuredReduceScatter(ReduceScatter):
    """FSDP2's default reduce-scatter, after measuring its input for ``state``."""

    def __init__(self, state: "ShardedSilentState", module: FSDPModule, base: int) -> None:
        self.state = state
        self.module = module
        self.base = base  # position of this group's first element in the model (sign table)
        self._default = DefaultReduceScatter()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._default.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.state._measure(self, output_tensor, input_tensor)
        return self._default(output_tensor, input_tensor, group, op, async_op)


class ShardedSilentState(BaseSilentState):
    r"""``SilentState`` for an FSDP2 (or HSDP) model: the same statistics, records, detector,
    alerts and sinks as under DDP, carried beside FSDP2's reduce-scatter.

    ``ddphooks.attach(model)`` creates it for a ``fully_shard`` root; the arguments are those of
    :class:`ddphooks.SilentState` without the DDP-only ones (``transport``,
    ``piggyback_limit_mb``, ``comm_hook``, ``comm_state``, ``watch_sync``); ``gather_max_world``
    and ``sampled_ranks`` choose the wire as under DDP (below).

    On a synchronised backward (FSDP2 skips the reduce-scatter inside
    ``set_requires_gradient_sync(False)``, which is how it accumulates gradients):

    1. Each FSDPModule's reduce-scatter input is this rank's local gradient of its parameters,
       laid out as ``S`` rows (one per shard rank), each row holding every parameter's padded
       shard. One chunked pass gives ``|g_p|^2`` of every parameter (summed over the rows) and
       adds the flat buffer into the step's sketch with signs taken at fixed positions of the
       model (each module's group at a base computed once, so every rank uses the same signs).
    2. The reduce-scatter runs unchanged; its output becomes this rank's shard of the averaged
       gradient (after HSDP's all-reduce over the replicas and FSDP's post-divide).
    3. At the end of backward (an autograd final callback, after FSDP2's own): each rank packs
       ``[loss_sum, loss_count, status, |g_p|^2, sketch, fingerprints | |gbar_p shard|^2]`` into its row
       of a ``W x slot`` buffer, zeros elsewhere, and one all-reduce (SUM) over the data-parallel
       mesh gathers them. ``|gbar_p|^2`` is the sum of the shards' squares over one replica.
       Above ``gather_max_world`` ranks (16 by default) FSDP2 and HSDP send the compact wire
       instead (``ddphooks.fleet``, as DDP does: its size does not grow with W like W slots do,
       and each rank's cosines and layer level reach the records one instrumented step late),
       with one more part: each rank adds its shards' ``|gbar_p shard|^2``, whose sum over the
       ranks is ``|gbar_p|^2`` (``FleetLayout.reduced``; R times it under HSDP, whose R
       replicas hold the same shards: divided by R). Under HSDP the compact replica check sums
       one histogram per parameter over the rank's replica group alone (the ranks holding its
       shards, in an all-reduce of their own on check steps: ``_count_shards``), and one per
       buffer over the whole mesh, in the compact wire: its size does not grow with the
       number of shards.
    4. ``state.latest`` becomes the step's ``SilentStats`` (``FleetStats`` with the compact
       wire), before ``backward()`` returns.

    Gradients are never modified; nothing of the statistics raises into backward. The replica
    check compares fingerprints where two ranks should hold the same bits: under HSDP each
    parameter shard across its replicas (and the buffers); under plain FSDP2, where no two ranks
    hold the same shard, the buffers only.

    Example::
        >>> state = ShardedSilentState(model=fsdp_root, sinks=[JsonlSink("stats.jsonl")])
        >>> loss = fsdp_root(x).loss
        >>> state.observe_loss(loss)
        >>> loss.backward()
        >>> state.latest.summary()["mean_cosine"]
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
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
        gather_max_world: int | None = 16,
        sampled_ranks: int = 16,
        max_pending_records: int = 1024,
        detect: bool | DetectorConfig = True,
        check_replicas_every: int = 100,
        on_alert: Callable[[dict], object] | None = None,
        stop_on: tuple[str, ...] | str = (),
    ) -> None:
        settings = dict(
            sketch_dim=sketch_dim, every=every, seed=seed, log_rank=log_rank, chunk_elems=chunk_elems, stats_kernel=stats_kernel,
            detail_every=detail_every, detail_max_world=detail_max_world, per_rank_max_world=per_rank_max_world,
            gather_max_world=gather_max_world, sampled_ranks=sampled_ranks, max_pending_records=max_pending_records,
            detect=detect, check_replicas_every=check_replicas_every, stop_on=stop_on, watch_sync=False,
        )  # fmt: skip
        super().__init__(settings, sinks=sinks, on_alert=on_alert)
        self._model = None
        if model is not None and dist.is_available() and dist.is_initialized():
            self.bind(model)

    def bind(self, model: torch.nn.Module) -> "ShardedSilentState":
        """Bind to the FSDP2 root ``model`` and measure its reduce-scatters.

        A collective over the data-parallel mesh: call it on every rank after ``fully_shard``.
        Binding twice is a no-op for the same model and an error for another one.
        """
        if self._bound:
            if model is self._model:
                return self
            raise RuntimeError("this SilentState is already bound to another FSDP2 model: create one state per model")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized: call init_process_group(...) and fully_shard the model first")
        modules, mesh_info = _fsdp_modules(model)
        group = _data_parallel_group(mesh_info)
        ranks = agree_across_ranks(group, self._settings, self._problem or stats_kernel_problem(self.config, model), model_device(model))
        self._bind_common(group, ranks)
        self._model = model
        self._module_names = {id(module): name for name, module in model.named_modules()}
        self._shards = mesh_info.shard_mesh_size
        self._replicas = self.world_size // self._shards
        self._current: _ShardedStep | None = None
        self._entries: dict[int, _GroupEntry] = {}
        self._slots: torch.Tensor | None = None
        self._lock = threading.Lock()  # reduce-scatters of one backward may come from autograd's device threads
        self._said: set[str] = set()
        self._partial_reduce = False  # a micro-step reduce-scattered without the HSDP all-reduce
        self._replicate_group = mesh_info.replicate_process_group if self._replicas > 1 else None  # the ranks holding this rank's shards
        self._shard_counts: torch.Tensor | None = None
        self._step_norms: torch.Tensor | None = None  # the reduced and the by-row local squared norms of a step
        # Replica check: under HSDP the parameter shards (flat rank r * S + s holds shard s), and the buffers.
        sharded = self._replicas > 1
        self._replica_groups = [[r * self._shards + s for r in range(self._replicas)] for s in range(self._shards)] if sharded else None
        # FSDP2 never synchronises buffers: only those that do not change are compared (ddphooks.replicas).
        self._replica_tensors = None if not self.config.check_replicas_every else ReplicaTensors(
            [(name, p.to_local() if hasattr(p, "to_local") else p) for name, p in model.named_parameters() if sharded],
            model, broadcast_buffers=False,
        )  # fmt: skip
        base = 0
        for module in modules:  # fixed positions, whatever order the reduce-scatters come in
            comm = _MeasuredReduceScatter(self, module, base)
            module.set_custom_reduce_scatter(comm)
            params = _param_group(module).fsdp_params
            numel = self._shards * (sum(p.padded_sharded_param_size.numel() for p in params) + self.bins)  # a bin a row: _entry
            base = BucketPlan([numel], self.bins, base, torch.device("cpu"), 1 << 20).end
        self._bound = True
        return self

    # -- one reduce-scatter -----------------------------------------------------------------------
    def _measure(self, comm: _MeasuredReduceScatter, output: torch.Tensor, flat: torch.Tensor) -> None:
        """Measure one group's reduce-scatter input; opens the step at its first group."""
        group = _param_group(comm.module)
        if not group.all_reduce_grads:  # HSDP accumulating reduce-scattered shards without all-reduce
            self._partial_reduce = True
            return
        with self._lock:
            record = self._current
            if record is None:
                self._pipeline.process()  # the previous step to the detector, alerts of the one before
                record = self._current = _ShardedStep(self.step)
                self._sketch_on(flat.device)  # not zeroed: the step's first band writes over it
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_step)
            if not self._instrumented(record.step):
                return
            try:  # the layout is the same on every rank, so a failure here fails alike everywhere
                entry = self._entry(comm, group, flat)
            except Exception as error:
                record.error = error
                return
            record.layouts.append(entry.layout)
            record.local_sq.append(entry.sq_norms)
            record.outputs.append((output, entry.shard_lengths))
            try:  # what the bands leave out is FSDP2's zero padding (see _entry)
                kernel, sketch = self._kernel(flat.device), self._sketch if self.bins else None
                for band in entry.bands:
                    overwrite, record.sketch_written = not record.sketch_written, True
                    if entry.row_norms is not None:  # its one band: its norms summed by row at the step's end
                        kernel.run(band.source(flat, entry.width), band.plan, sketch, entry.sq_norms, row_norms=entry.row_norms, overwrite_sketch=overwrite)
                        record.by_row.append((len(record.local_sq) - 1, entry))
                    elif band.sq_norms is None:
                        kernel.run(band.source(flat, entry.width), band.plan, sketch, entry.sq_norms, overwrite_sketch=overwrite)
                    else:
                        kernel.run(band.source(flat, entry.width), band.plan, sketch, band.sq_norms, overwrite_sketch=overwrite)
                        entry.sq_norms[band.params].add_(band.sq_norms)
                if flat.device.type != "cpu":
                    record.streams.append(torch.accelerator.current_stream(flat.device))
            except Exception as error:  # never raise a statistics bug into backward: the step is FAILED (_gather)
                record.error = record.error or error

    def _entry(self, comm: _MeasuredReduceScatter, group, flat: torch.Tensor) -> _GroupEntry:
        """The plan of this group's layout; rebuilt when the parameters that got a gradient change."""
        # The group's size fixes its layout: look the plan up before walking the parameters.
        key = (flat.numel(), flat.dtype, flat.device, comm.base)
        entry = self._entries.get(id(comm))
        if entry is not None and entry.key == key:
            return entry
        params = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
        lengths = [p.padded_sharded_param_size.numel() for p in params]
        if self._shards * sum(lengths) != flat.numel():
            params = list(group.fsdp_params)
            lengths = [p.padded_sharded_param_size.numel() for p in params]
        if self._shards * sum(lengths) == flat.numel():
            names = tuple(self._param_name(p, j) for j, p in enumerate(params))
            numels = tuple(p._orig_size.numel() for p in params)
        else:
            # Some parameters got no gradient this step: FSDP2 leaves them out of the layout and
            # nothing says which. Measure the group as one unit (norms, sketch and cosine stay
            # exact) and say so once.
            fqn = getattr(group, "_module_fqn", "") or "model"
            lengths, names, numels = [flat.numel() // self._shards], (f"{fqn}.(parameters with gradients)",), (flat.numel(),)
            params = []  # one unit: no parameter's rows to go by
            self._say_once(
                "unused",
                "ddphooks: some parameters of FSDP module %r got no gradient, so its per-parameter norms are recorded as "
                "one entry %r; FSDPModule.set_reduce_scatter_unused_params(True) keeps the layout fixed", fqn, names[0],
            )  # fmt: skip
        kernel = self._kernel(flat.device)
        for band in entry.bands if entry is not None else []:
            kernel.forget(band.plan)
        chunk = self._chunk_elems(flat.device)
        # One row per shard, each parameter's shard in the same columns of every row: the kernel
        # takes the sketch and the norms by column in one pass. With more shards than a parameter
        # has rows along dim 0, FSDP2 pads the rest with zeros (3.3x the gradient at 1024 shards for
        # the 16 M tiny Llama), which add nothing: the kernel reads the bands that hold gradient,
        # the first rows whole, then the columns of the parameters that still have rows, a chunk
        # of rows at a time. Every band starts at a bin 0 of the sketch, at the next free
        # position of the group's (bind reserves a bin a row for that).
        bands, base = [], comm.base
        width = sum(lengths)
        for first, end, j0, j1 in _bands(params, lengths, self._shards):
            columns = sum(lengths[j0:j1])
            whole = not bands
            step = end - first if whole else max(1, (max(self.bins, chunk // self.bins * self.bins) if self.bins else chunk) // columns)
            for row in range(first, end, step):
                plan = BucketPlan(lengths[j0:j1], self.bins, base, flat.device, chunk, rows=min(step, end - row))
                band_norms = None if whole else torch.empty(j1 - j0, dtype=torch.float32, device=flat.device)
                bands.append(_Band(plan, row, slice(j0, j1), sum(lengths[:j0]), band_norms))
                base = plan.end
        sq_norms = torch.empty(len(lengths), dtype=torch.float32, device=flat.device)
        by_row = len(bands) == 1 and bands[0].sq_norms is None and kernel.takes_row_norms(bands[0].plan)
        row_norms = torch.empty(len(lengths) * bands[0].plan.rows, dtype=torch.float32, device=flat.device) if by_row else None
        entry = _GroupEntry(key, bands, width, BucketLayout(len(self._entries), names, numels), lengths, sq_norms, row_norms)
        self._entries[id(comm)] = entry
        return entry

    def _param_name(self, fsdp_param, index: int) -> str:
        """The parameter's name in the model. FSDP2's ``_param_fqn`` is unset where the module's
        parameters were replaced after ``fully_shard`` (transformers' sharding at load time), so
        the name comes from the module that holds it."""
        info = fsdp_param._module_info
        module = self._module_names.get(id(info.module))
        if module is not None:
            return f"{module}.{info.param_name}" if module else info.param_name
        return fsdp_param._param_fqn or f"param{index}"

    # -- the end of a synchronised backward -----------------------------------------------------
    def _finish_step(self) -> None:
        """Gather every rank's slot over the data-parallel mesh and publish the step."""
        with self._lock:
            record, self._current = self._current, None
        self.step += 1
        try:
            if record is None or not self._instrumented(record.step):
                return
            if self._partial_reduce:
                self._partial_reduce = False
                self._say_once(
                    "partial",
                    "ddphooks: this HSDP run accumulates reduce-scattered gradients without the all-reduce "
                    "(set_requires_all_reduce(False)); such steps are not measured. Accumulate with "
                    "set_requires_gradient_sync(False) to have every step measured",
                )  # fmt: skip
                return
            self._publish(record.step, self._gather(record))
        finally:
            self._losses.reset()

    def _gather(self, record: _ShardedStep) -> SilentStats | BaseException:
        if not record.layouts:  # no group's layout could be built (_entry): alike on every rank, so none joins the all-reduce
            return record.error or RuntimeError(f"no reduce-scatter of step {record.step} was measured")
        device = record.local_sq[0].device
        if self.bins and not record.sketch_written:  # no band ran: the step before's sketch is still there
            self._sketch.zero_()
        if record.streams:  # accelerators: the measurements ran on FSDP2's reduce-scatter stream
            current = torch.accelerator.current_stream(device)
            for stream in record.streams:
                current.wait_stream(stream)
            for output, _ in record.outputs:  # allocated there, read here: not reused before that
                output.record_stream(current)
        if self._losses.first_missing():
            self._warn_no_loss(record.step)
        n_params = sum(len(layout.names) for layout in record.layouts)
        record.fingerprinted, record.fingerprint = self._scheduled_fingerprint(record.step, device)
        record.fleet = self._fleet_layout(record, n_params, reduced=n_params)  # with the shards' summed reduced norms
        if record.fleet is not None and record.fleet.sharded:
            self._count_shards(record, device)
        if record.fleet is None:  # every rank's whole slot, then its shards' squared norms: a row of `stride`
            slot, slots = self._whole_slots(n_params, len(record.fingerprinted), device)
            stride = slot + n_params
        else:
            stride = record.fleet.size
            slots = self._stats_buffer("_slots", stride, torch.float32, device, self._fleet_capacity(record.fleet))
        self._pack_or_fail(record, slots, stride, 0)  # a failure sends zeros and FAILED: every rank waits in the all-reduce
        dist.all_reduce(slots, group=self.process_group)
        try:
            if record.fleet is not None:  # reduced_sq in the wire, divided by the replicas on the host
                self._keep_fleet(record, slots, replicas=self._replicas)
                return self._fleet_stats(record)
            return SilentStats(
                record.step, self.world_size, record.layouts, self._keep_slot_rows(slots, slot, self._replicas), None, self.bins,
                record.transport, record.fingerprinted, previous=self._previous_stats, replica_groups=self._replica_groups,
            )  # fmt: skip
        except Exception as error:
            return error

    def _sharded_fingerprints(self) -> int:
        """Under HSDP the fingerprinted parameters are this rank's shards, compared only within
        its replica group (``_count_shards``)."""
        if self._replicas > 1 and self._replica_tensors is not None:
            return len(self._replica_tensors.parameters)
        return 0

    def _count_shards(self, record: _ShardedStep, device: torch.device) -> None:
        """HSDP's compact replica check of the parameter shards: one histogram per parameter
        (``fleet.count_shards``), summed over this rank's replica group alone, the R ranks that
        hold its shards, so its size does not grow with the number of shards; each shard's first
        replica (ranks 0 to S - 1) then sends what the record needs of it in the compact wire
        (``fleet_stats.histogram_checks``). Every rank of the group takes part whatever its own statistics
        did: a rank whose counting failed adds zeros and is FAILED in the step's statistics."""
        sharded = record.fleet.sharded
        counts = self._stats_buffer("_shard_counts", sharded * (fleet_stats.FINGERPRINT_BINS + 1), torch.float32, device)
        counts = counts.view(sharded, fleet_stats.FINGERPRINT_BINS + 1)
        try:
            fleet.count_shards(record.fingerprint.to(device), counts)
        except Exception as error:  # never into backward, never a missing collective
            counts.zero_()
            record.error = record.error or error
        dist.all_reduce(counts, group=self._replicate_group)
        record.shard_counts = counts.clone()
        record.shard_checks = fleet_stats.histogram_checks(record.shard_counts) if self.rank < self._shards else None

    def _pack(self, record: _ShardedStep, slots: torch.Tensor, stride: int, status: int) -> None:
        """Write ``slots`` (``_pack_or_fail``): the compact wire, with this rank's shards' squared
        norms in the summed ``reduced_sq``, or its row of ``stride`` numbers (its whole slot, then
        its shards' squared norms) and zeros elsewhere."""
        if record.fleet is not None:
            self._pack_fleet(record, slots, status, reduced=self._shard_norms(record, record.fleet.reduced))
            return
        slots.zero_()
        mine = slots[self.rank * stride : (self.rank + 1) * stride]
        n_params = sum(len(layout.names) for layout in record.layouts)
        self._pack_slot(record.local_sq, record.fingerprint, mine, status, tail=self._shard_norms(record, n_params))

    def _shard_norms(self, record: _ShardedStep, n_params: int) -> torch.Tensor:
        """Per parameter, ``|this rank's shard of gbar_p|^2`` (the reduce-scatters' outputs), and
        the local squared norms of the groups measured by row (``_GroupEntry.row_norms``: the
        squared norm of each parameter's norms by row) into ``record.local_sq``: one multi-tensor
        norm over all of them (``squared_norms_of_buffers``). Returns the ``n_params`` reduced ones."""
        buffers = [output for output, _ in record.outputs] + [entry.row_norms for _, entry in record.by_row]
        lengths = [lengths for _, lengths in record.outputs] + [[entry.bands[0].plan.rows] * len(entry.shard_lengths) for _, entry in record.by_row]
        local = sum(len(entry.shard_lengths) for _, entry in record.by_row)
        norms = self._stats_buffer("_step_norms", n_params + local, torch.float32, record.local_sq[0].device)
        squared_norms_of_buffers(buffers, lengths, norms)
        offset = n_params
        for index, entry in record.by_row:
            record.local_sq[index] = norms[offset : offset + len(entry.shard_lengths)]
            offset += len(entry.shard_lengths)
        return norms[:n_params]

    def _say_once(self, key: str, message: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            self._warn(message, *args)


def _bands(params: list, lengths: list[int], shards: int) -> list[tuple[int, int, int, int]]:
    """The bands of a group's reduce-scatter input that hold gradient, as ``(first row, end row,
    first parameter, end parameter)``, with the whole first rows first.

    FSDP2 gives shard row ``r`` the rows ``[r c, (r + 1) c)`` of a parameter sharded on dim 0
    (``c`` its padded shard's length there), zeros past the parameter's end; on another dim it
    shards evenly, every row full. Past the rows where every parameter holds gradient, a band
    covers the columns from the first to the last parameter that still does (one run of columns:
    a parameter between them with no rows left is read as zeros). A band narrower than half a row
    is read through the row stride, a chunk of rows at a time; a wider one costs less read whole,
    with the first rows. Without parameters to go by (a group measured as one unit), every row."""
    if not params:
        return [(0, shards, 0, len(lengths))]
    holding = []  # the leading rows of each parameter that hold gradient
    for param in params:
        chunk = param.padded_sharded_param_size[0] if len(param.padded_sharded_param_size) else 0
        whole = param.fsdp_placement.dim != 0 or chunk == 0
        holding.append(shards if whole else min(shards, -(-param._orig_size[0] // chunk)))
    width, bands, first = sum(lengths), [], 0
    for end in sorted(set(holding)):
        if end == first:  # an empty parameter holds no row
            continue
        held = [j for j, rows in enumerate(holding) if rows >= end]  # in every row of [first, end)
        j0, j1 = held[0], held[-1] + 1
        if not bands or 2 * sum(lengths[j0:j1]) > width:
            j0, j1 = 0, len(lengths)
        if bands and bands[-1][2:] == (j0, j1):
            bands[-1] = (bands[-1][0], end, j0, j1)
        else:
            bands.append((first, end, j0, j1))
        first = end
    return bands


def _param_group(module: FSDPModule):
    """The one parameter group of an FSDPModule (ddphooks refuses modules with several)."""
    return module._get_fsdp_state()._fsdp_param_group


def _param_groups(state) -> list:
    """An FSDPState's parameter groups: the list of newer torch (several with a per-parameter
    mesh), or the one optional group of torch 2.11 and before, which has no list."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]


def _fsdp_modules(model: torch.nn.Module) -> tuple[list[FSDPModule], object]:
    """The FSDPModules under ``model`` that hold parameters, and their common mesh; raises
    ``TypeError`` / ``ValueError`` naming what ddphooks cannot measure."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"ShardedSilentState needs the fully_shard root module, got {type(model).__name__}")
    modules, mesh_info, seen = [], None, set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:  # fully_shard([norm, lm_head]): one unit, one reduce-scatter
            continue
        seen.add(id(state))
        groups = _param_groups(state)
        if len(groups) > 1:
            raise ValueError(
                f"FSDP module {type(module).__name__} has {len(groups)} parameter groups (a per-parameter mesh "
                "from shard_placement_fn); ddphooks measures modules with one group: fully_shard them with one mesh"
            )
        if not groups:
            continue
        group = groups[0]
        comm = group._reduce_scatter_comm
        if isinstance(comm, _MeasuredReduceScatter):
            raise RuntimeError("ddphooks is already attached to this FSDP2 model; attach once and reuse the returned state")
        if type(comm) is not DefaultReduceScatter:
            raise ValueError(
                f"FSDP module {type(module).__name__} already uses a custom reduce-scatter ({type(comm).__name__}: a custom comm, "
                "set_allocate_memory_from_process_group_for_comm or symmetric memory); ddphooks replaces the default one only"
            )
        info = group.mesh_info
        if getattr(info, "is_spmd_mesh", False):
            raise ValueError("ddphooks does not measure fully_shard on an SPMD mesh with dp_mesh_dims yet; use a data-parallel mesh")
        if not hasattr(info, "shard_process_group"):
            raise ValueError("ddphooks measures FSDP2 and HSDP (a sharding mesh dimension); replicate() alone is DDP: use DistributedDataParallel")
        if mesh_info is not None and info.mesh != mesh_info.mesh:
            raise ValueError("the FSDP modules of this model use different meshes; ddphooks needs one data-parallel mesh")
        mesh_info = info
        modules.append(module)
    if not modules:
        raise ValueError("the FSDP2 model has no parameters to measure")
    if mesh_info.shard_mesh_size == 1:
        raise ValueError("the FSDP2 mesh shards over 1 rank, so FSDP2 skips the reduce-scatter ddphooks measures; use DistributedDataParallel")
    return modules, mesh_info


def _data_parallel_group(mesh_info) -> dist.ProcessGroup:
    """The process group over the whole data-parallel mesh (shards, and replicas under HSDP)."""
    mesh = mesh_info.mesh
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()


