"""A reversible stand-in for a tokenizer in the data tests (tokenizing draws no random numbers)."""

from __future__ import annotations

import torch

LENGTH = 96  # longer than any caption of the built-in dataset


def byte_tokenizer(texts: list[str]) -> torch.Tensor:
    """UTF-8 bytes, zero padded to LENGTH."""
    out = torch.zeros(len(texts), LENGTH, dtype=torch.long)
    for i, text in enumerate(texts):
        data = text.encode()[:LENGTH]
        out[i, : len(data)] = torch.tensor(list(data))
    return out


def detok(tokens: torch.Tensor) -> str:
    return bytes(x for x in tokens.tolist() if x).decode()
