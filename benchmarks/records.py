"""What one step's record costs the training thread, before and after the sink writer thread, and its size.

For W = 8, 64, 1024 ranks and 100, 272, 1000 parameters (sketch_dim 256, i.e. 251 bins), one
process builds the ``SilentStats`` the hook would publish (a W x slot fp32 tensor of gathered
slots: loss, positive squared norms per parameter, a sketch with a shared component) and times:

  before        training thread: json.dumps(stats.to_dict(detail=True, detail_max_world=10**9)),
                the full record (W x W cosine, per-parameter x per-rank norms) that rank 0 built
                and serialised at the first bucket of the next step before the writer thread
  submit        training thread now: RecordWriter.submit(stats) into a real writer with a real
                JsonlSink in a temporary folder; one submit per "step", each followed by waiting
                for the writer (so it always keeps up and nothing is dropped)
  writer        writer thread, per record: RecordBuilder.build + JsonlSink.write, compact and detail;
                "per step" amortises one detail record every detail_every (100) instrumented steps.
                The writer holds the GIL for most of it, so this is also the most it can take
                from the training thread's Python work (the goal checks report both)
  summary()     training thread: stats.summary(), what a loop that reads state.latest pays
  detector      the detector's process (ddphooks.detect.process): the online detector (on by
                default), which every rank runs on each step (reading the step's statistics from
                its slots and linking it to the previous one included); timed in this process
                after its warm-up on steps whose slots vary (8 random draws in turn). It holds no
                GIL of the training process
  hand-off      training thread: StepPipeline.process() at the next step's first bucket with the
                default detector (a DetectorProcess): the step's slots sent to the detector's
                process and the alerts of the step before read back; paced like the submits (the
                detector finishes each step before the next), as when it keeps up with training
Sizes are the bytes of the JSONL lines the sink wrote; "per step" amortises one detail record
every detail_every (100) instrumented steps. Each measurement uses a fresh SilentStats (it caches
its arrays). Times are medians with their interquartile range.

    python benchmarks/records.py                 # the full table (~2 minutes on 2 cores)
    python benchmarks/records.py --quick         # W = 8 and 1024 with 272 parameters, the detector at W = 8 (seconds)
    python benchmarks/records.py --json records.json
"""

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from ddphooks import JsonlSink
from ddphooks.config import SilentConfig
from ddphooks.detect import Detector, DetectorConfig, Observation
from ddphooks.detect.process import DetectorProcess
from ddphooks.pipeline import StepPipeline
from ddphooks.records import RecordBuilder
from ddphooks.sketch import sketch_bins
from ddphooks.stats import LOSS_COUNT, LOSS_SUM, PARAMS_BEGIN, STATUS, BucketLayout, SilentStats, slot_size
from ddphooks.writer import RecordWriter

# -- config ----------------------------------------------------------------------------------------
WORLDS, PARAMETERS = (8, 64, 1024), (100, 272, 1000)
QUICK_WORLDS, QUICK_PARAMETERS = (8, 1024), (272,)
SKETCH_DIM = 256
DEFAULTS = SilentConfig()  # detail_every and detail_max_world as a user gets them
BUCKET_CAP_MB, FIRST_BUCKET_MB = 25, 1
# SmolLM2-135M shapes (hidden 576, MLP 1536, 3 KV heads of 64): 272 parameters = embedding, 30 x 9, norm.
HIDDEN, MLP_WIDTH, KV_WIDTH, VOCAB = 576, 1536, 192, 49152
LAYER = (("input_layernorm.weight", HIDDEN), ("self_attn.q_proj.weight", HIDDEN * HIDDEN),
         ("self_attn.k_proj.weight", KV_WIDTH * HIDDEN), ("self_attn.v_proj.weight", KV_WIDTH * HIDDEN),
         ("self_attn.o_proj.weight", HIDDEN * HIDDEN), ("post_attention_layernorm.weight", HIDDEN),
         ("mlp.gate_proj.weight", MLP_WIDTH * HIDDEN), ("mlp.up_proj.weight", MLP_WIDTH * HIDDEN),
         ("mlp.down_proj.weight", HIDDEN * MLP_WIDTH))  # fmt: skip
# The goals: bytes of the default record, and training-thread seconds per instrumented step.
SIZE_GOALS = {(8, 272): 16 * 1024, (1024, 272): 256 * 1024}
TIME_GOALS = {(8, 272): 1e-3, (1024, 272): 20e-3}
# Paced submits (of which detail ones) per size; 'before' repeats, fewer where one takes seconds.
# Timed detector steps after its warm-up (fewer where one takes seconds), up to which W.
FULL = dict(SUBMITS=200, DETAIL_SUBMITS=12, BEFORE_REPEATS=15, BEFORE_BUDGET_S=6.0, MIN_REPEATS=3,
            DETECTOR_STEPS=16, DETECTOR_BUDGET_S=6.0, DETECTOR_MAX_WORLD=1024)  # fmt: skip
