"""What a launch of W ranks derives from the settings, once, at start: the batch geometry (W, k, m) and the
resolved DeepSpeed JSON.

    geometry = resolve_geometry(settings, world_size=4)                       # SettingsError if N does not divide
    ds = resolve_deepspeed(settings.deepspeed_request(), geometry, accelerator="cuda")   # ds_clip.ds_config

``ds_clip.ds_config`` takes the request and the geometry, never the settings tree; this module reads the tree.
"""

from __future__ import annotations

from typing import Any

from ds_clip.config.sections import TrainSettings
from ds_clip.ds_config.presets import preset_label
from ds_clip.ds_config.resolve import ResolvedDeepSpeed, resolve_deepspeed
from ds_clip.errors import SettingsError
from ds_clip.geometry import BatchGeometry, GeometryError


def resolve_geometry(s: TrainSettings, world_size: int) -> BatchGeometry:
    """W, k, m of a run of ``s`` on ``world_size`` ranks: --accum-freq k, or k = N / (W*m) from
    --global-batch-size N, or (a JSON's train_batch_size without train_micro_batch_size_per_gpu) m = N / (k*W), as
    DeepSpeed derives it. SettingsError (exit 2, before any engine) when they do not divide: the message names the
    flags, or the JSON's keys, and the numbers."""
    o = s.optim
    sources = s.sources or {}
    m = o.batch_size
    try:
        if sources.get("batch_size") == "derived":
            k, n = o.accum_freq or 1, o.global_batch_size or 0
            if n % (k * world_size):
                raise GeometryError(
                    f"m = N / (k x W) is no whole number: {k} x {world_size} = {k * world_size}"
                )
            m = n // (k * world_size)
        return BatchGeometry.derive(world_size, m, accum_freq=o.accum_freq, global_batch=o.global_batch_size)
    except GeometryError as exc:
        if "ds_json" not in {sources.get(f) for f in ("batch_size", "accum_freq", "global_batch_size")} and (
            sources.get("batch_size") != "derived"
        ):
            raise SettingsError(str(exc)) from None
        raise SettingsError(_triple_message(s, world_size, m, str(exc))) from None


def _triple_message(s: TrainSettings, world_size: int, m: int, why: str) -> str:
    """One line for a batch triple (some of it from the JSON) that does not divide on ``world_size`` ranks."""
    o, sources = s.optim, s.sources or {}
    label = preset_label(s.dist.ds_config or "")
    parts = []
    for key, fld, flag in (("train_batch_size", "global_batch_size", "--global-batch-size"),
                           ("train_micro_batch_size_per_gpu", "batch_size", "--batch-size"),
                           ("gradient_accumulation_steps", "accum_freq", "--accum-freq")):  # fmt: skip
        value = getattr(o, fld)
        if sources.get(fld) == "ds_json":
            parts.append(f"{key}={value}")
        elif sources.get(fld) in ("flag", "recipe") and value is not None:
            parts.append(f"{flag} {value}")
    n = o.global_batch_size
    k = o.accum_freq
    shown_m = "m" if sources.get("batch_size") == "derived" else m
    formula = f"N = m x k x W: {n} = {shown_m} x {k or 'k'} x {world_size}" if n else ""
    return (
        f"the batch of {label} ({', '.join(parts)}) does not divide on {world_size} "
        f"rank{'s' if world_size != 1 else ''}: {formula} has no whole solution ({why.split(' (')[0]}); "
        "launch a world size that divides it or change the keys"
    )


def resolve_deepspeed_for(
    s: TrainSettings, world_size: int | None, *, accelerator: str | None = None
) -> ResolvedDeepSpeed:
    """The DeepSpeed side of a run of ``s`` on ``world_size`` ranks (None: validation, no batch keys):
    ``resolve_deepspeed`` of the settings' request and their geometry."""
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    geometry = None if world_size is None else resolve_geometry(s, world_size)
    return resolve_deepspeed(s.deepspeed_request(), geometry, accelerator=accelerator)


def resolve_ds_config(s: TrainSettings, world_size: int) -> dict[str, Any]:
    """The resolved JSON alone (``resolve_deepspeed_for(s, world_size).config``), for a look at what a launch of
    ``world_size`` ranks would run."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return resolve_deepspeed_for(s, world_size).config
