"""What every ddphooks state has, whatever carries its statistics between the ranks.

Two transports share it: ``ddphooks.hook`` (DDP, on the gradient allreduce) and ``ddphooks.fsdp``
(FSDP2 and HSDP, beside the gradient reduce-scatter). Both measure with the same kernel
(``ddphooks.sketch``), pack the same per-rank slot, build the same ``SilentStats`` and hand it to
the same pipeline (detector, alerts, records); only how the slots travel differs.
"""

import logging
import threading
import weakref
from dataclasses import replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ddphooks import fleet, fleet_stats
from ddphooks.config import SilentConfig
from ddphooks.devices import PendingHost
from ddphooks.detect import DetectorConfig
from ddphooks.detect.process import DetectorProcess
from ddphooks.hosts import host_blocks
from ddphooks.identity import RankTable, local_identity
from ddphooks.loss import LossTracker
from ddphooks.pipeline import StepPipeline
from ddphooks.records import RecordBuilder, is_detail_step
from ddphooks.sinks import Sink
from ddphooks.sinks.base import bind_sink
from ddphooks.sketch import ACCELERATOR_CHUNK_ELEMS, CPU_CHUNK_ELEMS, BucketStatsKernel, SignTable, sketch_bins, squared_norms_of_buffers
from ddphooks.stats import FAILED, STATUS, BucketLayout, HostParts, KeptSlotRows, SilentStats, slot_size
from ddphooks.writer import RecordWriter

logger = logging.getLogger("ddphooks")

#: Seconds ``flush`` / ``close`` (and the exit handler) wait for the sinks before giving up.
CLOSE_TIMEOUT_S = 30.0


