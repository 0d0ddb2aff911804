"""Typed training settings: command line -> `TrainSettings` -> validation.

    python -m ds_clip.train --help          # every flag, one line each, with units

Precedence: command-line flag > DeepSpeed preset (`--ds-config`) > the defaults below. Engine settings
(ZeRO, offload, communication) live only in the preset; batch sizes, accumulation, optimizer and
precision come from flags, and `ds_clip.ds_config.resolve_ds_config` refuses a preset that disagrees.

Validation is cheap and imports neither deepspeed nor torch.distributed, so a bad flag fails in a second,
before any process group starts. `open_clip` is imported only to check an unknown `--model` name.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ds_clip.errors import UserError

BUILTIN_MODELS = ("ds-clip-tiny", "ds-clip-tiny-siglip")
PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_IMPLS = ("auto", "dense", "tiled")
DATASET_TYPES = ("synthetic", "webdataset")
REPORTERS = ("tensorboard", "csv", "wandb")
LOCAL_DIR_PREFIX = "local-dir:"


class SettingsError(UserError):
    """Bad user input. The message is one line naming the flag (or file, or JSON key) at fault.

    The entry point prints `ds-clip-train: error: <message>` and exits with status 2, like argparse.
    """


@dataclass
class TrainSettings:
    """Everything one training run needs, flat, with open_clip's names where open_clip has them.

    Sizes: m = `batch_size` pairs per rank per micro-batch, k = `accum_freq` micro-batches per optimizer
    step, W = world size; one optimizer step sees N = m * k * W pairs and moves the model as one process
    would on the whole N-pair batch (see shared/notes/gradient-contract.md).
    """

    # --- model ---
    model: str = "ds-clip-tiny"
    """Model: "ds-clip-tiny", "ds-clip-tiny-siglip" (built-in, no download), an open_clip model name, or
    "local-dir:PATH" (a folder holding open_clip_config.json and, optionally, weights)."""
    pretrained: str | None = None
    """Local weights file or folder for a named model. URLs and hub tags are refused (no downloads)."""
    grad_checkpointing: bool = False
    """Recompute tower activations in backward (open_clip's set_grad_checkpointing): less memory, more compute."""

    # --- data ---
    train_data: str | None = None
    """Webdataset shards, brace patterns allowed, several sources joined with "::". None: synthetic data."""
    val_data: str | None = None
    """Validation shards, same syntax as train_data, or "synthetic" (held-out pairs of the built-in dataset)."""
    dataset_type: str = "synthetic"
    """"synthetic" (random pairs, no files) or "webdataset". parse_settings picks synthetic when no
    --train-data is given, webdataset otherwise."""
    train_num_samples: int | None = None
    """Training pairs per epoch (samples); needed for webdataset shards without a size file."""
    val_num_samples: int | None = None
    """Validation pairs (samples); None: all of --val-data (512 for "synthetic")."""
    dataset_resampled: bool = False
    """Draw shards with replacement (webdataset); an epoch is then train_num_samples draws."""
    image_key: str = "jpg;jpeg;png;webp"
    """Webdataset keys tried for the image, ";"-separated, first match wins."""
    caption_key: str = "txt"
    """Webdataset key of the caption."""
    workers: int = 1
    """Data-loader worker processes per rank (0: load in the training process)."""

    # --- batch and schedule ---
    batch_size: int = 8
    """Micro-batch m: pairs per rank per forward pass (samples)."""
    accum_freq: int = 1
    """k: micro-batches per optimizer step; the loss sees all k*m*W pairs at once (exact cached features)."""
    epochs: int = 1
    """Passes over the training data (epochs); max_steps, when set, stops earlier."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (steps); None: run all epochs."""

    # --- optimizer (AdamW, run by DeepSpeed) and schedule (ds_clip's cosine with linear warmup) ---
    lr: float = 5e-4
    """Peak learning rate (per optimizer step, reached after warmup)."""
    wd: float = 0.2
    """AdamW weight decay (decoupled, per step, times lr)."""
    warmup: int = 0
    """Linear learning-rate warmup (optimizer steps). open_clip uses 10000 for long runs; 0 suits short ones."""
    beta1: float = 0.9
    """AdamW beta1 (first-moment decay)."""
    beta2: float = 0.98
    """AdamW beta2 (second-moment decay)."""
    eps: float = 1e-6
    """AdamW epsilon."""
    grad_clip_norm: float | None = None
    """Clip the global gradient L2 norm to this value (DeepSpeed gradient_clipping); None: no clipping."""

    # --- numerics and loss ---
    precision: str = "fp32"
    """"fp32", "bf16" or "fp16" (DeepSpeed mixed precision; fp16 with dynamic loss scaling)."""
    local_loss: bool = False
    """Each rank computes the loss rows of its own pairs against all columns (needs gather_with_grad)."""
    gather_with_grad: bool = False
    """All-gather features with a backward that reduces, so every rank gets the full-batch gradient."""
    siglip: bool = False
    """Sigmoid (SigLIP) loss instead of the softmax CLIP loss."""
    loss_impl: str = "auto"
    """"dense" (whole logit matrix in memory), "tiled" (blocks of the logit matrix, O(tile*N) memory) or
    "auto": tiled from a global batch of TILED_FROM_N pairs on, where it is also the faster one
    (docs/loss.md), dense below."""
    seed: int = 0
    """Random seed; each rank derives its own from it."""

    # --- logging, checkpoints, evaluation ---
    logs: str = "./logs"
    """Folder holding one sub-folder per run (settings, DeepSpeed JSON, metrics, checkpoints)."""
    name: str | None = None
    """Run folder name under logs. parse_settings fills None with
    "YYYY_mm_dd-HH_MM_SS-model_<model>-m_<m>-k_<k>"; ranks may start in different seconds, so the trainer
    should use rank 0's name on every rank."""
    log_every_n_steps: int = 10
    """Log loss, learning rate and samples/s every this many optimizer steps (steps)."""
    save_every_n_steps: int | None = None
    """Save a DeepSpeed checkpoint every this many optimizer steps (steps); None: only at the end."""
    val_every_n_steps: int | None = None
    """Evaluate on val_data every this many optimizer steps (steps); None: only at the end."""
    max_skipped_steps: int = 10
    """Stop with an error after this many consecutive optimizer steps whose loss or gradient was not
    finite (each one skipped on every rank); the last complete checkpoint is kept."""
    dist_timeout: float = 1800.0
    """Seconds a collective may wait for the other ranks before this rank gives up (a dead rank)."""
    keep_checkpoints: int | None = None
    """Keep only the newest N complete checkpoints (older ones are deleted after a newer one is complete);
    None: keep all."""
    zeroshot_classes: str | None = None
    """Zero-shot classification during evaluation: a JSON file {"classnames": [...], "templates": [...]}
    (templates with "{c}", or "simple"/"openai" for open_clip's lists) or a text file, one class a line."""
    resume: str | None = None
    """None, "latest" (latest checkpoint of the run named by --name), or a checkpoint folder."""
    report_to: list[str] = field(default_factory=list)
    """Metric sinks besides the console: any of "tensorboard", "csv", "wandb"."""

    # --- DeepSpeed ---
    ds_config: str | None = None
    """DeepSpeed preset name (ds_configs/<name>.json) or path to a JSON; None: "zero1_<precision>"."""
    zero_stage: int | None = None
    """ZeRO stage 0-3, overriding the preset's zero_optimization.stage; None: keep the preset's."""
    local_rank: int = -1
    """Set by the deepspeed launcher (--local_rank=N); not used otherwise (-1: not given)."""


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def build_parser() -> argparse.ArgumentParser:
    """The command line of `ds-clip-train` / `python -m ds_clip.train`; one flag per TrainSettings field."""
    d = TrainSettings()
    p = argparse.ArgumentParser(
        prog="ds-clip-train",
        description="Train CLIP/SigLIP with DeepSpeed and exact cached-feature gradient accumulation: "
        "one optimizer step = accum-freq micro-batches of batch-size pairs on every rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        metavar="NAME",
        default=d.model,
        help="ds-clip-tiny | ds-clip-tiny-siglip | open_clip name | local-dir:PATH",
    )
    g.add_argument(
        "--pretrained",
        metavar="PATH",
        default=d.pretrained,
        help="local weights file or folder (no URLs, no hub tags)",
    )
    g.add_argument(
        "--grad-checkpointing", action="store_true", help="recompute activations in backward: less memory"
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--train-data",
        metavar="PATTERN",
        default=None,
        help="webdataset shards: brace patterns, sources joined by '::'",
    )
    g.add_argument(
        "--val-data",
        metavar="PATTERN",
        default=None,
        help="validation shards (same syntax as --train-data) or 'synthetic'",
    )
    g.add_argument(
        "--dataset-type",
        choices=DATASET_TYPES,
        default=None,
        help="default: synthetic without --train-data, webdataset with it",
    )
    g.add_argument(
        "--train-num-samples", metavar="N", type=int, default=None, help="training pairs per epoch (samples)"
    )
    g.add_argument(
        "--val-num-samples",
        metavar="N",
        type=int,
        default=None,
        help="validation pairs (samples); default: all",
    )
    g.add_argument("--dataset-resampled", action="store_true", help="draw shards with replacement")
    g.add_argument(
        "--image-key", metavar="KEYS", default=d.image_key, help="webdataset image keys, ';'-separated"
    )
    g.add_argument("--caption-key", metavar="KEY", default=d.caption_key, help="webdataset caption key")
    g.add_argument(
        "--workers", metavar="N", type=int, default=d.workers, help="data-loader processes per rank"
    )

    g = p.add_argument_group("batch and schedule")
    g.add_argument(
        "--batch-size",
        metavar="M",
        type=int,
        default=d.batch_size,
        help="micro-batch m: pairs per rank per pass",
    )
    g.add_argument(
        "--accum-freq",
        metavar="K",
        type=int,
        default=d.accum_freq,
        help="k: micro-batches per optimizer step",
    )
    g.add_argument("--epochs", metavar="N", type=int, default=d.epochs, help="passes over the training data")
    g.add_argument(
        "--max-steps",
        metavar="STEPS",
        type=_optional_int,
        default=None,
        help="stop after this many optimizer steps",
    )

    g = p.add_argument_group("optimizer (AdamW) and learning rate (cosine, linear warmup)")
    g.add_argument("--lr", metavar="LR", type=float, default=d.lr, help="peak learning rate")
    g.add_argument("--wd", metavar="WD", type=float, default=d.wd, help="AdamW weight decay")
    g.add_argument(
        "--warmup", metavar="STEPS", type=int, default=d.warmup, help="linear warmup length (optimizer steps)"
    )
    g.add_argument("--beta1", metavar="B1", type=float, default=d.beta1, help="AdamW beta1")
    g.add_argument("--beta2", metavar="B2", type=float, default=d.beta2, help="AdamW beta2")
    g.add_argument("--eps", metavar="EPS", type=float, default=d.eps, help="AdamW epsilon")
    g.add_argument(
        "--grad-clip-norm",
        metavar="NORM",
        type=_optional_float,
        default=None,
        help="clip gradient L2 norm; none: off",
    )

    g = p.add_argument_group("numerics and loss")
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="default: the preset's (bf16/fp16 section enabled), else fp32",
    )
    g.add_argument(
        "--local-loss", action="store_true", help="loss rows of local pairs only (needs --gather-with-grad)"
    )
    g.add_argument(
        "--gather-with-grad", action="store_true", help="feature all-gather with a reducing backward"
    )
    g.add_argument("--siglip", action="store_true", help="sigmoid (SigLIP) loss instead of softmax CLIP loss")
    g.add_argument(
        "--loss-impl", choices=LOSS_IMPLS, default=d.loss_impl, help="logit matrix whole or in tiles"
    )
    g.add_argument("--seed", metavar="N", type=int, default=d.seed, help="random seed")

    g = p.add_argument_group("logging, checkpoints, evaluation")
    # "--log-dir" because torchrun (torch >= 2.x) takes "--logs" for a prefix of its own "--logs-specs".
    g.add_argument(
        "--logs",
        "--log-dir",
        dest="logs",
        metavar="DIR",
        default=d.logs,
        help="folder holding one sub-folder per run",
    )
    g.add_argument(
        "--name", metavar="NAME", default=None, help="run folder name; default: date-time, model, m, k"
    )
    g.add_argument(
        "--log-every-n-steps",
        metavar="STEPS",
        type=int,
        default=d.log_every_n_steps,
        help="log cadence (optimizer steps)",
    )
    g.add_argument(
        "--save-every-n-steps",
        metavar="STEPS",
        type=_optional_int,
        default=None,
        help="checkpoint cadence (steps)",
    )
    g.add_argument(
        "--val-every-n-steps",
        metavar="STEPS",
        type=_optional_int,
        default=None,
        help="evaluation cadence (steps)",
    )
    g.add_argument(
        "--max-skipped-steps",
        metavar="N",
        type=int,
        default=d.max_skipped_steps,
        help="stop after N consecutive non-finite steps, each skipped on every rank (steps)",
    )
    g.add_argument(
        "--dist-timeout",
        metavar="SECONDS",
        type=float,
        default=d.dist_timeout,
        help="how long a collective waits for the other ranks before failing (seconds)",
    )
    g.add_argument(
        "--keep-checkpoints",
        metavar="N",
        type=_optional_int,
        default=None,
        help="keep the newest N complete checkpoints; default: all",
    )
    g.add_argument(
        "--zeroshot-classes",
        metavar="FILE",
        default=None,
        help="class names + templates (JSON) or one class a line, for zero-shot eval",
    )
    g.add_argument(
        "--resume", metavar="latest|DIR", default=None, help="'latest' (of --name) or a checkpoint folder"
    )
    g.add_argument("--report-to", metavar="LIST", default="", help="comma list of tensorboard, csv, wandb")

    g = p.add_argument_group("DeepSpeed")
    g.add_argument(
        "--ds-config",
        metavar="NAME|PATH",
        default=None,
        help="preset name in ds_configs/ or a JSON path; default zero1_<precision>",
    )
    g.add_argument(
        "--zero-stage",
        metavar="{0,1,2,3}",
        type=_optional_int,
        default=None,
        help="ZeRO stage 0-3, overrides the preset's",
    )
    # The deepspeed launcher appends --local_rank=N to the script's arguments; accept both spellings.
    g.add_argument(
        "--local_rank", "--local-rank", dest="local_rank", type=int, default=-1, help=argparse.SUPPRESS
    )
    return p


