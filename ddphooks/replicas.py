"""What the replica check compares: only what the data-parallel wrapper keeps identical.

Every rank fingerprints its copy of the model (the L1 and L2 norm of each tensor) on replica-check
steps, the fingerprints travel in the statistics slot, and ``ddphooks.stats.replica_differences``
names the ranks that differ. A rank may only be named for a tensor that must be identical on
every rank at the moment it is fingerprinted:

1. Parameters, always: after every optimizer step they are identical on every replica (DDP,
   ZeRO-1/2; under HSDP each shard within its replica group). Fingerprinted in the last bucket's
   hook, before the optimizer step.
2. Buffers, in the state the wrapper guarantees:

   * DDP with ``broadcast_buffers=True`` (its default): DDP copies rank 0's buffers to every rank
     at the start of each forward, and the forward then moves them with each rank's own batch
     (BatchNorm's running mean and variance). They are fingerprinted right after the broadcast,
     in a forward pre-hook of the wrapped module on replica-check steps: every buffer, compared
     as DDP made it. A rank whose live buffers are not the ones DDP broadcasts to (a buffer
     replaced after wrapping) is named.
   * DDP with ``broadcast_buffers=False``, FSDP2 and HSDP (which never synchronise buffers) and
     DeepSpeed: each rank keeps its own running statistics. A buffer is compared only while its
     fingerprint on that rank has not changed since binding: masks, rotary tables, constant
     position ids, statistics frozen in eval mode. A buffer that moved once (BatchNorm's running
     statistics, a step counter; SyncBatchNorm's too, whose bits nothing guarantees) is that
     rank's own state from then on, even after it stops moving, and carries ``NOT_COMPARED``
     instead of its norms. (Values, not autograd's version counters: BatchNorm's kernels update
     their running statistics without bumping them.)

``replica_differences`` leaves a tensor out when any rank marked it ``NOT_COMPARED`` (the mark is
gathered like every fingerprint, so every rank leaves out the same tensors, and every rank's slot
has the same size whatever it marked).

Example::
    >>> replicas = ReplicaTensors(list(ddp.module.named_parameters()), ddp.module, broadcast_buffers=True)
    >>> replicas.capture_broadcast(step)      # forward pre-hook, after DDP's broadcast
    >>> slot_tail = replicas.fingerprint(step)  # last bucket: parameters, then buffers
"""

from __future__ import annotations

import torch

from ddphooks.stats import NOT_COMPARED


def replica_fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[l1_0, l2_0, l1_1, l2_1, ...]`` in fp32: the L1 and L2 norm of every tensor.

    The same bits give the same numbers on every rank (the same kernels run on the same data),
    so bitwise-identical replicas always agree, and a replica whose tensor differs by more than
    fp32 resolution of its norms shows. Fused multi-tensor norms (a few launches on an
    accelerator); half-precision tensors are accumulated in fp32 without a copy; integer buffers
    are converted (they are small).
    """
    groups: dict[torch.dtype | None, list[int]] = {}
    for i, tensor in enumerate(tensors):
        accumulate = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else None
        groups.setdefault(accumulate if tensor.is_floating_point() else torch.int64, []).append(i)
    norms = [torch.empty(0)] * (2 * len(tensors))
    for accumulate, indices in groups.items():
        group = [tensors[i].detach() for i in indices]
        if accumulate is torch.int64:
            group, accumulate = [t.float() for t in group], None
        for order in (1, 2):
            for i, norm in zip(indices, torch._foreach_norm(group, order, dtype=accumulate)):
                norms[2 * i + order - 1] = norm.float()
    return torch.stack(norms) if norms else torch.empty(0)


class ReplicaTensors:
    """The tensors one rank fingerprints for the replica check, and which of them may be compared.

    Args:
        parameters: ``(name, tensor)`` of the parameters every replica holds identically (all of
            them under DDP, the local shards under HSDP, none under plain FSDP2).
        module: the module whose buffers are fingerprinted (read at each check, so a buffer
            replaced by a new tensor is seen); None for none.
        broadcast_buffers: whether the wrapper copies rank 0's buffers to every rank at the start
            of each forward (DDP's ``broadcast_buffers``); then ``capture_broadcast`` is called
            from a forward pre-hook and buffers are compared as broadcast.
    """

    def __init__(self, parameters: list[tuple[str, torch.Tensor]], module: torch.nn.Module | None, broadcast_buffers: bool) -> None:
        self.parameters = list(parameters)
        self._module = module
        self.broadcast_buffers = broadcast_buffers
        self.buffer_names = [name for name, _ in module.named_buffers()] if module is not None else []  # fixed: every slot the same size
        self._broadcast: tuple[int, torch.Tensor] | None = None  # (step, buffers' fingerprints after the broadcast)
        self._last: torch.Tensor | None = None  # buffers' fingerprints at the last look, B x 2
        self._moved: torch.Tensor | None = None  # buffers that ever changed on this rank (never synchronised again)
        if self.buffer_names:
            self._last, _ = self._buffer_values()
            self._moved = torch.zeros(len(self.buffer_names), dtype=torch.bool, device=self._last.device)

    @property
    def names(self) -> list[str]:
        """Names of the fingerprinted tensors, in slot order: parameters, then buffers."""
        return [name for name, _ in self.parameters] + self.buffer_names

    def __len__(self) -> int:
        return len(self.parameters) + len(self.buffer_names)

    def capture_broadcast(self, step: int) -> None:
        """Fingerprint the buffers as the wrapper just broadcast them (a forward pre-hook of the
        wrapped module, on a replica-check step; the last forward of the step wins)."""
        if self.buffer_names:
            values, missing = self._buffer_values()
            self._last = values
            self._broadcast = (step, torch.where(missing.unsqueeze(1), torch.full_like(values, NOT_COMPARED), values).view(-1))

    def fingerprint(self, step: int) -> torch.Tensor:
        """``[l1, l2]`` of every parameter, then of every buffer (``NOT_COMPARED`` where a buffer
        may differ between ranks by design), fp32 on the parameters' device.

        Without a broadcast captured on ``step``, a buffer is compared only while its fingerprint
        has not changed since binding: one that moved on this rank (running statistics) is this
        rank's own state from then on. Under ``broadcast_buffers`` (a step whose forward did not
        run through the wrapper) only those that moved since the last broadcast are left out."""
        parts = [replica_fingerprint([tensor for _, tensor in self.parameters])] if self.parameters else []
        if self.buffer_names:
            captured, self._broadcast = self._broadcast, None
            if captured is not None and captured[0] == step:
                buffers = captured[1]
            else:
                values, missing = self._buffer_values()
                moved = (values != self._last).any(dim=1) | missing
                if not self.broadcast_buffers:  # nothing synchronises them again: once moved, never compared
                    moved = self._moved = self._moved | moved
                self._last = values
                buffers = torch.where(moved.unsqueeze(1), torch.full_like(values, NOT_COMPARED), values).view(-1)
            parts.append(buffers.to(parts[0].device) if parts else buffers)
        return torch.cat(parts) if parts else torch.empty(0)

    def _buffer_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers' fingerprints (B x 2) and which of them the module no longer has."""
        live = dict(self._module.named_buffers())
        device = next(iter(live.values())).device if live else torch.device("cpu")
        tensors = [live.get(name, torch.zeros(1, device=device)) for name in self.buffer_names]
        missing = torch.tensor([name not in live for name in self.buffer_names], device=device)
        return replica_fingerprint(tensors).view(-1, 2), missing