class StepRecord:
    """What every transport keeps of one instrumented step to pack, gather and publish it; each
    transport's own step (``ddphooks.hook._Step``, ``ddphooks.fsdp._ShardedStep``) adds how its
    gradients got there."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.layouts: list[BucketLayout] = []  # the step's bucket (DDP) or group (FSDP2) layouts, in order
        self.local_sq: list[torch.Tensor] = []  # this rank's squared norms per parameter, one tensor per layout
        self.local_norms: list[torch.Tensor] | None = None  # their square roots, where the kernel has them
        self.fingerprinted: list[str] = []  # names of the tensors fingerprinted on a replica-check step
        self.fingerprint: torch.Tensor | None = None
        self.gathered: torch.Tensor | None = None  # the all-reduced compact wire, a copy (its replica check reads it)
        self.transport = ""
        self.absent = False  # this rank has joined under DDP's Join: it contributes zeros and is left out
        self.divided_by_present = False  # the sum was divided by the ranks present (Join, divide_by_initial_world_size=False)
        self.error: BaseException | None = None
        self.failed = False  # this rank's pass or packing failed: its slot went out as FAILED
        # -- the compact wire (ddphooks.fleet) --
        self.fleet: fleet_stats.FleetLayout | None = None  # its layout (above gather_max_world), None: whole slots
        self.sampled: list[int] = []  # the ranks whose per-parameter norms travel
        self.cosines_step: int | None = None  # the step of the values this rank sends
        self.replica_check: object = None  # after a replica check: that step's FleetStats
        self.shard_counts: torch.Tensor | None = None  # HSDP: its replica group's parameter histograms (fleet.count_shards)
        self.shard_checks: torch.Tensor | None = None  # HSDP, on a shard's first replica: what it sends of them
        self.kept: fleet_stats.KeptWire | None = None  # where the step lies in the array kept of it (_keep_fleet)
        self.kept_host: PendingHost | None = None  # that array's one copy to the host


class BaseSilentState:
    """Settings, loss, step counter, sinks and the public API shared by every transport.

    Subclasses bind to their process group and model, run the statistics pass in their hook and
    call ``_publish`` with each step's statistics. See :class:`ddphooks.SilentState` (DDP) and
    :class:`ddphooks.fsdp.ShardedSilentState` (FSDP2) for the arguments.
    """

    #: Whether ``stats_kernel="auto"`` may choose the Triton kernel under this transport.
    AUTO_TRITON = True

    def __init__(self, settings: dict, *, sinks: Sink | list[Sink] | tuple[Sink, ...], on_alert: Callable[[dict], object] | None) -> None:
        self._settings = settings
        self._problem = None  # an invalid setting, raised on every rank when binding
        try:
            self.config = SilentConfig(**settings)
        except (TypeError, ValueError) as error:
            if not (dist.is_available() and dist.is_initialized()):
                raise  # no group to tell yet: every rank runs this line with the same values
            self._problem = f"{type(error).__name__}: {error}"
        if on_alert is not None and not callable(on_alert):
            raise TypeError(f"on_alert must be a function taking the alert dict, got {type(on_alert).__name__}")
        self.on_alert = on_alert
        self.sinks = [sinks] if isinstance(sinks, Sink) else list(sinks)
        for sink in self.sinks:
            if not isinstance(sink, Sink):
                raise TypeError(f"sinks must be ddphooks.Sink instances, got {type(sink).__name__}")
        self.step = 0
        """Synchronised steps seen so far (advances at the end of every synchronised backward)."""
        self._losses = LossTracker()
        self._bound = False

    @property
    def bound(self) -> bool:
        """Whether the state knows its process group (after ``bind`` or the first hook call)."""
        return self._bound

    def _bind_common(self, group: dist.ProcessGroup, ranks: RankTable) -> None:
        """Everything a bound state holds whatever its transport: rank, world, kernels, the
        pipeline (detector, writer thread) and the exit handler. ``group`` spans the ranks whose
        statistics are compared (the data-parallel group), ``ranks`` is its identity table
        (``agree_across_ranks``)."""
        self.process_group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        members = dist.get_process_group_ranks(group)
        self.global_ranks: list[int] | None = None if len(members) == dist.get_world_size() else list(members)
        """The global rank of each rank of the group where it is a subgroup of the job (every
        record carries it then); None where the group is the whole job."""
        self.ranks = ranks
        """Who and where each rank of the group is (``ddphooks.identity.RankTable``): the same on
        every rank; records carry it, alerts are named with it."""
        self.hosts = host_blocks(ranks.hosts())
        """The ranks by host (``ddphooks.hosts.HostBlocks``, from ``ranks``: the same on every
        rank): the blocks of the host-by-host cosine matrix of detail steps above
        ``detail_max_world``."""
        self.bins = sketch_bins(self.config.sketch_dim)
        self._kernels: dict[torch.device, BucketStatsKernel] = {}
        self._sketch: torch.Tensor | None = None  # this step's sketch accumulator (fp32, bins)
        self._slot_head: torch.Tensor | None = None  # [loss_sum, loss_count, status] packed into the slot
        self._latest: SilentStats | BaseException | None = None
        self._latest_lock = threading.Lock()
        self._previous_stats: SilentStats | None = None  # for the next step's cosine_previous
        # -- the compact wire (above gather_max_world): this rank's values, sent one step late -------
        self._own_values: np.ndarray | None = None  # [cos_loo, cos_previous, layer level, layer parameter] of _own_values_step
        self._own_values_step: int | None = None
        # The last step's inputs of own_values on their way to the host: (step, layouts, layout, copy)
        self._own_inputs: tuple[int, list[BucketLayout], fleet_stats.KeptWire, PendingHost] | None = None
        self._own_previous: tuple[list[BucketLayout], np.ndarray] | None = None  # layouts and sketch of the last step
        self._layer_state: tuple[list[BucketLayout], fleet.LayerState] | None = None  # layouts and this rank's layer CUSUM
        self._replica_differs: tuple[int, torch.Tensor] | None = None  # the last replica check's step and this rank's verdict (1: it differs)
        writer = None
        writes = self.config.log_rank is None or self.config.log_rank == self.rank
        if writes and self.sinks:  # no sinks: no writer thread, no records built
            for sink in self.sinks:
                bind_sink(sink, self.rank, dist.get_rank())
            self._records = RecordBuilder(
                self.config.every, self.config.detail_every, self.config.detail_max_world, self.global_ranks, self.config.per_rank_max_world, ranks,
                hosts=self.hosts,
            )  # fmt: skip
            if getattr(self, "_restored_records", None):
                self._records.load_state_dict(self._restored_records)
            records = self._records  # the writer thread must not hold the state itself
            writer = RecordWriter(self.sinks, lambda item: records.build(*item), self.config.max_pending_records)
        detector = None
        if self.config.detect:  # in a process of its own: its Python would hold the training process's GIL
            # On the log rank it builds each record too, from the step's slots (a copy of self._records).
            detector = DetectorProcess(
                self.config.detect if isinstance(self.config.detect, DetectorConfig) else None, warn=lambda message: self._warn(message),
                records=self._records if writer is not None else None,
            )  # fmt: skip
        self._pipeline = StepPipeline(detector, writer, self.on_alert, warns=writes, ranks=ranks, stop_on=self.config.stop_kinds)
        # At interpreter exit, write what is still queued (bounded: a stuck sink cannot hang the exit).
        self._finalizer = weakref.finalize(self, self._pipeline.close, CLOSE_TIMEOUT_S)

    def __getstate__(self) -> dict:
        if self._bound:
            raise TypeError(
                "a bound SilentState holds a process group, buffers and a writer thread and cannot be pickled; "
                "pickle it before it is bound (as Lightning does with its strategy) or create one in each process"
            )
        return self.__dict__.copy()

    # -- public API ----------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor) -> None:
        """Record this rank's loss for the current step, without synchronising the device.

        Call it before ``backward()`` with the loss as the model computed it, unscaled: with
        gradient accumulation many loops call ``(loss / accumulation_steps).backward()``; pass
        ``loss``, not the scaled one, or the records hold the loss divided by the number of
        micro-steps. With gradient accumulation (``no_sync()`` micro-steps,
        or ``set_requires_gradient_sync(False)`` under FSDP2), the rank's loss of a step is the
        mean of the losses observed since the previous synchronised step. Losses given here win
        over those ``attach`` captures from the forward output. On steps that are not
        instrumented it does nothing.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"observe_loss expects the scalar loss tensor you call backward() on, got {shape}; pass loss.mean()")
        if self._instrumented(self.step):
            self._losses.observe(loss, explicit=True)

    @property
    def latest(self) -> SilentStats | None:
        """Statistics of the most recent instrumented step (None before the first one).

        Complete as soon as ``backward()`` returns on an instrumented step, and identical on
        every rank: bitwise for everything gathered from the ranks' slots (losses, local norms,
        sketches, fingerprints: all the detector reads, so every rank raises the same alerts);
        to fp32 rounding for what each rank computes from the averaged gradient itself
        (``reduced_grad_norm``, the weighted mean cosine, the noise scale: a threaded BLAS may sum
        in another order on another rank). Its values are computed when first read (``summary()`` is cheap; the
        per-parameter ``to_dict()`` is not meant for every step).

        Raises ``RuntimeError`` where the step's statistics could not be computed, on this rank or
        on another one (``SilentStats.failed_ranks``: a bug in ddphooks; training is unchanged).
        """
        if not self._bound:
            return None
        latest = self._latest
        if isinstance(latest, BaseException):
            raise RuntimeError(f"ddphooks could not compute the statistics of the latest instrumented step: {latest!r}") from latest
        if latest is not None and latest.failed_ranks:
            raise RuntimeError(
                f"ddphooks did not measure step {latest.step}: the statistics of rank(s) {latest.failed_ranks} failed there "
                "(their log says why); training is unchanged"
            )
        return latest

    @property
    def dropped_records(self) -> dict[str, int]:
        """Records a sink did not get, per sink label (``"queue"``: dropped before any sink,
        because the sinks were slower than training); ``{}`` while everything is written."""
        writer = self._pipeline.writer if self._bound else None
        return {} if writer is None else writer.dropped

    @property
    def alerts(self) -> list[dict]:
        """Alerts so far (``step``, ``rank``, ``kind``, ``since``, ``score``, ``signals``,
        ``parameters``, ``message``, and who and where: ``global_rank``, ``host``, ``device``,
        ``where``), the same on every rank. A step's alerts appear when the step after next
        starts (the detector runs in a process of its own in between), or on ``flush``/``close``:
        that is where every rank checks them."""
        return [] if not self._bound else list(self._pipeline.alerts)

    def should_stop(self) -> bool:
        """Whether training should stop: True from the step an alert of a kind in ``stop_on`` is
        collected on, the same step on every rank.

        1. The detector runs on the same gathered statistics on every rank, so every rank finds
           the same alerts for step ``s``.
        2. Every rank collects the alerts of step ``s`` at the same point: the first bucket of
           step ``s + 2`` (``ddphooks.pipeline``), waiting for its detector there if it is late.
        3. So ``should_stop()`` asked after a step's backward (or after ``optimizer.step()``)
           turns True after the same step ``s + 2`` on every rank, without a collective of its own
           that a rank could miss. The rank named and why: ``stop_alert``.

        Watchdog alerts (``unsynchronised``) never stop training: the rank that found one may be
        the only one that did. Before binding, and with ``stop_on`` empty, always False.

        Example::
            >>> state = ddphooks.attach(model, stop_on=("layer", "replica", "nonfinite"))
            >>> for batch in loader:
            ...     model(**batch).loss.backward(); optimizer.step(); optimizer.zero_grad()
            ...     if state.should_stop():
            ...         break                       # every rank leaves after the same step
            >>> state.close()                       # the last records are written
        """
        return self._bound and self._pipeline.stopping is not None

    @property
    def stop_alert(self) -> dict | None:
        """The alert that made ``should_stop()`` True (None before)."""
        return self._pipeline.stopping if self._bound else None

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Process the completed steps (alerts, ``on_alert``) and wait (at most ``timeout``
        seconds) until their records are written and the sinks flushed."""
        if self._bound:
            self._before_flush()
        if self._bound and not self._pipeline.flush(timeout):
            # Queued, not logged here: the handler that is busy may be the one this would wait for.
            self._warn("ddphooks: flush() gave up after %.0f s: a sink or a logging handler is still busy", timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Process the completed steps, write what is queued, flush and close the sinks (at
        most ``timeout`` seconds)."""
        if self._bound:
            self._finalizer.detach()
            self._before_flush()
            self._pipeline.close(timeout)

    def state_dict(self) -> dict:
        """What a resumed run needs to continue: the step count (so numbering and the ``every``
        phase go on) and the smoothed noise scale."""
        state = {"format": 1, "step": self.step, "every": self.config.every}
        records = getattr(self, "_records", None) if self._bound else None
        if records is not None:
            state["records"] = records.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()`` of a checkpoint; call it before the first resumed step."""
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state.get("step"), bool) or state["step"] < 0:
            raise ValueError(f"not a SilentState state_dict (needs a non-negative integer 'step'): {state!r}")
        if getattr(self, "_current", None) is not None:
            raise RuntimeError("load_state_dict was called in the middle of a step; call it before the first backward of the resumed run")
        if state.get("every", self.config.every) != self.config.every:
            logger.warning(
                "ddphooks: the checkpoint was taken with every=%s, this state has every=%s; steps are renumbered from %d",
                state.get("every"), self.config.every, state["step"],
            )  # fmt: skip
        self.step = state["step"]
        self._restored_records = state.get("records")
        if self._bound and self._restored_records and getattr(self, "_records", None) is not None:
            self._records.load_state_dict(self._restored_records)

    # -- helpers of the transports ---------------------------------------------------------------
    def _before_flush(self) -> None:
        """What a transport checks before ``flush`` and ``close`` (DDP: its watchdog)."""

    def _warn(self, message: str, *args) -> None:
        """A ``logging`` warning (logger ``"ddphooks"``) queued to the pipeline's warnings thread:
        it is called inside forward and backward, where a logging handler that blocks must not
        hold up training (see ``ddphooks.pipeline``). A bound state only."""
        self._pipeline.warn(message, *args)

    def _send_failed(self, step: int, error: BaseException, row: torch.Tensor, status_index: int = STATUS) -> None:
        """This rank's statistics of ``step`` failed (a bug in ddphooks): say why here, and write
        its ``row`` of the step's gathered buffer as zeros and ``FAILED`` (at ``status_index``).
        Every rank, this one too, then builds the step's statistics from the same gathered slots
        and leaves the step unmeasured (``failed_ranks``), so that the ranks' next steps still
        compare alike; the collective keeps its size."""
        self._warn("ddphooks: the statistics of step %d failed on this rank: %r; its slot went out as FAILED, so no rank measures the step (training is unchanged)", step, error)
        row.zero_()
        row[status_index] = FAILED

    def _warn_no_loss(self, step: int) -> None:
        skipped = self._losses.skipped
        seen = (
            f"the forward output was {skipped}"
            if skipped is not None
            else "no training forward output reached ddphooks' loss capture (it is installed by attach, not by register_comm_hook)"
        )
        self._warn(
            "ddphooks: no loss was recorded for step %d on rank %d, so its records hold no loss (null) and the detector "
            "has no loss signal: %s. Add one line before backward(): state.observe_loss(loss), with the unscaled loss "
            "(not loss / accumulation_steps); or pass attach(model, loss_from=lambda module, args, kwargs, output: "
            "<the loss>). Said once.", step, self.rank, seen,
        )  # fmt: skip

    def _instrumented(self, step: int) -> bool:
        return step % self.config.every == 0

    def _chunk_elems(self, device: torch.device) -> int:
        """Elements per chunk of the statistics pass on ``device``: ``SilentConfig.chunk_elems``, or
        the device's default (cache-sized on the CPU, a whole default bucket on accelerators)."""
        return self.config.chunk_elems or (CPU_CHUNK_ELEMS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMS)

    def _kernel(self, device: torch.device) -> BucketStatsKernel:
        """The statistics kernel of ``device`` (one sign table per device, shared by all plans):
        torch ops, or one Triton kernel per bucket (``SilentConfig.stats_kernel``)."""
        if device not in self._kernels:
            signs = SignTable(self.config.seed, self.bins, device, window=max(self._chunk_elems(device), self.bins)) if self.bins else None
            choice = self.config.stats_kernel
            kernel = None
            if choice == "triton":
                from ddphooks.triton_stats import TritonBucketStats  # triton is imported only when chosen

                kernel = TritonBucketStats(self.bins, device, signs)
            elif choice == "auto" and self.AUTO_TRITON and auto_picks_triton(device, self.bins):
                kernel = self._checked_triton(device, signs)
            self._kernels[device] = kernel or BucketStatsKernel(self.bins, device, signs)
        return self._kernels[device]

    def _checked_triton(self, device: torch.device, signs: SignTable):
        """The Triton kernel where ``stats_kernel="auto"`` picks it, once it agrees with the torch
        path on a probe (``TritonBucketStats.agrees_with_torch``); None, said once, where it does
        not or cannot even be built (a broken triton install): never an error into backward."""
        try:
            from ddphooks.triton_stats import TritonBucketStats  # triton is imported only when chosen

            kernel = TritonBucketStats(self.bins, device, signs)
            problem = kernel.agrees_with_torch()
        except Exception as error:
            problem = repr(error)
        if problem is None:
            return kernel
        self._warn(
            "ddphooks: stats_kernel='auto' keeps the torch path on %s: the Triton kernel failed its check (%s). "
            "Pass stats_kernel='torch' to skip the check.", device, problem,
        )  # fmt: skip
        return None

    def _reset_sketch(self, device: torch.device) -> None:
        """Zero this step's sketch accumulator (allocated once per device)."""
        if self.bins and not self._sketch_on(device):
            self._sketch.zero_()

    def _sketch_on(self, device: torch.device) -> bool:
        """Allocate the sketch accumulator on ``device`` (zeroed) where it is not there yet; whether
        it was allocated."""
        if self.bins and (self._sketch is None or self._sketch.device != device):
            self._sketch = torch.zeros(self.bins, dtype=torch.float32, device=device)
            return True
        return False

    def _head(self, status: int, device: torch.device) -> torch.Tensor:
        """``[loss_sum, loss_count, status]`` of this rank's step, on ``device`` (a buffer reused
        from step to step)."""
        if self._slot_head is None or self._slot_head.device != device:
            self._slot_head = torch.zeros(3, dtype=torch.float32, device=device)
            self._head_written = (0, 0)
        count = self._losses.pack(self._slot_head[:1])
        if (count, status) != self._head_written:  # most steps repeat the last step's: no operation then
            self._slot_head[1].fill_(count)
            self._slot_head[2].fill_(status)
            self._head_written = (count, status)
        return self._slot_head

    def _pack_slot(
        self, local_sq: list[torch.Tensor], fingerprint: torch.Tensor | None, slot: torch.Tensor, status: int = 0, tail: torch.Tensor | None = None
    ) -> None:  # fmt: skip
        """Write ``[loss_sum, loss_count, status, |g_p|^2 ..., sketch, fingerprints]`` of this rank
        into ``slot`` (``status``: the flags of ``ddphooks.stats``, ``ABSENT`` ...), then ``tail``
        where one is given (in the same operation)."""
        parts = [self._head(status, slot.device), *local_sq]
        if self.bins:
            parts.append(self._sketch)
        if fingerprint is not None:
            parts.append(fingerprint)
        if tail is not None:
            parts.append(tail)
        torch.cat(parts, out=slot)

    def _stats_buffer(self, attribute: str, numel: int, dtype: torch.dtype, device: torch.device, capacity: int = 0) -> torch.Tensor:
        """The first ``numel`` elements of a persistent communication buffer.

        The buffer only grows (to ``max(numel, capacity)`` elements when it must): a replica
        check's wider slots, or a smaller bucket after a rebuild, reuse it. Freeing it for another
        would cost more than its size: on the CPU, glibc then serves every later allocation up to
        the freed size from its heap, gradients included, and keeps them resident after they are
        freed (see ``ddphooks.memory``)."""
        buffer = getattr(self, attribute)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(max(numel, capacity), dtype=dtype, device=device)
            setattr(self, attribute, buffer)
        return buffer[:numel]

    def _scheduled_fingerprint(self, step: int, device: torch.device) -> tuple[list[str], torch.Tensor | None]:
        """The fingerprinted names and this rank's fingerprint on a scheduled replica-check step
        of a transport whose statistics travel in one all-reduce of their own (FSDP2, DeepSpeed),
        else ``[]`` and None."""
        replicas = self._replica_tensors
        if replicas and (step // self.config.every) % self.config.check_replicas_every == 0:
            return replicas.names, replicas.fingerprint(step).to(device)
        return [], None

    def _whole_slots(self, n_params: int, fingerprinted: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """The slot's size and the ``W x (slot + n_params)`` buffer of a transport whose slots travel
        in one all-reduce of their own (FSDP2, DeepSpeed): each rank's slot, then its part of the
        reduced squared norms; sized once for a replica check's wider slot, not zeroed
        (``_pack_or_fail`` zeroes it)."""
        replicas = self._replica_tensors
        slot = slot_size(n_params, self.bins, fingerprinted)
        widest = slot_size(n_params, self.bins, len(replicas or ()))
        capacity = self.world_size * (widest + n_params)
        return slot, self._stats_buffer("_slots", self.world_size * (slot + n_params), torch.float32, device, capacity)

    def _keep_slot_rows(self, slots: torch.Tensor, slot: int, replicas: int = 1) -> HostParts:
        """``_whole_slots``' buffer after its all-reduce, copied off it (it is reused next step)
        and on its way to the host in one copy: one device operation a step. The host cuts the
        slots and sums the rows' parts of the reduced squared norms (``KeptSlotRows``): no sum,
        no second copy on the device."""
        return HostParts(PendingHost([slots.clone()]), KeptSlotRows(self.world_size, slot, replicas).cut)

    # -- the compact wire (ddphooks.fleet): one implementation for every transport that sends it ----
    def _fleet_layout(self, record: StepRecord, n_params: int, reduced: int = 0) -> fleet_stats.FleetLayout | None:
        """The compact wire's layout of this step above ``gather_max_world`` ranks (None: every
        rank's whole slot). It sets the all-reduce's size, so it depends only on what every rank
        shares: W, the layouts, the settings, whether this is a replica-check step, ``reduced``
        (the transport's: ``FleetLayout.reduced``) and under HSDP the parameter shards
        (``_sharded_fingerprints``)."""
        if self._sends_whole_slots():
            return None
        fingerprinted = len(record.fingerprinted)
        detail = is_detail_step(record.step, self.config.every, self.config.detail_every)
        matrix_rows, host_form = self._detail_matrix() if detail else (0, False)
        return fleet_stats.FleetLayout(
            self.world_size, n_params, len(record.layouts), self.bins, self.config.sampled_ranks, fingerprinted, reduced,
            sharded=self._sharded_fingerprints() if fingerprinted else 0, matrix_rows=matrix_rows, host_form=host_form,
        )  # fmt: skip

    def _sends_whole_slots(self) -> bool:
        """Whether every step carries every rank's whole slot (W <= ``gather_max_world``), not the
        compact wire: from W and the settings, the same on every rank."""
        limit = self.config.gather_max_world
        return limit is None or self.world_size <= limit

    def _detail_matrix(self) -> tuple[int, bool]:
        """What the compact wire sends on a detail step for the cosine matrix: ``(rows, host_form)``,
        W rows (every rank's sketch: the W x W matrix) up to ``detail_max_world``, else one row per
        block of ``hosts`` (each host's sum of its ranks' unit sketches: the host-by-host
        matrix); ``(0, False)`` without a sketch. From W, the settings and the identity table:
        the same on every rank."""
        if not self.bins:
            return 0, False
        if self.world_size <= self.config.detail_max_world:
            return self.world_size, False
        return self.hosts.count, True

    def _sharded_fingerprints(self) -> int:
        """``FleetLayout.sharded``: how many of the fingerprinted tensors (the first ones) are
        parameter shards, compared only within their replica group (HSDP). 0: every tensor over
        every rank (DDP, plain FSDP2)."""
        return 0

    def _fleet_capacity(self, layout: fleet_stats.FleetLayout) -> int:
        """The size of ``layout``'s buffer on a replica-check detail step: what the persistent
        buffer is sized for at once, so that a check's or a detail step's wider wire does not
        reallocate it."""
        rows, host_form = self._detail_matrix() if self.config.detail_every else (0, False)
        widest = replace(layout, fingerprinted=len(self._replica_tensors or ()), sharded=self._sharded_fingerprints(), matrix_rows=rows, host_form=host_form)
        return widest.size

    def _pack_or_fail(self, record: StepRecord, slots: torch.Tensor, slot: int, status: int) -> None:
        """Write ``slots``: this rank's share of the step and zeros elsewhere (the transport's
        ``_pack``: its whole slot, in row ``rank`` of ``slot`` numbers, or its parts of the compact
        wire), or, where this rank's statistics failed (its pass, or the packing itself: a bug),
        zeros and the status ``FAILED``.

        A failure must neither raise into backward nor change the collective, which every rank
        has sized alike: the rank sends zeros and the flag, every rank then leaves the step
        unmeasured (``SilentStats.failed_ranks``), and the gradients' reduction is unchanged."""
        if record.error is None:
            try:
                self._pack(record, slots, slot, status)
                return
            except Exception as error:
                record.error = error
        slots.zero_()
        if record.fleet is None:
            self._send_failed(record.step, record.error, slots[self.rank * slot : (self.rank + 1) * slot])
        else:
            rows = slots[record.fleet.part("per_rank")].view(self.world_size, fleet_stats.PER_RANK)
            self._send_failed(record.step, record.error, rows[self.rank], fleet_stats.WIRE_STATUS)
        record.failed, record.error = True, None

    def _pack(self, record: StepRecord, slots: torch.Tensor, slot: int, status: int) -> None:
        """Write every number of ``slots``: this rank's share of the step, zeros elsewhere (see
        ``_pack_or_fail``)."""
        raise NotImplementedError

    def _pack_fleet(self, record: StepRecord, out: torch.Tensor, status: int, reduced: torch.Tensor | None = None) -> None:
        """Write the compact wire ``out``, this rank's parts and zeros elsewhere (``fleet.pack``):
        its row with its values of the previous instrumented step, the sampled ranks chosen from
        the previous step's layer levels, its replica verdict after a check, its layer rises (and
        FSDP2's ``reduced``, its shards' squared norms)."""
        self._compute_own_values()
        record.cosines_step = self._own_values_step if self._own_values is not None else None
        # The previous step's layer levels, the same on every rank (its gathered rows): they choose
        # half the sampled ranks, so a rank whose layer stands out sends its layer view every step.
        previous = self._previous_stats
        try:
            scores = previous.layer_scores if isinstance(previous, fleet_stats.FleetStats) else None
        except Exception:  # never into backward: the window alone (only which rows, not the size, could differ)
            scores = None
        record.sampled = fleet.choose_sampled(self.world_size, self.config.sampled_ranks, record.step // self.config.every, scores)
        fingerprint = None if record.fingerprint is None else record.fingerprint.to(out.device)
        # After a replica check: this rank's verdict in its status, the check's histograms in the
        # statistics (every rank has the same previous statistics: the same record).
        differs, self._replica_differs = self._replica_differs, None
        if differs is not None and isinstance(previous, fleet_stats.FleetStats) and previous.step == differs[0]:
            record.replica_check, differs = previous, differs[1].to(out.device)
        else:
            differs = None
        # What the host knows: this rank's values and rises of its previous step (for the layer
        # CUSUMs' pooled scale), its status and loss count, in one copy.
        loss_sum, count = self._losses.total()
        if loss_sum is not None and loss_sum.device != out.device:  # a loss computed on another device than the gradients
            loss_sum = loss_sum.to(out.device)
        staged = fleet.stage(self._own_values, self._layer_state_of(record.layouts), record.fleet.n_params, status, count, out.device)
        sketch = self._sketch if self.bins else None
        matrix_row = self.hosts.of_rank[self.rank] if record.fleet.host_form else self.rank
        fleet.pack(
            record.fleet, record.sampled, self.rank, loss_sum, record.local_sq, sketch, staged, fingerprint,
            record.absent, out, differs, record.shard_checks, matrix_row, record.local_norms, reduced, count,
        )  # fmt: skip

    def _keep_fleet(self, record: StepRecord, wire: torch.Tensor, reduced: tuple[list[torch.Tensor], list[tuple[int, ...]]] | None = None, replicas: int = 0) -> None:
        """After the compact wire's all-reduce, keep the step in one array (``record.kept``,
        ``fleet_stats.KeptWire``) and send it to the host in one copy (``record.kept_host``): one
        ``cat`` copies ``wire`` off the buffer (reused next step) with what this rank's values of
        the step need (its squared norms and sketch: ``_compute_own_values`` reads them, with the
        wire's sums, at its next instrumented step), and with ``reduced`` (DDP's averaged buckets
        and their parameters' sizes) the reduced gradients' norms after them (a multi-tensor norm
        and its stack, squared on the host); FSDP2's ``reduced_sq`` is in the wire, summed over
        ``replicas``. After a replica check keep its verdict (``fleet.replica_differs``)."""
        self._compute_own_values()  # the step before's, if its packing did not (a failed pass)
        own = [] if record.failed else [*record.local_sq, *([self._sketch] if self.bins else [])]
        record.kept = fleet_stats.KeptWire(record.fleet, sum(tensor.numel() for tensor in own), replicas)
        kept = torch.empty(record.kept.size, dtype=torch.float32, device=wire.device)
        after_own = record.fleet.size + record.kept.own
        torch.cat([wire, *own], out=kept[:after_own])
        if reduced is not None:
            squared_norms_of_buffers(*reduced, kept[after_own:], squared=False)
        record.gathered = kept[: record.fleet.size]
        record.kept_host = PendingHost([kept])
        if record.failed:  # this rank's statistics failed: its next row says "unknown" for this step, as a rank's
            # with nothing to compare does (every rank then reads the same step's values; the layer CUSUMs wait)
            self._own_values = np.full(fleet.OWN_VALUES, np.nan)
            self._own_values_step, self._own_previous = record.step, None
            return
        self._own_inputs = (record.step, list(record.layouts), record.kept, record.kept_host)
        if record.fingerprint is not None:
            differs = fleet.replica_differs(record.fleet, record.gathered, record.fingerprint.to(record.gathered.device), record.shard_counts)
            self._replica_differs = (record.step, differs)

    def _compute_own_values(self) -> None:
        """This rank's values of the last step sent to the host (``fleet.own_values``, numpy): its
        cosines and layer CUSUM; keeps its sketch for the next step's cosine to it. The copy was
        queued one step before, behind that step's all-reduce, with that step's wire:
        ``_pack_fleet`` waits for the wire's copy anyway (the previous step's layer levels choose
        the sampled ranks), an event one step old, never the whole device."""
        pending, self._own_inputs = self._own_inputs, None
        if pending is None:
            return
        step, layouts, kept, copy = pending
        (array,) = copy.raw()
        inputs, layout = kept.own_inputs(array), kept.layout
        n_params, bins = layout.n_params, self.bins
        sketch = inputs[n_params : n_params + bins] if bins else None
        previous = self._own_previous
        comparable = previous is not None and previous[0] == layouts
        self._own_values, layer = fleet.own_values(
            layout, fleet.own_sums(layout, kept.wire(array)), sketch, previous[1] if comparable else None, inputs[:n_params], self._layer_state_of(layouts)
        )  # fmt: skip
        self._layer_state = (layouts, layer)
        self._own_values_step = step
        self._own_previous = (layouts, sketch.copy()) if bins else None

    def _layer_state_of(self, layouts: list[BucketLayout]) -> fleet.LayerState | None:
        """This rank's layer CUSUM where it is of these layouts; None where they changed (DDP's
        bucket rebuild reordered the parameters, FSDP2 measured a group as one unit): the CUSUM
        restarts."""
        kept = self._layer_state
        return kept[1] if kept is not None and kept[0] == layouts else None

    def _fleet_stats(self, record: StepRecord) -> fleet_stats.FleetStats:
        """The step's statistics from what ``_keep_fleet`` kept of it and sent to the host (the
        wire and the P squared norms of the averaged gradient)."""
        return fleet_stats.FleetStats(
            record.step,
            record.layouts,
            record.fleet,
            record.kept_host,
            None,
            record.transport,
            record.sampled,
            record.cosines_step,
            record.fingerprinted,
            divided_by_present=record.divided_by_present,
            replica_check=record.replica_check,
            hosts=self.hosts if record.fleet.host_form else None,
            kept=record.kept,
        )

    def _publish(self, step: int, result: SilentStats | BaseException) -> None:
        """Make ``result`` the latest statistics (or the error that stopped them) and hand it to
        the pipeline (detector, alerts, records)."""
        with self._latest_lock:
            self._latest = result
        if isinstance(result, SilentStats):
            self._previous_stats = result
            self._pipeline.complete(result)  # handed over when the next step starts
        else:
            self._warn("ddphooks: statistics of step %d failed: %r", step, result)


def auto_picks_triton(device: torch.device, bins: int) -> bool:
    """Whether ``stats_kernel="auto"`` tries the Triton kernel on ``device``: a CUDA device, a
    sketch, and the ``triton`` package (the kernel then still has to pass its check)."""
    import importlib.util

    return device.type == "cuda" and bins > 0 and importlib.util.find_spec("triton") is not None


def stats_kernel_problem(config: SilentConfig, model: torch.nn.Module | None) -> str | None:
    """Why ``config.stats_kernel`` cannot run on ``model``'s gradients (None: it can, or no model
    yet: then the first bucket says), as ``agree_across_ranks`` takes it."""
    if config.stats_kernel != "triton" or model is None:
        return None
    from ddphooks.triton_stats import check_device

    try:
        for device in {p.device for p in model.parameters() if p.requires_grad}:
            check_device(device)
    except ValueError as error:
        return f"ValueError: {error}"
    return None


def agree_across_ranks(group: dist.ProcessGroup | None, settings: dict, problem: str | None, device: torch.device) -> RankTable:
    """Gather every rank's settings, local problem and identity; raise the same error on every
    rank, or return the group's ``RankTable`` (the same on every rank).

    One ``all_gather_object`` over ``group``: every rank of the group calls it at bind, with
    values of the same kind, so its size and order follow from what every rank shares."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    identity = local_identity(dist.get_rank(), rank, device)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (settings, problem, identity), group=group)
    problems = [f"rank {rank}: {p}" for rank, (_, p, _) in enumerate(gathered) if p is not None]
    if problems:
        raise ValueError("invalid SilentState arguments on " + "; ".join(problems))
    if any(s != gathered[0][0] for s, _, _ in gathered):
        described = "; ".join(f"rank {rank} has {s}" for rank, (s, _, _) in enumerate(gathered))
        raise ValueError(f"SilentState settings differ across ranks ({described}); create it with the same arguments on every rank")
    return RankTable([identity for _, _, identity in gathered], subgroup=world < dist.get_world_size())
