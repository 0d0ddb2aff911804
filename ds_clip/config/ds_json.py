"""The training keys of a DeepSpeed JSON (``--ds-config FILE``) read as settings: the batch triple, clipping, the
optimizer and scheduler blocks, the precision sections.

Precedence: a flag the user passed (or the recipe) > the file's value > the field's default. A key the file sets
fills the field its flag left at the default; a passed flag keeps its own value over the file's (logged at start,
and ``--dry-run`` says which source each key came from). "auto" (Hugging Face's spelling) leaves the field to its
flag or default, and ``ds_clip.ds_config`` writes that value back into the key. Refused here, in one line naming
the key and the flag: a passed flag that asks for a different *kind* of thing than the file (--opt lamb against an
Adam block, --lr-scheduler against a scheduler block), and keys of a type ds_clip cannot read.

A low module: the JSON is read with the preset loader, nothing is imported from DeepSpeed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ds_clip.ds_config.presets import (
    ONE_BIT_OPTIMIZERS,
    ONE_LR_SCHEDULERS,
    is_auto,
    load_preset,
    optimizer_of,
    preset_label,
    scheduler_block,
)
from ds_clip.errors import SettingsError

_PER_GROUP_FLAGS = ("visual_lr", "text_lr", "visual_ld", "text_ld")

# torch_autocast's dtype -> the --precision name that runs it (open_clip's amp names: autocast over fp32 weights).
_AUTOCAST = {"bfloat16": "amp_bf16", "bf16": "amp_bf16", "torch.bfloat16": "amp_bf16", "float16": "amp",
             "fp16": "amp", "half": "amp", "torch.float16": "amp"}  # fmt: skip


def _js(value: Any) -> str:
    return json.dumps(value)


def _positive_int(key: str, value: Any, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise SettingsError(f'{key}={_js(value)} in {label} must be a whole number >= 1 (or "auto")')
    return int(value)


def _number(key: str, value: Any, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingsError(f'{key}={_js(value)} in {label} must be a number (or "auto")')
    return float(value)


class _Lift:
    """Collects the file's values into the flat settings ``values`` under the fields the user did not choose."""

    def __init__(self, values: dict[str, Any], chosen: Callable[[str], str | None], label: str) -> None:
        self.values, self.chosen, self.label = values, chosen, label
        self.sources: dict[str, str] = {}

    def put(self, field: str, value: Any) -> None:
        """The file's value for ``field``, taken unless the user chose the field (ds_clip.ds_config then writes
        the chosen value into the key and logs that it did)."""
        if self.chosen(field) is None:
            self.values[field] = value
            self.sources[field] = "ds_json"


def precision_of(cfg: dict[str, Any], label: str) -> tuple[str, str] | None:
    """The --precision name the file's enabled section asks for and that section's key, or None (none enabled,
    or "auto"). More than one enabled is refused."""
    found: list[tuple[str, str]] = []
    for key, name in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        section = cfg.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            found.append((name, f"{key}.enabled"))
    autocast = cfg.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled") is True:
        dtype = str(autocast.get("dtype", "bfloat16")).lower()
        if dtype not in _AUTOCAST:
            raise SettingsError(
                f"torch_autocast.dtype={_js(autocast.get('dtype'))} in {label}: bfloat16 or float16"
            )
        found.append((_AUTOCAST[dtype], "torch_autocast.enabled"))
    if [k for _, k in found] in (
        ["bf16.enabled", "torch_autocast.enabled"],
        ["bfloat16.enabled", "torch_autocast.enabled"],
    ) and found[1][0] == "amp_bf16":
        # DeepSpeed runs its bf16 engine (bf16 weights, with bf16_master_weights_and_grads bf16 master copies too)
        # under torch.autocast: DeepSpeedExamples' bf16_master_weight configs enable both.
        return found[0]
    if len(found) > 1:
        raise SettingsError(f"{label} enables {' and '.join(k for _, k in found)}: keep one precision")
    return found[0] if found else None


def _batch(cfg: dict[str, Any], lift: _Lift) -> None:
    label = lift.label
    keys = {"train_micro_batch_size_per_gpu": "batch_size", "gradient_accumulation_steps": "accum_freq",
            "train_batch_size": "global_batch_size"}  # fmt: skip
    given = {k: _positive_int(k, cfg[k], label) for k in keys if k in cfg and not is_auto(cfg[k])}
    for key, value in given.items():
        lift.put(keys[key], value)
    if "train_batch_size" in given and "train_micro_batch_size_per_gpu" not in given:
        if lift.chosen("batch_size") is None:
            # DeepSpeed's m = train_batch_size / (gradient_accumulation_steps x W), known at start
            # (config.resolve_geometry); until then m holds N / k, its value on one rank.
            n, k = given["train_batch_size"], given.get("gradient_accumulation_steps", 1)
            if n % k:
                raise SettingsError(
                    f"train_batch_size={n} in {label} is not a multiple of gradient_accumulation_steps={k}"
                )
            lift.values["batch_size"] = n // k
            lift.sources["batch_size"] = "derived"


