"""The one engine builder: settings sections -> open_clip model, DeepSpeed engine (from the resolved JSON),
optimizer, LR schedule, contrastive loss and (--distill-model) the frozen teacher. ``ds-clip-train`` builds its
engine here, and so do the tests and the benchmarks that prove what it trains, so a proof covers exactly what
ships (the shipped presets, DeepSpeed's config-built AdamW or CPU Adam under offload, the schedule, the clamp):

    s = parse_settings(argv)
    geometry, ds = resolve_run(s, world_size)       # once per run: the batch geometry, the DeepSpeed side
    bundle = build_model_bundle(s.model, seed=s.data.seed)
    built = build_engine(bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed,
                         rank=rank, total_steps=total_steps)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ds_clip.config import LossSettings, ModelSettings, OptimSettings, TrainSettings, resolve_geometry
from ds_clip.distributed import accelerator_name
from ds_clip.ds_config.resolve import ResolvedDeepSpeed, fill_start_keys, resolve_deepspeed
from ds_clip.geometry import BatchGeometry
from ds_clip.models.model import ModelBundle, Teacher, build_model, prepare_for_deepspeed
from ds_clip.siglip2.objective import Siglip2Runtime, runtime_of
from ds_clip.step.caption import CaptionLoss, caption_loss_for
from ds_clip.step.loss import ContrastiveLoss, LossSpec, resolve_impl
from ds_clip.training.optim import (
    format_groups,
    format_muon_split,
    muon_groups,
    param_groups_for,
    pin_muon_tags,
)
from ds_clip.training.schedule import build_scheduler, schedule_for

logger = logging.getLogger("ds_clip")


@dataclass
class BuiltEngine:
    engine: Any
    """The DeepSpeed engine (``engine.module`` is the open_clip model)."""
    loss_fn: ContrastiveLoss
    ds_config: dict[str, Any]
    """The resolved DeepSpeed JSON the engine was built from (written to the run folder)."""
    caption_fn: CaptionLoss | None = None
    """CoCa models: the caption term and the CoCa weights (``cached_step(..., caption=)``); else None."""
    teacher: Teacher | None = None
    """--distill-model: the frozen teacher, on the engine's device in its precision (not part of the engine)."""
    siglip2: Siglip2Runtime | None = None
    """--siglip2: the objective's runtime (its EMA teacher, the self-supervised start); its terms go to the step."""


def resolve_run(s: TrainSettings, world_size: int) -> tuple[BatchGeometry, ResolvedDeepSpeed]:
    """What a run of ``s`` on ``world_size`` ranks of this machine derives once, at start, and hands down: its
    batch geometry (W, k, m) and its DeepSpeed side (the JSON for W, the preset and why, what this machine's
    accelerator cannot run)."""
    geometry = resolve_geometry(s, world_size)
    return geometry, resolve_deepspeed(s.deepspeed_request(), geometry, accelerator=accelerator_name())