def parse_settings(argv: list[str] | None = None) -> TrainSettings:
    """Parse the command line (sys.argv[1:] when None), fill derived defaults, validate.

    Raises SettingsError for bad values; argparse itself exits 2 on malformed flags.
    """
    ns = build_parser().parse_args(argv)
    values: dict[str, Any] = vars(ns)
    values["report_to"] = [r.strip() for r in values["report_to"].split(",") if r.strip()]
    if values["dataset_type"] is None:
        values["dataset_type"] = "webdataset" if values["train_data"] else "synthetic"
    if values["precision"] is None:
        # CLI > preset > default: a preset named for its precision (zero2_bf16) sets --precision.
        values["precision"] = _preset_precision(values["ds_config"]) if values["ds_config"] else "fp32"
    s = TrainSettings(**values)
    if s.name is None:
        # An automatic name is new every run, so "latest" would silently start from scratch.
        if s.resume == "latest":
            raise SettingsError("--resume latest needs --name of the run to continue")
        s.name = default_run_name(s)
    validate(s)
    return s


def _preset_precision(ds_config: str) -> str:
    from ds_clip.ds_config import load_preset  # late import: ds_config imports this module

    preset = load_preset(ds_config)
    for key in ("bf16", "bfloat16", "fp16"):
        section = preset.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return "fp16" if key == "fp16" else "bf16"
    return "fp32"


