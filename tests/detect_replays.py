"""Replays of seeded runs through the detector, whose alerts ``tests/data/detect-replays.json`` holds:
the fixture that ``tests/test_detect_split.py`` compares the detector with, run by run (issue 58:
the detector split into a package raises the same alerts as the module it was).

A replay is a JSON spec: the run's records (a seeded synthetic stream, or the workload zoo's
recorded ``zoo-mixture-w8.jsonl``), the faults planted in them, the wire (every rank's values, or
the compact wire's sampled ranks, ``ddphooks.fleet.as_compact_records``), the detector's settings
and how it is fed:

1. ``offline``: ``detect_run(records, config)``, as ``ddphooks detect RUN.jsonl``;
2. ``online``: ``Detector(config, keep_scores=True).update(Observation.from_record(record))``
   step by step, with the non-finite values as Inf (as training hands them over, where a record
   writes null) and the per-parameter norms in float32 (as ``Observation.from_stats`` gives
   them); it also keeps the CUSUM behind each alert (``fired``) and every rank's evidence after
   the last step.

Regenerate the fixture (only where the detector's behaviour is meant to change)::

    python tests/detect_replays.py --write
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from ddphooks.detect import Detector, DetectorConfig, Observation, detect_run

DATA = Path(__file__).resolve().parent / "data"
FIXTURE = DATA / "detect-replays.json"
PARAMETERS = 6  # per-parameter norms of a synthetic stream: model.layers.{p}.mlp.down_proj.weight
LOSS_NOISE, NORM_NOISE, COSINE_SPREAD = 0.08, 0.1, 0.05  # per-rank noise of a healthy synthetic stream


def _names(count: int) -> list[str]:
    return [f"model.layers.{p}.mlp.down_proj.weight" for p in range(count)]


def healthy_records(world: int, steps: int, seed: int, parameters: int = PARAMETERS, sketch_dim: int = 256) -> list[dict]:
    """A healthy run's records: the loss trending down with each rank's batch noise, gradient norms
    shrinking with noise, leave-one-out cosines around 0.35 with the sketch's noise, cosines to the
    previous step around 0.15, and every rank's norm of each parameter."""
    rng = np.random.default_rng(seed)
    noise = 1 / math.sqrt(sketch_dim)
    names = _names(parameters)
    records = []
    for step in range(steps):
        losses = 3.0 * math.exp(-step / 300) + 1.0 + LOSS_NOISE * rng.standard_normal(world)
        norms = np.exp(NORM_NOISE * rng.standard_normal(world)) * (1.0 + 0.3 * math.exp(-step / 100))
        loo = 0.35 + COSINE_SPREAD * rng.standard_normal(world) + noise * rng.standard_normal(world)
        previous = 0.15 + 0.15 * rng.standard_normal(world)
        layers = np.exp(0.1 * rng.standard_normal((parameters, world)))
        records.append({
            "step": step, "world_size": world, "sketch_dim": sketch_dim, "cosine_noise": noise,
            "losses": losses.tolist(), "grad_norms": norms.tolist(), "cosine_loo": loo.tolist(),
            "cosine_previous": None if step == 0 else np.clip(previous, -1, 1).tolist(),
            "parameters": [{"name": name, "grad_norms": layers[p].tolist()} for p, name in enumerate(names)],
        })  # fmt: skip
    return records


def _set_unknown(record: dict, rank: int, parameter: int | None = None) -> None:
    """``rank``'s loss and gradient norm unknown (null, as a record writes NaN and Inf), and its
    norm of ``parameter`` (of every parameter where None)."""
    record["losses"][rank] = record["grad_norms"][rank] = None
    for index, entry in enumerate(record.get("parameters") or []):
        if parameter is None or index == parameter:
            entry["grad_norms"][rank] = None


