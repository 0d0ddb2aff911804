"""open_clip's temperature clamp, applied where DeepSpeed keeps the value: the working copy *and* the fp32
master copy of ``logit_scale``, on every ZeRO stage and precision.

open_clip clamps ``logit_scale`` to [0, ln 100] after each optimizer step. Under DeepSpeed the parameter
the model sees is only the working copy: the optimizer updates an fp32 master and copies it back at the
next step, so clamping the working copy alone is undone one step later. Where the master lives:

| engine | fp32 master of a parameter | ds_clip clamps |
|---|---|---|
| ZeRO-0 fp32 | the parameter itself | ``p.data`` |
| ZeRO-0 bf16 (``FP16_UnfusedOptimizer``) | ``optimizer.fp32_groups[i][j]`` (a per-parameter copy) | both |
| ZeRO-1/2, BF16_Optimizer | a fragment of a flat fp32 partition (``p._hp_mapping``, owning rank only) | both |
| ZeRO-3 | a slice of the rank's flat fp32 partition; working copy ``p.ds_tensor`` (+ ``p.data`` when persistent) | all |

Every rank clamps what it holds, in place and on the device: no collective and no host sync (the clamp
of a value already in range changes nothing, so there is no need to look first). NVMe-swapped ZeRO-3
optimizer state is not supported here (refused by ds_clip's presets).
"""

from __future__ import annotations

import math

import torch

# open_clip clamps the learned temperature so that exp(logit_scale) <= 100.
LOGIT_SCALE_MAX = math.log(100)


def _unfused_master(engine, p: torch.Tensor) -> torch.Tensor | None:
    opt = engine.optimizer
    for fp16_group, fp32_group in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", [])):
        for lp, hp in zip(fp16_group, fp32_group):
            if lp is p:
                return hp
    return None


def _zero3_local_master(p: torch.Tensor) -> torch.Tensor | None:
    # DeepSpeedZeroOptimizer_Stage3._get_fp32_opt_state_partition without its stream synchronize (a host
    # wait): the step that wrote the partition was queued on the same stream as this clamp.
    opt = getattr(p, "_z3_optimizer", None)
    if opt is None:
        return None
    position = opt.grad_position.get(opt.get_param_id(p))
    if position is None:
        return None
    group, offset, numel = position
    return opt.fp32_partitioned_groups_flat[group].narrow(0, offset, numel)


def master_copies(engine, p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors this rank holds for parameter ``p``: working copy first, then the fp32 master (if any)."""
    if hasattr(p, "ds_id"):
        # ZeRO-3: this rank's partition of the working copy and of the master, plus the whole working copy
        # where it stays gathered (a parameter under param_persistence_threshold, like logit_scale, is kept
        # whole on every rank and refreshed from the partitions after each step; elsewhere p.data is empty).
        held = [p.ds_tensor, p.data]
        master = _zero3_local_master(p)
        return held + ([master] if master is not None and master.numel() else [])
    held = [p.data]
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is not None:  # ZeRO-1/2 and BF16_Optimizer: the fragment this rank owns
        held.append(mapping.get_hp_fragment())
    else:
        master = _unfused_master(engine, p)
        if master is not None:
            held.append(master.data)
    return held


@torch.no_grad()
def clamp_logit_scale(engine, max_value: float = LOGIT_SCALE_MAX) -> None:
    """Clamp ``logit_scale`` to [0, max_value] in every copy this rank holds. Call on every rank after an
    applied optimizer step; nothing is communicated."""
    p = engine.module.logit_scale
    for t in master_copies(engine, p):
        t.clamp_(0, max_value)


def full_fp32_master(engine, name: str) -> torch.Tensor:
    """The whole fp32 master value of parameter ``name`` (a collective on ZeRO 1-3: every rank calls it).

    For tests and diagnostics: what the optimizer will update next step, not the working copy."""
    from deepspeed.utils import safe_get_full_fp32_param

    p = dict(engine.module.named_parameters())[name]
    if engine.zero_optimization_stage() >= 1 or getattr(p, "_hp_mapping", None) is not None:
        value = safe_get_full_fp32_param(p)
        if value is not None:
            return value.detach().float().cpu().clone()
    master = _unfused_master(engine, p)
    return (master if master is not None else p).detach().float().cpu().clone()