def build_model_bundle(
    m: ModelSettings,
    *,
    seed: int,
    local_rank: int | None = None,
    load_published: bool = True,
    loss: LossSettings | None = None,
) -> ModelBundle:
    """The open_clip model of the model section (seeded by ``seed``, the run's --seed, made DeepSpeed-safe) with
    its tokenizer and transforms; the image flags reach the model and the transforms, the locking flags freeze
    parameters before any engine (and so any optimizer) sees them.

    Published weights, configs and tokenizers (--pretrained TAG, hf-hub: models, ...) come from the cache: with
    ``local_rank`` given (every rank of a run calls this), local rank 0 of each host fetches what its cache lacks
    while the others wait (``fetch_once_per_host``). ``load_published`` False (``ds_clip.models.weights`` decided the run
    continues from a checkpoint, which holds the weights): no published weights are fetched or loaded."""
    from ds_clip.config import aug_cfg_dict
    from ds_clip.models.model import ImageOptions, TowerLocks
    from ds_clip.models.weights import resolve_pretrained

    if local_rank is not None:
        fetch_once_per_host(m, is_fetcher=local_rank == 0, load_weights=load_published)
    size = m.force_image_size
    bundle = build_model(
        m.model,
        pretrained=resolve_pretrained(m.pretrained),  # an exported folder or a weights file
        seed=seed,
        cache_dir=m.cache_dir,
        pretrained_image=m.pretrained_image,
        load_weights=load_published,
        grad_checkpointing=m.grad_checkpointing,
        image=ImageOptions(
            force_patch_dropout=m.force_patch_dropout,
            force_image_size=None if size is None else (size[0] if len(size) == 1 else (size[0], size[1])),
            image_mean=None if m.image_mean is None else tuple(m.image_mean),
            image_std=None if m.image_std is None else tuple(m.image_std),
            image_interpolation=m.image_interpolation,
            image_resize_mode=m.image_resize_mode,
            aug_cfg=aug_cfg_dict(m.aug_cfg) if m.aug_cfg else None,
            force_quick_gelu=m.force_quick_gelu,
            force_custom_text=m.force_custom_text,
            force_context_length=m.force_context_length,
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
    if m.use_bn_sync:
        # As open_clip_train does, after locking (a frozen BatchNorm is no longer a _BatchNorm): the cached step
        # freezes SyncBatchNorm's running statistics in its no-grad pass as it does BatchNorm's (a subclass).
        import torch

        bundle.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(bundle.model)
    if loss is not None and loss.siglip2:
        # Before DeepSpeed and the checkpoint's shape check see the model: the decoder, heads and mask token are
        # parameters of it like any other.
        from ds_clip.siglip2.objective import attach

        attach(bundle.model, bundle.model_cfg, loss, seed=seed)
    prepare_for_deepspeed(bundle.model)
    return bundle


def fetch_once_per_host(m: ModelSettings, *, is_fetcher: bool, load_weights: bool = True) -> None:
    """Fill each host's cache once: local rank 0 fetches the published files of the student and the teacher
    that the cache lacks (open_clip's own loaders, through ds_clip.sources.hub.fetch) while every other rank waits in
    one all-gather; then every rank knows whether each host's fetch worked, and all build from the cache with
    no network call. Every rank calls it (a collective), whatever its host. Offline (HF_HUB_OFFLINE) nothing is
    fetched: validation has already refused a cache that lacks a file. The wait is bounded by --dist-timeout."""
    from ds_clip import distributed
    from ds_clip.sources import hub

    def needs_now() -> list[hub.Need]:
        return hub.run_needs(
            m.model, m.pretrained, cache_dir=m.cache_dir, pretrained_image=m.pretrained_image,
            load_weights=load_weights, distill_model=m.distill_model, distill_pretrained=m.distill_pretrained,
        )[0]  # fmt: skip

    needs = needs_now()
    command = hub.run_needs(
        m.model, m.pretrained, cache_dir=m.cache_dir, pretrained_image=m.pretrained_image
    )[1]
    if not needs or hub.is_offline():  # the same on every rank (same flags): no collective, or one on all
        return
    error = None
    if is_fetcher:
        try:
            hub.fetch_all(needs_now, command)
        except hub.HubError as exc:
            error = str(exc)
    try:
        errors = distributed.all_gather_object(error)
    except (RuntimeError, distributed.dist.DistError) as exc:
        raise hub.HubError(
            f"waited for local rank 0 to fetch {needs[0].repo} ({type(exc).__name__}): a fetch longer than "
            f"--dist-timeout, or a rank died; fill the cache first with `{command}`"
        ) from None
    first = next((e for e in errors if e), None)
    if first is not None:
        raise hub.HubError(first)
    # A host whose local rank 0 fetched nothing for this rank (e.g. a different --cache-dir per rank) fails in
    # the offline build with the cache error, never with a network call.


def build_teacher(m: ModelSettings, student: ModelBundle, *, seed: int) -> Teacher | None:
    """The --distill-model teacher of the model section (None without it), built by the same builder as the
    student, on the CPU in fp32, frozen and in eval mode, after checking it reads the student's images and
    tokens. Its weights come from its local-dir: folder or --distill-pretrained (config validation refuses a
    teacher without weights). The global RNG is left as it was: a teacher never shifts the student's random
    stream."""
    import torch

    from ds_clip.models.model import check_teacher_fits
    from ds_clip.models.weights import resolve_pretrained

    name = m.distill_model
    if name is None:
        return None
    with torch.random.fork_rng(devices=[]):
        bundle = build_model(
            name, pretrained=resolve_pretrained(m.distill_pretrained), seed=seed, cache_dir=m.cache_dir
        )
    check_teacher_fits(student, bundle, name)
    return Teacher(bundle.model, name)


def build_engine(
    bundle: ModelBundle,
    geometry: BatchGeometry,
    ds: ResolvedDeepSpeed,
    *,
    model: ModelSettings,
    optim: OptimSettings,
    loss: LossSettings,
    seed: int,
    rank: int,
    total_steps: int,
    steps_per_epoch: int | None = None,
) -> BuiltEngine:
    """DeepSpeed engine and loss for ``bundle.model``; every rank calls it (``deepspeed.initialize`` is a
    collective). ``ds`` is the DeepSpeed side resolved for ``geometry``'s world size on this machine's
    accelerator; ``model`` gives the teacher (--distill-model, built with ``seed``) and --torchcompile.
    ``total_steps`` is the length of the LR schedule in optimizer steps; ``steps_per_epoch`` converts
    --epochs-cooldown (default: total_steps // --epochs, exact without --max-steps)."""
    import deepspeed

    _check_resolved_for(ds, geometry, accelerator_name())
    ds.refuse_blocked()  # before DeepSpeed fails inside its op builder, or torch in the first forward
    # Before DeepSpeed starts: a teacher that does not fit the student is refused without an engine.
    teacher = build_teacher(model, bundle, seed=seed)
    ds_json = ds.config
    fill_start_keys(ds_json, hidden_size=hidden_size(bundle.model), total_steps=total_steps)
    # Per-tower groups, each with its own "lr"/"weight_decay"; the schedule scales each from its own peak.
    groups, group_table = param_groups_for(bundle.model, optim)
    muon_split = pin_muon_tags(bundle.model) if optim.optimizer == "muon" else None
    if muon_split is not None:
        # DeepSpeed lets a group's own lr win over muon_lr/adam_lr: each group's halves carry their rate.
        rates = ds_json["optimizer"]["params"]
        groups, group_table = muon_groups(
            groups, group_table, lr=optim.lr, muon_lr=rates.get("muon_lr"), adam_lr=rates.get("adam_lr")
        )
    if rank == 0:
        _log_choices(ds, optim, group_table)
        if muon_split is not None:
            logger.info(
                "--opt muon: DeepSpeed's Muon on the towers' hidden matrices\n%s",
                format_muon_split(*muon_split),
            )
    # A JSON's scheduler block: DeepSpeed builds it from the config and steps it once per optimizer step (each
    # engine.step() of the cached step); else ds_clip's --lr-scheduler.
    lr_scheduler = None
    if "scheduler" not in ds_json:
        schedule = schedule_for(optim, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        lr_scheduler = lambda opt: build_scheduler(opt, schedule)  # noqa: E731
    engine, *_ = deepspeed.initialize(
        model=bundle.model, model_parameters=groups, config=ds_json, lr_scheduler=lr_scheduler
    )
    if model.torchcompile:  # after initialize: DeepSpeed wraps (and ZeRO hooks) the uncompiled module
        from ds_clip.models.model import compile_engine

        compile_engine(engine)
    _choose_gradient_reduction(engine, geometry)
    if teacher is not None:
        from ds_clip.step.cached import input_dtype

        teacher.to(engine.device, input_dtype(engine))
    siglip2 = runtime_of(bundle.model)
    if siglip2 is not None:
        siglip2.start(total_steps=total_steps, engine=engine)
    loss_fn = ContrastiveLoss(
        LossSpec(
            siglip=loss.siglip,
            distill=teacher is not None,
            local_loss=loss.local_loss,
            gather_with_grad=loss.gather_with_grad,
            impl=resolve_impl(
                loss.loss_impl,
                geometry.global_batch,
                siglip=loss.siglip,
                local_loss=loss.local_loss,
                distill=teacher is not None,
            ),
            tile_size=loss.loss_tile_size,
        ),
        rank=rank,
        world_size=geometry.world_size,
    )
    caption_fn = caption_loss_for(
        bundle.model,
        caption_weight=loss.coca_caption_loss_weight,
        contrastive_weight=loss.coca_contrastive_loss_weight,
        siglip=loss.siglip,
    )
    return BuiltEngine(
        engine=engine,
        loss_fn=loss_fn,
        ds_config=ds_json,
        caption_fn=caption_fn,
        teacher=teacher,
        siglip2=siglip2,
    )


def hidden_size(model) -> int:
    """The model's hidden size for DeepSpeed's "auto" bucket sizes (Hugging Face fills them from
    config.hidden_size): the widest LayerNorm of either tower, else the widest 2-D parameter."""
    import torch

    widths = [m.normalized_shape[-1] for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    widths = widths or [p.shape[-1] for p in model.parameters() if p.ndim == 2]
    return int(max(widths or [1]))


def _log_choices(ds: ResolvedDeepSpeed, optim: OptimSettings, group_table) -> None:
    """Rank 0: the preset and why, the coalescing fallback, what the JSON's keys became, the optimizer's
    parameter groups."""
    for note in ds.notes:
        logger.info("DeepSpeed JSON: %s", note)
    if ds.default_reason is not None:
        logger.info(
            "DeepSpeed preset %s (the default; --ds-config to choose): %s", ds.preset, ds.default_reason
        )
    if ds.coalesce_fallback is not None:
        logger.info("--coalesce-grad-reduction auto: off here, %s", ds.coalesce_fallback)
    scheduler = ds.config.get("scheduler")
    schedule_name = (
        f"the JSON's {scheduler['type']}"
        if scheduler
        else "no"
        if optim.skip_scheduler
        else optim.lr_scheduler
    )
    logger.info(
        "optimizer parameter groups (--opt %s: DeepSpeed %s; peak lr; %s schedule):\n%s",
        optim.optimizer, ds.config["optimizer"]["type"], schedule_name, format_groups(group_table),
    )  # fmt: skip


def _choose_gradient_reduction(engine, geometry: BatchGeometry) -> None:
    """How the engine reduces gradients at ``engine.step()`` on ZeRO-0 (ZeRO 1-3 move gradients into their
    partitions in that same call: kept as DeepSpeed does it)."""
    if geometry.world_size == 1 and engine.zero_optimization_stage() == 0:
        # Alone, DeepSpeed still flattens every gradient into buckets and all-reduces them at engine.step()
        # (a copy of the whole gradient; 605 MB per step for ViT-B-32). Averaging over one rank is the
        # identity, so skip it.
        engine.enable_backward_allreduce = False
    elif _reduces_in_place(engine):
        engine.allreduce_gradients = _in_place_allreduce(engine)


def _reduces_in_place(engine) -> bool:
    """ZeRO-0 on several ranks, fp32, DeepSpeed's plain average (no predivide, no other communication dtype):
    where ds_clip averages the gradients itself, in place, instead of DeepSpeed's whole-gradient flatten."""
    import torch

    return (
        engine.zero_optimization_stage() == 0
        and engine.dp_world_size > 1
        and not engine.bfloat16_enabled()
        and not engine.fp16_enabled()
        and engine.gradient_average
        and engine.postscale_gradients()
        and engine.gradient_predivide_factor() == 1.0
        and engine.communication_data_type == torch.float32
        and all(p.dtype == torch.float32 for p in engine.module.parameters() if p.requires_grad)
    )


def _in_place_allreduce(engine):
    """A replacement for ``engine.allreduce_gradients`` on ZeRO-0 (``_reduces_in_place``). DeepSpeed's own flattens
    every gradient into one 5e8-element bucket, all-reduces it and copies it back: a transient copy of the whole
    gradient and two passes over it, a fifth of a 2-rank ViT-B-32 step on a CPU (docs/benchmarks.md). This
    averages the same gradients in place (``distributed.average_in_place``). DeepSpeed calls it where it called
    its own: at ``engine.step()`` in ds_clip's unmanaged accumulation, once per optimizer step, before clipping
    and the update. A trainable parameter without a gradient gets zeros first, as DeepSpeed's does, so every
    rank reduces the same tensors."""
    import torch

    from ds_clip.distributed import average_in_place

    params = [p for p in engine.module.parameters() if p.requires_grad]

    def allreduce_gradients(bucket_size: int | None = None) -> None:
        if not engine.is_gradient_accumulation_boundary():
            return  # DeepSpeed's own reduces at the boundary only (managed accumulation calls it per backward)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        average_in_place([p.grad for p in params])

    return allreduce_gradients


def _check_resolved_for(ds: ResolvedDeepSpeed, geometry: BatchGeometry, accelerator: str) -> None:
    """The resolved JSON must be the one for this engine: its world size and micro-batch, this accelerator."""
    here = (geometry.world_size, geometry.micro_batch_size, accelerator)
    resolved = (ds.world_size, ds.config.get("train_micro_batch_size_per_gpu"), ds.accelerator)
    if resolved != here:
        raise ValueError(
            f"the DeepSpeed JSON was resolved for (world size, micro-batch, accelerator) = {resolved}, this engine "
            f"is {here}: resolve_run(settings, {geometry.world_size}) resolves both for this machine"
        )
