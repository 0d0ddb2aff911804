"""The typed settings tree: one dataclass per section, each field one flag (its type, default and docstring
make the flag, its --help line and its row in docs/configuration.md), and `TrainSettings`, the whole tree.

Builders take the section they read (`ModelSettings` for the model, `DataSettings` for the data, ...).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from ds_clip.config.fields import (
    DATASET_TYPE_CHOICES,
    DEFAULT_SYNTHETIC_SAMPLES,
    IMAGE_INTERPOLATIONS,
    IMAGE_RESIZE_MODES,
    LOSS_IMPLS,
    LR_SCHEDULERS,
    opt,
)
from ds_clip.ds_config.presets import PRECISION_NAMES
from ds_clip.ds_config.rules import DeepSpeedRequest


@dataclass
class ModelSettings:
    """model: which open_clip model is trained, from which weights."""

    model: str = opt(
        "ds-clip-tiny", metavar="NAME", open_clip="differs: adds the built-in tiny models; default RN50 there"
    )
    """"ds-clip-tiny", "ds-clip-tiny-siglip" (built in, no download), an open_clip model name,
    "hf-hub:ORG/REPO" (a hub repo holding open_clip_config.json and weights), or "local-dir:PATH" (a folder
    holding open_clip_config.json and, optionally, weights)."""
    pretrained: str | None = opt(
        None,
        metavar="TAG|PATH",
        open_clip="differs: also hf-hub:ORG/REPO, a URL and an exported folder; fetched once per host",
    )
    """Weights of a named model: an open_clip tag ("laion2b_s34b_b79k", "openai": open_clip.list_pretrained()),
    "hf-hub:ORG/REPO", a URL, or a local weights file or folder (an export). Published weights are fetched
    once per host into the cache (--cache-dir) and read from it by every rank (docs/pretrained.md); not with
    local-dir: or hf-hub: models (they bring their own weights)."""
    cache_dir: str | None = opt(None, metavar="DIR", default_text="huggingface_hub's cache (HF_HUB_CACHE)")
    """Cache folder of published weights, configs and tokenizers (open_clip's cache_dir). Offline
    (HF_HUB_OFFLINE=1) a run reads only this cache and refuses what it lacks."""
    pretrained_image: bool = opt(False)
    """Start a timm image tower from timm's ImageNet weights when no whole-model weights are loaded (open_clip's
    pretrained_image)."""
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
        None, metavar="TAG|PATH", open_clip="differs: also hf-hub:ORG/REPO, a URL and an exported folder"
    )
    """Weights of the --distill-model teacher, as --pretrained (a tag such as "openai", hf-hub:, a URL, a file
    or folder); needed for a named teacher, not with local-dir: or hf-hub: teachers (they bring their own)."""


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
    """Training pairs per epoch. Needed for resampled webdataset; in exact-epoch webdataset mode an optional
    cap (each shard's count comes from sizes.json, img2dataset's NNNNN_stats.json, or else a scan)."""
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
    decode: str = opt("fast", choices=("fast", "exact"), open_clip="ds_clip only")
    """Webdataset images under open_clip's train transform (RandomResizedCrop, then normalise): "fast" picks
    the crop from the JPEG header, decodes at a reduced size (DCT scaling) still >= the crop's output,
    crops and resizes in uint8 and normalises on the accelerator; "exact" decodes the full image and runs
    the transform as open_clip does (bit-equal inputs). Other transforms always decode exactly."""
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
    accum_freq: int | None = opt(
        None,
        metavar="K",
        unit="micro-batches",
        derived=True,
        default_text="1; N / (W*m) with --global-batch-size",
    )
    """k: micro-batches per optimizer step; the loss sees all N = k*m*W pairs at once (exact cached
    features), so one step moves the model as one process would on the whole N-pair batch. With
    --global-batch-size leave it out (k is derived); a k that disagrees with N is refused."""
    global_batch_size: int | None = opt(None, metavar="N", unit="pairs", open_clip="ds_clip only")
    """N: pairs per optimizer step, all ranks together. k = N / (W*m) is derived at start on whatever world
    size W the launcher gives (logged with N, W, m); W*m must divide N. Saved in the checkpoint: a resume
    or an elastic restart on another W re-derives k and trains the same steps (docs/global-batch.md)."""
    recipe: str | None = opt(None, metavar="NAME|PATH", open_clip="ds_clip only")
    """A training recipe that fixes N and the schedule: a shipped one (datacomp-small, datacomp-medium,
    datacomp-large, datacomp-xlarge, laion400m-vit-b-32, laion400m-vit-b-16, laion400m-vit-l-14) or a JSON
    file of settings by flag name. Flags on the command line override it, except a different
    --global-batch-size (refused: a recipe's N is what it is)."""
    epochs: int | None = opt(
        None,
        metavar="N",
        unit="epochs",
        derived=True,
        default_text="1; with --max-steps alone, as many as its steps take",
        open_clip="differs: default 32 there",
    )
    """Passes over the training data. With --max-steps too, the run stops at whichever limit comes first;
    --dry-run and the start line say how many steps and epochs that is."""
    max_steps: int | None = opt(None, metavar="STEPS", unit="steps", open_clip="ds_clip only")
    """Stop after this many optimizer steps (or at the end of --epochs, if that comes first)."""
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
        open_clip="differs: DeepSpeed's config-built adamw, adam, lamb, lion, muon, sgd (open_clip: adamw or timm/NAME)",
    )
    """Optimizer, built by DeepSpeed from its JSON (so ZeRO partitions it and offload presets run it on the
    CPU): "adamw" (torch AdamW; DeepSpeed's CPU Adam under offload), "adam" (DeepSpeed's Adam with L2 weight
    decay), "lamb" (DeepSpeed's FusedLamb: CUDA only, no offload), "lion" (FusedLion on CUDA, DeepSpeed's CPU Lion
    under offload; on a CPU-only machine only with an offload preset), "muon" (DeepSpeed's Muon on both towers'
    hidden matrices, its AdamW on embeddings, the patch stem, projections, logit scale/bias, norms and biases),
    "sgd" (torch SGD, --momentum). A --ds-config file's optimizer block sets it when the flag is left out.
    Per-tower groups and the LR schedule apply to each."""
    momentum: float | None = opt(None, metavar="M", default_text="0 (--opt sgd); DeepSpeed's (--opt muon)")
    """Momentum of --opt sgd and of Muon's matrices under --opt muon (the others have --beta1/--beta2)."""
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
    from the global batch on where it is the faster one on a CPU (docs/loss.md): 128 pairs for the global CLIP
    loss; 8192 for --local-loss, SigLIP and distillation, where dense's N x N matrices pass a GiB; dense below."""
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
    siglip2: bool = opt(False, open_clip="ds_clip only")
    """SigLIP 2's objective (docs/siglip2.md): the sigmoid loss (implies --siglip) plus a LocCa caption decoder
    over the image tower's tokens and, from --siglip2-selfsup-start on, SILC self-distillation and TIPS masked
    prediction against an EMA teacher of the image tower. A SigLIP model (one with a logit_bias)."""
    siglip2_selfsup_start: float = opt(
        0.8, metavar="FRACTION", unit="of the run's steps", open_clip="ds_clip only"
    )
    """--siglip2: the fraction of the run's optimizer steps after which self-distillation and masked prediction
    join (the paper's last 20%); the teacher starts as a copy of the student there."""
    siglip2_locca_weight: float = opt(1.0, metavar="W", open_clip="ds_clip only")
    """--siglip2: weight of the decoder's token cross-entropy (captioning, referring expressions, grounded
    captions), a mean over the non-pad target tokens of the whole global batch."""
    siglip2_parallel_fraction: float = opt(0.5, metavar="FRACTION", open_clip="ds_clip only")
    """--siglip2: share of the decoder's sequences predicted in parallel (all inputs masked, no causal mask: CapPa)
    instead of autoregressively."""
    siglip2_decoder_layers: int | None = opt(
        None,
        metavar="N",
        default_text="a quarter of the text tower's layers, at least 1",
        open_clip="ds_clip only",
    )
    """--siglip2: layers of the LocCa decoder (the text tower's width and heads, with cross-attention)."""
    siglip2_silc_weight: float | None = opt(
        None, metavar="W", default_text="1 x the model-size factor", open_clip="ds_clip only"
    )
    """--siglip2: weight of the local-to-global self-distillation (SILC); the paper's 1, times 0.25 / 0.5 / 1 /
    0.5 for image towers of width 768 or less / 1024 / 1152 / 1536."""
    siglip2_tips_weight: float | None = opt(
        None, metavar="W", default_text="0.25 x the model-size factor", open_clip="ds_clip only"
    )
    """--siglip2: weight of the masked patch prediction (TIPS); the paper's 0.25, times the model-size factor."""
    siglip2_local_views: int = opt(8, metavar="N", open_clip="ds_clip only")
    """--siglip2: local views (crops of 5-40 % of the image area) per image that the student matches to the
    teacher's global view (SILC's eight)."""
    siglip2_mask_ratio: float = opt(0.5, metavar="FRACTION", open_clip="ds_clip only")
    """--siglip2: share of the student's patch embeddings replaced by the mask token for masked prediction."""
    siglip2_teacher_momentum: float = opt(0.996, metavar="M", open_clip="ds_clip only")
    """--siglip2: the teacher's EMA momentum per optimizer step (fixed, as SILC keeps it)."""
    siglip2_teacher_temp: float = opt(0.04, metavar="T", open_clip="ds_clip only")
    """--siglip2: temperature of the teacher's softmax over the head's prototypes (after centering)."""
    siglip2_student_temp: float = opt(0.1, metavar="T", open_clip="ds_clip only")
    """--siglip2: temperature of the student's softmax over the head's prototypes."""
    siglip2_prototypes: int = opt(65536, metavar="K", open_clip="ds_clip only")
    """--siglip2: output dimension of the self-distillation head (DINO's 65536)."""
    siglip2_patch_prototypes: int = opt(8192, metavar="K", open_clip="ds_clip only")
    """--siglip2: output dimension of the masked-prediction (patch) head (iBOT's 8192)."""


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
    resume: str | None = opt(
        None, metavar="latest|DIR", open_clip="differs: latest also pulls from --remote-sync when newer there"
    )
    """"latest" (the latest complete checkpoint of the run named by --name; with --remote-sync, the remote's
    when it is newer, pulled and checked first) or a checkpoint folder."""
    remote_sync: str | None = opt(
        None, metavar="URL", open_clip="differs: complete checkpoints only (marker last), checked by checksum"
    )
    """Copy the run folder (checkpoints, logs) to URL/<name> (s3://, gs:// or any fsspec URL) every
    --remote-sync-frequency seconds from a background thread, and at the end; only complete checkpoints,
    their COMPLETE marker written last. A failed sync is logged and retried, never fatal. The remote must
    be reachable and writable at start (else exit 2). docs/remote.md."""
    remote_sync_frequency: int = opt(300, metavar="SECONDS", unit="seconds")
    """Seconds between two syncs of the run folder to --remote-sync."""
    remote_sync_final_timeout: int = opt(600, metavar="SECONDS", unit="seconds", open_clip="ds_clip only")
    """Seconds the end of a run waits for its last sync to --remote-sync. When they pass (a store that stopped
    answering), one line says which checkpoints are and are not complete on the remote, the local run folder
    is kept as it is, and ds-clip-train exits 1 (docs/remote.md). The other ranks wait for it in a collective:
    it must be at least 60 s below --dist-timeout (else exit 2 at start)."""
    remote_sync_protocol: str = opt(
        "s3",
        choices=("s3", "fsspec"),
        open_clip="differs: s3 goes through s3fs (fsspec), not the aws command line",
    )
    """"s3" (an s3:// URL, through s3fs) or "fsspec" (any URL fsspec knows: gs://, az://, file://, ...)."""
    on_save_failure: str = opt("stop", choices=("stop", "continue"), open_clip="ds_clip only")
    """A checkpoint that cannot be written (no space, no permission, a quota) is reported in one line and its
    partial folder removed, the last complete one kept; then "stop" (exit 1) or "continue" (keep training and
    try again at the next save, e.g. while --remote-sync holds the last checkpoint)."""


