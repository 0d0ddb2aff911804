"""The DeepSpeed presets shipped with ds_clip (ds_configs/*.json) and the precision and optimizer names.

    load_preset("zero2_bf16")            # a shipped preset, by name
    load_preset("path/to/mine.json")     # a JSON of the user's own

A low module (standard library and ds_clip.errors only): ds_clip.config reads a preset's precision and
ds_clip.ds_config resolves a preset against the flags, and neither has to import the other's layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

from ds_clip.errors import SettingsError

# The presets live once in git, in the repo's top-level ds_configs/. ds_clip/ds_configs is a symlink to it, so
# the editable checkout reads them in place, and setuptools copies the files it points to into the wheel as
# package data (pyproject.toml): an installed ds_clip finds them inside the package, no checkout needed.
PRESET_DIR = files("ds_clip") / "ds_configs"


# What the engine runs (the presets' precision sections), and open_clip_train's --precision names mapped onto
# it. open_clip's amp* autocast the forward over fp32 weights; its bf16/fp16/pure_* hold the weights in low
# precision with no fp32 copy. DeepSpeed's bf16/fp16 hold low-precision working weights and an fp32 master copy
# in the optimizer (fp16 with dynamic loss scaling, where open_clip's amp has its GradScaler): each open_clip
# name maps onto the DeepSpeed precision of its dtype.
DEEPSPEED_PRECISIONS = ("fp32", "bf16", "fp16")
PRECISION_MAP: dict[str, str] = {
    "fp32": "fp32",
    "amp": "fp16",
    "fp16": "fp16",
    "pure_fp16": "fp16",
    "amp_bf16": "bf16",
    "amp_bfloat16": "bf16",
    "bf16": "bf16",
    "pure_bf16": "bf16",
}
PRECISION_NAMES = tuple(PRECISION_MAP)


# --opt: the optimizers DeepSpeed builds from the "optimizer" block of its JSON (so ZeRO partitions them and
# offload runs them on the CPU), by ds_clip name -> DeepSpeed's "type" (SGD: DeepSpeed's torch.optim fallback).
# "adam" is DeepSpeed's Adam with adam_w_mode false (L2 weight decay added to the gradient); "muon" is DeepSpeed's
# MuonWithAuxAdam (Muon on hidden matrices, AdamW on the rest: ds_clip.training.optim tags which).
OPTIMIZERS: dict[str, str] = {
    "adamw": "AdamW", "adam": "Adam", "lamb": "Lamb", "lion": "Lion", "muon": "Muon", "sgd": "SGD"
}  # fmt: skip


# DeepSpeed's optimizer "type" (lower case, as DeepSpeed compares it) -> --opt. "Adam" is AdamW unless its
# adam_w_mode is false (DeepSpeed's default for Adam is adam_w_mode true).
OPTIMIZER_TYPES = {
    "adam": "adamw",
    "adamw": "adamw",
    "lamb": "lamb",
    "lion": "lion",
    "muon": "muon",
    "sgd": "sgd",
}
# DeepSpeed's compressed-communication optimizers: CUDA kernels and an NCCL/MPI compressed all-reduce.
ONE_BIT_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
# The schedulers of DeepSpeed's lr_schedules.py that ds_clip runs as a JSON writes them.
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")
# These set one absolute LR for every parameter group; WarmupCosineLR scales each group's own LR.
ONE_LR_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "OneCycle")


def is_auto(value: Any) -> bool:
    """Hugging Face's "auto" in a DeepSpeed JSON: the trainer fills the key from its own settings."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def optimizer_of(kind: Any, params: dict[str, Any], label: str) -> str:
    """The --opt that runs a JSON's optimizer block of DeepSpeed "type" ``kind``; SettingsError for a type ds_clip
    does not run."""
    low = str(kind).lower()
    if low not in OPTIMIZER_TYPES:
        raise SettingsError(
            f"optimizer.type={json.dumps(kind)} in {label} is not one ds_clip runs: Adam, AdamW, Lamb, Lion, Muon "
            "or SGD"
        )
    if low == "adam" and params.get("adam_w_mode") is False:
        return "adam"  # DeepSpeed's Adam with L2 regularisation (weight decay added to the gradient)
    return OPTIMIZER_TYPES[low]


def scheduler_block(cfg: dict[str, Any], label: str) -> tuple[str, dict[str, Any]] | None:
    """A JSON's scheduler block as (type, params), None without one; SettingsError for a malformed block or a
    type ds_clip does not run."""
    block = cfg.get("scheduler")
    if block is None:
        return None
    if not isinstance(block, dict) or not isinstance(block.get("params", {}), dict):
        raise SettingsError(f"scheduler in {label} must be a JSON object with a params object")
    kind = block.get("type")
    if kind not in SCHEDULERS:
        raise SettingsError(
            f"scheduler.type={json.dumps(kind)} in {label} is not one ds_clip runs: {', '.join(SCHEDULERS)} "
            "(or drop the block: --lr-scheduler)"
        )
    return kind, block.setdefault("params", {})


def deepspeed_precision(name: str) -> str:
    """--precision as given (ds_clip's or open_clip's name) -> the DeepSpeed precision it runs."""
    if name not in PRECISION_MAP:
        raise SettingsError(f"--precision must be one of {', '.join(PRECISION_NAMES)}, got {name!r}")
    return PRECISION_MAP[name]


def precision_mapping_text() -> str:
    """One line: every --precision name and the DeepSpeed precision it runs (logged once per run)."""
    by_target: dict[str, list[str]] = {}
    for name, target in PRECISION_MAP.items():
        by_target.setdefault(target, []).append(name)
    return "; ".join(f"{', '.join(names)} -> DeepSpeed {t}" for t, names in by_target.items())


def list_presets() -> list[str]:
    """Names of the presets shipped in ds_configs/ (file names without .json), sorted."""
    return sorted(p.name[: -len(".json")] for p in PRESET_DIR.iterdir() if p.name.endswith(".json"))


def preset_label(name_or_path: str) -> str:
    """How error messages name a preset: "ds_configs/zero2_bf16.json" or the path the user gave."""
    return name_or_path if name_or_path.endswith(".json") else f"ds_configs/{name_or_path}.json"


def load_shipped_json(
    name_or_path: str, folder: Any, *, flag: str, kind: str, shipped: Callable[[], list[str]]
) -> tuple[Path, Any]:
    """A file shipped in the wheel, by name (``folder``/<name>.json), or a user's path ending .json -> the path
    and its parsed JSON. The one loader of the presets (--ds-config) and the recipes (--recipe): SettingsError
    naming ``flag`` for a missing file (listing the ``shipped`` names of this ``kind``) or invalid JSON."""
    if name_or_path.endswith(".json"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise SettingsError(f"{flag} {name_or_path}: no such file")
    else:
        path = folder / f"{name_or_path}.json"
        if not path.is_file():
            raise SettingsError(
                f"{flag} {name_or_path!r} is neither {kind} ({', '.join(shipped())}) nor a path ending .json"
            )
    try:
        return path, json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SettingsError(f"{flag} {path}: not valid JSON ({e})") from None


def load_preset(name_or_path: str) -> dict[str, Any]:
    """A preset name (ds_configs/<name>.json) or a path ending .json -> its JSON object."""
    path, data = load_shipped_json(
        name_or_path, PRESET_DIR, flag="--ds-config", kind="a preset", shipped=list_presets
    )
    if not isinstance(data, dict):
        raise SettingsError(f"--ds-config {path}: the top level must be a JSON object")
    return data