QUICK = dict(SUBMITS=30, DETAIL_SUBMITS=3, BEFORE_REPEATS=3, BEFORE_BUDGET_S=1.0, MIN_REPEATS=2,
             DETECTOR_STEPS=4, DETECTOR_BUDGET_S=1.0, DETECTOR_MAX_WORLD=64)  # fmt: skip


def llama_layout(n_params):
    """Bucket layouts of a Llama with ``n_params`` parameter tensors, bucketed like DDP (greedy, in
    reverse parameter order, a 1 MB first bucket, then 25 MB)."""
    body = [(f"model.layers.{i // len(LAYER)}.{LAYER[i % len(LAYER)][0]}", LAYER[i % len(LAYER)][1]) for i in range(n_params - 2)]
    params = [("model.embed_tokens.weight", VOCAB * HIDDEN), *body, ("model.norm.weight", HIDDEN)]
    buckets, current, size, cap = [], [], 0, FIRST_BUCKET_MB * 2**20
    for name, numel in reversed(params):
        current.append((name, numel))
        size += 4 * numel
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, BUCKET_CAP_MB * 2**20
    if current:
        buckets.append(current)
    return [BucketLayout(i, tuple(n for n, _ in b), tuple(k for _, k in b)) for i, b in enumerate(buckets)]


def gathered_slots(world, n_params, bins, seed=0):
    """The W x slot fp32 tensor the hook gathers, and the reduced squared norms: losses near 2,
    squared norms that vary over parameters (log-normal) and a little over ranks, sketches with a
    component shared by all ranks (pairwise cosines around 0.4)."""
    rng = np.random.default_rng(seed)
    rows = np.empty((world, slot_size(n_params, bins)), dtype=np.float32)
    rows[:, LOSS_SUM] = 2.0 + 0.05 * rng.standard_normal(world)
    rows[:, LOSS_COUNT] = 1.0
    rows[:, STATUS] = 0.0
    scale = np.exp(rng.standard_normal(n_params) - 8)
    rows[:, PARAMS_BEGIN : PARAMS_BEGIN + n_params] = scale * np.exp(0.1 * rng.standard_normal((world, n_params)))
    rows[:, PARAMS_BEGIN + n_params :] = rng.standard_normal(bins) + 1.2 * rng.standard_normal((world, bins))
    return torch.from_numpy(rows), torch.from_numpy((0.4 * scale).astype(np.float32))


def spread(samples):
    """Median and interquartile range of a list of seconds."""
    quartiles = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) >= 2 else [samples[0]] * 3
    return {"median": statistics.median(samples), "iqr": [quartiles[0], quartiles[2]], "n": len(samples)}


def measure_before(fresh, repeats, budget_s, min_repeats):
    """Training-thread seconds and bytes of the full record serialised as main did."""
    times, size = [], 0
    while len(times) < repeats:
        stats = fresh(0)
        start = time.perf_counter()
        line = json.dumps(stats.to_dict(detail=True, detail_max_world=10**9), allow_nan=False)
        times.append(time.perf_counter() - start)
        size = len(line.encode()) + 1  # and its newline
        repeats = min(repeats, max(min_repeats, math.ceil(budget_s / times[0])))
    return spread(times), size


