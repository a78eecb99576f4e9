"""Can a missing ``zero_grad()`` be detected from ddphooks' statistics without false alarms?

With DDP, a rank whose training loop stops calling ``zero_grad()`` keeps the previous step's
*reduced* gradient A(t-1) in ``.grad``; the next backward adds the rank's fresh gradient, so the
local gradient the hook sees is L_i(t) = A(t-1) + g_i(t). The sketch is linear, so the previous
reduced gradient's sketch is m(t-1) = mean_i s_i(t-1), and each step's ``SilentStats`` already
holds all that is needed. Per step t (both steps with the same bucket layout) this script computes
from the kept sketches and norms, each averaged over ranks:

    c      cosine(s_i(t), m(t-1))
    beta   <s_i(t), m(t-1)> / |m(t-1)|^2         (1: A(t-1) carried over whole; ~0: zeroed)
    ratio  |L_i(t)| / |A(t-1)|                   (exact norms)
    growth |A(t)| / |A(t-1)|                     (reduced norm)
    rho    mean pairwise sketched cosine between ranks (what ``stats.mean_cosine`` gives)

For every case it trains the model twice with ``ddphooks.attach(..., sketch_dim=256,
detect=False)``: healthy (zero_grad at the end of every step) and faulty (the last zero_grad at the
end of step F-1, on every rank, so L_i carries A from step F+1 on). It prints per statistic the
healthy distribution (steps >= --warmup), the faulty one (steps >= F+1), d' = (faulty mean -
healthy mean) / healthy sd and whether one threshold separates them with no overlap; then two
rules, A: "beta in [lo, hi] on K consecutive steps", and B: the same with a wider band and the
reduced norm >= G x its recent median (a carried-over gradient is a running sum, so it grows):
alarms on healthy runs, alarms before the fault and detection delay on faulty runs. Synced
gradient accumulation (every micro-step allreduced, zero_grad every 4th / 8th) is healthy only:
it carries A over by design. Each model and world size is one process group running its cases in
turn (1 torch thread per rank).

    python benchmarks/zero_grad.py                                   # MLP + tiny Llama, W = 2 and 4 (6.5 min on 2 cores)
    python benchmarks/zero_grad.py --models mlp --worlds 2 --steps 40 --fault-step 20   # quick
"""

import argparse
import math
import time

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddphooks
from ddphooks.launch import spawn

CASES = {
    # name: (settings, has a faulty twin)
    "sgd": (dict(opt="sgd"), True),
    "adamw": (dict(opt="adamw"), True),
    "sgd-lr/10": (dict(opt="sgd", lr_scale=0.1), True),
    "adamw-lr/10": (dict(opt="adamw", lr_scale=0.1), True),
    "sgd-mom0.9": (dict(opt="sgd", momentum=0.9), True),
    "adamw+clip1": (dict(opt="adamw", clip=1.0), True),
    "sgd-accum4-synced": (dict(opt="sgd", accum=4), False),  # 4 micro-steps, each allreduced, zero_grad every 4th
    "sgd-accum8-synced": (dict(opt="sgd", accum=8), False),
    "sgd-fixed-batch": (dict(opt="sgd", fixed=True), True),  # every rank reuses its first batch (overfitting a tiny set)
    "adamw-fixed-batch": (dict(opt="adamw", fixed=True), True),
}
LR = {"mlp": {"sgd": 0.05, "adamw": 1e-3}, "llama": {"sgd": 0.1, "adamw": 3e-3}}  # llama AdamW: the experiment's rate

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--models", nargs="+", default=["mlp", "llama"], choices=["mlp", "llama"])
parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
parser.add_argument("--llama-cases", nargs="+", default=["sgd", "adamw", "adamw-lr/10", "adamw+clip1", "adamw-fixed-batch"], choices=list(CASES), help="cases run on the tiny Llama (slower)")
parser.add_argument("--steps", type=int, default=60, help="hook steps per run")
parser.add_argument("--fault-step", type=int, default=30, help="F: zero_grad is no longer called after step F-1")
parser.add_argument("--warmup", type=int, default=5, help="healthy steps before this are not counted")
parser.add_argument("--sketch-dim", type=int, default=256)
parser.add_argument("--band", nargs=2, type=float, default=[0.9, 1.1], metavar=("LO", "HI"), help="beta band of the rule")
parser.add_argument("--growth-band", nargs=2, type=float, default=[0.9, 1.3], metavar=("LO", "HI"), help="beta band of rule B")
parser.add_argument("--growth", type=float, default=2.0, help="rule B: reduced norm at least this times its recent median")
parser.add_argument("--history", type=int, default=20, help="rule B: steps of that median")
parser.add_argument("--ks", nargs="+", type=int, default=[1, 3, 5], help="consecutive steps K of the rule")
parser.add_argument("--save", default=None, metavar="NPZ", help="also save every run's per-step statistics to this .npz file")
parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process group")


