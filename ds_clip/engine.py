"""The one engine builder: settings -> open_clip model, resolved DeepSpeed JSON, optimizer, LR schedule and
contrastive loss. ``ds-clip-train`` builds its engine here, and so do the tests and the demo that prove
what it trains, so a proof covers exactly what ships (the shipped presets, DeepSpeed's config-built
AdamW or CPU Adam under offload, the schedule, the clamp).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ds_clip.config import TrainSettings
from ds_clip.ds_config import coalesce_fallback, default_preset, resolve_ds_config
from ds_clip.loss import ContrastiveLoss, LossSpec, resolve_impl
from ds_clip.model import ModelBundle, build_model, prepare_for_deepspeed
from ds_clip.optim import format_groups, param_groups_for
from ds_clip.schedule import build_scheduler, schedule_for

logger = logging.getLogger("ds_clip")


@dataclass
class BuiltEngine:
    engine: Any
    """The DeepSpeed engine (``engine.module`` is the open_clip model)."""
    loss_fn: ContrastiveLoss
    ds_config: dict[str, Any]
    """The resolved DeepSpeed JSON the engine was built from (written to the run folder)."""


def build_model_bundle(s: TrainSettings) -> ModelBundle:
    """The open_clip model (seeded by --seed, made DeepSpeed-safe) with its tokenizer and transforms; the
    image flags reach the model and the transforms, the locking flags freeze parameters before any engine
    (and so any optimizer) sees them."""
    from ds_clip.config import aug_cfg_dict
    from ds_clip.export import resolve_pretrained
    from ds_clip.model import ImageOptions, TowerLocks

    m = s.model
    size = m.force_image_size
    bundle = build_model(
        m.model,
        pretrained=resolve_pretrained(m.pretrained),  # an exported folder or a weights file
        seed=s.data.seed,
        grad_checkpointing=m.grad_checkpointing,
        image=ImageOptions(
            force_patch_dropout=m.force_patch_dropout,
            force_image_size=None if size is None else (size[0] if len(size) == 1 else (size[0], size[1])),
            image_mean=None if m.image_mean is None else tuple(m.image_mean),
            image_std=None if m.image_std is None else tuple(m.image_std),
            image_interpolation=m.image_interpolation,
            aug_cfg=aug_cfg_dict(m.aug_cfg) if m.aug_cfg else None,
        ),
        locks=TowerLocks(
            image=m.lock_image,
            image_unlocked_groups=m.lock_image_unlocked_groups,
            image_freeze_bn_stats=m.lock_image_freeze_bn_stats,
            text=m.lock_text,
            text_unlocked_layers=m.lock_text_unlocked_layers,
            text_freeze_layer_norm=m.lock_text_freeze_layer_norm,
        ),
    )
    prepare_for_deepspeed(bundle.model)
    return bundle


def build_engine(
    s: TrainSettings,
    bundle: ModelBundle,
    *,
    rank: int,
    world_size: int,
    total_steps: int,
    steps_per_epoch: int | None = None,
) -> BuiltEngine:
    """DeepSpeed engine and loss for ``bundle.model``; every rank calls it (``deepspeed.initialize`` is a
    collective). ``total_steps`` is the length of the LR schedule in optimizer steps; ``steps_per_epoch``
    converts --epochs-cooldown (default: total_steps // --epochs, exact without --max-steps)."""
    import deepspeed

    ds_json = resolve_ds_config(s, world_size)
    o, loss = s.optim, s.loss
    # Per-tower groups, each with its own "lr"/"weight_decay"; the schedule scales each from its own peak.
    groups, group_table = param_groups_for(bundle.model, o)
    schedule = schedule_for(o, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
    if rank == 0:
        if s.dist.ds_config is None:
            preset, reason = default_preset(s, world_size)
            logger.info("DeepSpeed preset %s (the default; --ds-config to choose): %s", preset, reason)
        why = coalesce_fallback(s, world_size)
        if why is not None:
            logger.info("--coalesce-grad-reduction auto: off here, %s", why)
        table = format_groups(group_table)
        logger.info("optimizer parameter groups (peak lr; %s schedule):\n%s", o.lr_scheduler, table)
    engine, *_ = deepspeed.initialize(
        model=bundle.model,
        model_parameters=groups,
        config=ds_json,
        lr_scheduler=lambda opt: build_scheduler(opt, schedule),
    )
    if s.model.torchcompile:  # after initialize: DeepSpeed wraps (and ZeRO hooks) the uncompiled module
        from ds_clip.model import compile_engine

        compile_engine(engine)
    if world_size == 1 and engine.zero_optimization_stage() == 0:
        # Alone, DeepSpeed still flattens every gradient into buckets and all-reduces them at engine.step()
        # (a copy of the whole gradient; 605 MB per step for ViT-B-32). Averaging over one rank is the
        # identity, so skip it. (ZeRO 1-3 move gradients into their partitions in that same call: kept.)
        engine.enable_backward_allreduce = False
    loss_fn = ContrastiveLoss(
        LossSpec(
            siglip=loss.siglip,
            local_loss=loss.local_loss,
            gather_with_grad=loss.gather_with_grad,
            impl=resolve_impl(loss.loss_impl, world_size * o.accum_freq * o.batch_size),
            tile_size=loss.loss_tile_size,
        ),
        rank=rank,
        world_size=world_size,
    )
    return BuiltEngine(engine=engine, loss_fn=loss_fn, ds_config=ds_json)
