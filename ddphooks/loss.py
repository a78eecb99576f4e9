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
        self.skipped: str | None = None  # the last forward output the capture found no loss in

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
            total.copy_(value)  # the step's first loss: one operation, not a zeroing and an addition
        else:
            total.add_(value)
        self._counts[explicit] += 1

    def total(self) -> tuple[torch.Tensor | None, int]:
        """The loss sum of the winning source (None where it counted none) and its count."""
        explicit = self._counts[True] > 0
        count = self._counts[explicit]
        return (self._sums[explicit] if count else None), count

    def pack(self, out: torch.Tensor) -> int:
        """Write the loss sum of the winning source into the 1-element ``out``; return its count."""
        explicit = self._counts[True] > 0
        count = self._counts[explicit]
        if count:
            out.copy_(self._sums[explicit])
        else:
            out.zero_()
        return count

    def reset(self) -> None:
        """Start the next step (the sums are zeroed lazily, on their next use)."""
        self._counts = {True: 0, False: 0}


def loss_of(output: object) -> torch.Tensor | None:
    """The rank's loss in a forward output, or None where the output holds none unambiguously.

    What counts as a loss:

    1. a 0-dim floating tensor that requires grad (a model that returns its loss);
    2. ``output.loss`` (a transformers ``ModelOutput``) or ``output["loss"]`` (a Lightning
       ``training_step`` dict): a floating tensor of one element, the key says it is the loss;
    3. in a tuple or list (nanoGPT's ``(logits, loss)``, transformers' ``return_dict=False``
       ``(loss, logits, ...)``), its one element of the first kind, if exactly one is.

    Anything else (logits; a one-element prediction such as a value head's ``(1, 1)`` output at
    batch 1; a tuple with two scalar losses) gives None: ``describe_output`` says what it was.
    """
    if isinstance(output, Mapping):
        return _keyed(output.get("loss"))
    if isinstance(output, (tuple, list)):
        scalars = [item for item in output if _is_scalar_loss(item)]
        return scalars[0] if len(scalars) == 1 else None
    if isinstance(output, torch.Tensor):
        return output if _is_scalar_loss(output) else None
    return _keyed(getattr(output, "loss", None))


def _is_scalar_loss(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point() and value.requires_grad


def _keyed(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return value
    return None


def describe_output(output: object) -> str:
    """A short description of a forward output that gave no loss, for the warning that says so."""

    def one(value: object) -> str:
        if isinstance(value, torch.Tensor):
            grad = ", requires grad" if value.requires_grad else ""
            return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}{grad}"
        return type(value).__name__

    if isinstance(output, (tuple, list)):
        scalars = sum(_is_scalar_loss(item) for item in output)
        items = ", ".join(one(item) for item in output[:4]) + (", ..." if len(output) > 4 else "")
        why = f"{scalars} 0-dim tensors that require grad: ambiguous" if scalars > 1 else "no 0-dim tensor that requires grad"
        return f"a {type(output).__name__} of {len(output)} ({items}), with {why}"
    if isinstance(output, torch.Tensor):
        if output.numel() == 1 and output.dim() > 0:
            return f"{one(output)}: one element but not 0-dim, so not taken for a loss (a prediction at batch size 1?)"
        return f"{one(output)} (not a 0-dim loss that requires grad: logits or predictions?)"
    if isinstance(output, Mapping):
        return f"a {type(output).__name__} with keys {sorted(map(str, output))[:8]} and no tensor 'loss'"
    return f"a {type(output).__name__} with no tensor .loss"