def _plant(record: dict, fault: dict, rng: np.random.Generator) -> None:
    """One step of one fault (see ``FAULTS``) in ``record``, in place."""
    kind, rank, size = fault["kind"], fault.get("rank", 0), fault.get("size", 1.0)
    world, step = record["world_size"], record["step"]
    parameter = fault.get("parameter", 3)
    if kind in ("labels", "loss"):  # another loss: shuffled labels also turn the gradient away
        record["losses"][rank] += 0.6 * size
        if kind == "labels":
            record["cosine_loo"][rank] -= 0.3 * size
    elif kind == "wrong_data":  # a little off in every signal: only their sum stands out
        record["losses"][rank] += 2 * LOSS_NOISE * size
        record["grad_norms"][rank] *= math.exp(2 * NORM_NOISE * size)
        record["cosine_loo"][rank] -= 2 * LOSS_NOISE * size
    elif kind == "scale":  # the rank's gradient times ``size``
        record["grad_norms"][rank] *= size
    elif kind == "zero_gradient":  # a rank with no gradient on the step (a log of -inf)
        record["grad_norms"][rank] = 0.0
    elif kind == "cosine":
        record["cosine_loo"][rank] -= 0.8 * size
    elif kind == "stuck":  # the same batch again: nearly the same gradient, a loss that falls
        if record["cosine_previous"] is not None:
            record["cosine_previous"][rank] = float(np.clip(0.75 + 0.1 * rng.standard_normal(), -1, 1))
        record["losses"][rank] -= 0.2 * size
    elif kind in ("layer", "sdc"):  # one parameter's gradient times ``size``; sdc: the rank's whole norm too
        record["parameters"][parameter]["grad_norms"][rank] *= size
        if kind == "sdc":
            record["grad_norms"][rank] *= 3
            record["cosine_loo"][rank] -= 0.25
    elif kind == "replica":
        record["replicas"] = {
            "ranks": [rank], "tensors": 2,
            "parameters": [{"name": _names(PARAMETERS)[parameter], "ranks": [rank], "relative_difference": 0.01 * size}],
        }  # fmt: skip
    elif kind == "nonfinite":  # ``ranks`` NaN in the loss, the gradient and one parameter; every rank: the cosines too
        ranks = fault.get("ranks", [rank])
        for bad in ranks:
            _set_unknown(record, bad, parameter)
        if len(ranks) == world:
            record["cosine_loo"] = record["cosine_previous"] = [None] * world
        gradients = [{"rank": bad, "bucket": 0, "parameter": _names(PARAMETERS)[parameter]} for bad in ranks]
        record["nonfinite"] = {"losses": list(ranks), "gradients": gradients, "gradient_count": len(gradients)}
    elif kind == "duplicate":  # ``ranks`` train on the batches of the first of them
        ranks = fault["ranks"]
        for other in ranks[1:]:
            for key in ("losses", "grad_norms", "cosine_loo"):
                record[key][other] = record[key][ranks[0]]
            for entry in record["parameters"]:
                entry["grad_norms"][other] = entry["grad_norms"][ranks[0]]
            record["grad_norms"][other] *= 1 + fault.get("rounding", 0.0)
        if len(ranks) == world and fault.get("cosines") != "copied":
            record["cosine_loo"] = [1.0] * world
    elif kind == "absent":  # the rank joined under Join: no values
        record["absent"] = [rank]
        _set_unknown(record, rank)
        for key in ("cosine_loo", "cosine_previous"):
            if record[key] is not None:
                record[key][rank] = None
    elif kind == "negative":  # every loss lowered by ``size`` (an objective that crosses zero)
        record["losses"] = [loss - size for loss in record["losses"]]
    elif kind == "unused":  # ``parameter`` has no local gradient on about half the ranks
        norms = record["parameters"][parameter]["grad_norms"]
        record["parameters"][parameter]["grad_norms"] = [0.0 if rng.random() < 0.5 else norm for norm in norms]
    elif kind == "reorder":  # the parameters listed in another order (DDP's rebuilt buckets)
        record["parameters"] = record["parameters"][::-1]
    elif kind == "trend":  # every rank's gradient norm falling by e every ``size`` steps
        record["grad_norms"] = [norm * math.exp(-step / size) for norm in record["grad_norms"]]
    elif kind == "spread":  # every rank's losses and gradient norms ``size`` times as spread out
        extra = math.sqrt(size**2 - 1)
        record["losses"] = (np.array(record["losses"]) + extra * LOSS_NOISE * rng.standard_normal(world)).tolist()
        record["grad_norms"] = (np.array(record["grad_norms"]) * np.exp(extra * NORM_NOISE * rng.standard_normal(world))).tolist()
    else:
        raise ValueError(f"unknown fault {kind!r}")


FAULTS = (
    "labels", "loss", "wrong_data", "scale", "zero_gradient", "cosine", "stuck", "layer", "sdc", "replica", "nonfinite", "duplicate",
    "absent", "negative", "unused", "reorder", "trend", "spread",
)  # fmt: skip


