"""The checks of single sections and the helpers every check uses: a failed check is a SettingsError naming
the flag (its option as the field defines it, `flag_named`).

`check_data` and `check_eval` are public: the data builder and ds-clip-eval run them on the sections they get.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

from ds_clip.config.fields import DATASET_TYPES, PRECISIONS, REPORTERS
from ds_clip.config.flags import flag_named
from ds_clip.config.sections import (
    CheckpointSettings,
    DataSettings,
    DistSettings,
    EmaSettings,
    EvalSectionSettings,
    LoggingSettings,
    LossSettings,
    OptimSettings,
)
from ds_clip.ds_config.presets import OPTIMIZERS, PRECISION_NAMES
from ds_clip.errors import SettingsError
from ds_clip.geometry import divisibility_message
from ds_clip.sources.urls import ShardPatternError, expand_shards


def need(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


def check_choice(name: str, value: Any) -> None:
    f = flag_named(name)
    choices = f.meta["choices"]
    need(value in choices, f"{f.option} must be one of {', '.join(choices)}, got {value!r}")


def check_min(name: str, value: Any, low: float, *, strict: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    option = flag_named(name).option
    if strict:
        need(value is not None and value > low, f"{option} must be > {low:g}, got {value}")
    else:
        need(value is not None and value >= low, f"{option} must be >= {low:g}, got {value}")


def check_shards(flag: str, pattern: str) -> None:
    # The webdataset reader expands the same way (one expander): what passes here is what it reads.
    try:
        expand_shards(pattern, flag)
    except ShardPatternError as exc:
        raise SettingsError(str(exc)) from None


def _check_upsampling_factors(d: DataSettings) -> None:
    # open_clip_train.data: an assert for "needs --dataset-resampled", one for the count, float() for each.
    flag, text = "--train-data-upsampling-factors", d.train_data_upsampling_factors
    need(
        d.dataset_type == "webdataset",
        f"{flag} weights the '::'-joined sources of webdataset shards; --dataset-type is {d.dataset_type}",
    )
    need(
        d.dataset_resampled,
        f"{flag} needs --dataset-resampled (as in open_clip, the factors weight drawing with replacement)",
    )
    words = (text or "").split("::")
    sources = (d.train_data or "").split("::")
    need(
        len(words) == len(sources),
        f"{flag} {text!r} has {len(words)} factors but --train-data has {len(sources)} '::'-joined sources",
    )
    for word in words:
        try:
            value = float(word)
        except ValueError:
            raise SettingsError(f"{flag} {text!r}: {word!r} is not a number") from None
        need(
            0 < value < float("inf"), f"{flag} {text!r}: each factor must be a positive number, got {word!r}"
        )


def _check_csv(d: DataSettings) -> None:
    need(bool(d.train_data), "--dataset-type csv needs --train-data (a CSV/TSV file)")
    path = Path(d.train_data or "").expanduser()
    need(path.is_file(), f"--train-data {d.train_data!r}: no such CSV/TSV file (--dataset-type csv)")
    need(
        not d.dataset_resampled,
        "--dataset-resampled draws webdataset shards; with --dataset-type csv every row is trained once an epoch",
    )
    need(
        len(d.csv_separator) == 1 or d.csv_separator == "\\t",
        f"--csv-separator must be one character (or \\t for a tab), got {d.csv_separator!r}",
    )
    for flag, value in (("--csv-img-key", d.csv_img_key), ("--csv-caption-key", d.csv_caption_key)):
        need(bool(value), f"{flag} must name a column of the --train-data file")


def check_data(d: DataSettings) -> None:
    """The rules of the data section alone (also run by ds_clip.data.build_train_data on what it gets)."""
    need(
        d.dataset_type in DATASET_TYPES,  # "auto" is derived by parse_settings
        f"--dataset-type must be one of {', '.join(DATASET_TYPES)}, got {d.dataset_type!r}",
    )
    check_min("workers", d.workers, 0)
    check_min("train_num_samples", d.train_num_samples, 1, optional=True)
    check_min("synthetic_image_size", d.synthetic_image_size, 8, optional=True)
    check_min("shuffle_buffer", d.shuffle_buffer, 0)
    for flag, value in (("--image-key", d.image_key), ("--caption-key", d.caption_key)):
        need(bool([k for k in value.split(";") if k.strip()]), f"{flag} must name at least one extension, got {value!r}")  # fmt: skip
    if d.train_data_upsampling_factors is not None:
        _check_upsampling_factors(d)
    if d.dataset_type == "webdataset":
        need(bool(d.train_data), "--dataset-type webdataset needs --train-data (a shard pattern)")
        need(
            not d.dataset_resampled or d.train_num_samples is not None,
            "--dataset-resampled needs --train-num-samples (it defines an epoch)",
        )
    elif d.dataset_type == "csv":
        _check_csv(d)
    elif d.train_data:
        raise SettingsError("--train-data is given but --dataset-type is synthetic: drop one of them")


def check_eval(ev: EvalSectionSettings, *, batch_size: int) -> None:
    """The rules of the eval section and of the evaluation's batch size (also run by ds-clip-eval)."""
    check_min("batch_size", batch_size, 1)
    check_min("val_num_samples", ev.val_num_samples, 1, optional=True)
    check_min("val_every_n_steps", ev.val_every_n_steps, 1, optional=True)
    check_min("val_frequency", ev.val_frequency, 0, optional=True)
    check_min("zeroshot_frequency", ev.zeroshot_frequency, 0, optional=True)
    if ev.val_data and ev.val_data != "synthetic":
        check_shards("--val-data", ev.val_data)
    for flag, folder in (("--imagenet-val", ev.imagenet_val), ("--imagenet-v2", ev.imagenet_v2)):
        if folder is not None:
            imagenet_class_folders(folder, flag)
    if ev.zeroshot_folder is not None:
        need(
            Path(ev.zeroshot_folder).expanduser().is_dir(),
            f"--zeroshot-folder {ev.zeroshot_folder!r}: no such folder",
        )
    if ev.zeroshot_classnames is not None:
        need(
            ev.zeroshot_folder is not None,
            "--zeroshot-classnames names the classes of --zeroshot-folder: give that too",
        )
        need(
            Path(ev.zeroshot_classnames).expanduser().is_file(),
            f"--zeroshot-classnames {ev.zeroshot_classnames!r}: no such file",
        )
    need(
        ev.zeroshot_templates in ("openai", "simple") or Path(ev.zeroshot_templates).expanduser().is_file(),
        f"--zeroshot-templates {ev.zeroshot_templates!r}: expected openai, simple or a file of templates",
    )
    if ev.zeroshot_classes is not None:
        need(bool(ev.val_data), "--zeroshot-classes needs --val-data (the images to classify)")
        need(
            Path(ev.zeroshot_classes).expanduser().is_file(),
            f"--zeroshot-classes {ev.zeroshot_classes!r}: no such file",
        )


