"""Where ddphooks' torch work runs: accelerators through ``torch.accelerator`` where this torch has
it (2.6+), so the same code serves CUDA, Ascend NPUs (once ``torch_npu`` is imported) and any
other backend (older torch falls back to the backend module, ``torch.cuda``, ``torch.npu``); and
the CPU threads of communication callbacks (``match_intra_op_threads``); and a step's tensors on
their way to the host (``PendingHost``), which ``ddphooks.stats`` reads without importing torch."""

import threading

import numpy as np
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


class PendingHost:
    """Tensors on their way to host memory.

    On an accelerator (CUDA, NPU) every tensor is copied with ``non_blocking=True`` into pinned
    host memory (PyTorch's caching host allocator reuses those buffers) and an event is recorded
    behind the copies on the current stream; ``arrays()`` waits on that event only, never on the
    whole device, and only when somebody reads a value. CPU tensors are used as they are.

    Args:
        tensors: tensors on one device; they must not be modified before the copy completes
            (the hook hands over fresh clones).
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        device = tensors[0].device
        self.asynchronous = device.type != "cpu"
        self._event = None
        if not self.asynchronous:
            self._host = list(tensors)
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        self._event = recorded_event(device)

    def columns(self, begin: int, end: int) -> np.ndarray:
        """Columns ``begin`` to ``end - 1`` of the first (W x slot) tensor as float64, without
        converting the rest."""
        if self._event is not None:
            self._event.synchronize()
        return _float64(self._host[0][:, begin:end])

    def arrays(self) -> list[np.ndarray]:
        """The tensors as float64 numpy arrays (waits for the copy on an accelerator)."""
        if self._event is not None:
            self._event.synchronize()
        return [_float64(t) for t in self._host]

    def raw(self) -> list[np.ndarray]:
        """The tensors as numpy arrays in their own dtype where numpy has it (fp32 slots: half the
        bytes of ``arrays()``; float64 otherwise), not copied where they can be shared: what a
        ``StepSlots`` carries to another process."""
        if self._event is not None:
            self._event.synchronize()
        return [t.detach().numpy() if t.dtype in (torch.float32, torch.float64) else _float64(t) for t in self._host]


def _float64(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor as a new float64 numpy array."""
    # fp32 widens to float64 exactly: in numpy, one call instead of a torch op and a conversion
    tensor = tensor.detach()
    return tensor.numpy().astype(np.float64) if tensor.dtype == torch.float32 else tensor.to(torch.float64).numpy()