@dataclass
class EmaSettings:
    """ema: an exponential moving average of the weights, kept beside the fp32 master partitions (ds_clip.step.ema)."""

    ema_decay: float | None = opt(None, metavar="DECAY", default_text="off", open_clip="ds_clip only")
    """Keep an EMA of the weights with this decay, in (0, 1) (e.g. 0.9999): fp32, sharded like the master
    weights under ZeRO 1-3 and offload, saved in checkpoints, evaluated beside the live weights (metrics
    prefixed ema/), exported with ds-clip-export --ema. The first update (step 1) copies the weights, as
    timm's ModelEmaV3 does."""
    ema_update_every: int = opt(1, metavar="STEPS", unit="steps", open_clip="ds_clip only")
    """Update the EMA at every this many applied optimizer steps (with the decay of that step)."""
    ema_warmup: bool = opt(False, open_clip="ds_clip only")
    """Warm the decay up as timm's ModelEmaV3 does: 1 - (1 + t/gamma)^-power at step t + 1, capped by
    --ema-decay."""
    ema_warmup_gamma: float = opt(1.0, metavar="GAMMA", open_clip="ds_clip only")
    """With --ema-warmup: the gamma of the warm-up curve (> 0)."""
    ema_warmup_power: float = opt(2 / 3, metavar="POWER", default_text="2/3", open_clip="ds_clip only")
    """With --ema-warmup: the power of the warm-up curve (> 0); 2/3 reaches 0.999 at 31.6k steps, 3/4 at 10k."""