IMAGENET_CLASSES = 1000


def imagenet_class_folders(folder: str, flag: str) -> dict[str, int]:
    """An ImageNet-style folder's class sub-folders -> index into open_clip's 1000 IMAGENET_CLASSNAMES.

    Folders named by class index (0-999: ImageNetV2's layout, or any subset of the classes) are that class;
    otherwise there must be 1000 of them, in ImageFolder's order (sorted names: ImageNet's synset folders
    n01440764 ... sort into ImageNet's class order, which IMAGENET_CLASSNAMES follows)."""
    root = Path(folder).expanduser()
    need(root.is_dir(), f"{flag} {folder!r}: no such folder")
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    if names and all(n.isdigit() and int(n) < IMAGENET_CLASSES for n in names):
        return {n: int(n) for n in names}
    need(
        len(names) == IMAGENET_CLASSES,
        f"{flag} {folder}: expected {IMAGENET_CLASSES} class folders (ImageNet's synsets, in ImageFolder order) or "
        f"folders named by class index 0-{IMAGENET_CLASSES - 1}; found {len(names)} folders",
    )
    return {n: i for i, n in enumerate(names)}


def check_optim(o: OptimSettings) -> None:
    """Batch sizes, the run's length, the optimizer's hyper-parameters, per-tower groups and the LR schedule."""
    check_min("batch_size", o.batch_size, 1)
    check_min("epochs", o.epochs, 1, optional=True)
    check_min("accum_freq", o.accum_freq, 1, optional=True)
    check_global_batch(o)
    check_min("max_steps", o.max_steps, 1, optional=True)
    check_min("lr", o.lr, 0, strict=True)
    check_min("wd", o.wd, 0)
    need(0 <= o.beta1 < 1, f"--beta1 must be in [0, 1), got {o.beta1}")
    need(0 <= o.beta2 < 1, f"--beta2 must be in [0, 1), got {o.beta2}")
    check_min("eps", o.eps, 0, strict=True)
    check_min("warmup", o.warmup, 0)
    check_optimizer(o)
    check_optim_groups_and_schedule(o)
    need(
        o.grad_clip_norm is None or o.grad_clip_norm > 0,
        f"--grad-clip-norm must be > 0 (omit it for no clipping), got {o.grad_clip_norm}",
    )
    check_min("max_skipped_steps", o.max_skipped_steps, 1)


