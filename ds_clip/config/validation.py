"""`validate`: every rule of the settings, one pass, before anything starts.

Cheap, and imports neither deepspeed nor torch.distributed, so a bad flag fails in a second, before any process
group starts. Shard patterns and files are looked at; open_clip is imported only to check an unknown --model
name or the keys of --aug-cfg. The DeepSpeed preset is resolved against the flags for a world size not known
yet (ds_clip.ds_config.resolve.check_preset); the start resolves it again for the real one.
"""

from __future__ import annotations

from pathlib import Path

from ds_clip.config.checks import (
    check_data,
    check_dist,
    check_ema,
    check_eval,
    check_loss,
    check_optim,
    check_outputs,
    check_shards,
    check_siglip2,
    need,
)
from ds_clip.config.flags import flag_named
from ds_clip.config.model_checks import check_distill, check_model, check_model_flags
from ds_clip.config.sections import CheckpointSettings, LoggingSettings, TrainSettings
from ds_clip.ds_config.resolve import check_preset
from ds_clip.errors import SettingsError


def validate(s: TrainSettings) -> None:
    """Raise SettingsError naming the flag for the first bad value in `s`, the preset included. Fast: no
    deepspeed import; shard patterns, files and (for an unknown name) open_clip's model list are looked at."""
    _check_json_batch(s)
    check_optim(s.optim)
    check_loss(s.loss)
    check_dist(s.dist)
    check_outputs(s.logging, s.checkpoint)
    check_ema(s.ema)
    check_data(s.data)
    if s.data.train_data and s.data.dataset_type != "csv":  # a CSV path is a file, not a shard pattern
        check_shards("--train-data", s.data.train_data)
    check_eval(s.eval, batch_size=s.optim.batch_size)
    check_model(s.model, resuming=s.checkpoint.resume is not None)
    check_model_flags(s.model)
    check_distill(s)
    check_siglip2(s)
    _check_resume(s.checkpoint, s.logging)
    check_final_sync_fits(s.checkpoint, s.dist.dist_timeout)
    # The DeepSpeed preset: exists, parses, and agrees with the flags (world size unknown yet).
    check_preset(s.deepspeed_request())


FINAL_SYNC_SPARE_S = 60
"""Seconds --dist-timeout must leave beyond --remote-sync-final-timeout: rank 0 also closes its metric sinks
before the collective the other ranks wait in."""


def check_final_sync_fits(ck: CheckpointSettings, dist_timeout: float) -> None:
    """--remote-sync: rank 0's bounded last sync must end within --dist-timeout. The other ranks wait for it in
    the run's last collective; one that waits longer fails with "lost contact", and the launcher then kills rank
    0 in the middle of its upload."""
    if ck.remote_sync is None:
        return
    final = ck.remote_sync_final_timeout
    need(
        final + FINAL_SYNC_SPARE_S <= dist_timeout,
        f"--remote-sync-final-timeout {final} s does not fit in --dist-timeout {dist_timeout:g} s: the other ranks "
        f"wait in a collective while rank 0 makes its last sync; lower --remote-sync-final-timeout to at most "
        f"{max(int(dist_timeout) - FINAL_SYNC_SPARE_S, 0)} or raise --dist-timeout to at least "
        f"{final + FINAL_SYNC_SPARE_S}",
    )


def _check_json_batch(s: TrainSettings) -> None:
    """A --ds-config file's batch triple that no world size divides, in the file's words (before check_optim
    would name the flags its values became)."""
    o, sources = s.optim, s.sources or {}
    keys = {"global_batch_size": "train_batch_size", "batch_size": "train_micro_batch_size_per_gpu",
            "accum_freq": "gradient_accumulation_steps"}  # fmt: skip
    from_json = [f for f in keys if sources.get(f) == "ds_json"]
    n = o.global_batch_size
    if not from_json or n is None or sources.get("batch_size") == "derived":
        return
    per_rank = o.batch_size * (o.accum_freq or 1)
    if n % per_rank:
        shown = ", ".join(
            f"{keys[f]}={getattr(o, f)}"
            if sources.get(f) == "ds_json"
            else f"{flag_named(f).option} {getattr(o, f)}"
            for f in keys
            if getattr(o, f) is not None
        )
        raise SettingsError(
            f"the batch of {s.dist.ds_config} ({shown}) divides on no world size: N = m x k x W needs m x k = "
            f"{per_rank} to divide N = {n}"
        )


def _check_resume(ck: CheckpointSettings, lg: LoggingSettings) -> None:
    if ck.resume == "latest":
        need(lg.name is not None, "--resume latest needs --name of the run to continue")
    elif ck.resume is not None:
        need(Path(ck.resume).expanduser().exists(), f"--resume {ck.resume!r}: no such checkpoint folder")
