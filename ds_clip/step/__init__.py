"""The step and what it trains: one optimizer step of cached-feature accumulation and the objective it computes.

    cached      the step: embed, one loss over the global batch, push back, one optimizer step
    checks      what the step refuses before its first forward
    loss        the contrastive losses over the whole global batch (CLIP, SigLIP, distillation)
    caption     CoCa's caption term, split-invariant
    tiled_loss  the losses blockwise, in memory linear in the batch
    clamp       open_clip's temperature clamp, on every copy DeepSpeed keeps
    ema         the weight EMA beside the fp32 masters

``ds_clip.step.cached_step`` and ``StepResult`` are the step's public names (also ``ds_clip.cached_step``).
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = ("StepResult", "cached_step", "normalize_images")
__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    # Imported on first use (PEP 562): a module of this package imports its siblings without running the step's.
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ds_clip.step' has no attribute {name!r}")
    return getattr(importlib.import_module("ds_clip.step.cached"), name)
