"""Random token rows shared by the training scripts (imported from the scripts' own folder)."""

import torch

VOCAB, LENGTH = 96, 16


def token_rows(n: int, seed: int) -> list[dict]:
    """Random token sequences; each masks a random prefix of its labels, so label counts differ."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (LENGTH,), generator=generator)
        labels = ids.clone()
        labels[: int(torch.randint(1, LENGTH - 2, (1,), generator=generator))] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return rows