# -- models and data -------------------------------------------------------------------------------
class Net(torch.nn.Module):
    """The tests' small MLP (16 -> 48 -> 64 -> 8, tanh; about 4.5k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 48)
        self.hidden = torch.nn.Linear(48, 64)
        self.out = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


def mlp_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank, with a rank-dependent shift (as in tests/test_hook.py)."""
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank)
    x = torch.randn(32, 16, generator=generator) + 0.3 * rank
    return x, torch.randn(32, 8, generator=generator)


LLAMA_LENGTH, LLAMA_BATCH = 64, 8


def llama_stream() -> torch.Tensor:
    """The experiment's embedded instruction rows as one byte stream (byte-level ids, 256 = EOS)."""
    from ddphooks.experiment.data import embedded_rows, prompt

    ids: list[int] = []
    for row in embedded_rows(count=1500):
        ids += list((prompt(row) + row["output"]).encode("utf-8")) + [256]
    return torch.tensor(ids)


def llama_batch(stream: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank + 7)
    starts = torch.randint(0, len(stream) - LLAMA_LENGTH, (LLAMA_BATCH,), generator=generator)
    return torch.stack([stream[s : s + LLAMA_LENGTH] for s in starts.tolist()])


# -- one rank --------------------------------------------------------------------------------------
def train(rank: int, world: int, model_name: str, runs: list, steps: int, sketch_dim: int) -> list | None:
    """Every (case, fault step) in ``runs`` in turn, on a fresh DDP model; rank 0 returns per run
    the kept statistics of every hook step."""
    stream = llama_stream() if model_name == "llama" else None
    out = []
    for case, fault_step in runs:
        settings = CASES[case][0]
        torch.manual_seed(0)
        if model_name == "mlp":
            module = Net()
        else:
            from ddphooks.models import tiny_llama

            module = tiny_llama(vocab_size=257, hidden=128, layers=4, heads=4, max_positions=LLAMA_LENGTH, seed=0)
        model = DDP(module)
        state = ddphooks.attach(model, sketch_dim=sketch_dim, detect=False)
        lr = LR[model_name][settings["opt"]] * settings.get("lr_scale", 1.0)
        if settings["opt"] == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=settings.get("momentum", 0.0))
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        accum = settings.get("accum", 1)
        kept = {"sketches": [], "norms": [], "reduced": [], "losses": [], "layout": [], "step": []}
        layouts: dict = {}
        t0 = time.perf_counter()
        for t in range(steps):
            data_step = 0 if settings.get("fixed") else t
            if model_name == "mlp":
                x, y = mlp_batch(rank, data_step)
                loss = torch.nn.functional.mse_loss(model(x), y)
            else:
                ids = llama_batch(stream, rank, data_step)
                loss = model(input_ids=ids, labels=ids).loss
            state.observe_loss(loss)
            (loss / accum).backward()
            stats = state.latest
            if rank == 0:
                kept["sketches"].append(np.array(stats._sketches, dtype=np.float64))
                kept["norms"].append(np.array(stats.grad_norms))
                kept["reduced"].append(stats.reduced_grad_norm)
                kept["losses"].append(np.array(stats.losses))
                kept["layout"].append(layouts.setdefault(tuple(stats.buckets), len(layouts)))
                kept["step"].append(stats.step)
            if (t + 1) % accum == 0:
                if settings.get("clip"):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), settings["clip"])
                optimizer.step()
                if fault_step is None or t < fault_step:
                    optimizer.zero_grad(set_to_none=True)
        state.close()
        if rank == 0:
            out.append({"case": case, "fault_step": fault_step, "seconds": time.perf_counter() - t0, **{k: np.array(v) for k, v in kept.items()}})
    return out if rank == 0 else None


