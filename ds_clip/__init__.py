"""ds_clip: DeepSpeed trainer for CLIP-style models with exact cached-feature accumulation.

``ds-clip-train`` is the trainer. To use its step in your own loop (README, "Use the step in your own
loop"; ``examples/own_loop.py``)::

    from ds_clip import (ContrastiveLoss, LossSpec, cached_step, clamp_logit_scale, prepare_for_deepspeed,
                         step_engine_config)

The names below are imported on first use (PEP 562), so ``import ds_clip`` stays light: the settings and
preset checks that run before any process starts import neither torch nor DeepSpeed.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it (one definition each; these are re-exports).
_EXPORTS = {
    "cached_step": "ds_clip.step.cached",
    "StepResult": "ds_clip.step.cached",
    "ContrastiveLoss": "ds_clip.step.loss",
    "LossSpec": "ds_clip.step.loss",
    "step_engine_config": "ds_clip.ds_config.resolve",
    "prepare_for_deepspeed": "ds_clip.models.model",
    "clamp_logit_scale": "ds_clip.step.clamp",
    "WeightEma": "ds_clip.step.ema",
    "EmaSchedule": "ds_clip.step.ema",
    "build_run_step": "ds_clip.training.wiring",
    "RunStep": "ds_clip.training.wiring",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ds_clip' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