def default_run_name(s: TrainSettings, now: datetime | None = None) -> str:
    """ "YYYY_mm_dd-HH_MM_SS-model_<model>-m_<m>-k_<k>", with characters unsafe in a folder name replaced."""
    stamp = (now or datetime.now()).strftime("%Y_%m_%d-%H_%M_%S")
    model = s.model
    if model.startswith(LOCAL_DIR_PREFIX):
        model = Path(model[len(LOCAL_DIR_PREFIX) :]).name or "local"
    name = f"{stamp}-model_{model}-m_{s.batch_size}-k_{s.accum_freq}"
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", name)


def _check_shards(flag: str, pattern: str) -> None:
    # The webdataset reader expands the same way (one expander): what passes here is what it reads.
    from ds_clip.data.urls import ShardPatternError, expand_shards

    try:
        expand_shards(pattern, flag)
    except ShardPatternError as exc:
        raise SettingsError(str(exc)) from None


def _check_model(s: TrainSettings) -> None:
    if s.model in BUILTIN_MODELS:
        return
    if s.model.startswith(LOCAL_DIR_PREFIX):
        folder = Path(s.model[len(LOCAL_DIR_PREFIX) :]).expanduser()
        if not (folder / "open_clip_config.json").is_file():
            raise SettingsError(f"--model {s.model}: {folder / 'open_clip_config.json'} not found")
        if s.pretrained:
            # open_clip ignores pretrained= for local-dir: and loads the folder's own weights.
            raise SettingsError(
                f"--pretrained is ignored with --model {s.model}: put the weights in that folder "
                "(open_clip_model.safetensors) instead"
            )
        return
    import open_clip  # only for names we do not know ourselves (a few seconds)

    if s.model not in open_clip.list_models():
        raise SettingsError(
            f"--model {s.model!r} is unknown: use {', '.join(BUILTIN_MODELS)}, an open_clip model name "
            "(open_clip.list_models()), or local-dir:PATH"
        )


