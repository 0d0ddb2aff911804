"""Checkpoint folder layout: the file names, the step tag, the errors, and small atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ds_clip.distributed import rank, world_size
from ds_clip.errors import RunError, UserError

POINTER = "latest_complete"
MARKER = "COMPLETE"
META = "ds_clip_meta.json"
MANIFEST = "manifest.json"
TAG_PREFIX = "step_"
UNIVERSAL_PREFIX = "universal_from_"


class CheckpointError(RunError):
    """A checkpoint that is missing, partial, unreadable or from an incompatible run."""


class CorruptCheckpointError(UserError):
    """A checkpoint file whose bytes differ from the checksum the manifest recorded at save time."""


class SaveError(RunError):
    """A checkpoint that could not be written (no space, no permission, a quota): its partial folder is gone,
    the last complete checkpoint stays."""


def _rank() -> int:
    return rank()


def _world() -> int:
    return world_size()


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def param_shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """Parameter names and shapes as the engine holds them (ZeRO-3's partitioned params: their ds_shape)."""
    return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


def optimizer_param_names(engine) -> list[list[str]] | None:
    """ZeRO-0: the names of the optimizer's parameters, group by group, in the order its state dict numbers them.

    A ZeRO-0 checkpoint keys its optimizer state by that number alone (torch's ``Optimizer.state_dict``); with the
    names it can be written in DeepSpeed's universal layout (one folder per parameter name) and resumed on a ZeRO
    stage that partitions. ZeRO 1-3 checkpoints carry their own names (DeepSpeed's ``param_shapes``): None.
    """
    opt = getattr(engine, "optimizer", None)
    if opt is None or int(engine.zero_optimization_stage()) != 0:
        return None
    # bf16/fp16 ZeRO-0 wraps the torch optimizer: its groups hold fp32 copies, fp16_groups the module's own.
    groups = getattr(opt, "fp16_groups", None) or [g["params"] for g in opt.param_groups]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [[names[id(p)] for p in group] for group in groups]


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _step_of(folder: Path) -> int | None:
    name = folder.name
    if not name.startswith(TAG_PREFIX) or not name[len(TAG_PREFIX) :].isdigit():
        return None
    return int(name[len(TAG_PREFIX) :])
