"""open_clip's learning-rate schedule, counted in optimizer steps: linear warmup, then cosine to 0."""

from __future__ import annotations

import math

import torch


def cosine_with_warmup(step: int, *, warmup: int, total: int) -> float:
    """Multiplier of the base LR for optimizer step ``step`` (0-based), as open_clip's ``cosine_lr``."""
    if step < warmup:
        return (step + 1) / warmup
    decay = max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(step - warmup, decay) / decay))


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup: int, total: int):
    """A LambdaLR that DeepSpeed steps once per optimizer step (engine.step())."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_with_warmup(step, warmup=warmup, total=total)
    )