def check_global_batch(o: OptimSettings) -> None:
    """What --global-batch-size allows before the world size is known: some W must divide N with this m (and
    this k, when --accum-freq is given too). The world size itself is checked at start (geometry.derive)."""
    n = o.global_batch_size
    if n is None:
        return
    check_min("global_batch_size", n, 1)
    if n % o.batch_size:
        raise SettingsError(divisibility_message(n, None, o.batch_size))
    if o.accum_freq is not None and n % (o.accum_freq * o.batch_size):
        raise SettingsError(
            f"--accum-freq {o.accum_freq} disagrees with --global-batch-size {n}: k*m = {o.accum_freq}*"
            f"{o.batch_size} does not divide N on any world size; drop --accum-freq, k follows from N"
        )


def check_ema(e: EmaSettings) -> None:
    """--ema-decay in (0, 1); the other EMA flags only with it."""
    if e.ema_decay is None:
        changed = [
            flag_named(name).option
            for name, default in (("ema_update_every", 1), ("ema_warmup", False), ("ema_warmup_gamma", 1.0),
                                  ("ema_warmup_power", 2 / 3))
            if getattr(e, name) != default
        ]  # fmt: skip
        need(
            not changed, f"{', '.join(changed)} set without --ema-decay: add --ema-decay DECAY (e.g. 0.9999)"
        )
        return
    need(
        0 < e.ema_decay < 1,
        f"--ema-decay must be in (0, 1) (the weight the average keeps per update, e.g. 0.9999), got {e.ema_decay}",
    )
    check_min("ema_update_every", e.ema_update_every, 1)
    check_min("ema_warmup_gamma", e.ema_warmup_gamma, 0, strict=True)
    check_min("ema_warmup_power", e.ema_warmup_power, 0, strict=True)


def check_loss(loss: LossSettings) -> None:
    check_choice("loss_impl", loss.loss_impl)
    check_min("loss_tile_size", loss.loss_tile_size, 1)
    check_min("coca_contrastive_loss_weight", loss.coca_contrastive_loss_weight, 0)
    check_min("coca_caption_loss_weight", loss.coca_caption_loss_weight, 0)
    need(
        not loss.local_loss or loss.gather_with_grad,
        "--local-loss without --gather-with-grad does not give the full-batch gradient (each rank would "
        "drop the other ranks' terms): add --gather-with-grad",
    )


