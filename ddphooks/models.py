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


class _Block(torch.nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP (nanoGPT's layout)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc, self.out = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, tokens, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, hidden))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    """A small character-level GPT (token and position embeddings, pre-norm blocks, a language
    model head); ``forward(ids, targets)`` returns the mean cross-entropy when given targets."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, heads: int, block_size: int) -> None:
        super().__init__()
        self.vocab_size, self.block_size = vocab_size, block_size
        self.tokens, self.positions = torch.nn.Embedding(vocab_size, hidden), torch.nn.Embedding(block_size, hidden)
        self.blocks = torch.nn.ModuleList(_Block(hidden, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


def tiny_gpt(vocab_size: int = 65, hidden: int = 128, layers: int = 2, heads: int = 4, block_size: int = 64, seed: int = 0) -> torch.nn.Module:
    """A 2-layer character-level GPT (about 0.4 M parameters, 28 tensors with the defaults): a
    model whose steps take tens of milliseconds, where a fixed cost per step shows. Pure torch."""
    torch.manual_seed(seed)
    return TinyGPT(vocab_size, hidden, layers, heads, block_size)


class _ResidualBlock(torch.nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (a 1x1 convolution where the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(outputs)
        self.conv2 = torch.nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(outputs)
        self.shortcut = None
        if stride != 1 or inputs != outputs:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(inputs, outputs, 1, stride, bias=False), torch.nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.shortcut is None else self.shortcut(x)))


def small_resnet(widths: tuple[int, ...] = (32, 64, 128, 278), blocks: int = 3, classes: int = 10, seed: int = 0) -> torch.nn.Module:
    """A ResNet-style image classifier with BatchNorm for 32 x 32 inputs: a 3x3 stem, then
    ``blocks`` residual blocks per width (the first of each width but the first halving the
    resolution); with the defaults 4.9 M parameters in 86 tensors, the shape of the CNN client
    issue 59 names (``benchmarks/overhead.py --models cnn``)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), torch.nn.BatchNorm2d(widths[0]), torch.nn.ReLU()]
    inputs = widths[0]
    for stage, width in enumerate(widths):
        for block in range(blocks):
            layers.append(_ResidualBlock(inputs, width, 2 if stage and not block else 1))
            inputs = width
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(inputs, classes)]
    return torch.nn.Sequential(*layers)