def replay_records(spec: dict) -> list[dict]:
    """The records of a replay: its stream with its faults, each on its steps ``[start, end)``, in
    the order listed; without the keys ``spec["drop"]`` lists (null); on the compact wire where
    ``spec["sampled"]`` says so."""
    if "source" in spec:
        from ddphooks.experiment.report import read_run

        records = read_run(DATA / spec["source"]).records
    else:
        records = healthy_records(spec["world"], spec["steps"], spec["seed"], spec.get("parameters", PARAMETERS))
    for index, fault in enumerate(spec.get("faults", [])):
        rng = np.random.default_rng([spec.get("seed", 0), index])
        for record in records[fault["start"] : fault.get("end")]:
            _plant(record, fault, rng)
    for record in records:  # quantities a run did not capture
        record.update(dict.fromkeys(spec.get("drop", [])))
    if spec.get("sampled"):
        from ddphooks.fleet import as_compact_records  # torch: only for the compact wire's replays

        records = as_compact_records(records, spec["sampled"])
    return records


def _online_observation(record: dict) -> Observation:
    """A record as training hands it to the detector: non-finite values Inf, not NaN (null), and
    per-parameter norms in float32."""
    obs = Observation.from_record(record)
    for name in ("losses", "grad_norms", "parameter_norms"):
        array = getattr(obs, name)
        if array is not None:
            array[np.isnan(array)] = np.inf
    if obs.parameter_norms is not None:
        obs.parameter_norms = obs.parameter_norms.astype(np.float32)
    for rank in obs.absent:  # an absent rank's values are NaN, not a fault
        for array in (obs.losses, obs.grad_norms):
            if array is not None:
                array[rank] = np.nan
    return obs


def replay(spec: dict) -> dict:
    """What the detector raises on a replay: ``alerts``; online also ``fired`` (the CUSUM behind
    each statistical alert) and ``evidence`` (every rank's after the last step)."""
    records = replay_records(spec)
    config = DetectorConfig(**spec.get("config", {}))
    if spec.get("feed", "offline") == "offline":
        return {"alerts": detect_run(records, config)}
    detector = Detector(config, keep_scores=True)
    for record in records:
        detector.update(_online_observation(record))
    return {
        "alerts": detector.alerts,
        "fired": [[step, rank, list(key), part] for step, rank, key, part in detector.fired],
        "evidence": detector.evidence().tolist(),
    }


def _spec(name: str, world: int, steps: int, seed: int, *faults: dict, **options) -> dict:
    return {"name": name, "world": world, "steps": steps, "seed": seed, "faults": list(faults), **options}


def _fault(kind: str, start: int, end: int | None = None, **fields) -> dict:
    return {"kind": kind, "start": start, **({"end": end} if end is not None else {}), **fields}


