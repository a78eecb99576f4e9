"""Where ddphooks' torch work runs: accelerators through ``torch.accelerator`` where this torch has
it (2.6+), so the same code serves CUDA, Ascend NPUs (once ``torch_npu`` is imported) and any
other backend (older torch falls back to the backend module, ``torch.cuda``, ``torch.npu``); and
the CPU threads of communication callbacks (``match_intra_op_threads``)."""

import threading

import torch

_callback_threads = threading.local()


def set_device(device: torch.device) -> None:
    """Make ``device`` (an accelerator with an index) the current device of this process."""
    if hasattr(torch, "accelerator"):
        torch.accelerator.set_device_index(device.index)
    else:
        getattr(torch, device.type).set_device(device)


def recorded_event(device: torch.device):
    """An event recorded on ``device``'s current stream (``synchronize()`` waits for the work
    queued before it, not for the whole device)."""
    event = torch.Event(device=device.type) if hasattr(torch, "Event") else getattr(torch, device.type).Event()
    event.record()
    return event


def match_intra_op_threads() -> None:
    """Give the calling thread the intra-op thread count the process set (``torch.set_num_threads``),
    once per thread.

    gloo completes a collective's future on a thread of its own, which PyTorch never initialised, so
    a callback that gloo runs there computes with the BLAS library's default (every core), while
    the same callback run inline, on the thread that attached it, uses the process's setting. A
    ``torch.dot`` then splits its sum differently: two ranks' records of the same reduced gradient
    differed in the last bits, and the callbacks competed with training for the cores."""
    if getattr(_callback_threads, "matched", False):
        return
    _callback_threads.matched = True
    try:
        torch.set_num_threads(torch.get_num_threads())
    except Exception:  # never into backward: the thread keeps its default
        pass
