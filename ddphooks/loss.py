"""Each rank's loss of a step, from ``observe_loss`` or captured from the forward output.

A step's loss on one rank is the mean of the losses seen since the last synchronised step, so
gradient accumulation (``no_sync()`` micro-batches) gives the mean over the micro-batches. Two
sources feed it: explicit ``SilentState.observe_loss`` calls and the automatic capture that
``ddphooks.attach`` installs on the forward. When a step has explicit losses they win and the
captured ones are ignored, so a user who passes a better loss (say, unscaled) is never mixed
with the automatic guess. Everything stays on the loss's device: no ``.item()``, no sync.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class LossTracker:
    """Running sums of one step's losses, kept apart by source (explicit or captured)."""

    def __init__(self) -> None:
        self._sums: dict[bool, torch.Tensor] = {}  # explicit? -> fp32 scalar on the loss's device
        self._counts = {True: 0, False: 0}
        self._missing_reported = False

    def first_missing(self) -> bool:
        """True the first time a step ends with no loss observed (then never again): the
        caller says once that records will carry no loss."""
        if self._missing_reported or self._counts[True] or self._counts[False]:
            return False
        self._missing_reported = True
        return True

    def observe(self, loss: torch.Tensor, explicit: bool) -> None:
        value = loss.detach().reshape(()).float()
        total = self._sums.get(explicit)
        if total is None or total.device != value.device:
            total = self._sums[explicit] = torch.zeros((), dtype=torch.float32, device=value.device)
        if self._counts[explicit] == 0:
            total.zero_()
        total.add_(value)
        self._counts[explicit] += 1

    def pack(self, out: torch.Tensor) -> None:
        """Write ``[loss_sum, loss_count]`` of the winning source into the 2-element ``out``."""
        explicit = self._counts[True] > 0
        count = self._counts[explicit]
        if count:
            out[0].copy_(self._sums[explicit])
        else:
            out[0].zero_()
        out[1].fill_(count)

    def reset(self) -> None:
        """Start the next step (the sums are zeroed lazily, on their next use)."""
        self._counts = {True: 0, False: 0}


def loss_of(output: object) -> torch.Tensor | None:
    """The scalar loss in a forward output, or None.

    Accepts a scalar tensor, an object with a tensor ``.loss`` attribute (a transformers
    ``ModelOutput``), or a mapping with a ``"loss"`` entry (a Lightning ``training_step`` dict).
    """
    if isinstance(output, torch.Tensor):
        candidate = output
    elif isinstance(output, Mapping):
        candidate = output.get("loss")
    else:
        candidate = getattr(output, "loss", None)
    if isinstance(candidate, torch.Tensor) and candidate.numel() == 1 and candidate.is_floating_point():
        return candidate
    return None