def check_siglip2(s) -> None:
    """--siglip2: every term of the objective trains, or the run is refused naming the flag that would drop one."""
    loss = s.loss
    if not loss.siglip2:
        changed = [
            f.name for f in dataclasses.fields(loss)
            if f.name.startswith("siglip2_") and getattr(loss, f.name) != f.default
        ]  # fmt: skip
        need(
            not changed,
            f"{', '.join(flag_named(n).option for n in changed)} set without --siglip2: add --siglip2",
        )
        return
    need(
        0 <= loss.siglip2_selfsup_start < 1,
        "--siglip2-selfsup-start must be in [0, 1) (the fraction of the run's steps after which self-distillation "
        f"and masked prediction train); {loss.siglip2_selfsup_start} would drop them",
    )
    for name in ("siglip2_locca_weight", "siglip2_silc_weight", "siglip2_tips_weight"):
        value = getattr(loss, name)
        need(
            value is None or value > 0,
            f"{flag_named(name).option} must be above 0 under --siglip2 (0 drops that term of SigLIP 2's objective; "
            f"train without --siglip2 for the sigmoid loss alone), got {value}",
        )
    check_min("siglip2_local_views", loss.siglip2_local_views, 1)
    check_min("siglip2_prototypes", loss.siglip2_prototypes, 1)
    check_min("siglip2_patch_prototypes", loss.siglip2_patch_prototypes, 1)
    check_min("siglip2_decoder_layers", loss.siglip2_decoder_layers, 1, optional=True)
    for name in ("siglip2_parallel_fraction",):
        value = getattr(loss, name)
        need(0 <= value <= 1, f"{flag_named(name).option} must be in [0, 1], got {value}")
    need(
        0 < loss.siglip2_mask_ratio < 1,
        f"--siglip2-mask-ratio must be in (0, 1) (0 drops masked prediction), got {loss.siglip2_mask_ratio}",
    )
    need(
        0 < loss.siglip2_teacher_momentum < 1,
        f"--siglip2-teacher-momentum must be in (0, 1), got {loss.siglip2_teacher_momentum}",
    )
    check_min("siglip2_teacher_temp", loss.siglip2_teacher_temp, 0, strict=True)
    check_min("siglip2_student_temp", loss.siglip2_student_temp, 0, strict=True)
    m = s.model
    for flag, on in (
        ("--lock-image", m.lock_image),
        ("--distill-model", m.distill_model is not None),
    ):
        need(
            not on,
            f"--siglip2 with {flag}: "
            + (
                "the image tower is the student of self-distillation and masked prediction and the decoder's "
                "encoder; a locked one drops those terms"
                if flag == "--lock-image"
                else "SigLIP 2's teacher is the EMA of the image tower; a second, external teacher is not part "
                "of its objective"
            ),
        )


def check_dist(dist: DistSettings) -> None:
    """The flags alone; whether DeepSpeed allows them (stage, optimizer wrapper, preset) is decided with the
    preset, in ds_clip.ds_config."""
    need(
        dist.precision in PRECISIONS,
        f"--precision must be one of {', '.join(PRECISION_NAMES)}, got {dist.precision!r}",
    )
    check_choice("coalesce_grad_reduction", dist.coalesce_grad_reduction)
    need(
        dist.zero_stage is None or dist.zero_stage in (0, 1, 2, 3),
        f"--zero-stage must be 0, 1, 2 or 3, got {dist.zero_stage}",
    )
    check_min("dist_timeout", dist.dist_timeout, 0, strict=True)


def check_outputs(lg: LoggingSettings, ck: CheckpointSettings) -> None:
    """What the run writes and when: the logging and checkpoint cadences, the metric sinks, the run name."""
    check_min("log_every_n_steps", lg.log_every_n_steps, 1)
    check_min("save_every_n_steps", ck.save_every_n_steps, 1, optional=True)
    check_min("keep_checkpoints", ck.keep_checkpoints, 1, optional=True)
    check_min("save_frequency", ck.save_frequency, 0, optional=True)
    need(
        not ck.delete_previous_checkpoint or ck.keep_checkpoints in (None, 1),
        f"--delete-previous-checkpoint keeps 1 checkpoint but --keep-checkpoints says {ck.keep_checkpoints}: "
        "drop one of them",
    )
    bad = [r for r in lg.report_to if r not in REPORTERS]
    need(not bad, f"--report-to: unknown {', '.join(bad)}; choose from {', '.join(REPORTERS)}")
    need(
        "wandb" not in lg.report_to or importlib.util.find_spec("wandb") is not None,
        "--report-to wandb needs the wandb package (pip install wandb)",
    )
    check_remote(ck)
    if lg.name is not None:
        need(
            lg.name not in ("", ".", "..") and "/" not in lg.name,
            f"--name {lg.name!r} must be a folder name, not a path",
        )


