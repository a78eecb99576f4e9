"""The synchronisation watchdog: notices when DDP stops synchronising the model ddphooks watches.

``silent_hook`` runs only when DDP communicates. When DDP itself stops synchronising, the hook,
and with it every statistic, alert and replica check, goes quiet while the replicas drift apart:
DDP's autograd hooks lost because the wrapped module was converted after wrapping (PyTorch issue
104336: ``model.double(); model.float()``, ``.cpu().cuda()``), a forward and backward through the
unwrapped module, or through a second ``DistributedDataParallel`` wrapper. The watchdog watches
from outside the hook, at O(1) cost per backward pass:

1. A forward pre-hook on the attached DDP module notes, at each training forward (grad enabled),
   whether DDP will synchronise the coming backward: ``require_backward_grad_sync``, which
   ``no_sync()`` turns off (gradient accumulation, as Accelerate, the Trainer and Lightning do it).
2. A post-accumulate-grad hook on one sentinel parameter (the first that requires a gradient)
   fires once in each backward pass that reaches it. Tensor hooks live on the parameter itself,
   so they survive the conversions that drop DDP's own hooks, and they fire whichever module ran
   the forward. It notes how many times ``silent_hook`` has run so far and whether DDP should
   synchronise this backward: the flag of step 1, or, where no forward of the attached DDP module
   ran since the last backward (the forward went around it), the flag as it is now.
3. At the next check the backward is judged: it was synchronised if ``silent_hook`` ran since
   step 2. A check happens at the next training forward of the attached DDP module, at the next
   firing of the sentinel (the next backward pass), and at ``flush()`` / ``close()``. By then
   the backward has finished and DDP has launched everything it launches for it (its
   end-of-backward work with ``static_graph`` included); the sentinel's gradient may come from a
   nested backward (reentrant activation checkpointing), which fires it once all the same.
4. The first unsynchronised backward of an episode raises one alert of kind ``unsynchronised``
   naming this rank (each rank judges itself: the ranks cannot agree without the communication
   that stopped), on ``state.alerts``, ``on_alert``, the log rank's ``"ddphooks"`` logger and the
   first record written after it; its message ends with ``see docs/alerts.md#unsynchronised``.
   When ``silent_hook`` runs again the episode ends with one note on the logger, and every rank
   checks the replicas (if the replica check is on) on the instrumented step after the one whose
   slot carries this rank's request: they drifted with nothing comparing them, and a check
   widens every rank's slot, so no rank decides it alone.

What never raises it: backward passes inside ``no_sync()``, evaluation forwards (no backward),
steps where the sentinel receives no gradient (a frozen or unused sentinel leaves it blind, never
wrong), ``every=N`` (the hook runs on every step; only its statistics are every N-th).

Example::
    >>> watchdog = SyncWatchdog(ddp_model, raise_alert=print, log_note=print, rank=0, current_step=lambda: state.step)
    >>> watchdog.hook_called()      # from silent_hook, every bucket
    >>> watchdog.check()            # from flush() / close()
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ddphooks.detect import reference
from ddphooks.detect.messages import first_check

CAUSES = (
    "DDP's gradient hooks were lost because the wrapped module's parameters were converted or moved after wrapping "
    "(model.double()/.float()/.half(), .cpu().cuda(), .to(dtype) on the module inside DistributedDataParallel: "
    "convert before wrapping); the forward ran through the unwrapped module (model.module(...)) instead of the "
    "DistributedDataParallel object; or through another DistributedDataParallel wrapper of the same module "
    "(attach ddphooks to the one you train with)"
)


class SyncWatchdog:
    """Alerts when the attached DDP model gets gradients DDP should have synchronised, but did not.

    Args:
        ddp: the ``DistributedDataParallel`` module ``silent_hook`` is registered on.
        raise_alert: called with each ``unsynchronised`` alert dict (``SilentState`` hands it to
            its pipeline: ``state.alerts``, ``on_alert``, the log, the next record).
        log_note: ``log_note(message, *args)``, a warning on the ``"ddphooks"`` logger (queued,
            never blocking the training thread).
        rank: this rank, named in the alert.
        current_step: the step ``silent_hook`` will number next (``SilentState.step``).
    """

    def __init__(
        self, ddp: torch.nn.Module, raise_alert: Callable[[dict], None], log_note: Callable[..., None], rank: int, current_step: Callable[[], int]
    ) -> None:
        self._ddp = ddp
        self._raise_alert = raise_alert
        self._log_note = log_note
        self._rank = rank
        self._current_step = current_step
        # -- counters ----------------------------------------------------------------------------
        self.hook_calls = 0
        """Calls of silent_hook so far (every bucket of every step)."""
        self.unsynchronised = 0
        """Backward passes judged unsynchronised so far."""
        # -- the last training forward of the DDP module -------------------------------------------
        self._forward_seen = False  # since the last backward was armed
        self._forward_sync = True
        # -- the backward waiting to be judged -----------------------------------------------------
        self._armed = False
        self._armed_calls = 0
        self._armed_expected = False
        # -- the episode ---------------------------------------------------------------------------
        self.episode_since: int | None = None
        """Step (``SilentState.step``) of the first unsynchronised backward of the open episode."""
        self._episode_count = 0
        self.replica_check_due = False
        """Set when synchronisation resumes: this rank asks every rank, in its next statistics
        slot, to check the replicas on the instrumented step after it (``SilentState._slot_status``)."""
        # The first trained parameter: in a transformer the embedding, used by every forward, and
        # in a fine-tuned model the first adapter; frozen parameters never get a gradient.
        sentinel = next((p for p in ddp.module.parameters() if p.requires_grad), None)
        # Through lambdas, so that a profiler (benchmarks/overhead.py) can wrap the methods.
        self._handles = [] if sentinel is None else [sentinel.register_post_accumulate_grad_hook(lambda p: self._gradient_arrived(p))]
        # Plain Python bookkeeping, which a compiled DDP module calls eagerly; disabled here rather
        # than by a decorator, which would import torch._dynamo (1.5 s) with ddphooks itself (DDP
        # has imported it by now).
        self._handles.append(ddp.register_forward_pre_hook(torch.compiler.disable(lambda module, args: self._forward(module, args))))

    def remove(self) -> None:
        """Remove the hooks (the watchdog stops watching)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- events ------------------------------------------------------------------------------------
    def hook_called(self) -> None:
        """``silent_hook`` ran (any bucket): DDP synchronises."""
        self.hook_calls += 1
        if self.episode_since is not None:
            step = self._current_step()
            self._log_note(
                "ddphooks: DDP synchronises again at step %d, after %d unsynchronised backward pass(es) since step %d; "
                "the replicas are checked on the next instrumented step after it",
                step, self._episode_count, self.episode_since,
            )  # fmt: skip
            self.episode_since = None
            self.replica_check_due = True

    def _forward(self, module: torch.nn.Module, args: tuple) -> None:
        # The wrapped module's mode, as for the loss capture: Lightning's validation calls .eval()
        # on the wrapper and restores only the LightningModule's mode.
        if not (getattr(module, "module", module).training and torch.is_grad_enabled()):
            return  # evaluation: no backward follows
        self.check()
        self._forward_seen = True
        self._forward_sync = bool(module.require_backward_grad_sync)

    def _gradient_arrived(self, parameter: torch.Tensor) -> None:
        self.check()  # the previous backward, if no forward of the DDP module came in between
        self._armed = True
        self._armed_expected = self._forward_sync if self._forward_seen else bool(self._ddp.require_backward_grad_sync)
        self._armed_calls = self.hook_calls
        self._forward_seen = False

    def check(self) -> None:
        """Judge the backward waiting to be judged (see the module docstring, step 3)."""
        if not self._armed:
            return
        self._armed = False
        if not self._armed_expected or self.hook_calls != self._armed_calls:
            return
        step = self._current_step()
        self.unsynchronised += 1
        self._episode_count += 1
        if self.episode_since is not None:
            return  # one alert per episode
        self.episode_since, self._episode_count = step, 1
        self._raise_alert(
            first_check({
                "step": step,
                "rank": self._rank,
                "kind": "unsynchronised",
                "since": step,
                "score": 1.0,
                "signals": ["watchdog"],
                "parameters": [],
                "message": (
                    f"rank {self._rank}: the model received gradients in a backward pass that DDP should have "
                    f"synchronised (not inside no_sync()), but DistributedDataParallel never communicated them "
                    f"(silent_hook did not run; last synchronised step {step - 1}): the ranks now train apart, and no "
                    f"statistics, alerts or replica checks come from ddphooks until DDP synchronises again. "
                    f"Likely causes: {CAUSES}; {reference('unsynchronised')}"
                ),
            })
        )