# -- statistics ------------------------------------------------------------------------------------
def per_step(run: dict) -> dict[str, np.ndarray]:
    """The candidate statistics per step (NaN at step 0 and across a bucket-layout change)."""
    s, norms, reduced = run["sketches"], run["norms"], run["reduced"]
    steps = len(s)
    out = {name: np.full(steps, np.nan) for name in ("c", "beta", "ratio", "growth", "rho")}
    with np.errstate(all="ignore"):
        for t in range(steps):
            u = s[t] / np.linalg.norm(s[t], axis=1, keepdims=True)
            w = len(u)
            out["rho"][t] = (np.sum(u.sum(0) ** 2) - w) / (w * (w - 1))
            if t == 0 or run["layout"][t] != run["layout"][t - 1]:
                continue
            m = s[t - 1].mean(0)
            dots = s[t] @ m
            out["c"][t] = np.mean(dots / (np.linalg.norm(s[t], axis=1) * np.linalg.norm(m)))
            out["beta"][t] = np.mean(dots / (m @ m))
            out["ratio"][t] = np.mean(norms[t] / reduced[t - 1])
            out["growth"][t] = reduced[t] / reduced[t - 1]
    return out


def describe(values: np.ndarray) -> tuple[float, float, float, float, int]:
    v = values[np.isfinite(values)]
    if not len(v):
        return (math.nan,) * 4 + (0,)
    return float(v.mean()), float(v.std()), float(v.min()), float(v.max()), len(v)


def rule_hits(beta: np.ndarray, lo: float, hi: float, k: int, reduced: np.ndarray | None = None, growth: float = 0.0, history: int = 20) -> np.ndarray:
    """Steps at which beta has been inside [lo, hi] for k consecutive steps (ending there); with
    ``reduced``, only where the reduced norm is also >= ``growth`` x its median over the
    ``history`` steps before those k (a carried-over gradient is a running sum: it grows)."""
    inside = np.isfinite(beta) & (beta >= lo) & (beta <= hi)
    run, hits = 0, np.zeros(len(beta), dtype=bool)
    for t, flag in enumerate(inside):
        run = run + 1 if flag else 0
        hits[t] = run >= k
        if hits[t] and reduced is not None:
            before = reduced[max(0, t - k + 1 - history) : max(1, t - k + 1)]
            hits[t] = reduced[t] >= growth * np.median(before)
    return hits


def fmt(x: float, width: int = 8) -> str:
    if not math.isfinite(x):
        return f"{'nan':>{width}}"
    return f"{x:>{width}.3g}" if abs(x) < 1e4 else f"{x:>{width}.2e}"


# -- main ------------------------------------------------------------------------------------------
STATS = ("c", "beta", "ratio", "growth", "rho")


