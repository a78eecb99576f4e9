"""Small models built from config, for the benchmarks and the experiment (no download).

transformers is an optional dependency (``pip install ddphooks[experiment]``), imported only here
and only when a model is built.
"""

from __future__ import annotations

import torch


def tiny_llama(vocab_size: int = 8192, hidden: int = 256, layers: int = 10, heads: int = 8, max_positions: int = 512, seed: int = 0):
    """A Llama-style causal LM from ``LlamaConfig`` (about 12 M parameters with the defaults)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3 + 63) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def mlp(width: int = 2048, depth: int = 6, seed: int = 0) -> torch.nn.Module:
    """A plain MLP; ``width=2048, depth=6`` has about 25 M parameters."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, width))
    return torch.nn.Sequential(*layers)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
