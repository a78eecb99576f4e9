"""The Triton statistics kernel (``SilentConfig(stats_kernel="triton")``) against the torch path.

On the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before the workers start, so
triton reads it when they import it): the kernel alone on ragged layouts, then the whole hook
under DDP and the FSDP2 transport, each against the same run with the default torch path.
"""

import importlib.util
import math
import os

import pytest
import torch

import ddphooks
from ddphooks.launch import spawn
from test_fsdp import _sharded
from test_hook import TIMEOUT, _batch, _loss, _make_ddp, _Messages

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (Linux x86-64 test extra)")

# (bins, parameter lengths, first row, rows): a table wrap, an empty parameter, one element, many
# small ones, a bucket 2.3 G positions into the model (its base overflows 32 bits); FSDP2's input of
# rows (one per shard, every parameter's shard in the same columns), narrower than a tile and wider.
LAYOUTS = (
    (61, [1000, 70_001, 5, 0, 30_000, 17, 1], 3, 1),
    (251, [300_000, 251, 4_000], 40_000, 1),
    (1021, [50_000, 9], 70_000, 1),
    (13, [3000, 7], 0, 1),
    (251, [7], 2, 1),
    (251, [100] * 50, 5, 1),
    (251, [5000, 3], 9_000_000, 1),
    (251, [40, 3, 1], 11, 1024),
    (61, [300, 7, 0, 2000], 5, 50),
)


def _check_kernel() -> list[tuple]:
    """Per layout and form: the largest relative differences in the sketch and the norms, and
    whether the bucket after the pass is what it must be (unchanged, or divided like torch.div)."""
    from ddphooks.sketch import BucketPlan, BucketStatsKernel, SignTable
    from ddphooks.triton_stats import TritonBucketStats

    cpu, generator, found = torch.device("cpu"), torch.Generator().manual_seed(0), []
    for bins, lengths, first_row, rows in LAYOUTS:
        table = SignTable(3, bins, cpu)
        plan = BucketPlan(lengths, bins, first_row * bins, cpu, 1 << 16, rows=rows)
        for dtype, form in ((torch.float32, "run"), (torch.bfloat16, "run"), (torch.bfloat16, "divide"), (torch.float32, "divide"), (torch.float32, "step")):
            flat = torch.randn(plan.numel, generator=generator).to(dtype)
            original = flat.clone()
            before = torch.randn(bins, generator=generator)  # the sketch is added into the step's
            expected_sketch, expected_sq = before.clone(), torch.empty(len(lengths))
            BucketStatsKernel(bins, cpu, table).run(flat, plan, expected_sketch, expected_sq)
            kernel = TritonBucketStats(bins, cpu, table)
            sketch, sq = before.clone(), torch.full((len(lengths),), 7.0)  # norms are overwritten
            if form == "step":  # the DDP hook's form: one launch a bucket, zeroing and summing once a step
                kernel.start_step(sketch, [sq])
                kernel.accumulate(flat, plan, sketch, sq)
                kernel.finish_step(sketch, [sq])
                expected_sketch = expected_sketch - before  # the step's sketch, written over the one before
            elif form == "divide" and dtype == torch.bfloat16:
                # Triton's interpreter rounds fp32 to bf16 by truncation, torch to nearest even: the
                # probe finds the mismatch, and the kernel refuses to divide (the hook divides with torch)
                assert not kernel.divides_like_torch(dtype, 3)
                with pytest.raises(ValueError, match="does not divide torch.bfloat16 by 3 as torch.div does here"):
                    kernel.run(flat, plan, sketch, sq, divide_by=3)
                kernel.run(flat, plan, sketch, sq)
                form = "divide refused"
            elif form == "divide":
                assert kernel.divides_like_torch(dtype, 3)
                kernel.run(flat, plan, sketch, sq, divide_by=3)
            else:
                kernel.run(flat, plan, sketch, sq)
            expected_flat = torch.div(original, 3) if form == "divide" else original
            same = torch.equal(flat, expected_flat)
            sketch_diff = ((sketch - expected_sketch).abs().max() / expected_sketch.abs().max()).item()
            sq_diff = max(abs(a - b) / b if b else abs(a) for a, b in zip(sq.tolist(), expected_sq.tolist()))
            found.append((bins, (len(lengths), rows), f"{dtype} {form}", sketch_diff, sq_diff, same))
    return found


