"""What silent_hook adds on the wire and in collective launches, computed for large world sizes.

Only 2-4 processes fit on a development machine, so this is arithmetic, not a measurement: the
parameter lists come from real model configs (instantiated on the meta device, no memory), the
buckets from DDP's greedy assignment (1 MB first bucket, then bucket_cap_mb), and the wire bytes
from a ring allreduce, which sends and receives 2 (W-1)/W times the buffer per rank.

With the piggyback transport the last bucket's allreduce carries W slots of
(3 + parameters + sketch bins) fp32 numbers; every other bucket is untouched.

    python benchmarks/comm_accounting.py
"""

import argparse
import json

import torch

from ddphooks.sketch import sketch_bins
from ddphooks.stats import slot_size

# -- config ----------------------------------------------------------------------------------------
WORLDS = (2, 8, 64, 1024)
SKETCH_DIM = 256
BUCKET_CAP_MB, FIRST_BUCKET_MB = 25, 1
MODELS = {
    # name: LlamaConfig arguments (SmolLM2-135M and Llama-3.2-1B shapes; tiny-llama is ddphooks.models)
    "tiny-llama-12M": dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=10, num_attention_heads=8, tie_word_embeddings=False),
    "smollm2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama-1B": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
}


def parameter_sizes(config_args):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config_args))
    return [p.numel() for p in model.parameters() if p.requires_grad]


def buckets(sizes, bytes_per_element=4):
    """DDP's greedy assignment, in reverse parameter order: close a bucket once it reaches its cap."""
    result, current, cap = [], 0, FIRST_BUCKET_MB * 2**20
    for numel in reversed(sizes):
        current += numel * bytes_per_element
        if current >= cap:
            result.append(current)
            current, cap = 0, BUCKET_CAP_MB * 2**20
    if current:
        result.append(current)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sketch-dim", type=int, default=SKETCH_DIM)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bins = sketch_bins(args.sketch_dim)
    rows = []
    print(f"extra communication of silent_hook, sketch_dim={args.sketch_dim} ({bins} bins), fp32 gradients, "
          f"{FIRST_BUCKET_MB} MB first bucket, {BUCKET_CAP_MB} MB buckets\n")
    print(f"{'model':<15} {'params':>7} {'tensors':>7} {'buckets':>7} {'W':>5} {'slot B':>7} {'extra B/step':>12} "
          f"{'% of 25MB':>9} {'% of last':>9} {'% of grads':>10} {'launches':>16}")
    for name, config_args in MODELS.items():
        sizes = parameter_sizes(config_args)
        bucket_bytes = buckets(sizes)
        slot_bytes = 4 * slot_size(len(sizes), bins)
        for world in WORLDS:
            extra = world * slot_bytes
            row = {
                "model": name,
                "parameters": sum(sizes),
                "tensors": len(sizes),
                "buckets": len(bucket_bytes),
                "world_size": world,
                "slot_bytes": slot_bytes,
                "extra_bytes_per_step": extra,
                "extra_fraction_of_25MB_bucket": extra / (BUCKET_CAP_MB * 2**20),
                "extra_fraction_of_last_bucket": extra / bucket_bytes[-1],
                "extra_fraction_of_gradient_bytes": extra / sum(bucket_bytes),
                "extra_wire_bytes_per_rank": 2 * (world - 1) / world * extra,
                "launches": {"allreduce_hook": len(bucket_bytes), "silent_piggyback": len(bucket_bytes), "silent_separate": len(bucket_bytes) + 1},
            }
            rows.append(row)
            launches = f"{len(bucket_bytes)} (+0; sep. +1)"
            print(f"{name:<15} {sum(sizes) / 1e6:6.0f}M {len(sizes):>7} {len(bucket_bytes):>7} {world:>5} {slot_bytes:>7,d} {extra:>12,d} "
                  f"{100 * row['extra_fraction_of_25MB_bucket']:8.3f}% {100 * row['extra_fraction_of_last_bucket']:8.3f}% "
                  f"{100 * row['extra_fraction_of_gradient_bytes']:9.4f}% {launches:>16}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