def main() -> None:
    args = parser.parse_args()
    F = args.fault_step
    started = time.perf_counter()
    results = []  # (model, world, case, healthy run, faulty run or None)
    for model_name in args.models:
        cases = args.cases if model_name == "mlp" else [c for c in args.cases if c in args.llama_cases]
        runs = [(case, None) for case in cases] + [(case, F) for case in cases if CASES[case][1]]
        for world in args.worlds:
            t0 = time.perf_counter()
            (kept, *_) = spawn(train, world, (model_name, runs, args.steps, args.sketch_dim), timeout=args.timeout, threads=1)
            by_key = {(r["case"], r["fault_step"]): r for r in kept}
            for case in cases:
                results.append((model_name, world, case, by_key[(case, None)], by_key.get((case, F))))
            seconds = sum(r["seconds"] for r in kept)
            print(f"[{model_name} W={world}: {len(runs)} runs x {args.steps} steps, {time.perf_counter() - t0:.0f} s wall, {1000 * seconds / (len(runs) * args.steps):.0f} ms/step]", flush=True)

    print(f"\nhealthy: steps {args.warmup}..{args.steps - 1}; faulty: steps {F + 1}..{args.steps - 1} (last zero_grad at the end of step {F - 1}); "
          f"sketch {args.sketch_dim}; statistics averaged over ranks")
    header = f"{'model':<6}{'W':>2} {'case':<18}{'stat':<7}| {'healthy mean':>12}{'sd':>8}{'min':>8}{'max':>8} | {'faulty mean':>11}{'sd':>8}{'min':>8}{'max':>8} | {'d_prime':>8} {'separates':>9}"
    print(header)
    print("-" * len(header))
    for model_name, world, case, healthy, faulty in results:
        h_stats = per_step(healthy)
        f_stats = per_step(faulty) if faulty is not None else None
        for name in STATS:
            hm, hs, hmin, hmax, _ = describe(h_stats[name][args.warmup :])
            line = f"{model_name:<6}{world:>2} {case:<18}{name:<7}| {fmt(hm, 12)}{fmt(hs)}{fmt(hmin)}{fmt(hmax)} | "
            if f_stats is not None:
                fm, fs, fmin, fmax, _ = describe(f_stats[name][F + 1 :])
                d = (fm - hm) / hs if hs > 0 else math.nan
                separates = "yes" if (fmin > hmax or fmax < hmin) else "no"
                line += f"{fmt(fm, 11)}{fmt(fs)}{fmt(fmin)}{fmt(fmax)} | {fmt(d)} {separates:>9}"
            else:
                line += f"{'(healthy only)':>35} |"
            print(line)
        diverged = faulty is not None and not np.all(np.isfinite(faulty["losses"]))
        final = f"loss healthy {np.nanmean(healthy['losses'][:3]):.3g} -> {np.nanmean(healthy['losses'][-3:]):.3g}"
        if faulty is not None:
            final += f", faulty -> {np.nanmean(faulty['losses'][-3:]):.3g}" + (" (non-finite)" if diverged else "")
        print(f"{'':<8} {case:<18}{final}")

    if args.save:
        arrays = {}
        for model_name, world, case, healthy, faulty in results:
            for label, run in (("healthy", healthy), ("faulty", faulty)):
                if run is not None:
                    prefix = f"{model_name}/W{world}/{case}/{label}/"
                    arrays.update({prefix + k: v for k, v in per_step(run).items()})
                    arrays.update({prefix + k: run[k] for k in ("norms", "reduced", "losses")})
        np.savez(args.save, **arrays)

    lo, hi = args.band
    glo, ghi = args.growth_band
    rules = [
        (f"A: beta in [{lo}, {hi}] on K consecutive steps", lambda s, k: rule_hits(s["beta"], lo, hi, k)),
        (
            f"B: beta in [{glo}, {ghi}] on K consecutive steps and |A(t)| >= {args.growth} x the median |A| of the "
            f"{args.history} steps before those K",
            lambda s, k: rule_hits(s["beta"], glo, ghi, k, s["reduced"], args.growth, args.history),
        ),
    ]
    for title, hits_of in rules:
        print(f"\nrule {title} (counted from step 1)")
        header = f"{'model':<6}{'W':>2} {'case':<18}" + "".join(f"| K={k}: {'healthy alarms':>14} {'pre-F alarms':>12} {'delay':>5} " for k in args.ks)
        print(header)
        print("-" * len(header))
        for model_name, world, case, healthy, faulty in results:
            line = f"{model_name:<6}{world:>2} {case:<18}"
            h_stats = {**per_step(healthy), "reduced": healthy["reduced"]}
            f_stats = {**per_step(faulty), "reduced": faulty["reduced"]} if faulty is not None else None
            for k in args.ks:
                alarms = int(hits_of(h_stats, k).sum())
                if f_stats is not None:
                    hits = hits_of(f_stats, k)
                    early = int(hits[: F + 1].sum())
                    after = np.nonzero(hits[F + 1 :])[0]
                    delay = str(int(after[0])) if len(after) else "miss"
                    line += f"| K={k}: {alarms:>14} {early:>12} {delay:>5} "
                else:
                    line += f"| K={k}: {alarms:>14} {'-':>12} {'-':>5} "
            print(line)
    print("(alarms: steps at which the rule fires; delay: steps after F+1, the first step whose local gradient carries A(t-1), until it fires)")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