def _records(rank: int, kernel: str, sharded: bool) -> tuple[list[dict], list[torch.Tensor], set[str]]:
    """Three steps of the small MLP under DDP or FSDP2 with ``stats_kernel=kernel``: the records,
    the parameters after training and the kernel classes that ran."""
    model = _sharded((2,))[0] if sharded else _make_ddp()
    state = ddphooks.attach(model, stats_kernel=kernel, check_replicas_every=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    for step in range(3):
        loss = _loss(model, *_batch(rank, step))
        loss.backward()
        state.flush()
        records.append(state.latest.to_dict())
        optimizer.step()
        optimizer.zero_grad()
    state.close()
    kernels = {type(k).__name__ for k in state._kernels.values()}
    return records, [(p.full_tensor() if sharded else p).detach().clone() for p in model.parameters()], kernels


def _check_auto(rank: int) -> dict:
    """stats_kernel="auto", the default: the torch path on the CPU; where auto picks Triton (here
    the CPU under the interpreter stands in for a CUDA device), the kernel once its check passes,
    and the torch path with one warning where the check fails. The check itself, on a kernel that
    computes and on one whose launch writes nothing."""
    from ddphooks import state as state_module
    from ddphooks.sketch import SignTable
    from ddphooks.triton_stats import TritonBucketStats

    cpu = torch.device("cpu")
    kernel = TritonBucketStats(61, cpu, SignTable(0, 61, cpu))
    found = {"check": kernel.agrees_with_torch()}
    found["table_made"] = kernel.signs._values is not None  # the probe's torch path signs with a table of its own
    kernel._launch = lambda flat, plan, sq_norms, sketches, division: sq_norms.zero_()  # a launch that computes nothing
    found["broken_check"] = kernel.agrees_with_torch()
    found["default"] = sorted(_records(rank, "auto", False)[2])
    picks, check, build = state_module.auto_picks_triton, TritonBucketStats.agrees_with_torch, TritonBucketStats.__init__
    state_module.auto_picks_triton = lambda device, bins: bins > 0
    try:
        records, params, found["picked"] = _records(rank, "auto", False)
        found["picked_matches_torch"] = all(_close(a, b, 1e-5) for a, b in zip(records, _records(rank, "torch", False)[0]))
        TritonBucketStats.agrees_with_torch = lambda self: "RuntimeError('no C compiler for the launcher')"
        log = _Messages()
        found["refused"] = sorted(_records(rank, "auto", False)[2])
        found["warnings"] = [m for m in log.messages if "stats_kernel='auto'" in m]
        # A kernel that cannot even be built (a broken install) is refused the same way, not raised into backward.
        TritonBucketStats.agrees_with_torch = check

        def broken(self, *args):
            raise ImportError("triton: libcuda.so cannot be found")

        TritonBucketStats.__init__ = broken
        log.messages.clear()
        found["unbuildable"] = sorted(_records(rank, "auto", False)[2])
        found["unbuildable_warnings"] = [m for m in log.messages if "stats_kernel='auto'" in m]
    finally:
        state_module.auto_picks_triton, TritonBucketStats.agrees_with_torch, TritonBucketStats.__init__ = picks, check, build
    return found


def _check_hook_and_errors(rank: int, world: int) -> dict:
    result = {"kernel": _check_kernel() if rank == 0 else None, "auto": _check_auto(rank)}
    for transport in ("ddp", "fsdp2"):
        triton_records, triton_params, triton_kernels = _records(rank, "triton", transport == "fsdp2")
        torch_records, torch_params, torch_kernels = _records(rank, "torch", transport == "fsdp2")
        result[transport] = {
            "records": (triton_records, torch_records),
            "kernels": (triton_kernels, torch_kernels),
            "unchanged": all(torch.equal(a, b) for a, b in zip(triton_params, torch_params)),
        }
    # Without the interpreter the CPU is refused at attach, on every rank alike, naming the fix.
    del os.environ["TRITON_INTERPRET"]
    try:
        ddphooks.attach(_make_ddp(), stats_kernel="triton")
    except ValueError as error:
        result["cpu_error"] = str(error)
    return result


def _close(a, b, tolerance: float) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tolerance) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tolerance) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)
    return a == b


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return spawn(_check_hook_and_errors, 2, timeout=TIMEOUT)


def test_the_kernel_matches_the_torch_path_on_ragged_layouts(results):
    found = results[0]["kernel"]
    assert len(found) == 5 * len(LAYOUTS)
    for bins, params, form, sketch_diff, sq_diff, bucket_as_expected in found:
        assert sketch_diff < 1e-5 and sq_diff < 1e-5, (bins, params, form, sketch_diff, sq_diff)
        assert bucket_as_expected, (bins, params, form)  # unchanged, or divided bitwise like torch.div


