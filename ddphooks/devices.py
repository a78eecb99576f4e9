"""Accelerator handling through ``torch.accelerator`` where this torch has it (2.6+), so the same
code serves CUDA, Ascend NPUs (once ``torch_npu`` is imported) and any other backend; older
torch falls back to the backend module (``torch.cuda``, ``torch.npu``)."""

import torch


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