@dataclass
class EvalSectionSettings:
    """eval: validation data and when to evaluate (ds_clip.evaluate.EvalSettings is built from it)."""

    val_data: str | None = opt(None, metavar="PATTERN", open_clip='differs: also "synthetic"')
    """Validation shards (same syntax as --train-data), a CSV/TSV file (a .csv/.tsv name, or any file with
    --dataset-type csv; the --csv-* columns and separator) or "synthetic" (held-out pairs of the built-in
    dataset). Checked before the first step; an evaluation that fails mid-run is logged and skipped."""
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
    zeroshot_folder: str | None = opt(
        None, metavar="DIR", open_clip="ds_clip only (open_clip: --imagenet-val)"
    )
    """Zero-shot top-1/top-5 on your own classes: a folder with one sub-folder of images per class
    (torchvision's ImageFolder layout); class names from the sub-folders' names ("_" read as a space) or
    --zeroshot-classnames, prompts from --zeroshot-templates. At --zeroshot-frequency and at the end, as
    --imagenet-val."""
    zeroshot_classnames: str | None = opt(None, metavar="JSON", open_clip="ds_clip only")
    """Class names of the --zeroshot-folder classes: a JSON object {"sub-folder": "class name", ...} naming
    every sub-folder, or a JSON list of names in the sub-folders' sorted order."""
    zeroshot_templates: str = opt("openai", metavar="openai|simple|FILE", open_clip="ds_clip only")
    """Prompt templates of --zeroshot-folder: open_clip's "openai" (80, as its ImageNet zero-shot) or
    "simple" lists, or a file: a JSON list of strings with "{c}" (the class name), or one template a line."""


