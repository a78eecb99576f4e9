"""What a ddphooks state keeps alive between steps, tensor by tensor.

``retained_tensors(state)`` walks a bound state (any transport) and lists every tensor and numpy
array it holds, once per storage, with the attribute path that holds it. Storages of the model
itself (its parameters and buffers, which the replica check refers to) are left out: they exist
without ddphooks. What remains is what ddphooks costs in memory between steps:

* on the gradients' device: the sign tables (9.1 MB on the CPU, 24 MB on accelerators; none but the
  row signs with the Triton kernel), the statistics scratch (0.5 MB on the CPU, one chunk of up to
  64 MB on accelerators), the per-bucket plans and norms (a few integers per parameter),
  the slot buffers (W slots of a few KB) and, with the fp32 "piggyback" transport, the copy of
  the last bucket the statistics ride on (at most ``piggyback_limit_mb``);
* on the host: the latest step's statistics and the detector's windows (W numbers per signal and
  step, a bounded history).

Nothing in that list grows with the model beyond the plans and norms (bytes per *parameter
tensor*, not per element) and the piggyback copy up to its cap; ``tests/test_memory.py`` checks
it at two model sizes against the live heap.

Why a process's resident memory can still look larger with ddphooks on the CPU: gradients freed
by ``zero_grad()`` go back to the C allocator, not to the operating system. glibc serves a block
below its mmap threshold from its heap, and raises that threshold to the size of every mapped
block that is freed (up to 32 MB), so after the first ``zero_grad`` the gradients of most models
come from the heap. Freed heap memory stays resident whenever any block that is still alive lies
above it, and it is reused by the next step's gradients: resident memory between steps then
includes about one gradient's worth of free memory, with or without ddphooks (measured in
``benchmarks/memory.py``: plain DDP shows it on some runs, ddphooks' small allocations during
backward make it more frequent). It is not held by ddphooks and does not grow with the number of
steps; the peak (``VmHWM``) is what bounds a run. On accelerators the caching allocator holds
device memory and this does not apply. ddphooks itself frees no large block during training:
its tables are built without table-sized temporaries and its buffers only grow, so it never
raises the threshold itself.

Example::
    >>> state = ddphooks.attach(ddp_model)
    >>> ...  # a few steps
    >>> sum(t.nbytes for t in retained_tensors(state) if t.device != "cpu")
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

#: Types never walked into: the model, process groups, threads and locks, functions.
_OPAQUE = (torch.nn.Module, type, Exception)


@dataclass(frozen=True)
class RetainedTensor:
    """One storage a state keeps alive."""

    path: str
    """Where it is held, e.g. ``state._kernels[cpu].signs.values``."""
    nbytes: int
    """Bytes of the whole storage (a view counts its full storage once)."""
    device: str
    """``"cpu"``, ``"cuda:0"``, ...; numpy arrays are ``"cpu"``."""
    shape: tuple[int, ...]
    dtype: str


def retained_tensors(state) -> list[RetainedTensor]:
    """Every tensor and numpy array ``state`` holds (once per storage, named by its shortest
    path), the model's own left out.

    The walk follows attributes of ddphooks objects, dicts, lists, tuples, sets and deques; it
    does not enter the model, process groups, sinks' libraries or functions. The largest first.
    """
    model_storages = {_storage_key(t) for t in _model_tensors(state)}
    found: dict[tuple, RetainedTensor] = {}
    for path, value in _walk(state, "state", set()):
        if isinstance(value, np.ndarray):
            owner = value
            while isinstance(owner, np.ndarray) and owner.base is not None:
                owner = owner.base
            if isinstance(owner, torch.Tensor):
                value = owner  # a numpy view of a tensor (Tensor.numpy(), or a slice of one): the tensor's storage
        if isinstance(value, torch.Tensor):
            if value.is_sparse or value.device.type == "meta":
                continue
            value = _local(value)
            key = _storage_key(value)
            if key in model_storages or (key in found and len(found[key].path) <= len(path)):
                continue  # a storage seen through several paths is named by the shortest
            storage = value.untyped_storage()
            found[key] = RetainedTensor(path, storage.nbytes(), str(value.device), tuple(value.shape), str(value.dtype))
        else:  # a numpy array: count its base buffer once
            base = value if value.base is None else value.base
            key = ("numpy", id(base))
            if key not in found and isinstance(base, np.ndarray):
                found[key] = RetainedTensor(path, base.nbytes, "cpu", tuple(value.shape), str(value.dtype))
    return sorted(found.values(), key=lambda t: -t.nbytes)


def retained_bytes(state, device: str | None = None) -> int:
    """Bytes ``state`` keeps alive between steps (on ``device`` only, e.g. ``"cpu"``, if given)."""
    return sum(t.nbytes for t in retained_tensors(state) if device is None or t.device == device)


def _storage_key(tensor: torch.Tensor) -> tuple:
    tensor = _local(tensor)
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr(), storage.nbytes())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2 parameter's) local shard: the storage it holds on this rank."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _model_tensors(state) -> Iterator[torch.Tensor]:
    """The parameters and buffers of the state's model (any transport), which are not ddphooks'."""
    model = getattr(state, "_model", None)
    if isinstance(model, torch.nn.Module):
        yield from model.parameters()
        yield from model.buffers()
    replicas = getattr(state, "_replica_tensors", None)
    for _, tensor in getattr(replicas, "parameters", ()):
        yield tensor


def _walk(value, path: str, seen: set[int]) -> Iterator[tuple[str, object]]:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        yield path, value
        return
    if value is None or isinstance(value, (str, bytes, int, float, bool, _OPAQUE)) or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        for key, item in list(value.items()):
            yield from _walk(item, f"{path}[{key}]", seen)
    elif isinstance(value, (list, tuple, set, frozenset, deque)):
        for i, item in enumerate(list(value)):
            yield from _walk(item, f"{path}[{i}]", seen)
    elif type(value).__module__.startswith("ddphooks."):
        for name, item in list(getattr(value, "__dict__", {}).items()):
            yield from _walk(item, f"{path}.{name}", seen)
        for name in getattr(type(value), "__slots__", ()):
            yield from _walk(getattr(value, name, None), f"{path}.{name}", seen)
