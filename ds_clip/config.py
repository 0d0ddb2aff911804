"""Typed training settings, the one source of every flag: sections of fields -> CLI, --help, docs, checks.

    python -m ds_clip.train --help                    # every flag, by section, with units and defaults
    python scripts/gen_configuration_doc.py           # rewrites docs/configuration.md from these fields

Each field of a section below is one flag: its type, default and docstring make the flag, its --help line
and its row in docs/configuration.md; small metadata (`opt(...)`) adds what the field cannot say (another
flag name, choices, a unit, how the flag relates to open_clip's). `ds-clip-eval` builds its shared flags
(`--val-data`, `--batch-size`, ...) from the same fields (`add_flags`).

Precedence: command-line flag > DeepSpeed preset (`--ds-config`) > the defaults below. Engine settings
(ZeRO, offload, communication) live only in the preset; batch sizes, accumulation, optimizer and
precision come from flags, and `ds_clip.ds_config.resolve_ds_config` refuses a preset that disagrees.

Validation (`validate`) is one pass, cheap, and imports neither deepspeed nor torch.distributed, so a bad
flag fails in a second, before any process group starts. `open_clip` is imported only to check an unknown
`--model` name or the keys of `--aug-cfg`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib.util
import inspect
import re
import textwrap
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ds_clip.ds_config import check_preset
from ds_clip.presets import (
    DEEPSPEED_PRECISIONS,
    OPTIMIZERS,
    PRECISION_NAMES,
    SettingsError,
    deepspeed_precision,
    preset_precision,
)
from ds_clip.urls import ShardPatternError, expand_shards

BUILTIN_MODELS = ("ds-clip-tiny", "ds-clip-tiny-siglip")
PRECISIONS = DEEPSPEED_PRECISIONS  # what a parsed --precision holds (open_clip's names are mapped onto these)
LOSS_IMPLS = ("auto", "dense", "tiled")
DATASET_TYPES = ("synthetic", "webdataset", "csv")
DATASET_TYPE_CHOICES = (*DATASET_TYPES, "auto")
IMAGE_RESIZE_MODES = ("shortest", "longest", "squash")
IMAGE_INTERPOLATIONS = ("bicubic", "bilinear", "random")
REPORTERS = ("tensorboard", "csv", "wandb")
LR_SCHEDULERS = ("cosine", "const", "const-cooldown")
LOCAL_DIR_PREFIX = "local-dir:"
# A synthetic run without --train-num-samples trains this many pairs per epoch.
DEFAULT_SYNTHETIC_SAMPLES = 25_600

__all__ = [
    "BUILTIN_MODELS",
    "CheckpointSettings",
    "DataSettings",
    "DistSettings",
    "EvalSectionSettings",
    "Flag",
    "LoggingSettings",
    "LossSettings",
    "ModelSettings",
    "OptimSettings",
    "SettingsError",
    "TrainSettings",
    "add_flags",
    "build_parser",
    "check_data",
    "check_eval",
    "check_model_flags",
    "aug_cfg_dict",
    "default_run_name",
    "flags",
    "parse_settings",
    "settings_to_dict",
    "validate",
]


def opt(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    unit: str = "",
    open_clip: str = "same",
    default_text: str | None = None,
    derived: bool = False,
    hidden: bool = False,
    nargs: str | None = None,
) -> Any:
    """A settings field and what its flag needs beyond type, default and docstring.

    flag: the option when it is not "--" + the field name with "-" for "_"; aliases: more spellings.
    unit: what the number counts (steps, pairs, seconds...), shown in --help and the docs.
    open_clip: "same" (open_clip_train's flag, same meaning and default), "differs: <how>", or
    "ds_clip only". default_text: how --help shows a default that is not a plain value.
    derived: the command line leaves it None and `parse_settings` derives it (--dataset-type, --precision).
    hidden: a flag users do not set (the launcher's --local_rank): no --help line.
    nargs: a list flag that takes several words as open_clip's does ("+", "*": `--image-mean 0.5 0.5 0.5`),
    each converted to the list's item type; without it a list flag takes one comma-separated word.
    """
    meta = dict(
        flag=flag, aliases=aliases, choices=choices, metavar=metavar, unit=unit, open_clip=open_clip,
        default_text=default_text, derived=derived, hidden=hidden, nargs=nargs,
    )  # fmt: skip
    return field(default=default, default_factory=default_factory, metadata=meta)


# ------------------------------------------------------------------------------------------------ sections


@dataclass
class ModelSettings:
    """model: which open_clip model is trained, from which weights."""

    model: str = opt(
        "ds-clip-tiny", metavar="NAME", open_clip="differs: adds the built-in tiny models; default RN50 there"
    )
    """"ds-clip-tiny", "ds-clip-tiny-siglip" (built in, no download), an open_clip model name, or
    "local-dir:PATH" (a folder holding open_clip_config.json and, optionally, weights)."""
    pretrained: str | None = opt(
        None, metavar="PATH", open_clip="differs: local files and folders only; open_clip also downloads tags"
    )
    """Local weights file or folder (an export) for a named model. URLs and hub tags are refused (no
    downloads); not with local-dir: (put the weights in that folder)."""
    grad_checkpointing: bool = opt(False)
    """Recompute tower activations in backward (open_clip's set_grad_checkpointing): less memory, more
    compute."""
    torchcompile: bool = opt(
        False,
        open_clip="differs: through DeepSpeed's engine.compile, random ops as in eager mode, not on ZeRO-3",
    )
    """torch.compile the model (DeepSpeed's engine.compile, inductor). Dropout and patch dropout draw the
    numbers eager mode draws, so a compiled run trains as the uncompiled one does (to float rounding). The
    first steps compile (minutes on a CPU); ZeRO 0-2."""
    lock_image: bool = opt(False)
    """Lock the image tower (LiT): its parameters get no gradient, no optimizer state and never change
    (open_clip's lock_image_tower). Fully locked, it is not recomputed in the cached step."""
    lock_image_unlocked_groups: int = opt(0, metavar="N", unit="layer groups")
    """With --lock-image: leave the last N layer groups of the image tower trainable (open_clip's groups:
    for a ViT the stem, each block, the last block with ln_post, the projection)."""
    lock_image_freeze_bn_stats: bool = opt(False)
    """With --lock-image: freeze BatchNorm running statistics of the locked layers (ResNet/timm towers)."""
    lock_text: bool = opt(False)
    """Lock the text tower: its parameters get no gradient, no optimizer state and never change (open_clip's
    lock_text_tower). Fully locked, it is not recomputed in the cached step."""
    lock_text_unlocked_layers: int = opt(0, metavar="N", unit="layer groups")
    """With --lock-text: leave the last N layer groups of the text tower trainable (open_clip's groups: the
    embeddings, each block, the last block with ln_final, the projection)."""
    lock_text_freeze_layer_norm: bool = opt(
        False,
        open_clip="differs: open_clip stops with an AssertionError without it for its own text towers; "
        "ds_clip exits 2 naming the flag",
    )
    """With --lock-text: keep LayerNorm of the locked layers frozen too. open_clip's own text towers always
    freeze it and need this flag; Hugging Face text towers leave LayerNorm trainable without it."""
    force_patch_dropout: float | None = opt(None, metavar="P", unit="fraction of patches")
    """Set the image tower's patch dropout (FLIP) to P in [0, 1), e.g. 0 to fine-tune without it;
    none: the model config's."""
    force_image_size: list[int] | None = opt(None, metavar="PX", unit="pixels", nargs="+")
    """Image side (or height width) of the model and of its transforms (synthetic data renders at it);
    none: the model config's."""
    image_mean: list[float] | None = opt(None, metavar="MEAN", nargs="+")
    """Per-channel mean the transforms normalise with (1 or 3 values); none: the model's."""
    image_std: list[float] | None = opt(None, metavar="STD", nargs="+")
    """Per-channel standard deviation the transforms normalise with (1 or 3 values, > 0); none: the
    model's."""
    image_interpolation: str | None = opt(None, choices=IMAGE_INTERPOLATIONS)
    """Resize interpolation of the transforms ("random": a random one per training image); none: the
    model's."""
    image_resize_mode: str | None = opt(None, choices=IMAGE_RESIZE_MODES)
    """Resize (and crop) mode of the evaluation transforms: "shortest" side to the image size then centre
    crop, "longest" side then pad, "squash" (no crop); none: the model's. Training crops are unchanged."""
    use_bn_sync: bool = opt(False, open_clip="differs: refused on the CPU (torch's SyncBatchNorm needs GPUs)")
    """BatchNorm towers (open_clip's ResNets): normalise with the statistics of the micro-batch on all ranks
    (torch's SyncBatchNorm, m x W samples) instead of each rank's m. GPUs only: SyncBatchNorm refuses CPU
    tensors."""
    force_quick_gelu: bool = opt(False)
    """Build the model with QuickGELU activations (as OpenAI's weights were trained)."""
    force_custom_text: bool = opt(False)
    """Build the model as open_clip's CustomTextCLIP (the text tower in its own "text" module)."""
    force_context_length: int | None = opt(None, metavar="TOKENS", unit="tokens")
    """Text context length of the model and its tokenizer; none: the model config's."""
    aug_cfg: list[str] = opt(
        default_factory=list, metavar="KEY=VALUE", nargs="*", open_clip="same (stored as its KEY=VALUE words)"
    )
    """Training augmentation as open_clip's AugmentationCfg, e.g. scale='(0.5,1.0)' use_timm=True
    color_jitter=0.4 (values read as Python literals, else strings). Seeded per (seed, epoch, sample)."""
    distill_model: str | None = opt(
        None,
        metavar="NAME",
        open_clip="differs: works with --accum-freq > 1 (open_clip asserts k = 1); --distill-pretrained "
        "optional for local-dir:",
    )
    """Distil from this frozen teacher (any name --model accepts, local-dir: included): the loss becomes
    open_clip's DistillClipLoss over all N pairs. The teacher must read the student's images and tokens
    (same image size, mean/std, tokenizer) and hold trained weights; it runs in eval mode, in the run's
    precision, outside the optimizer and the checkpoints."""
    distill_pretrained: str | None = opt(
        None, metavar="PATH", open_clip="differs: local files and folders only; open_clip also downloads tags"
    )
    """Local weights file or folder of the --distill-model teacher (as --pretrained); needed for a named
    teacher, not with local-dir: (its folder holds the weights)."""


@dataclass
class DataSettings:
    """data: the training pairs (ds_clip.data.build_train_data reads this section as it is)."""

    train_data: str | None = opt(None, metavar="PATTERN", open_clip="differs: globs are expanded too")
    """Webdataset shards: brace patterns ("shards/{00000..00127}.tar"), globs, local paths or file:PATH,
    pipe: commands and URLs, several sources joined by "::". Local sources must exist. With
    --dataset-type csv: one CSV/TSV file of image paths and captions."""
    train_data_upsampling_factors: str | None = opt(
        None,
        metavar="F::F...",
        open_clip="differs: a factor of 0 is refused (open_clip never draws that source)",
    )
    """One weight per "::"-joined --train-data source (e.g. 1::2::0.5), with --dataset-resampled: each shard
    of source i is drawn with weight F_i (so a source's share also grows with its shard count)."""
    dataset_type: str = opt(
        "synthetic",
        choices=DATASET_TYPE_CHOICES,
        derived=True,
        default_text="auto: synthetic without --train-data; with it csv for a .csv/.tsv file, else webdataset",
        open_clip="differs: auto also picks synthetic without --train-data; synthetic renders ds_clip's "
        "captioned shapes",
    )
    """"synthetic" (rendered pairs, no files), "webdataset" (tar shards), "csv" (a CSV/TSV file of image
    paths and captions, open_clip's CsvDataset columns) or "auto" (as the default)."""
    train_num_samples: int | None = opt(
        None,
        metavar="N",
        unit="pairs",
        default_text=f"{DEFAULT_SYNTHETIC_SAMPLES} for synthetic data, the shards' size for webdataset",
    )
    """Training pairs per epoch. Needed for resampled webdataset and shards without a size file; in
    exact-epoch webdataset mode an optional cap."""
    dataset_resampled: bool = opt(False)
    """Draw shards with replacement (seeded per epoch and rank); an epoch is then --train-num-samples
    pairs. Without it every sample is seen exactly once per epoch."""
    image_key: str = opt("jpg;jpeg;png;webp", metavar="KEYS", open_clip="ds_clip only")
    """Webdataset member extensions tried in order for the image, ";"-separated."""
    caption_key: str = opt("txt", metavar="KEYS", open_clip="ds_clip only")
    """Webdataset member extensions tried in order for the caption, ";"-separated."""
    workers: int = opt(1, metavar="N", unit="processes", open_clip="differs: default 4 there")
    """Data-loader worker processes per rank (0: load in the training process)."""
    seed: int = opt(0, metavar="N")
    """Random seed of the run: model initialisation, each micro-batch's RNG, the synthetic pairs, the
    shard order, the sample shuffle and each sample's augmentation. Each rank derives its own."""
    synthetic_image_size: int | None = opt(
        None, metavar="PX", unit="pixels", default_text="the model's image size", open_clip="ds_clip only"
    )
    """Side at which synthetic images are rendered (the model's preprocess then resizes); 64 when the
    data is built without a model."""
    shuffle_buffer: int = opt(1000, metavar="N", unit="samples", open_clip="ds_clip only")
    """Undecoded webdataset samples each worker shuffles over; 0 or 1: no sample shuffle."""
    csv_separator: str = opt(
        "\t",
        metavar="CHAR",
        default_text="tab",
        open_clip="differs: one character (pandas also takes a regex)",
    )
    """Column separator of the --dataset-type csv file: one character ("," for CSV), or \\t for a tab."""
    csv_img_key: str = opt("filepath", metavar="COLUMN", open_clip="same")
    """Column of the --dataset-type csv file that holds the image paths (relative ones are relative to the
    working directory of the training processes, as in open_clip)."""
    csv_caption_key: str = opt("title", metavar="COLUMN", open_clip="same")
    """Column of the --dataset-type csv file that holds the captions."""


@dataclass
class OptimSettings:
    """optim: batch sizes, length of the run, AdamW (run by DeepSpeed), per-tower LRs and the LR schedule."""

    batch_size: int = opt(8, metavar="M", unit="pairs", open_clip="differs: default 64 there")
    """Pairs per rank per forward pass: the micro-batch m."""
    accum_freq: int = opt(1, metavar="K", unit="micro-batches")
    """k: micro-batches per optimizer step; the loss sees all N = k*m*W pairs at once (exact cached
    features), so one step moves the model as one process would on the whole N-pair batch."""
    epochs: int = opt(1, metavar="N", unit="epochs", open_clip="differs: default 32 there")
    """Passes over the training data; --max-steps, when set, stops earlier."""
    max_steps: int | None = opt(None, metavar="STEPS", unit="steps", open_clip="ds_clip only")
    """Stop after this many optimizer steps; none: run all epochs."""
    lr: float = opt(5e-4, metavar="LR", open_clip="differs: default from the model there (5e-4 for ViTs)")
    """Peak learning rate, reached after warmup, then --lr-scheduler (cosine decay to 0 by default); the
    image and text towers' default (--visual-lr, --text-lr)."""
    wd: float = opt(0.2, metavar="WD")
    """AdamW weight decay (decoupled; not applied to gains, biases and logit_scale)."""
    warmup: int = opt(0, metavar="STEPS", unit="steps", open_clip="differs: default 10000 there")
    """Linear learning-rate warmup; open_clip's 10000 suits long runs, 0 short ones."""
    lr_scheduler: str = opt("cosine", choices=LR_SCHEDULERS)
    """After warmup: "cosine" (decay to 0 at the last step), "const" (stay at the peak) or "const-cooldown"
    (the peak, then from --epochs-cooldown before the end a decay to --lr-cooldown-end). Every parameter
    group is scaled from its own peak."""
    epochs_cooldown: int | None = opt(None, metavar="N", unit="epochs")
    """const-cooldown: length of the cooldown, converted to optimizer steps (N x steps per epoch); it
    starts that many steps before the last step."""
    lr_cooldown_power: float = opt(1.0, metavar="P")
    """const-cooldown: power of the polynomial cooldown (1: linear)."""
    lr_cooldown_end: float = opt(0.0, metavar="LR")
    """const-cooldown: learning rate at the end of the cooldown (a group whose peak is not --lr ends at the
    same fraction of its own peak)."""
    visual_lr: float | None = opt(
        None, metavar="LR", default_text="--lr", open_clip="ds_clip only (EVA-CLIP's --visual-lr)"
    )
    """Peak learning rate of the image tower (visual.*); 0 keeps it where it is (AdamW moves nothing)."""
    text_lr: float | None = opt(
        None, metavar="LR", default_text="--lr", open_clip="ds_clip only (EVA-CLIP's --text-lr)"
    )
    """Peak learning rate of the text tower (transformer, token and positional embedding, ln_final,
    text_projection; text.* for HF and custom text towers)."""
    visual_wd: float | None = opt(
        None, metavar="WD", default_text="--wd", open_clip="ds_clip only (EVA-CLIP's --visual-wd)"
    )
    """Weight decay of the image tower (not applied to its gains, biases and norms)."""
    text_wd: float | None = opt(
        None, metavar="WD", default_text="--wd", open_clip="ds_clip only (EVA-CLIP's --text-wd)"
    )
    """Weight decay of the text tower (not applied to its gains, biases and norms)."""
    visual_ld: float = opt(1.0, metavar="LD", open_clip="ds_clip only (EVA-CLIP's --visual-ld)")
    """Layer-wise LR decay of the image tower (EVA-CLIP's rule): with L blocks, the embeddings are layer
    0, block i is layer i+1, the rest (final norm, projection) layer L+1; layer l trains at
    --visual-lr * LD^(L+1-l). 1: off."""
    text_ld: float = opt(1.0, metavar="LD", open_clip="ds_clip only (EVA-CLIP's --text-ld)")
    """Layer-wise LR decay of the text tower, as --visual-ld (token and positional embedding: layer 0;
    ln_final, text_projection: layer L+1). 1: off."""
    optimizer: str = opt(
        "adamw",
        flag="--opt",
        metavar="NAME",
        open_clip="differs: DeepSpeed's config-built adamw, lamb, lion, sgd (open_clip: adamw or timm/NAME)",
    )
    """Optimizer, built by DeepSpeed from its JSON (so ZeRO partitions it and offload presets run it on the
    CPU): "adamw" (torch AdamW; DeepSpeed's CPU Adam under offload), "lamb" (DeepSpeed's FusedLamb: CUDA
    only, no offload), "lion" (FusedLion on CUDA, DeepSpeed's CPU Lion under offload; on a CPU-only machine
    only with an offload preset), "sgd" (torch SGD, --momentum). Per-tower groups and the LR schedule apply
    to each."""
    momentum: float | None = opt(None, metavar="M", default_text="0 (--opt sgd only)")
    """Momentum of --opt sgd (the other optimizers have --beta1/--beta2 instead)."""
    skip_scheduler: bool = opt(False)
    """No LR schedule: every group trains at its peak LR from the first step (no warmup, no decay), as
    open_clip without a scheduler."""
    beta1: float = opt(0.9, metavar="B1", open_clip="differs: default from the model there (0.9 for ViTs)")
    """beta1 of AdamW, Lamb and Lion (first-moment decay)."""
    beta2: float = opt(0.98, metavar="B2", open_clip="differs: default from the model there (0.98 for ViTs)")
    """beta2 of AdamW, Lamb and Lion (second-moment decay)."""
    eps: float = opt(1e-6, metavar="EPS", open_clip="differs: default from the model there (1e-6 for ViTs)")
    """Epsilon of AdamW and Lamb."""
    grad_clip_norm: float | None = opt(None, metavar="NORM", unit="L2 norm")
    """Clip the global gradient L2 norm to this value (DeepSpeed gradient_clipping); none: no clipping."""
    max_skipped_steps: int = opt(10, metavar="N", unit="steps", open_clip="ds_clip only")
    """Stop with an error after this many consecutive optimizer steps whose loss or gradient was not
    finite (each one skipped on every rank); the last complete checkpoint is kept."""


@dataclass
class LossSettings:
    """loss: which contrastive loss, and how its logit matrix is computed across ranks."""

    local_loss: bool = opt(False)
    """Each rank computes the loss rows of its own pairs against all columns; needs --gather-with-grad
    for the full-batch gradient."""
    gather_with_grad: bool = opt(False)
    """All-gather features with a backward that reduces, so every rank gets the full-batch gradient."""
    siglip: bool = opt(False)
    """Sigmoid (SigLIP) loss instead of the softmax CLIP loss."""
    loss_impl: str = opt("auto", choices=LOSS_IMPLS, open_clip="ds_clip only")
    """"dense" (whole logit matrix in memory), "tiled" (blocks of it, O(tile*N) memory) or "auto": tiled
    from a global batch of 8192 pairs on, where it is also the faster one (docs/loss.md), dense below."""
    loss_tile_size: int = opt(4096, metavar="PAIRS", unit="pairs", open_clip="ds_clip only")
    """Rows and columns of one block of the logit matrix in the tiled loss: memory grows as tile x N."""
    coca_contrastive_loss_weight: float = opt(1.0, metavar="W")
    """CoCa models: weight of the contrastive (CLIP) loss over all N pairs."""
    coca_caption_loss_weight: float = opt(
        2.0,
        metavar="W",
        open_clip="differs: there the caption mean is over each rank's tokens, here over the global batch's",
    )
    """CoCa models: weight of the captioning cross-entropy, a mean over the non-pad tokens of the whole
    global batch (all ranks and micro-batches), so W x k x m trains like one process holding all N captions."""


@dataclass
class CheckpointSettings:
    """checkpoint: when to save, how many to keep, where to resume from."""

    save_every_n_steps: int | None = opt(
        None,
        metavar="STEPS",
        unit="steps",
        default_text="the end only",
        open_clip="differs: open_clip has --save-frequency, in epochs",
    )
    """Save a DeepSpeed checkpoint every this many optimizer steps (and always at the end); with
    --save-frequency, at the steps of either."""
    save_frequency: int | None = opt(
        None,
        metavar="EPOCHS",
        unit="epochs",
        default_text="the end only",
        open_clip="differs: default 1 there (every epoch); 0 = none here too",
    )
    """Save a checkpoint at the end of every this many epochs (0: no epoch saves), besides
    --save-every-n-steps and the end of the run."""
    save_most_recent: bool = opt(
        False, open_clip="differs: a DeepSpeed checkpoint folder, not epoch_latest.pt"
    )
    """Also save at the end of every epoch, keeping only the most recent such checkpoint (the ones
    --save-frequency / --save-every-n-steps save are kept)."""
    delete_previous_checkpoint: bool = opt(False)
    """Keep only the newest complete checkpoint: the previous one is deleted once a new one is complete
    (the same as --keep-checkpoints 1)."""
    keep_checkpoints: int | None = opt(
        None,
        metavar="N",
        unit="checkpoints",
        default_text="all",
        open_clip="ds_clip only (open_clip: --delete-previous-checkpoint)",
    )
    """Keep only the newest N complete checkpoints; older ones are deleted after a newer one is complete."""
    resume: str | None = opt(None, metavar="latest|DIR")
    """"latest" (the latest complete checkpoint of the run named by --name) or a checkpoint folder."""


@dataclass
class EvalSectionSettings:
    """eval: validation data and when to evaluate (ds_clip.evaluate.EvalSettings is built from it)."""

    val_data: str | None = opt(None, metavar="PATTERN", open_clip='differs: also "synthetic"')
    """Validation shards (same syntax as --train-data) or "synthetic" (held-out pairs of the built-in
    dataset)."""
    val_num_samples: int | None = opt(None, metavar="N", unit="pairs", default_text="all (512 for synthetic)")
    """Validation pairs evaluated."""
    val_every_n_steps: int | None = opt(
        None,
        metavar="STEPS",
        unit="steps",
        default_text="the end only",
        open_clip="differs: open_clip has --val-frequency, in epochs",
    )
    """Evaluate on --val-data every this many optimizer steps (and always at the end); with
    --val-frequency / --zeroshot-frequency, at the steps of any of them."""
    val_frequency: int | None = opt(
        None,
        metavar="EPOCHS",
        unit="epochs",
        default_text="the end only",
        open_clip="differs: default 1 there (every epoch)",
    )
    """Evaluate on --val-data at the end of every this many epochs (0: never mid-run), besides
    --val-every-n-steps and the end of the run."""
    zeroshot_frequency: int | None = opt(
        None,
        metavar="EPOCHS",
        unit="epochs",
        default_text="the end only",
        open_clip="differs: default 2 there",
    )
    """Zero-shot evaluation (--zeroshot-classes) at the end of every this many epochs (0: never
    mid-run), besides the end of the run; without zero-shot data it has nothing to do (as in open_clip)."""
    zeroshot_classes: str | None = opt(
        None, metavar="FILE", open_clip="ds_clip only (open_clip: --imagenet-val)"
    )
    imagenet_val: str | None = opt(
        None,
        metavar="DIR",
        open_clip="differs: also class folders named by index 0-999 (a subset of the classes)",
    )
    """Zero-shot top-1/top-5 on an ImageNet validation folder (torchvision ImageFolder layout) with open_clip's
    1000 ImageNet class names and its 80 OpenAI templates, each rank classifying its share of the images, at
    --zeroshot-frequency and at the end. Class folders: 1000 (sorted as ImageFolder sorts them: ImageNet's
    synset folders give ImageNet's class order), or folders named by class index 0-999 (ImageNetV2's layout;
    any subset of the classes, still classified among all 1000)."""
    imagenet_v2: str | None = opt(
        None, metavar="DIR", open_clip="differs: a local ImageNetV2 folder (class folders 0-999); no download"
    )
    """As --imagenet-val, on a local ImageNetV2 folder (e.g. imagenetv2-matched-frequency-format-val, class
    folders named 0-999)."""
    zeroshot_classes: str | None = opt(
        None, metavar="FILE", open_clip="ds_clip only (open_clip: --imagenet-val)"
    )
    """Zero-shot classification: a JSON file {"classnames": [...], "templates": [...]} (templates with
    "{c}", or "simple"/"openai" for open_clip's lists) or a text file, one class a line. Needs --val-data."""


@dataclass
class LoggingSettings:
    """logging: the run folder and what is logged to it."""

    # "--log-dir" because torchrun (torch >= 2.x) takes "--logs" for a prefix of its own "--logs-specs".
    logs: str = opt("./logs", metavar="DIR", aliases=("--log-dir",), open_clip="same; alias --log-dir")
    """Folder holding one sub-folder per run (settings, DeepSpeed JSON, metrics, checkpoints). Under
    torchrun write --log-dir (torchrun claims --logs as a prefix of its --logs-specs)."""
    name: str | None = opt(None, metavar="NAME", default_text="date-time, model, m, k")
    """Run folder name under --logs; default "YYYY_mm_dd-HH_MM_SS-model_<model>-m_<m>-k_<k>" (rank 0's)."""
    log_every_n_steps: int = opt(10, metavar="STEPS", unit="steps", open_clip="differs: default 100 there")
    """Log loss, learning rate and samples/s every this many optimizer steps."""
    report_to: list[str] = opt(
        default_factory=list,
        metavar="LIST",
        default_text="console only",
        open_clip="differs: a comma list of tensorboard, csv, wandb",
    )
    """Metric sinks besides the console, comma-separated: any of "tensorboard", "csv", "wandb"."""
    wandb_project_name: str = opt("ds_clip", metavar="NAME", open_clip="differs: default open-clip there")
    """Weights & Biases project of the run (--report-to wandb)."""
    wandb_notes: str = opt("", metavar="TEXT")
    """Weights & Biases notes of the run (--report-to wandb)."""
    log_local: bool = opt(False, open_clip="differs: console lines (ds_clip writes no out.log)")
    """Log on every node's first rank (local rank 0), each line prefixed with its rank; default: rank 0
    only."""
    debug: bool = opt(False, open_clip="differs: DEBUG level for ds_clip's own log lines")
    """Log ds_clip's debug lines too."""


@dataclass
class DistSettings:
    """dist: DeepSpeed (preset, ZeRO stage, precision) and the process group."""

    ds_config: str | None = opt(
        None,
        metavar="NAME|PATH",
        default_text="zero1_<precision>; zero0_<precision> on 1 rank",
        open_clip="ds_clip only",
    )
    """DeepSpeed preset name (ds_configs/<name>.json) or path to a JSON of engine settings. Left out: ZeRO-1 on
    several ranks; ZeRO-0 on one (nothing to partition), unless --zero-stage, --coalesce-grad-reduction on or
    fp16 asks for ZeRO (ds_config.default_preset; the start-up log says which and why)."""
    zero_stage: int | None = opt(
        None, metavar="{0,1,2,3}", default_text="the preset's", open_clip="ds_clip only"
    )
    """ZeRO stage 0-3, overriding the preset's zero_optimization.stage."""
    precision: str = opt(
        "fp32",
        choices=PRECISION_NAMES,
        derived=True,
        default_text="the preset's, else fp32",
        open_clip="differs: open_clip's names, each mapped onto a DeepSpeed precision; default amp there",
    )
    """DeepSpeed precision: "fp32", "bf16" (bf16 weights, fp32 master copy in the optimizer) or "fp16" (the
    same with dynamic loss scaling). open_clip's names map onto them: amp, fp16, pure_fp16 -> fp16;
    amp_bf16, amp_bfloat16, bf16, pure_bf16 -> bf16; fp32 -> fp32 (DeepSpeed's master copy is between
    open_clip's amp and pure modes)."""
    coalesce_grad_reduction: str = opt("off", choices=("auto", "on", "off"), open_clip="ds_clip only")
    """One gradient reduction per optimizer step on ZeRO 1-3 (DeepSpeed's engine.coalesce_grad_reduction()
    around the k backward passes): "on" (refused where DeepSpeed does not allow it: ZeRO-0, a BF16/FP16
    optimizer wrapper, a preset with managed_gradient_accumulation false), "auto" (on where allowed, else
    logged once and off), "off" (ZeRO-2/3 reduce after every micro-batch, keeping gradients partitioned)."""
    dist_timeout: float = opt(1800.0, metavar="SECONDS", unit="seconds", open_clip="ds_clip only")
    """How long a collective waits for the other ranks before this rank fails (a dead rank)."""
    dry_run: bool = opt(False, open_clip="ds_clip only")
    """Parse and check every flag, resolve the DeepSpeed JSON, print the settings and the JSON, exit: no
    process group, no model."""
    local_rank: int = opt(-1, flag="--local_rank", aliases=("--local-rank",), hidden=True)
    """Appended by the deepspeed launcher (--local_rank=N); not for users, unused otherwise."""


@dataclass
class TrainSettings:
    """Everything one training run needs: one section per concern, each field one flag.

    Sizes: m = `optim.batch_size` pairs per rank per micro-batch, k = `optim.accum_freq` micro-batches per
    optimizer step, W = world size; one optimizer step sees N = m * k * W pairs and moves the model as one
    process would on the whole N-pair batch (see shared/notes/gradient-contract.md).

    Field names are unique across sections (each is its flag's dest): `TrainSettings.of(batch_size=4)`
    and settings.json use them flat.
    """

    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    eval: EvalSectionSettings = field(default_factory=EvalSectionSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    dist: DistSettings = field(default_factory=DistSettings)

    @classmethod
    def section_types(cls) -> dict[str, type]:
        """Section name -> its dataclass, in order ("model": ModelSettings, ...)."""
        return dict(_SECTIONS)

    @classmethod
    def of(cls, **values: Any) -> TrainSettings:
        """Settings from flat field names (`of(batch_size=4, precision="bf16")`); the rest default."""
        sections: dict[str, dict[str, Any]] = {f.section: {} for f in flags()}
        by_name = {f.name: f for f in flags()}
        for name, value in values.items():
            if name not in by_name:
                raise TypeError(f"TrainSettings has no field {name!r}")
            sections[by_name[name].section][name] = value
        return cls(**{sec: _SECTIONS[sec](**kw) for sec, kw in sections.items()})


_SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(TrainSettings)[f.name] for f in dataclasses.fields(TrainSettings)
}


# ------------------------------------------------------------------------- open_clip flags ds_clip answers

# open_clip_train's flags that ds_clip has no field for: each is parsed (so argparse never says "unrecognized
# arguments") and answered with one line, exit 2: why ds_clip has no such thing and what to use instead.
# option -> (takes a value?, the answer). With the fields above this covers every option of open_clip_train
# 3.3.0's parser (tests/test_open_clip_flags.py walks that parser).
ANSWERED: dict[str, tuple[bool, str]] = {
    "--cache-dir": (
        True,
        "ds_clip downloads nothing (no model, tokenizer or weight downloads): pass local weights with "
        "--pretrained FILE|DIR or a model folder with --model local-dir:DIR",
    ),
    "--pretrained-image": (
        False,
        "ds_clip downloads no ImageNet weights for the image tower: load a whole model's weights with "
        "--pretrained FILE|DIR",
    ),
    "--torchscript": (
        False,
        "DeepSpeed trains the eager module, which torch.jit.script would replace: use --torchcompile (or "
        "script the exported model, ds-clip-export)",
    ),
    "--trace": (
        False,
        "torch.jit.trace is for inference and ds_clip trains: trace the exported model (ds-clip-export) instead",
    ),
    "--device": (
        True,
        "DeepSpeed picks the accelerator (CUDA when there is one, else the CPU; DS_ACCELERATOR=cpu forces the "
        "CPU) and the launcher the device of each rank: drop it",
    ),
    "--dist-url": (
        True,
        "the launcher sets the rendezvous (deepspeed, torchrun, mpirun or srun: MASTER_ADDR/MASTER_PORT): drop "
        "it; see scripts/launch_*.sh",
    ),
    "--dist-backend": (
        True,
        "DeepSpeed picks the backend from the accelerator (nccl on CUDA, gloo on the CPU): drop it",
    ),
    "--horovod": (
        False,
        "ds_clip runs on DeepSpeed, not Horovod: launch with deepspeed, torchrun, mpirun or srun "
        "(scripts/launch_*.sh)",
    ),
    "--ddp-static-graph": (
        False,
        "there is no DDP wrapper: DeepSpeed's engine reduces the gradients, once per optimizer step (see "
        "--coalesce-grad-reduction): drop it",
    ),
    "--no-set-device-rank": (
        False,
        "DeepSpeed sets each rank's device from LOCAL_RANK; with one GPU per process set CUDA_VISIBLE_DEVICES "
        "and launch with --num_gpus 1 per process: drop it",
    ),
    "--copy-codebase": (
        False,
        "ds_clip runs the installed package; the run folder keeps settings.json and ds_config.json to "
        "reproduce a run: drop it",
    ),
    "--remote-sync": (
        True,
        "ds_clip does not sync the run folder to remote storage: copy <logs>/<name>/checkpoints with your own "
        "tool (each complete checkpoint has a COMPLETE marker)",
    ),
    "--remote-sync-frequency": (True, "goes with --remote-sync, which ds_clip does not have: drop it"),
    "--remote-sync-protocol": (True, "goes with --remote-sync, which ds_clip does not have: drop it"),
    "--use-bnb-linear": (
        True,
        "bitsandbytes int8 linear layers are not trained by ds_clip (DeepSpeed's precisions: --precision "
        "fp32, bf16, fp16): drop it",
    ),
    "--loss-dist-impl": (
        True,
        "ds_clip's loss gathers once per step; choose its layout with --local-loss --gather-with-grad and "
        "--loss-impl dense|tiled|auto instead",
    ),
}


def answer(option: str) -> str:
    """The one line an answered open_clip flag gets (exit 2)."""
    return f"{option} is open_clip_train's flag: {ANSWERED[option][1]}"


class _Answered(argparse.Action):
    """Parses an answered open_clip flag (with or without its value) and stops with its answer."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise SettingsError(answer(self.option_strings[0]))


# ---------------------------------------------------------------------------------------- fields -> flags


@dataclass(frozen=True)
class Flag:
    """One flag, as the fields define it: what the parser, --help and docs/configuration.md show."""

    section: str
    name: str
    """The field name, also the argparse dest and the key in settings.json."""
    options: tuple[str, ...]
    """The option strings, the main one first."""
    type: Any
    default: Any
    doc: str
    meta: dict[str, Any]

    @property
    def option(self) -> str:
        return self.options[0]

    @property
    def is_switch(self) -> bool:
        return self.type is bool

    def shown_default(self) -> str:
        """The default as --help and the docs show it."""
        if self.meta["default_text"] is not None:
            return self.meta["default_text"]
        if self.is_switch:
            return "off"
        if self.default is None:
            return "none"
        if isinstance(self.default, list):
            return ",".join(self.default) or "none"
        return str(self.default)

    def type_text(self) -> str:
        """Type and unit, for the docs table."""
        if self.is_switch:
            return "switch"
        base = {int: "int", float: "float", str: "str"}.get(_base_type(self.type), "list")
        return f"{base}, {self.meta['unit']}" if self.meta["unit"] else base


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args and typing.get_origin(tp) is not list else tp


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of `cls` (a string right after the annotated assignment), one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


@functools.cache
def flags() -> tuple[Flag, ...]:
    """Every flag of ds-clip-train, in section order, built from the section dataclasses."""
    out: list[Flag] = []
    for section, cls in _SECTIONS.items():
        hints, docs = typing.get_type_hints(cls), _field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name not in docs:
                raise AssertionError(f"{cls.__name__}.{f.name} has no docstring (it is the flag's --help)")
            option = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            out.append(
                Flag(section, f.name, (option, *f.metadata["aliases"]), hints[f.name], default, docs[f.name],
                     dict(f.metadata))
            )  # fmt: skip
    names = [f.name for f in out]
    if len(names) != len(set(names)):
        raise AssertionError("field names must be unique across sections: each is a flag's dest")
    return tuple(out)


def flag_named(name: str) -> Flag:
    """The flag of field `name` (e.g. "batch_size")."""
    return next(f for f in flags() if f.name == name)


def _optional(kind: type):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _comma_list(text: str) -> list[str]:
    return [r.strip() for r in text.split(",") if r.strip()]


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Iterable[str],
    **overrides: dict[str, Any],
) -> None:
    """Add the flags of fields `names` to `parser`; `overrides[name]` changes add_argument keywords
    (ds-clip-eval: `batch_size={"default": 64}`, `val_data={"required": True}`)."""
    for name in names:
        f = flag_named(name)
        m = f.meta
        kw: dict[str, Any] = {"dest": f.name}
        if f.is_switch:
            kw["action"] = "store_true"
        else:
            base = _base_type(f.type)
            if m["nargs"]:  # several words, each of the list's item type (open_clip's nargs flags)
                kw["nargs"] = m["nargs"]
                kw["type"] = typing.get_args(base)[0]
            elif typing.get_origin(f.type) is list:
                kw["type"] = _comma_list
            elif base in (int, float):  # an optional number also takes "none"
                kw["type"] = _optional(base) if type(None) in typing.get_args(f.type) else base
            kw["default"] = (
                None if m["derived"] else (list(f.default) if isinstance(f.default, list) else f.default)
            )
            if m["choices"]:
                kw["choices"] = m["choices"]
            if m["metavar"]:
                kw["metavar"] = m["metavar"]
        kw.update(overrides.get(name, {}))
        shown = str(kw["default"]) if "default" in overrides.get(name, {}) else f.shown_default()
        kw["help"] = argparse.SUPPRESS if m["hidden"] else _help(f, None if kw.get("required") else shown)
        parser.add_argument(*f.options, **kw)


def _help(f: Flag, shown_default: str | None) -> str:
    """The --help line: the field's docstring, then its unit and default (none shown for a required flag)."""
    notes = [f"unit: {f.meta['unit']}"] if f.meta["unit"] else []
    notes += [] if f.is_switch or shown_default is None else [f"default: {shown_default}"]
    return (f.doc + (f" ({'; '.join(notes)})" if notes else "")).replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """The command line of `ds-clip-train` / `python -m ds_clip.train`: one flag per settings field."""
    p = argparse.ArgumentParser(
        prog="ds-clip-train",
        description="Train CLIP/SigLIP with DeepSpeed and exact cached-feature gradient accumulation: "
        "one optimizer step = accum-freq micro-batches of batch-size pairs on every rank. "
        "Steps are optimizer steps; pairs are image-text samples.",
    )
    for section, cls in _SECTIONS.items():
        group = p.add_argument_group(section, (cls.__doc__ or "").split(": ", 1)[-1])
        add_flags(group, [f.name for f in flags() if f.section == section])
    group = p.add_argument_group(
        "open_clip flags ds_clip answers",
        "open_clip_train's flags with no ds_clip counterpart: exit 2 saying why",
    )
    for option, (takes_value, why) in ANSWERED.items():
        group.add_argument(
            option, action=_Answered, nargs="?" if takes_value else 0, dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS, help=why.replace("%", "%%"),
        )  # fmt: skip
    return p


def parse_settings(argv: list[str] | None = None) -> TrainSettings:
    """Parse the command line (sys.argv[1:] when None), fill derived defaults, validate.

    Raises SettingsError for bad values; argparse itself exits 2 on malformed flags.
    """
    values: dict[str, Any] = vars(build_parser().parse_args(argv))
    if values["dataset_type"] in (None, "auto"):  # a .csv/.tsv file is csv, other data shards, none synthetic
        values["dataset_type"] = _derived_dataset_type(values["train_data"])
    if values["precision"] is None:
        # CLI > preset > default: a preset named for its precision (zero2_bf16) sets --precision.
        values["precision"] = preset_precision(values["ds_config"]) if values["ds_config"] else "fp32"
    values["precision"] = deepspeed_precision(values["precision"])  # open_clip's names -> DeepSpeed's
    if values["delete_previous_checkpoint"] and values["keep_checkpoints"] is None:
        values["keep_checkpoints"] = 1  # open_clip's flag for --keep-checkpoints 1
    s = TrainSettings.of(**values)
    if s.logging.name is None:
        # An automatic name is new every run, so "latest" would silently start from scratch.
        if s.checkpoint.resume == "latest":
            raise SettingsError("--resume latest needs --name of the run to continue")
        s.logging.name = default_run_name(s)
    validate(s)
    return s


def default_run_name(s: TrainSettings, now: datetime | None = None) -> str:
    """ "YYYY_mm_dd-HH_MM_SS-model_<model>-m_<m>-k_<k>", with characters unsafe in a folder name replaced."""
    stamp = (now or datetime.now()).strftime("%Y_%m_%d-%H_%M_%S")
    model = s.model.model
    if model.startswith(LOCAL_DIR_PREFIX):
        model = Path(model[len(LOCAL_DIR_PREFIX) :]).name or "local"
    name = f"{stamp}-model_{model}-m_{s.optim.batch_size}-k_{s.optim.accum_freq}"
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", name)


def settings_to_dict(s: TrainSettings) -> dict[str, Any]:
    """JSON-able copy of the settings for settings.json in the run folder: every field by its flat name
    (its flag's dest); `TrainSettings.of(**d)` reads it back."""
    return {f.name: _jsonable(getattr(getattr(s, f.section), f.name)) for f in flags()}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------------------------------- validation


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


def _check_choice(name: str, value: Any) -> None:
    f = flag_named(name)
    choices = f.meta["choices"]
    _need(value in choices, f"{f.option} must be one of {', '.join(choices)}, got {value!r}")


def _check_min(name: str, value: Any, low: float, *, strict: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    option = flag_named(name).option
    if strict:
        _need(value is not None and value > low, f"{option} must be > {low:g}, got {value}")
    else:
        _need(value is not None and value >= low, f"{option} must be >= {low:g}, got {value}")


def _check_shards(flag: str, pattern: str) -> None:
    # The webdataset reader expands the same way (one expander): what passes here is what it reads.
    try:
        expand_shards(pattern, flag)
    except ShardPatternError as exc:
        raise SettingsError(str(exc)) from None


def _derived_dataset_type(train_data: str | None) -> str:
    """--dataset-type when not given: synthetic without --train-data, csv for a .csv/.tsv file (open_clip's
    "auto" looks at the same extension), else webdataset."""
    if not train_data:
        return "synthetic"
    return "csv" if train_data.rsplit(".", 1)[-1].lower() in ("csv", "tsv") else "webdataset"


def _check_upsampling_factors(d: DataSettings) -> None:
    # open_clip_train.data: an assert for "needs --dataset-resampled", one for the count, float() for each.
    flag, text = "--train-data-upsampling-factors", d.train_data_upsampling_factors
    _need(
        d.dataset_type == "webdataset",
        f"{flag} weights the '::'-joined sources of webdataset shards; --dataset-type is {d.dataset_type}",
    )
    _need(
        d.dataset_resampled,
        f"{flag} needs --dataset-resampled (as in open_clip, the factors weight drawing with replacement)",
    )
    words = (text or "").split("::")
    sources = (d.train_data or "").split("::")
    _need(
        len(words) == len(sources),
        f"{flag} {text!r} has {len(words)} factors but --train-data has {len(sources)} '::'-joined sources",
    )
    for word in words:
        try:
            value = float(word)
        except ValueError:
            raise SettingsError(f"{flag} {text!r}: {word!r} is not a number") from None
        _need(
            0 < value < float("inf"), f"{flag} {text!r}: each factor must be a positive number, got {word!r}"
        )


def _check_csv(d: DataSettings) -> None:
    _need(bool(d.train_data), "--dataset-type csv needs --train-data (a CSV/TSV file)")
    path = Path(d.train_data or "").expanduser()
    _need(path.is_file(), f"--train-data {d.train_data!r}: no such CSV/TSV file (--dataset-type csv)")
    _need(
        not d.dataset_resampled,
        "--dataset-resampled draws webdataset shards; with --dataset-type csv every row is trained once an epoch",
    )
    _need(
        len(d.csv_separator) == 1 or d.csv_separator == "\\t",
        f"--csv-separator must be one character (or \\t for a tab), got {d.csv_separator!r}",
    )
    for flag, value in (("--csv-img-key", d.csv_img_key), ("--csv-caption-key", d.csv_caption_key)):
        _need(bool(value), f"{flag} must name a column of the --train-data file")


def check_data(d: DataSettings) -> None:
    """The rules of the data section alone (also run by ds_clip.data.build_train_data on what it gets)."""
    _need(
        d.dataset_type in DATASET_TYPES,  # "auto" is derived by parse_settings
        f"--dataset-type must be one of {', '.join(DATASET_TYPES)}, got {d.dataset_type!r}",
    )
    _check_min("workers", d.workers, 0)
    _check_min("train_num_samples", d.train_num_samples, 1, optional=True)
    _check_min("synthetic_image_size", d.synthetic_image_size, 8, optional=True)
    _check_min("shuffle_buffer", d.shuffle_buffer, 0)
    for flag, value in (("--image-key", d.image_key), ("--caption-key", d.caption_key)):
        _need(bool([k for k in value.split(";") if k.strip()]), f"{flag} must name at least one extension, got {value!r}")  # fmt: skip
    if d.train_data_upsampling_factors is not None:
        _check_upsampling_factors(d)
    if d.dataset_type == "webdataset":
        _need(bool(d.train_data), "--dataset-type webdataset needs --train-data (a shard pattern)")
        _need(
            not d.dataset_resampled or d.train_num_samples is not None,
            "--dataset-resampled needs --train-num-samples (it defines an epoch)",
        )
    elif d.dataset_type == "csv":
        _check_csv(d)
    elif d.train_data:
        raise SettingsError("--train-data is given but --dataset-type is synthetic: drop one of them")


def check_eval(ev: EvalSectionSettings, *, batch_size: int) -> None:
    """The rules of the eval section and of the evaluation's batch size (also run by ds-clip-eval)."""
    _check_min("batch_size", batch_size, 1)
    _check_min("val_num_samples", ev.val_num_samples, 1, optional=True)
    _check_min("val_every_n_steps", ev.val_every_n_steps, 1, optional=True)
    _check_min("val_frequency", ev.val_frequency, 0, optional=True)
    _check_min("zeroshot_frequency", ev.zeroshot_frequency, 0, optional=True)
    if ev.val_data and ev.val_data != "synthetic":
        _check_shards("--val-data", ev.val_data)
    for flag, folder in (("--imagenet-val", ev.imagenet_val), ("--imagenet-v2", ev.imagenet_v2)):
        if folder is not None:
            imagenet_class_folders(folder, flag)
    if ev.zeroshot_classes is not None:
        _need(bool(ev.val_data), "--zeroshot-classes needs --val-data (the images to classify)")
        _need(
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
    _need(root.is_dir(), f"{flag} {folder!r}: no such folder")
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    if names and all(n.isdigit() and int(n) < IMAGENET_CLASSES for n in names):
        return {n: int(n) for n in names}
    _need(
        len(names) == IMAGENET_CLASSES,
        f"{flag} {folder}: expected {IMAGENET_CLASSES} class folders (ImageNet's synsets, in ImageFolder order) or "
        f"folders named by class index 0-{IMAGENET_CLASSES - 1}; found {len(names)} folders",
    )
    return {n: i for i, n in enumerate(names)}


def validate(s: TrainSettings) -> None:
    """Raise SettingsError naming the flag for the first bad value in `s`, the preset included. Fast: no
    deepspeed import; shard patterns, files and (for an unknown name) open_clip's model list are looked at."""
    o, ck, ev, lg, dist = s.optim, s.checkpoint, s.eval, s.logging, s.dist
    # optim
    for name in ("batch_size", "accum_freq", "epochs"):
        _check_min(name, getattr(o, name), 1)
    _check_min("max_steps", o.max_steps, 1, optional=True)
    _check_min("lr", o.lr, 0, strict=True)
    _check_min("wd", o.wd, 0)
    _need(0 <= o.beta1 < 1, f"--beta1 must be in [0, 1), got {o.beta1}")
    _need(0 <= o.beta2 < 1, f"--beta2 must be in [0, 1), got {o.beta2}")
    _check_min("eps", o.eps, 0, strict=True)
    _check_min("warmup", o.warmup, 0)
    _check_optimizer(o)
    _check_optim_groups_and_schedule(o)
    _need(
        o.grad_clip_norm is None or o.grad_clip_norm > 0,
        f"--grad-clip-norm must be > 0 (omit it for no clipping), got {o.grad_clip_norm}",
    )
    _check_min("max_skipped_steps", o.max_skipped_steps, 1)
    # loss
    _check_choice("loss_impl", s.loss.loss_impl)
    _check_min("loss_tile_size", s.loss.loss_tile_size, 1)
    _check_min("coca_contrastive_loss_weight", s.loss.coca_contrastive_loss_weight, 0)
    _check_min("coca_caption_loss_weight", s.loss.coca_caption_loss_weight, 0)
    _need(
        not s.loss.local_loss or s.loss.gather_with_grad,
        "--local-loss without --gather-with-grad does not give the full-batch gradient (each rank would "
        "drop the other ranks' terms): add --gather-with-grad",
    )
    # dist
    _need(
        dist.precision in PRECISIONS,
        f"--precision must be one of {', '.join(PRECISION_NAMES)}, got {dist.precision!r}",
    )
    # Whether DeepSpeed allows it (stage, optimizer wrapper, preset) is decided with the preset, in ds_config.
    _check_choice("coalesce_grad_reduction", dist.coalesce_grad_reduction)
    _need(
        dist.zero_stage is None or dist.zero_stage in (0, 1, 2, 3),
        f"--zero-stage must be 0, 1, 2 or 3, got {dist.zero_stage}",
    )
    _check_min("dist_timeout", dist.dist_timeout, 0, strict=True)
    # logging, checkpoint, eval cadences
    _check_min("log_every_n_steps", lg.log_every_n_steps, 1)
    _check_min("save_every_n_steps", ck.save_every_n_steps, 1, optional=True)
    _check_min("keep_checkpoints", ck.keep_checkpoints, 1, optional=True)
    _check_min("save_frequency", ck.save_frequency, 0, optional=True)
    _need(
        not ck.delete_previous_checkpoint or ck.keep_checkpoints in (None, 1),
        f"--delete-previous-checkpoint keeps 1 checkpoint but --keep-checkpoints says {ck.keep_checkpoints}: "
        "drop one of them",
    )
    bad = [r for r in lg.report_to if r not in REPORTERS]
    _need(not bad, f"--report-to: unknown {', '.join(bad)}; choose from {', '.join(REPORTERS)}")
    _need(
        "wandb" not in lg.report_to or importlib.util.find_spec("wandb") is not None,
        "--report-to wandb needs the wandb package (pip install wandb)",
    )
    if lg.name is not None:
        _need(
            lg.name not in ("", ".", "..") and "/" not in lg.name,
            f"--name {lg.name!r} must be a folder name, not a path",
        )
    # data
    check_data(s.data)
    if s.data.train_data and s.data.dataset_type != "csv":  # a CSV path is a file, not a shard pattern
        _check_shards("--train-data", s.data.train_data)
    check_eval(ev, batch_size=o.batch_size)
    # model and weights
    if s.model.pretrained:
        _check_pretrained(s.model.pretrained)
    _check_model(s.model)
    check_model_flags(s.model)
    _check_distill(s)
    # resume
    if ck.resume == "latest":
        _need(lg.name is not None, "--resume latest needs --name of the run to continue")
    elif ck.resume is not None:
        _need(Path(ck.resume).expanduser().exists(), f"--resume {ck.resume!r}: no such checkpoint folder")
    # The DeepSpeed preset: exists, parses, and agrees with the flags (world size unknown yet).
    check_preset(s)


def _check_optimizer(o: OptimSettings) -> None:
    """--opt names an optimizer DeepSpeed builds from its JSON; --momentum only where it has one. (What the
    accelerator and the preset's offload allow is decided with the preset: ds_clip.ds_config.)"""
    if o.optimizer.startswith("timm/"):
        raise SettingsError(
            f"--opt {o.optimizer}: ds_clip has DeepSpeed build the optimizer from its JSON (so ZeRO partitions it and "
            f"offload runs it on the CPU), and timm's optimizers are not among them: use --opt "
            f"{', '.join(OPTIMIZERS)}"
        )
    _need(o.optimizer in OPTIMIZERS, f"--opt must be one of {', '.join(OPTIMIZERS)}, got {o.optimizer!r}")
    if o.momentum is not None:
        _need(
            o.optimizer == "sgd",
            f"--momentum applies to --opt sgd; {o.optimizer} has no momentum term (its moments: --beta1/--beta2)",
        )
        _need(0 <= o.momentum < 1, f"--momentum must be in [0, 1), got {o.momentum}")
    _need(
        not o.skip_scheduler or o.lr_scheduler == "cosine",
        f"--skip-scheduler trains at the peak LR throughout, so --lr-scheduler {o.lr_scheduler} would be "
        "ignored: drop one of them",
    )


def _check_optim_groups_and_schedule(o: OptimSettings) -> None:
    """Per-tower LR / weight decay / layer decay, and the LR schedule's flags."""
    for name in ("visual_lr", "text_lr", "visual_wd", "text_wd"):
        _check_min(name, getattr(o, name), 0, optional=True)
    for name in ("visual_ld", "text_ld"):
        value = getattr(o, name)
        _need(0 < value <= 1, f"{flag_named(name).option} must be in (0, 1] (1: no layer decay), got {value}")
    _check_choice("lr_scheduler", o.lr_scheduler)
    if o.lr_scheduler == "const-cooldown":
        _need(o.epochs_cooldown is not None, "--lr-scheduler const-cooldown needs --epochs-cooldown (epochs)")
        _check_min("epochs_cooldown", o.epochs_cooldown, 1)
        _need(
            o.max_steps is not None or o.epochs_cooldown <= o.epochs,
            f"--epochs-cooldown {o.epochs_cooldown} is longer than the run (--epochs {o.epochs})",
        )
        _check_min("lr_cooldown_power", o.lr_cooldown_power, 0, strict=True)
        _need(
            0 <= o.lr_cooldown_end <= o.lr,
            f"--lr-cooldown-end must be in [0, --lr {o.lr:g}], got {o.lr_cooldown_end}",
        )
        return
    for name, default in (("epochs_cooldown", None), ("lr_cooldown_power", 1.0), ("lr_cooldown_end", 0.0)):
        _need(
            getattr(o, name) == default,
            f"{flag_named(name).option} applies to --lr-scheduler const-cooldown only (got "
            f"--lr-scheduler {o.lr_scheduler})",
        )


def _check_model(m: ModelSettings) -> None:
    _check_model_name(m.model, m.pretrained)


def _check_model_name(
    model: str, pretrained: str | None, flag: str = "--model", pretrained_flag: str = "--pretrained"
) -> None:
    """A model name (built in, open_clip's, or local-dir: with its config) and its weights flag."""
    if model in BUILTIN_MODELS:
        return
    if model.startswith(LOCAL_DIR_PREFIX):
        folder = Path(model[len(LOCAL_DIR_PREFIX) :]).expanduser()
        if not (folder / "open_clip_config.json").is_file():
            raise SettingsError(f"{flag} {model}: {folder / 'open_clip_config.json'} not found")
        if pretrained:
            # open_clip ignores pretrained= for local-dir: and loads the folder's own weights.
            raise SettingsError(
                f"{pretrained_flag} is ignored with {flag} {model}: put the weights in that folder "
                "(open_clip_model.safetensors) instead"
            )
        return
    import open_clip  # only for names we do not know ourselves (a few seconds)

    if model not in open_clip.list_models():
        raise SettingsError(
            f"{flag} {model!r} is unknown: use {', '.join(BUILTIN_MODELS)}, an open_clip model name "
            "(open_clip.list_models()), or local-dir:PATH"
        )


# The weight files open_clip loads from a local-dir: folder (open_clip_model.safetensors first).
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pth")


def _check_distill(s: TrainSettings) -> None:
    """--distill-model / --distill-pretrained: a teacher that exists and holds trained weights, and an
    objective open_clip defines a distillation for. (Whether it reads the student's images and tokens is
    checked where both models are built: ds_clip.model.check_teacher_fits.)"""
    m = s.model
    if m.distill_model is None:
        _need(m.distill_pretrained is None, "--distill-pretrained needs --distill-model (the teacher)")
        return
    _check_model_name(m.distill_model, m.distill_pretrained, "--distill-model", "--distill-pretrained")
    _need(
        not s.loss.siglip,
        "--distill-model with --siglip: open_clip defines distillation (DistillClipLoss) for the softmax CLIP "
        "loss only; drop one of them",
    )
    if m.distill_pretrained:
        _check_pretrained(m.distill_pretrained, "--distill-pretrained")
    elif m.distill_model.startswith(LOCAL_DIR_PREFIX):
        folder = Path(m.distill_model[len(LOCAL_DIR_PREFIX) :]).expanduser()
        _need(
            any(any(folder.glob(g)) for g in _WEIGHT_GLOBS),
            f"--distill-model {m.distill_model}: the folder holds no weights (*.safetensors, *.bin, *.pth); "
            "a teacher with random weights teaches nothing",
        )
    else:
        raise SettingsError(
            f"--distill-model {m.distill_model} needs --distill-pretrained (its weights; ds_clip downloads "
            "nothing): a teacher with random weights teaches nothing"
        )


def check_model_flags(m: ModelSettings) -> None:
    """The locking, image and augmentation flags: ranges, and each sub-flag only with its main flag. (What
    depends on the tower, e.g. unlocked groups of a ResNet, open_clip refuses when the model is built.)"""
    for name, main in (
        ("lock_image_unlocked_groups", "lock_image"),
        ("lock_image_freeze_bn_stats", "lock_image"),
        ("lock_text_unlocked_layers", "lock_text"),
        ("lock_text_freeze_layer_norm", "lock_text"),
    ):
        value = getattr(m, name)
        if isinstance(value, int) and not isinstance(value, bool):
            _check_min(name, value, 0)
        _need(
            not value or getattr(m, main),
            f"{flag_named(name).option} needs {flag_named(main).option} (it only changes a locked tower)",
        )
    if m.force_patch_dropout is not None:
        _need(
            0 <= m.force_patch_dropout < 1,
            f"--force-patch-dropout must be in [0, 1) (a fraction of patches), got {m.force_patch_dropout}",
        )
    if m.force_image_size is not None:
        _need(
            len(m.force_image_size) in (1, 2) and all(v >= 1 for v in m.force_image_size),
            f"--force-image-size takes one side or height and width in pixels (>= 1), got {m.force_image_size}",
        )
    for name in ("image_mean", "image_std"):
        values = getattr(m, name)
        if values is not None:
            option = flag_named(name).option
            _need(len(values) in (1, 3), f"{option} takes 1 or 3 values (per channel), got {len(values)}")
            _need(name != "image_std" or min(values) > 0, f"{option} values must be > 0, got {values}")
    if m.image_interpolation is not None:
        _check_choice("image_interpolation", m.image_interpolation)
    if m.image_resize_mode is not None:
        _check_choice("image_resize_mode", m.image_resize_mode)
    _check_min("force_context_length", m.force_context_length, 1, optional=True)
    if m.aug_cfg:
        aug_cfg_dict(m.aug_cfg)


def aug_cfg_dict(words: list[str]) -> dict[str, Any]:
    """--aug-cfg words -> open_clip's aug_cfg dict, read as open_clip_train's ParseKwargs reads them (each
    value a Python literal, else the plain string); unknown keys refused, as AugmentationCfg would."""
    from dataclasses import fields as dc_fields

    from open_clip.transform import AugmentationCfg  # only when --aug-cfg is given

    known = {f.name for f in dc_fields(AugmentationCfg)}
    out: dict[str, Any] = {}
    for word in words:
        key, sep, text = word.partition("=")
        _need(bool(sep) and bool(key), f"--aug-cfg: {word!r} is not KEY=VALUE")
        _need(key in known, f"--aug-cfg: unknown key {key!r}; open_clip's keys: {', '.join(sorted(known))}")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text  # as open_clip: a bare word (rand-m9-mstd0.5) is a string
    return out


def _check_pretrained(pretrained: str, flag: str = "--pretrained") -> None:
    path = Path(pretrained).expanduser()
    if path.is_dir():
        # An exported folder (ds-clip-export): the trainer loads its open_clip_model.safetensors.
        _need(
            any(path.glob("*.safetensors")) or any(path.glob("*.bin")),
            f"{flag} {pretrained!r}: the folder holds no *.safetensors or *.bin weights",
        )
        return
    if path.exists():
        return
    if "://" in pretrained or pretrained.startswith("hf-hub:"):
        raise SettingsError(
            f"{flag} {pretrained!r}: only local files or folders are loaded, not URLs or hubs"
        )
    raise SettingsError(
        f"{flag} {pretrained!r}: no such file or folder (ds_clip loads local weights only; "
        "open_clip tags like 'openai' are not downloaded)"
    )