@dataclass
class LoggingSettings:
    """logging: the run folder and what is logged to it."""

    # "--log-dir" because torchrun (torch >= 2.x) takes "--logs" for a prefix of its own "--logs-specs".
    logs: str = opt("./logs", metavar="DIR", aliases=("--log-dir",), open_clip="same; alias --log-dir")
    """Folder holding one sub-folder per run (settings, DeepSpeed JSON, metrics, checkpoints). Under
    torchrun write --log-dir (torchrun claims --logs as a prefix of its --logs-specs)."""
    name: str | None = opt(None, metavar="NAME", default_text="date-time, model, m, k or N")
    """Run folder name under --logs; default "YYYY_mm_dd-HH_MM_SS-model_<model>-m_<m>-k_<k>" (rank 0's), with
    "-N_<N>" in place of "-k_<k>" under --global-batch-size or a recipe that sets it (k then follows from the
    world size); <model> of local-dir:PATH is "local-" and the last two folder names of PATH."""
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
        default_text="zero0_<precision> on 1 rank and fp32 on up to 4; zero1_<precision> beyond",
        open_clip="ds_clip only",
    )
    """DeepSpeed preset name (ds_configs/<name>.json) or path to a JSON of engine settings. Left out: ZeRO-0 on
    one rank (nothing to partition) and in fp32 on up to 4 (where ZeRO-1 saves little or no memory), ZeRO-1
    otherwise; --zero-stage, --coalesce-grad-reduction on or fp16 asks for ZeRO (ds_config.default_preset; the
    start-up log says which and why)."""
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
    """Parse and check every flag, read the training data and the evaluation inputs as the start would, resolve
    the DeepSpeed JSON, print the settings, the run's length (steps and epochs) and the JSON, exit: no process
    group, no model."""
    local_rank: int = opt(-1, flag="--local_rank", aliases=("--local-rank",), hidden=True)
    """Appended by the deepspeed launcher (--local_rank=N); not for users, unused otherwise."""


