"""Per-step cost of ``Detector.update`` at large world sizes (issue 42), on synthetic observations.

Feeds ``Detector.update(Observation(...))`` realistic steps: losses ~2 with per-rank noise,
log-normal gradient norms, leave-one-out cosines ~0.3, cosines to the previous step ~0.15, W x P
per-parameter norms (P = 273, the tiny Llama of scale.py), no replicas, nothing non-finite. The
detector first runs its warm-up (untimed), then ``--steps`` steps are timed one by one. One table:
W, P, ms per step (median and IQR); with ``--ref REV`` also the detector of that git revision
(its ``ddphooks/detect`` imported from ``git show``), for a before/after.

    python benchmarks/detector_scale.py                          # W = 8, 256, 1024, 4096
    python benchmarks/detector_scale.py --ref main               # and the detector of main, for a before/after
    python benchmarks/detector_scale.py --worlds 8 64 --steps 5  # quick
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ddphooks import detect

ROOT = Path(__file__).resolve().parents[1]


def load_revision(revision: str):
    """The detector of a git revision, imported as its own module: ``ddphooks/detect/`` (a package
    since issue 58, its modules importing each other relatively) or, before, ``ddphooks/detect.py``."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout

    name = f"detect_{revision}"
    folder = Path(tempfile.mkdtemp())
    files = git("ls-tree", "-r", "--name-only", revision, "ddphooks/detect", "ddphooks/detect.py").split()
    if "ddphooks/detect.py" in files:
        path, search = folder / "detect_reference.py", None
        path.write_text(git("show", f"{revision}:ddphooks/detect.py"))
    else:
        for file in files:
            target = folder / name / Path(file).relative_to("ddphooks/detect")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(git("show", f"{revision}:{file}"))
        path, search = folder / name / "__init__.py", [str(folder / name)]
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=search)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def observations(module, world: int, parameters: int, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    names = [f"model.layers.{p // 9}.tensor{p % 9}.weight" for p in range(parameters)]
    scale = np.exp(rng.standard_normal(parameters))  # each parameter's typical norm
    noise = 1 / 16  # sketch_dim 256
    for step in range(steps):
        yield module.Observation(
            step=step,
            world_size=world,
            losses=2.0 + 0.05 * rng.standard_normal(world),
            grad_norms=np.exp(0.1 * rng.standard_normal(world)),
            cosine_loo=0.3 + 0.05 * rng.standard_normal(world),
            cosine_noise=noise,
            cosine_previous=None if step == 0 else 0.15 + 0.1 * rng.standard_normal(world),
            replicas=None,
            parameter_names=names,
            parameter_norms=scale * np.exp(0.1 * rng.standard_normal((world, parameters))),
            nonfinite={},
        )


def time_detector(module, world: int, parameters: int, steps: int) -> list[float]:
    detector = module.Detector()
    warmup = detector.config.warmup + 2
    times = []
    for index, obs in enumerate(observations(module, world, parameters, warmup + steps)):
        start = time.perf_counter()
        detector.update(obs)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> str:
    q1, median, q3 = np.percentile(1e3 * np.array(times), [25, 50, 75])
    return f"{median:.1f} ({q1:.1f}-{q3:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 256, 1024, 4096])
    parser.add_argument("--parameters", type=int, default=273)
    parser.add_argument("--steps", type=int, default=60, help="timed steps after the warm-up")
    parser.add_argument("--ref", help="git revision whose detector is timed as well (before)")
    args = parser.parse_args()
    reference = load_revision(args.ref) if args.ref else None
    header = "| W | P | ms per step, median (IQR) |" + (f" {args.ref}: ms per step |" if reference else "")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for world in args.worlds:
        row = f"| {world} | {args.parameters} | {summary(time_detector(detect, world, args.parameters, args.steps))} |"
        if reference is not None:
            row += f" {summary(time_detector(reference, world, args.parameters, args.steps))} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