def check_remote(ck: CheckpointSettings) -> None:
    """--remote-sync: a URL of the chosen protocol whose fsspec file system is installed (reachability is
    checked when the run starts)."""
    if ck.remote_sync is None:
        return
    check_choice("remote_sync_protocol", ck.remote_sync_protocol)
    check_min("remote_sync_frequency", ck.remote_sync_frequency, 1)
    check_min("remote_sync_final_timeout", ck.remote_sync_final_timeout, 1)
    url = ck.remote_sync
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    need(
        ck.remote_sync_protocol != "s3" or scheme in ("s3", "s3a"),
        f"--remote-sync {url}: --remote-sync-protocol s3 needs an s3:// URL; for other storage pass "
        "--remote-sync-protocol fsspec",
    )
    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        raise SettingsError(
            f"--remote-sync {url}: no fsspec file system for {scheme}:// here ({str(exc).splitlines()[0][:160]}); "
            "pip install 'ds_clip[remote]' (s3fs) or the fsspec package of that storage (gcsfs for gs://)"
        ) from None


def check_optimizer(o: OptimSettings) -> None:
    """--opt names an optimizer DeepSpeed builds from its JSON; --momentum only where it has one. (What the
    accelerator and the preset's offload allow is decided with the preset: ds_clip.ds_config.)"""
    if o.optimizer.startswith("timm/"):
        raise SettingsError(
            f"--opt {o.optimizer}: ds_clip has DeepSpeed build the optimizer from its JSON (so ZeRO partitions it and "
            f"offload runs it on the CPU), and timm's optimizers are not among them: use --opt "
            f"{', '.join(OPTIMIZERS)}"
        )
    need(o.optimizer in OPTIMIZERS, f"--opt must be one of {', '.join(OPTIMIZERS)}, got {o.optimizer!r}")
    if o.momentum is not None:
        need(
            o.optimizer in ("sgd", "muon"),
            f"--momentum applies to --opt sgd and muon; {o.optimizer} has no momentum term (its moments: "
            "--beta1/--beta2)",
        )
        need(0 <= o.momentum < 1, f"--momentum must be in [0, 1), got {o.momentum}")
    need(
        not o.skip_scheduler or o.lr_scheduler == "cosine",
        f"--skip-scheduler trains at the peak LR throughout, so --lr-scheduler {o.lr_scheduler} would be "
        "ignored: drop one of them",
    )


def check_optim_groups_and_schedule(o: OptimSettings) -> None:
    """Per-tower LR / weight decay / layer decay, and the LR schedule's flags."""
    for name in ("visual_lr", "text_lr", "visual_wd", "text_wd"):
        check_min(name, getattr(o, name), 0, optional=True)
    for name in ("visual_ld", "text_ld"):
        value = getattr(o, name)
        need(0 < value <= 1, f"{flag_named(name).option} must be in (0, 1] (1: no layer decay), got {value}")
    check_choice("lr_scheduler", o.lr_scheduler)
    if o.lr_scheduler == "const-cooldown":
        need(o.epochs_cooldown is not None, "--lr-scheduler const-cooldown needs --epochs-cooldown (epochs)")
        check_min("epochs_cooldown", o.epochs_cooldown, 1)
        need(
            o.max_steps is not None or o.epochs_cooldown <= (o.epochs or 1),
            f"--epochs-cooldown {o.epochs_cooldown} is longer than the run (--epochs {o.epochs or 1})",
        )
        check_min("lr_cooldown_power", o.lr_cooldown_power, 0, strict=True)
        need(
            0 <= o.lr_cooldown_end <= o.lr,
            f"--lr-cooldown-end must be in [0, --lr {o.lr:g}], got {o.lr_cooldown_end}",
        )
        return
    for name, default in (("epochs_cooldown", None), ("lr_cooldown_power", 1.0), ("lr_cooldown_end", 0.0)):
        need(
            getattr(o, name) == default,
            f"{flag_named(name).option} applies to --lr-scheduler const-cooldown only (got "
            f"--lr-scheduler {o.lr_scheduler})",
        )