@dataclass
class TrainSettings:
    """Everything one training run needs: one section per concern, each field one flag.

    Sizes: m = `optim.batch_size` pairs per rank per micro-batch, k = `optim.accum_freq` micro-batches per
    optimizer step, W = world size; one optimizer step sees N = m * k * W pairs and moves the model as one
    process would on the whole N-pair batch (ds_clip.step says how). With `optim.global_batch_size` N set,
    `optim.accum_freq` may stay None: k is derived from the world size at start (ds_clip.geometry).

    Field names are unique across sections (each is its flag's dest): `TrainSettings.of(batch_size=4)`
    and settings.json use them flat.
    """

    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    ema: EmaSettings = field(default_factory=EmaSettings)
    eval: EvalSectionSettings = field(default_factory=EvalSectionSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    dist: DistSettings = field(default_factory=DistSettings)
    sources: dict[str, str] | None = field(default=None, compare=False, repr=False)
    """Where each field's value came from, by field name: "flag" (given on the command line), "recipe",
    "ds_json" (a key of the --ds-config file), "derived" (m from train_batch_size at start); a field not
    listed holds its default. ``parse_settings`` fills it; settings built with ``TrainSettings.of`` have None,
    and then every field counts as chosen (``chosen``)."""

    def chosen(self, name: str) -> bool:
        """Did the user choose field ``name`` (a flag or a recipe; for settings not parsed from a command line,
        any field)? A value the JSON gave, or a default, is not a choice a JSON key can conflict with."""
        if self.sources is None:
            return True
        return self.sources.get(name) in ("flag", "recipe")

    def deepspeed_request(self) -> DeepSpeedRequest:
        """What the DeepSpeed resolution (``ds_clip.ds_config``) reads of these settings: the optimizer section,
        the dist flags, --use-bn-sync, --torchcompile and the sources; it never sees the whole tree."""
        d = self.dist
        return DeepSpeedRequest(
            optim=self.optim,
            precision=d.precision,
            zero_stage=d.zero_stage,
            coalesce_grad_reduction=d.coalesce_grad_reduction,
            ds_config=d.ds_config,
            use_bn_sync=self.model.use_bn_sync,
            torchcompile=self.model.torchcompile,
            sources=self.sources,
        )

    @classmethod
    def section_types(cls) -> dict[str, type]:
        """Section name -> its dataclass, in order ("model": ModelSettings, ...)."""
        return dict(_SECTIONS)

    @classmethod
    def of(cls, **values: Any) -> TrainSettings:
        """Settings from flat field names (`of(batch_size=4, precision="bf16")`); the rest default."""
        sections: dict[str, dict[str, Any]] = {sec: {} for sec in _SECTIONS}
        by_name = {f.name: sec for sec, kind in _SECTIONS.items() for f in dataclasses.fields(kind)}
        for name, value in values.items():
            if name not in by_name:
                raise TypeError(f"TrainSettings has no field {name!r}")
            sections[by_name[name]][name] = value
        return cls(**{sec: _SECTIONS[sec](**kw) for sec, kw in sections.items()})


_SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(TrainSettings)[f.name]
    for f in dataclasses.fields(TrainSettings)
    if dataclasses.is_dataclass(typing.get_type_hints(TrainSettings)[f.name])
}