def _optimizer(cfg: dict[str, Any], lift: _Lift) -> None:
    block = cfg.get("optimizer")
    if block is None:
        return
    label = lift.label
    if not isinstance(block, dict):
        raise SettingsError(f"optimizer in {label} must be a JSON object")
    kind = str(block.get("type", "AdamW"))
    params = block.get("params") or {}
    if not isinstance(params, dict):
        raise SettingsError(f"optimizer.params in {label} must be a JSON object")
    low = kind.lower()
    if low in ONE_BIT_OPTIMIZERS:
        raise SettingsError(
            f"optimizer.type={_js(kind)} in {label}: DeepSpeed's 1-bit optimizers need CUDA GPUs (their compressed "
            "all-reduce runs on NCCL or MPI with CUDA kernels; no CPU version), and they exchange compressed "
            "momentum instead of the exact averaged gradient ds_clip's step relies on: use Adam, AdamW, Lamb, Lion "
            "or Muon"
        )
    opt = optimizer_of(kind, params, label)
    how = lift.chosen("optimizer")
    if how is not None and lift.values["optimizer"] != opt:
        raise SettingsError(
            f"optimizer.type={_js(kind)} in {label} conflicts with {how}: the block's params are for {kind}; "
            "drop --opt or the optimizer block"
        )
    lift.put("optimizer", opt)
    for key, field in (("lr", "lr"), ("weight_decay", "wd"), ("eps", "eps"), ("momentum", "momentum")):
        if key == "momentum" and opt not in ("sgd", "muon"):
            continue  # not a hyper-parameter of the Adam family's update
        if key in params and not is_auto(params[key]):
            lift.put(field, _number(f"optimizer.params.{key}", params[key], label))
    betas = params.get("betas")
    if betas is not None and not is_auto(betas):
        if not (isinstance(betas, list) and len(betas) == 2):
            raise SettingsError(f"optimizer.params.betas={_js(betas)} in {label} must be [beta1, beta2]")
        for field, value in zip(("beta1", "beta2"), betas):
            lift.put(field, _number("optimizer.params.betas", value, label))


def _scheduler(cfg: dict[str, Any], lift: _Lift) -> None:
    label = lift.label
    found = scheduler_block(cfg, label)
    if found is None:
        return
    kind, params = found
    for field in ("lr_scheduler", "skip_scheduler"):
        how = lift.chosen(field)
        if how is not None:
            raise SettingsError(
                f"scheduler.type={_js(kind)} in {label} conflicts with {how}: one LR schedule runs; drop the flag "
                "or the scheduler block"
            )
    if kind in ONE_LR_SCHEDULERS:
        for field in _PER_GROUP_FLAGS:
            how = lift.chosen(field)
            if how is not None:
                raise SettingsError(
                    f"scheduler.type={_js(kind)} in {label} sets one LR for every parameter group, which would "
                    f"overwrite {how}: use WarmupCosineLR (it scales each group's own LR) or drop the flag"
                )
    lift.sources["lr_scheduler"] = "ds_json"
    steps = params.get("warmup_num_steps")
    if steps is not None and not is_auto(steps):
        lift.put("warmup", int(_number("scheduler.params.warmup_num_steps", steps, label)))
    peak = params.get("warmup_max_lr")
    if kind in ("WarmupLR", "WarmupDecayLR") and peak is not None and not is_auto(peak):
        # DeepSpeed's WarmupLR/WarmupDecayLR set every group's lr themselves and peak at warmup_max_lr, whatever
        # the optimizer block's lr: the file's peak is the run's --lr (a passed --lr still wins over both).
        lift.put("lr", _number("scheduler.params.warmup_max_lr", peak, label))


def lift_ds_json(
    ds_config: str, values: dict[str, Any], chosen: Callable[[str], str | None]
) -> dict[str, str]:
    """Fill the flat settings ``values`` from the training keys of ``--ds-config`` (a preset name or a path) for
    every field ``chosen(field)`` says the user did not choose (None; else how they chose it, "--lr 0.001").

    Returns the sources of the fields the file set: "ds_json", or "derived" for an m that DeepSpeed derives
    from train_batch_size at start. ``values["precision"]`` stays None where neither the flag nor the file sets
    it."""
    cfg = load_preset(ds_config)
    label = preset_label(ds_config)
    lift = _Lift(values, chosen, label)
    _batch(cfg, lift)
    clip = cfg.get("gradient_clipping")
    if clip is not None and not is_auto(clip):
        norm = _number("gradient_clipping", clip, label)
        lift.put("grad_clip_norm", norm if norm > 0 else None)
    _optimizer(cfg, lift)
    _scheduler(cfg, lift)
    found = precision_of(cfg, label)
    if found is not None:
        lift.put("precision", found[0])
    return lift.sources