def replay_specs() -> list[dict]:
    """The replays: every alert kind, at W = 2 (the split and the mirror), 4, 8, 16 and 32, on
    every rank's values and on the compact wire, offline and online."""
    level_one = {"alert_level": 1.0}
    specs = []
    # Each statistical fault on several seeds and world sizes, two faults a run on different ranks.
    statistical = [
        ("labels", {}), ("loss", {}), ("wrong_data", {}), ("scale", {"size": 3.0}), ("scale", {"size": 1.5}),
        ("cosine", {}), ("stuck", {}), ("layer", {"size": 20.0}), ("sdc", {"size": 20.0}),
    ]  # fmt: skip
    for world in (2, 4, 8):
        for index, (kind, fields) in enumerate(statistical):
            seed = 100 * world + index
            first, second = statistical[(index + 3) % len(statistical)]
            faults = [_fault(kind, 60, 140, rank=world - 1, **fields), _fault(first, 170, rank=0, **second)]
            feed = "online" if index % 3 == 0 else "offline"
            specs.append(_spec(f"w{world}-{kind}-then-{first}", world, 240, seed, *faults, config=level_one if index % 2 else {}, feed=feed))
    for world in (16, 32):
        for index, (kind, fields) in enumerate(statistical[::2]):
            faults = [_fault(kind, 50, rank=(3 * index + 1) % world, **fields)]
            specs.append(_spec(f"w{world}-{kind}", world, 110, 1000 * world + index, *faults, config=level_one, feed="online" if index % 2 else "offline"))
    # Faults that come and go: an episode each, once the last has been quiet for quiet_steps.
    recurring = [("loss", {}), ("cosine", {}), ("scale", {"size": 3.0}), ("layer", {"size": 20.0}), ("stuck", {})]
    for world in (2, 4, 8):
        for index, (kind, fields) in enumerate(recurring):
            faults = [_fault(kind, start, start + 25, rank=(episode * (world - 1)) % world, **fields) for episode, start in enumerate((50, 110, 170))]
            specs.append(_spec(f"w{world}-{kind}-three-episodes", world, 230, 300 + 10 * world + index, *faults, config=level_one, feed="online" if index % 2 else "offline"))
    # W = 2: the pair's split of a scaled gradient under a steep trend, given to the rank that
    # changed; a stuck rank's mirror emptied; a layer that changes on the other rank while the
    # first episode lasts, named.
    for seed in range(3):
        specs.append(_spec(f"w2-split-trend-{seed}", 2, 170, 500 + seed, _fault("trend", 0, size=140.0), _fault("scale", 100, rank=seed % 2, size=1.5 if seed < 2 else 1 / 1.5), feed="online"))
        specs.append(_spec(f"w2-stuck-mirror-{seed}", 2, 260, 510 + seed, _fault("stuck", 100, rank=1), _fault("layer", 130, rank=1, parameter=2, size=0.5)))
        specs.append(_spec(f"w2-stuck-then-layer-{seed}", 2, 320, 520 + seed, _fault("stuck", 100, 120, rank=1), _fault("layer", 250, rank=0, parameter=2, size=2.0)))
        specs.append(_spec(f"w2-stuck-then-split-{seed}", 2, 220, 530 + seed, _fault("stuck", 100, rank=1), _fault("scale", 130, rank=0, size=1.5), config=level_one))
    # Replica, non-finite and duplicate data: no baseline, from step 0.
    for world in (2, 4, 8, 16):
        seed = 600 + world
        specs.append(_spec(f"w{world}-replica", world, 80, seed, _fault("replica", 5, 7, rank=world - 1), _fault("replica", 30, 31, rank=0, size=2.0), _fault("replica", 50, 52, rank=world - 1, parameter=1)))
        specs.append(_spec(
            f"w{world}-nonfinite", world, 120, seed,
            _fault("nonfinite", 5, 6, rank=1), _fault("nonfinite", 6, 9, ranks=list(range(world))),  # poisons every rank: rank 1 named
            _fault("nonfinite", 30, 31, rank=0),  # an overflow a loss scaler skips: nothing
            _fault("nonfinite", 50, 52, rank=world - 1), _fault("nonfinite", 56, 57, rank=world - 1),  # stays non-finite alone
            _fault("nonfinite", 70, 71, rank=0), _fault("nonfinite", 73, 74, rank=0), _fault("nonfinite", 76, 77, rank=0),  # the third lone step
            _fault("nonfinite", 90, 91, rank=1), _fault("nonfinite", 94, 96, ranks=list(range(world))),  # everywhere later: not blamed
            feed="online" if world == 4 else "offline",
        ))  # fmt: skip
        every = list(range(world))
        specs.append(_spec(f"w{world}-duplicate-every", world, 40, seed, _fault("duplicate", 0, ranks=every)))
        if world >= 4:
            group = [0, world // 2]
            specs.append(_spec(
                f"w{world}-duplicate-group", world, 90, seed + 1, _fault("duplicate", 10, ranks=group, rounding=3e-7),
                _fault("loss", 30, 34, rank=group[1], size=0.2), _fault("duplicate", 60, ranks=[1, world - 1]), feed="online" if world == 8 else "offline",
            ))  # fmt: skip
    # Records without losses: the gradient norms and cosines decide, the norms alone take twice as long.
    specs.append(_spec("w4-duplicate-without-losses", 4, 40, 640, _fault("duplicate", 0, ranks=[1, 3]), drop=["losses"]))
    specs.append(_spec("w4-duplicate-norms-alone", 4, 40, 641, _fault("duplicate", 0, ranks=[1, 3]), drop=["losses", "cosine_loo"], feed="online"))
    # Every rank's numbers the same but their cosines to the others below 1: no duplicate data.
    specs.append(_spec("w4-duplicate-cosines-below-one", 4, 30, 642, _fault("duplicate", 0, ranks=[0, 1, 2, 3], cosines="copied")))
    # A large group, apart for longer than quiet_steps, then together again: a second episode.
    large = list(range(0, 16, 2)) + [1, 3]
    specs.append(_spec("w16-duplicate-large-group", 16, 80, 643, _fault("duplicate", 5, 25, ranks=large), _fault("duplicate", 45, ranks=large), feed="online"))
    # The compact wire: a corrupted layer on a sampled rank (the layer levels' view above the
    # sampled ranks), the rank's total norm as before.
    for world, sampled in ((8, 4), (8, 8), (16, 4)):
        faults = [_fault("layer", 50, rank=1, size=20.0), _fault("labels", 90, rank=world - 2)]
        specs.append(_spec(f"w{world}-compact-{sampled}", world, 130, 700 + world + sampled, *faults, sampled=sampled, config=level_one))
    # What the scoring reads: a loss that turns negative, parameters without a local gradient,
    # parameters listed in another order, a rank absent under Join, spreads that grow.
    specs.append(_spec("w4-negative-loss", 4, 320, 801, _fault("negative", 0, size=2.5), _fault("loss", 260, rank=2), config=level_one))
    specs.append(_spec("w4-unused-parameters", 4, 240, 802, _fault("unused", 0, parameter=1), _fault("unused", 0, parameter=4), _fault("layer", 150, rank=2, size=20.0)))
    specs.append(_spec("w4-reordered", 4, 120, 803, _fault("layer", 40, rank=2, size=1.5), _fault("reorder", 43), config=level_one, feed="online"))
    specs.append(_spec("w8-absent", 8, 160, 804, _fault("absent", 40, 60, rank=5), _fault("labels", 100, rank=5)))
    specs.append(_spec("w4-zero-gradients", 4, 120, 810, _fault("zero_gradient", 40, 43, rank=2), _fault("zero_gradient", 70, 71, rank=1), _fault("labels", 80, rank=1)))
    specs.append(_spec("w2-absent", 2, 80, 806, _fault("absent", 30, 40, rank=1), _fault("nonfinite", 50, 53, rank=1)))
    specs.append(_spec("w2-compact-1", 2, 160, 807, _fault("layer", 60, rank=0, size=20.0), sampled=1, config=level_one, feed="online"))
    # A split at W = 2 with few steps before it (a short warm-up): the pair's trend a constant, or unknown.
    specs.append(_spec("w2-early-split", 2, 60, 808, _fault("scale", 6, rank=1, size=3.0), config={"warmup": 2, "window": 8, "recent": 4}))
    specs.append(_spec("w2-early-split-unknown-before", 2, 60, 809, _fault("nonfinite", 0, 6, ranks=[0, 1]), _fault("scale", 6, rank=0, size=3.0), config={"warmup": 1, "window": 4, "recent": 2}, feed="online"))
    specs.append(_spec("w4-spread-grows", 4, 160, 805, _fault("spread", 40, size=3.0), _fault("wrong_data", 100, rank=3, size=1.5), config=level_one))
    # The workload zoo's recorded domain mixture at W = 8: healthy at the defaults, alerts with
    # the MAD alone, a rank on wrong data named, and the same on the compact wire.
    zoo = {"name": "zoo-mixture-w8", "source": "zoo-mixture-w8.jsonl"}
    specs += [
        {**zoo, "name": "zoo-mixture-w8"},
        {**zoo, "name": "zoo-mixture-w8-mad", "config": {"scale_quantile": 0.5}},
        {**zoo, "name": "zoo-mixture-w8-mad-level-one", "config": {"scale_quantile": 0.5, "alert_level": 1.0, "loss_scale": "linear"}, "feed": "online"},
        {**zoo, "name": "zoo-mixture-w8-wrong-data", "faults": [_fault("wrong_data", 100, rank=1, size=3.0)], "config": level_one},
    ]
    return specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {FIXTURE.relative_to(Path.cwd()) if FIXTURE.is_relative_to(Path.cwd()) else FIXTURE}")
    args = parser.parse_args()
    runs, kinds, start = [], Counter(), time.perf_counter()
    for spec in replay_specs():
        result = replay(spec)
        kinds.update(alert["kind"] for alert in result["alerts"])
        runs.append({"spec": spec, **result})
        print(f"{spec['name']:40s} {len(result['alerts']):3d} {', '.join(sorted({a['kind'] for a in result['alerts']}))}", file=sys.stderr)
    print(f"{len(runs)} replays, {sum(kinds.values())} alerts in {time.perf_counter() - start:.1f} s: {dict(sorted(kinds.items()))}", file=sys.stderr)
    if args.write:
        FIXTURE.write_text(json.dumps({"replays": runs}, separators=(",", ":")) + "\n")
        print(f"{FIXTURE}: {FIXTURE.stat().st_size / 1e3:.0f} kB", file=sys.stderr)


if __name__ == "__main__":
    main()