@pytest.mark.parametrize("transport", ["ddp", "fsdp2"])
def test_records_match_the_torch_path_and_training_is_unchanged(results, transport):
    for rank in (0, 1):
        triton_records, torch_records = results[rank][transport]["records"]
        assert [r["step"] for r in triton_records] == [0, 1, 2]
        for with_triton, with_torch in zip(triton_records, torch_records):
            # The same statistics to fp32 rounding (the sums run in another order).
            assert _close(with_triton, with_torch, 1e-5), (transport, with_triton, with_torch)
            assert with_triton["cosine"] is not None and with_triton["parameters"], with_triton.keys()
        assert results[rank][transport]["kernels"] == ({"TritonBucketStats"}, {"BucketStatsKernel"})
        assert results[rank][transport]["unchanged"]


def test_the_cpu_without_the_interpreter_is_refused_at_attach(results):
    for rank in (0, 1):
        message = results[rank]["cpu_error"]
        assert "stats_kernel='triton' runs on CUDA devices" in message and "the gradients are on cpu" in message
        assert "Use stats_kernel='torch'" in message


def test_auto_uses_the_kernel_only_where_it_is_picked_and_passes_its_check(results):
    for rank in (0, 1):
        auto = results[rank]["auto"]
        assert auto["check"] is None and not auto["table_made"]
        assert auto["broken_check"].startswith("on a probe bucket its norms differ from the torch path's by 1.0e+00"), auto["broken_check"]
        assert auto["default"] == ["BucketStatsKernel"]  # the CPU: the torch path
        assert auto["picked"] == {"TritonBucketStats"} and auto["picked_matches_torch"]
        assert auto["refused"] == ["BucketStatsKernel"]
        assert auto["warnings"] == [
            "ddphooks: stats_kernel='auto' keeps the torch path on cpu: the Triton kernel failed its check "
            "(RuntimeError('no C compiler for the launcher')). Pass stats_kernel='torch' to skip the check."
        ]
        assert auto["unbuildable"] == ["BucketStatsKernel"]
        assert auto["unbuildable_warnings"] == [
            "ddphooks: stats_kernel='auto' keeps the torch path on cpu: the Triton kernel failed its check "
            "(ImportError('triton: libcuda.so cannot be found')). Pass stats_kernel='torch' to skip the check."
        ]


def test_settings_are_checked():
    with pytest.raises(ValueError, match=r"stats_kernel='cuda' is not one of 'auto', 'torch', 'triton'"):
        ddphooks.SilentConfig(stats_kernel="cuda")
    with pytest.raises(ValueError, match=r"stats_kernel='triton' computes the norms with the sketch; with sketch_dim=0 use stats_kernel='torch'"):
        ddphooks.SilentConfig(stats_kernel="triton", sketch_dim=0)


def test_a_failing_division_probe_leaves_the_division_to_torch(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernel checks its device
    from ddphooks.sketch import SignTable
    from ddphooks.triton_stats import TritonBucketStats

    kernel = TritonBucketStats(13, torch.device("cpu"), SignTable(3, 13, torch.device("cpu")))

    def broken(dtype, divide_by):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(kernel, "_probe_division", broken)
    with caplog.at_level("WARNING", logger="ddphooks"):
        assert not kernel.divides_like_torch(torch.float32, 2)
        assert not kernel.divides_like_torch(torch.float32, 2)  # found once
    assert [r.getMessage() for r in caplog.records] == [
        "ddphooks: the Triton kernel's division probe failed (RuntimeError('no kernel image is available for execution on the device')); "
        "torch divides torch.float32 buckets by 2 instead"
    ]


def test_auto_keeps_the_torch_path_under_deepspeed(monkeypatch):
    """DeepSpeed runs the pass once per parameter (tensor hooks): "auto" never picks Triton there."""
    from ddphooks import state as state_module
    from ddphooks.deepspeed import DeepSpeedSilentState

    monkeypatch.setattr(state_module, "auto_picks_triton", lambda device, bins: True)
    state = DeepSpeedSilentState()
    state.bins, state._kernels = 61, {}  # what binding sets (from sketch_dim)
    assert state.config.stats_kernel == "auto"
    assert type(state._kernel(torch.device("cpu"))).__name__ == "BucketStatsKernel"