def measure_after(fresh, world, submits, detail_submits, folder):
    """Submit into a real RecordWriter + JsonlSink; time submit (training thread), build and write
    (writer thread, by wrapping both), and read the record sizes back from the file."""
    sink = JsonlSink(Path(folder) / f"records-{world}.jsonl")
    builder = RecordBuilder(every=1, detail_every=DEFAULTS.detail_every, detail_max_world=DEFAULTS.detail_max_world)
    build_s, write_s = {True: [], False: []}, {True: [], False: []}
    plain_write = sink.write

    def timed_build(stats):
        start = time.perf_counter()
        record = builder.build(stats)
        build_s[record["detail"]].append(time.perf_counter() - start)
        return record

    def timed_write(record):
        start = time.perf_counter()
        plain_write(record)
        write_s[record["detail"]].append(time.perf_counter() - start)

    sink.write = timed_write
    writer = RecordWriter([sink], timed_build, max_pending=10**6)  # never drops: every submit is timed as it is
    writer.submit(fresh(1))  # warm-up: starts the thread and opens the file
    writer.flush(600)
    for timings in (*build_s.values(), *write_s.values()):
        timings.clear()
    # Paced: one record per "step", the writer idle when it arrives; detail steps spread over the run.
    submit_s, period = [], max(1, submits // detail_submits)
    for i in range(submits):
        step = i * builder.detail_every + (0 if i % period == 0 else 1)  # a multiple of detail_every is a detail step
        stats = fresh(step)
        start = time.perf_counter()
        writer.submit(stats)
        submit_s.append(time.perf_counter() - start)
        writer.flush(600)
    writer.close(600)
    if writer.dropped:
        raise RuntimeError(f"the writer dropped records: {writer.dropped}")
    sizes, with_previous = {True: [], False: []}, []
    for line in sink.path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        sizes[record["detail"]].append(len(line.encode()) + 1)
        # Above per_rank_max_world a compact record carries the signal over ranks, not per rank.
        with_previous.append(record["cosine_previous" if record["per_rank"] else "cosine_previous_over_ranks"] is not None)
    compact, detail = statistics.median(sizes[False]), statistics.median(sizes[True])
    writer_s = {kind: [b + w for b, w in zip(build_s[kind], write_s[kind])] for kind in (True, False)}
    per_step = lambda compact_value, detail_value: (detail_value + (builder.detail_every - 1) * compact_value) / builder.detail_every
    return {
        "submit_s": spread(submit_s),
        "writer_compact_s": spread(writer_s[False]),
        "writer_detail_s": spread(writer_s[True]),
        "build_compact_s": spread(build_s[False]),
        "write_compact_s": spread(write_s[False]),
        "build_detail_s": spread(build_s[True]),
        "write_detail_s": spread(write_s[True]),
        "compact_bytes": int(compact),
        "detail_bytes": int(detail),
        "writer_s_per_step": per_step(statistics.median(writer_s[False]), statistics.median(writer_s[True])),
        "bytes_per_step": per_step(compact, detail),
        "cosine_previous_in_records": all(with_previous),
    }


def measure_detector(fresh_variant, steps, budget_s):
    """Pipeline-thread seconds of one detector step (reading the step's statistics and its
    ``cosine_previous`` against the previous step included, as the pipeline does), after the detector's
    warm-up, when it starts scoring; stops early once ``budget_s`` is spent."""
    detector, times, previous = Detector(), [], None
    warmup = DetectorConfig().warmup
    for step in range(warmup + steps):
        stats = fresh_variant(step, previous)
        start = time.perf_counter()
        detector.update(Observation.from_stats(stats))
        previous = stats
        if step >= warmup:
            times.append(time.perf_counter() - start)
            if sum(times) > budget_s:
                break
    return spread(times)


def measure_handoff(fresh_variant, steps, budget_s):
    """Training-thread seconds of ``StepPipeline.process()`` with the detector on (in its process,
    as ``attach`` sets it up up to ``gather_max_world``), after the detector's warm-up; between
    steps (untimed) the detector finishes the step."""
    detector = DetectorProcess(warn=print)
    pipeline, times = StepPipeline(detector, None, on_alert=None, warns=False), []
    warmup = DetectorConfig().warmup
    for step in range(warmup + steps):
        pipeline.complete(fresh_variant(step))
        start = time.perf_counter()
        pipeline.process()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        pipeline.flush(60.0)
        if sum(times) > budget_s:
            break
    pipeline.close(60.0)
    detector.close()
    return spread(times)


def measure(world, n_params, settings, folder):
    bins = sketch_bins(SKETCH_DIM)
    layouts = llama_layout(n_params)
    gathered, reduced = gathered_slots(world, n_params, bins)
    step_before = SilentStats(0, world, layouts, *gathered_slots(world, n_params, bins, seed=1), bins, "piggyback")

    def fresh(step):  # with the step before, as the hook builds it: the records carry cosine_previous
        return SilentStats(step, world, layouts, gathered, reduced, bins, "piggyback", previous=step_before)

    variants = [gathered_slots(world, n_params, bins, seed) for seed in range(8)]

    def fresh_variant(step, previous=None):  # steps that differ, for the detector's baselines
        return SilentStats(step, world, layouts, *variants[step % len(variants)], bins, "piggyback", previous=previous)

    before, before_bytes = measure_before(fresh, settings["BEFORE_REPEATS"], settings["BEFORE_BUDGET_S"], settings["MIN_REPEATS"])
    after = measure_after(fresh, world, settings["SUBMITS"], settings["DETAIL_SUBMITS"], folder)
    summary_s = []
    for _ in range(settings["DETAIL_SUBMITS"]):
        stats = fresh(1)
        start = time.perf_counter()
        stats.summary()
        summary_s.append(time.perf_counter() - start)
    detector = handoff = None
    if world <= settings["DETECTOR_MAX_WORLD"]:
        detector = measure_detector(fresh_variant, settings["DETECTOR_STEPS"], settings["DETECTOR_BUDGET_S"])
        handoff = measure_handoff(fresh_variant, settings["DETECTOR_STEPS"], settings["DETECTOR_BUDGET_S"])
    return {"world_size": world, "parameters": n_params, "buckets": len(layouts), "bins": bins, "before_s": before,
            "before_bytes": before_bytes, **after, "summary_s": spread(summary_s), "detector_s": detector, "handoff_s": handoff}  # fmt: skip


def goals(rows):
    """The issue's goals, checked against the rows measured here."""
    result = []
    for row in rows:
        key = (row["world_size"], row["parameters"])
        if key in SIZE_GOALS:
            limit = SIZE_GOALS[key]
            result.append({"goal": "default record bytes", "world_size": key[0], "parameters": key[1], "limit": limit,
                           "compact_bytes": row["compact_bytes"], "bytes_per_step": row["bytes_per_step"],
                           "met": row["compact_bytes"] <= limit and row["bytes_per_step"] <= limit})  # fmt: skip
        if key in TIME_GOALS:
            limit = TIME_GOALS[key]
            bound = row["submit_s"]["median"] + row["writer_s_per_step"]  # as if the writer stole the GIL throughout
            result.append({"goal": "training-thread seconds per step", "world_size": key[0], "parameters": key[1], "limit": limit,
                           "submit_s": row["submit_s"]["median"], "with_writer_s": bound, "met": bound <= limit})  # fmt: skip
            if row["detector_s"] is None:
                continue
            # The detector runs in its own process: the training thread's part is the hand-off.
            with_detector = bound + row["handoff_s"]["median"]
            result.append({"goal": "training-thread seconds per step with the detector", "world_size": key[0],
                           "parameters": key[1], "limit": limit, "submit_s": row["submit_s"]["median"],
                           "handoff_s": row["handoff_s"]["median"], "with_writer_s": with_detector, "met": with_detector <= limit})  # fmt: skip
    return result


def show(s, unit=1e3, digits=1):
    """'median [q1-q3]' in ms (or another unit)."""
    q1, q3 = s["iqr"]
    return f"{unit * s['median']:.{digits}f} [{unit * q1:.{digits}f}-{unit * q3:.{digits}f}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="W = 8 and 1024 with 272 parameters, few repeats")
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = QUICK if args.quick else FULL
    worlds, parameters = (QUICK_WORLDS, QUICK_PARAMETERS) if args.quick else (WORLDS, PARAMETERS)
    print(f"\nddphooks records, {date.today()}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; sketch_dim {SKETCH_DIM}, detail_every {DEFAULTS.detail_every}, "
          f"detail_max_world {DEFAULTS.detail_max_world}; medians [IQR]\n")
    print(f"{'W':>5} {'params':>6} {'before ms':>22} {'before B':>11} {'submit us':>12} {'writer compact ms':>19} "
          f"{'writer detail ms':>20} {'writer ms/step':>14} {'compact B':>9} {'detail B':>9} {'B/step':>8} {'summary() ms':>17} "
          f"{'detector ms':>20} {'hand-off us':>14}")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for world in worlds:
            for n_params in parameters:
                r = measure(world, n_params, settings, folder)
                rows.append(r)
                print(f"{world:>5} {n_params:>6} {show(r['before_s']):>22} {r['before_bytes']:>11,d} {show(r['submit_s'], 1e6, 0):>12} "
                      f"{show(r['writer_compact_s'], 1e3, 2):>19} {show(r['writer_detail_s']):>20} {1e3 * r['writer_s_per_step']:>14.2f} "
                      f"{r['compact_bytes']:>9,d} {r['detail_bytes']:>9,d} {r['bytes_per_step']:>8,.0f} {show(r['summary_s'], 1e3, 2):>17} "
                      f"{show(r['detector_s'], 1e3, 2) if r['detector_s'] else '-':>20} "
                      f"{show(r['handoff_s'], 1e6, 0) if r['handoff_s'] else '-':>14}", flush=True)
    checked = goals(rows)
    print()
    for g in checked:
        value = (f"{g['compact_bytes']:,d} B compact, {g['bytes_per_step']:,.0f} B per step" if "compact_bytes" in g
                 else f"submit {1e6 * g['submit_s']:.0f} us"
                 + (f" + hand-off {1e6 * g['handoff_s']:.0f} us" if "handoff_s" in g else "")
                 + f", {1e3 * g['with_writer_s']:.2f} ms with all the writer's time per step"
                 + (" (the detector's runs in its own process)" if "detector" in g["goal"] else ""))  # fmt: skip
        limit = f"{g['limit']:,d} B" if "compact_bytes" in g else f"{1e3 * g['limit']:.0f} ms"
        print(f"goal: {g['goal']} at W={g['world_size']}, {g['parameters']} parameters <= {limit}: {value} -> {'met' if g['met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(date.today()), "torch": torch.__version__, "detail_every": DEFAULTS.detail_every,
                       "detail_max_world": DEFAULTS.detail_max_world, "rows": rows, "goals": checked}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
