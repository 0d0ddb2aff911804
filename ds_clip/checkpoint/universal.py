"""A ZeRO 1-3 checkpoint in DeepSpeed's universal layout, every optimizer state key carried.

DeepSpeed 0.19.8's ``ds_to_universal`` knows Adam's state alone (it reads ``exp_avg``/``exp_avg_sq`` by name,
``KeyError`` for SGD's ``momentum_buffer`` or Muon's): this writer takes every key the saved optimizer holds
instead. The layout is the one DeepSpeed's own ZeRO-1/2 universal load reads: per parameter name
``zero/<name>/fp32.pt`` and ``<key>.pt`` (``{"param": full tensor}``), ``step.pt`` (the step count as the optimizer
keeps it) where the parameter's group counts steps; ``zero/optimizer_state.pt`` with the groups' hyperparameters and
what is not per parameter (the fp16 loss scaler, ``ds_version``); ``mp_rank_00_model_states.pt`` (LR scheduler,
engine counters, module buffers).

ZeRO-1/2: each rank's flat partition of a group holds the slice ``param_slice_mappings`` names of each parameter;
ZeRO-3: each parameter is split into ``ceil(numel / W)`` elements per rank, one after the other in each rank's
flat sub-group. Either way a parameter is its ranks' pieces concatenated in rank order.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

# What a ZeRO optimizer keeps beside its per-parameter state and that a load on another shape must see again.
GLOBAL_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "ds_version")


def _load(path: Path) -> Any:
    from ds_clip.checkpoint.load import safe_load

    return safe_load(path)


def _rank_files(path: Path, kind: str) -> list[Path]:
    """``[bf16_]zero_pp_rank_R_mp_rank_00_<kind>.pt`` in rank order (DeepSpeed's bf16 optimizer adds the prefix)."""
    import re

    files = sorted(
        path.glob(f"*zero_pp_rank_*_mp_rank_00_{kind}.pt"),
        key=lambda f: int(re.search(r"zero_pp_rank_(\d+)_", f.name).group(1)),
    )
    if not files:
        raise FileNotFoundError(f"no zero_pp_rank_*_mp_rank_00_{kind}.pt in {path}")
    return files


def _save_param(zero: Path, name: str, key: str, value: torch.Tensor, shape) -> None:
    folder = zero / name
    folder.mkdir(parents=True, exist_ok=True)
    t = value.detach().float().clone().reshape(list(shape))
    # open_clip's 0-dim parameters (logit_scale, logit_bias) have the engine's shape [1] (prepare_for_deepspeed).
    torch.save({"param": t.reshape(1) if t.dim() == 0 else t}, folder / f"{key}.pt")


def write_zero_universal(path: Path, out: Path, stage: int) -> None:
    """``path`` (a ZeRO-``stage`` checkpoint, 1-3) in the universal layout under ``out``."""
    optim = [_load(f)["optimizer_state_dict"] for f in _rank_files(path, "optim_states")]
    zero = out / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    if stage == 3:
        model_files = _rank_files(path, "model_states")
        models = [_load(f) for f in model_files]
        base = [o["optimizer_state_dict"] for o in optim]
        _split_zero3(zero, optim, base, models)
        model_file = model_files[0]
    else:
        model_file = sorted(path.glob("mp_rank_00_model_states.pt"))[0]
        models = [_load(model_file)]
        base = [o["base_optimizer_state"] for o in optim]
        _split_zero12(zero, optim, base, models[0])
    common = {k: optim[0][k] for k in GLOBAL_KEYS if k in optim[0]}
    # ZeRO-3 keeps the version beside its optimizer state, not in it: DeepSpeed's universal load asserts on it.
    common.setdefault("ds_version", models[0].get("ds_version"))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in base[0]["param_groups"]]
    torch.save({"param_groups": groups, **common}, zero / "optimizer_state.pt")
    # Frozen parameters and buffers: their values, as ds_to_universal writes them (a ZeRO-3 module state holds
    # the persistent parameters and the buffers whole).
    for name, tensor in (models[0].get("module") or {}).items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not (zero / name / "fp32.pt").exists():
            _save_param(zero, name, "fp32", tensor, tensor.shape)
    shutil.copy2(model_file, out / "mp_rank_00_model_states.pt")


def _per_param_state(state: dict[str, Any], numel: int, pad: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
    """A flat group's state: the tensors of the partition's size (one piece per parameter; ZeRO-1/2 saves the
    fp32 partition without its alignment padding ``pad``, the state with it), and the step count (a number or a
    0-dim tensor; None where the optimizer counts no steps, as SGD)."""
    flat = {
        k: v
        for k, v in state.items()
        if torch.is_tensor(v) and v.dim() == 1 and numel <= v.numel() <= numel + pad
    }
    step = state.get("step")
    other = sorted(set(state) - set(flat) - {"step"})
    if other:
        raise ValueError(f"optimizer state {', '.join(other)} is not per element of the partition")
    return flat, step


def _split_zero12(zero: Path, optim: list[dict], base: list[dict], model: dict) -> None:
    shapes = {n: s for group in model["param_shapes"] for n, s in group.items()}
    for g in range(len(optim[0]["single_partition_of_fp32_groups"])):
        pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
        step = None
        for o, b in zip(optim, base, strict=True):
            fp32 = o["single_partition_of_fp32_groups"][g]
            # The torch state numbers the groups' flat partitions in the order of the base optimizer's groups.
            index = b["param_groups"][g]["params"][0]
            pads = o.get("group_paddings") or [0] * (g + 1)
            flat, step = _per_param_state(b["state"].get(index, {}), fp32.numel(), pads[g])
            for name, frag in o["param_slice_mappings"][g].items():
                cut = {"fp32": fp32, **flat}
                for key, t in cut.items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(
                        t.narrow(0, frag.start, frag.numel)
                    )
        for name, by_key in pieces.items():
            for key, parts in by_key.items():
                _save_param(zero, name, key, torch.cat(parts), shapes[name])
            if step is not None:
                torch.save(step, zero / name / "step.pt")


def _split_zero3(zero: Path, optim: list[dict], base: list[dict], models: list[dict]) -> None:
    world = len(optim)
    for i, group_shapes in enumerate(models[0]["param_shapes"]):
        pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
        step = None
        for r in range(world):
            fp32 = optim[r]["fp32_flat_groups"][i]
            flat, step = _per_param_state(base[r]["state"].get(i, {}), fp32.numel())
            offset = 0
            for name, shape in group_shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / world)
                take = max(0, min(part, numel - r * part))
                for key, t in {"fp32": fp32, **flat}.items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(t.narrow(0, offset, take))
                offset += part
        for name, by_key in pieces.items():
            for key, parts in by_key.items():
                _save_param(zero, name, key, torch.cat(parts), group_shapes[name])
            if step is not None:
                torch.save(step, zero / name / "step.pt")
    # Frozen parameters: each rank keeps its fragment.
    frozen = models[0].get("frozen_param_shapes") or {}
    for name, shape in frozen.items():
        full = torch.cat([m["frozen_param_fragments"][name].flatten() for m in models])
        _save_param(zero, name, "fp32", full[: math.prod(shape)], shape)