def _check_pretrained(pretrained: str) -> None:
    path = Path(pretrained).expanduser()
    if path.is_dir():
        # An exported folder (ds-clip-export): the trainer loads its open_clip_model.safetensors.
        _need(
            any(path.glob("*.safetensors")) or any(path.glob("*.bin")),
            f"--pretrained {pretrained!r}: the folder holds no *.safetensors or *.bin weights",
        )
        return
    if path.exists():
        return
    if "://" in pretrained or pretrained.startswith("hf-hub:"):
        raise SettingsError(
            f"--pretrained {pretrained!r}: only local files or folders are loaded, not URLs or hubs"
        )
    raise SettingsError(
        f"--pretrained {pretrained!r}: no such file or folder (ds_clip loads local weights only; "
        "open_clip tags like 'openai' are not downloaded)"
    )


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise SettingsError(message)


def validate(s: TrainSettings) -> None:
    """Raise SettingsError naming the flag for the first bad value in `s`. Fast; no deepspeed import."""
    _need(s.batch_size >= 1, f"--batch-size must be >= 1, got {s.batch_size}")
    _need(s.accum_freq >= 1, f"--accum-freq must be >= 1, got {s.accum_freq}")
    _need(s.epochs >= 1, f"--epochs must be >= 1, got {s.epochs}")
    _need(s.max_steps is None or s.max_steps >= 1, f"--max-steps must be >= 1, got {s.max_steps}")
    _need(s.lr > 0, f"--lr must be > 0, got {s.lr}")
    _need(s.wd >= 0, f"--wd must be >= 0, got {s.wd}")
    _need(0 <= s.beta1 < 1, f"--beta1 must be in [0, 1), got {s.beta1}")
    _need(0 <= s.beta2 < 1, f"--beta2 must be in [0, 1), got {s.beta2}")
    _need(s.eps > 0, f"--eps must be > 0, got {s.eps}")
    _need(s.warmup >= 0, f"--warmup must be >= 0, got {s.warmup}")
    _need(
        s.grad_clip_norm is None or s.grad_clip_norm > 0,
        f"--grad-clip-norm must be > 0 (omit it for no clipping), got {s.grad_clip_norm}",
    )
    _need(
        s.precision in PRECISIONS, f"--precision must be one of {', '.join(PRECISIONS)}, got {s.precision!r}"
    )
    _need(
        s.loss_impl in LOSS_IMPLS, f"--loss-impl must be one of {', '.join(LOSS_IMPLS)}, got {s.loss_impl!r}"
    )
    _need(
        s.dataset_type in DATASET_TYPES,
        f"--dataset-type must be one of {', '.join(DATASET_TYPES)}, got {s.dataset_type!r}",
    )
    _need(
        s.zero_stage is None or s.zero_stage in (0, 1, 2, 3),
        f"--zero-stage must be 0, 1, 2 or 3, got {s.zero_stage}",
    )
    _need(s.workers >= 0, f"--workers must be >= 0, got {s.workers}")
    _need(s.log_every_n_steps >= 1, f"--log-every-n-steps must be >= 1, got {s.log_every_n_steps}")
    for flag, value in (
        ("--save-every-n-steps", s.save_every_n_steps),
        ("--val-every-n-steps", s.val_every_n_steps),
        ("--train-num-samples", s.train_num_samples),
        ("--val-num-samples", s.val_num_samples),
    ):
        _need(value is None or value >= 1, f"{flag} must be >= 1, got {value}")
    _need(
        not s.local_loss or s.gather_with_grad,
        "--local-loss without --gather-with-grad does not give the full-batch gradient (each rank would "
        "drop the other ranks' terms): add --gather-with-grad",
    )
    bad = [r for r in s.report_to if r not in REPORTERS]
    _need(not bad, f"--report-to: unknown {', '.join(bad)}; choose from {', '.join(REPORTERS)}")
    _need(
        "wandb" not in s.report_to or importlib.util.find_spec("wandb") is not None,
        "--report-to wandb needs the wandb package (pip install wandb)",
    )
    if s.name is not None:
        _need(
            s.name not in ("", ".", "..") and "/" not in s.name,
            f"--name {s.name!r} must be a folder name, not a path",
        )

    # Data.
    if s.dataset_type == "webdataset":
        _need(bool(s.train_data), "--dataset-type webdataset needs --train-data")
    elif s.train_data:
        raise SettingsError("--train-data is given but --dataset-type is synthetic: drop one of them")
    if s.train_data:
        _check_shards("--train-data", s.train_data)
    if s.val_data and s.val_data != "synthetic":
        _check_shards("--val-data", s.val_data)
    _need(s.max_skipped_steps >= 1, f"--max-skipped-steps must be >= 1, got {s.max_skipped_steps}")
    _need(s.dist_timeout > 0, f"--dist-timeout must be > 0 seconds, got {s.dist_timeout}")
    _need(
        s.keep_checkpoints is None or s.keep_checkpoints >= 1,
        f"--keep-checkpoints must be >= 1, got {s.keep_checkpoints}",
    )
    if s.zeroshot_classes is not None:
        _need(bool(s.val_data), "--zeroshot-classes needs --val-data (the images to classify)")
        _need(
            Path(s.zeroshot_classes).expanduser().is_file(),
            f"--zeroshot-classes {s.zeroshot_classes!r}: no such file",
        )

    # Model and weights.
    if s.pretrained:
        _check_pretrained(s.pretrained)
    _check_model(s)

    # Resume.
    if s.resume == "latest":
        _need(s.name is not None, "--resume latest needs --name of the run to continue")
    elif s.resume is not None:
        _need(Path(s.resume).expanduser().exists(), f"--resume {s.resume!r}: no such checkpoint folder")

    # The DeepSpeed preset: exists, parses, and agrees with the flags (world size unknown yet).
    from ds_clip.ds_config import check_preset  # late import: ds_config imports this module

    check_preset(s)


def settings_to_dict(s: TrainSettings) -> dict[str, Any]:
    """JSON-able copy of the settings, for settings.json in the run folder."""
    return dataclasses.asdict(s)
