"""What ddphooks keeps between steps does not grow with the model (issue: memory).

Two model sizes past every cap (the piggyback copy is bounded by the last bucket, at most
``piggyback_limit_mb``): the tensors the state holds (``ddphooks.memory``, the piggyback copy
aside) and the C heap's live bytes with ddphooks against plain DDP must not grow with the number
of parameters, and the state's large buffers must never be freed for new ones during training
(a freed block moves later gradient allocations to glibc's heap, see ``ddphooks.memory``).
"""

import ctypes
import gc

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddphooks
from ddphooks.launch import spawn
from ddphooks.memory import retained_tensors
from ddphooks.sketch import SIGN_DRAW_ELEMS, random_signs
from ddphooks.stats import HostArrays

TIMEOUT = 240
WIDTH = 512  # one Linear(512, 512) is 1 MB of fp32 gradient
SIZES = (24, 72)  # layers: 6.3 M and 18.9 M parameters
STEPS = 4


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_in_use() -> int | None:
    """Live bytes of the C allocator (glibc's mallinfo2: heap blocks in use plus mapped blocks),
    None where there is no glibc 2.33+. Freed memory the allocator keeps is not counted."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _check_memory(rank: int, world: int, layers: int, attached: bool, tmp: str) -> dict:
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]))
    state = None
    if attached:  # what a user runs: a sink, the detector, replica checks every other step
        state = ddphooks.attach(ddp, sinks=[ddphooks.JsonlSink(f"{tmp}/stats.jsonl")], check_replicas_every=2)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    addresses, transports = [], []
    for _ in range(STEPS):
        loss = ddp(torch.randn(4, WIDTH) * (rank + 1)).square().mean()
        if state is not None:
            state.observe_loss(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if state is not None:
            scratch = state._kernels[torch.device("cpu")]._product
            piggyback = None if state._piggyback is None else state._piggyback.data_ptr()
            addresses.append((piggyback, scratch.data_ptr()))
            transports.append(state.latest.transport)
    if state is not None:
        state.flush()
    gc.collect()
    result = {"heap": _heap_in_use(), "params": sum(p.numel() for p in ddp.parameters())}
    if state is not None:
        kept = retained_tensors(state)
        result.update(
            retained=sum(t.nbytes for t in kept),
            piggyback=sum(t.nbytes for t in kept if t.path == "state._piggyback"),
            addresses=addresses,
            transports=transports,
        )
        state.close()
    return result


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    runs = {}
    for layers in SIZES:
        for attached in (False, True):
            tmp = tmp_path_factory.mktemp(f"memory-{layers}-{attached}")
            runs[layers, attached] = spawn(_check_memory, 2, args=(layers, attached, str(tmp)), timeout=TIMEOUT)[0]
    return runs


def test_retained_tensors_do_not_grow_with_the_model(measured):
    small, large = measured[SIZES[0], True], measured[SIZES[1], True]
    added_params = large["params"] - small["params"]
    for run in (small, large):
        assert 0 < run["piggyback"] <= 32 * 2**20  # the documented copy of the last bucket, under its cap
        assert run["retained"] - run["piggyback"] <= 64 * 2**20
    growth = (large["retained"] - large["piggyback"]) - (small["retained"] - small["piggyback"])
    assert growth <= 0.1 * added_params, f"kept memory grew by {growth / added_params:.2f} bytes per added parameter"


def test_live_heap_over_plain_ddp_does_not_grow_with_the_model(measured):
    if measured[SIZES[0], False]["heap"] is None:
        pytest.skip("needs glibc's mallinfo2 to count live heap bytes")
    extra = {layers: measured[layers, True]["heap"] - measured[layers, False]["heap"] - measured[layers, True]["piggyback"] for layers in SIZES}
    added_params = measured[SIZES[1], True]["params"] - measured[SIZES[0], True]["params"]
    for layers in SIZES:
        assert extra[layers] <= 64 * 2**20, f"{extra[layers] / 2**20:.1f} MB over plain DDP at {layers} layers"
    assert extra[SIZES[1]] - extra[SIZES[0]] <= 0.1 * added_params, extra


def test_large_buffers_are_never_freed_for_new_ones(measured):
    """The piggyback copy and the scratch keep their storage across a replica check's wider slot
    (steps 0 and 2 check the replicas); step 0 used the separate transport, before DDP's rebuild."""
    for layers in SIZES:
        run = measured[layers, True]
        assert run["transports"] == ["separate"] + ["piggyback"] * (STEPS - 1)
        assert run["addresses"][0][0] is None  # no copy sized for the bucket layout DDP replaces
        assert len(set(run["addresses"][1:])) == 1, run["addresses"]


def test_chunked_sign_draws_are_the_one_draw_stream():
    numel = 5 * SIGN_DRAW_ELEMS + 12
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([3, 7])))
    expected = torch.from_numpy(rng.integers(0, 2, size=numel, dtype=np.int8)).mul_(2).sub_(1)
    assert torch.equal(random_signs(numel, (3, 7), torch.device("cpu")), expected)
    out = torch.empty(numel, dtype=torch.int8)
    assert random_signs(numel, (3, 7), torch.device("cpu"), out=out) is out and torch.equal(out, expected)
    with pytest.raises(ValueError, match="out must be a CPU int8 tensor of 10 entries"):
        random_signs(10, (3, 7), torch.device("cpu"), out=torch.empty(10))


def test_a_numpy_view_of_a_tensor_is_counted_as_the_tensor():
    # SilentStats keeps float64 host arrays; one made by Tensor.numpy() holds the tensor's storage.
    from ddphooks.memory import retained_bytes

    tensor = torch.ones(1000, dtype=torch.float64)
    holder = {"view": tensor.numpy(), "array": np.ones(500)}  # a dict is walked like a ddphooks object
    assert retained_bytes(holder) == 8 * 1000 + 8 * 500
    holder["tensor"] = tensor  # the same storage, counted once
    assert retained_bytes(holder) == 8 * 1000 + 8 * 500


def test_a_numpy_slice_of_a_tensor_is_counted_as_the_tensors_storage_once():
    # A step's host copy read through slices (stats.HostParts): each slice's base is the array
    # Tensor.numpy() made, whose base is the tensor; the storage is counted once, named by the first of its shortest paths.
    tensor = torch.zeros(100)
    held = HostArrays([tensor.numpy()[10:20].reshape(2, 5), tensor.numpy()[:5], tensor, np.zeros(7)])
    kept = retained_tensors(held)
    assert [(t.path, t.nbytes) for t in kept] == [("state._host[0]", 400), ("state._host[3]", 56)]
