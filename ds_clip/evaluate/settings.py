"""What one evaluation reads (``EvalSettings``), its error kind and the constants of the built-in validation
pairs: the layer every other evaluation module builds on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ds_clip.config import DataSettings, EvalSectionSettings, TrainSettings
from ds_clip.errors import RunError, UserError

SYNTHETIC = "synthetic"
SYNTHETIC_VAL_OFFSET = 2**40
DEFAULT_SYNTHETIC_VAL_SAMPLES = 512

# forward(image=..., text=...) -> open_clip's output dict (either input may be None).
Forward = Callable[..., dict]


class EvalError(UserError):
    """Bad evaluation input (a flag, file or pattern); the message names it."""

    same_on_every_rank = (
        False  # every rank reads the evaluation inputs on its own host: each says what it found
    )


class EvalFailed(RunError):
    """An evaluation that could not finish on some rank (its samples unreadable, a forward that raised).
    Every rank raises it together, with the same message (the ranks agree on it before any further
    collective), so the trainer can log it and train on."""


_TABLE_SUFFIXES = (".csv", ".tsv")


def is_table(val_data: str, dataset_type: str = "auto") -> bool:
    """Whether --val-data is a CSV/TSV file, read as open_clip reads it: a .csv/.tsv file, or a file (not a
    .tar shard) when --dataset-type is csv (open_clip reads --val-data with the training data's type)."""
    if val_data == SYNTHETIC:
        return False
    low = val_data.lower()
    return low.endswith(_TABLE_SUFFIXES) or (
        dataset_type == "csv" and not low.endswith(".tar") and "::" not in low and "{" not in low
    )


# ds-clip-eval's own default: it runs no backward, so a larger batch fits.
EVAL_BATCH_SIZE = 64


@dataclass
class EvalSettings:
    """What one evaluation reads. Not a second definition of flags: the trainer builds it from its
    settings (`from_settings`: the `eval` section plus the data and batch values it shares) and ds-clip-eval
    from the same fields' flags (`build_parser`); the defaults below are those fields' defaults, but for
    ds-clip-eval's larger batch."""

    val_data: str
    """--val-data."""
    val_num_samples: int | None = EvalSectionSettings.val_num_samples
    """--val-num-samples."""
    batch_size: int = EVAL_BATCH_SIZE
    """--batch-size: pairs per forward pass per rank."""
    zeroshot_classes: str | None = EvalSectionSettings.zeroshot_classes
    """--zeroshot-classes."""
    seed: int = DataSettings.seed
    """--seed: of the synthetic validation pairs."""
    image_size: int = 64
    """Side at which synthetic images are rendered: the model's image size (its preprocess resizes)."""
    image_key: str = DataSettings.image_key
    """--image-key."""
    caption_key: str = DataSettings.caption_key
    """--caption-key."""
    table: bool = False
    """--val-data is a CSV/TSV file (``is_table``), read with the three --csv-* keys below."""
    csv_separator: str = DataSettings.csv_separator
    """--csv-separator."""
    csv_img_key: str = DataSettings.csv_img_key
    """--csv-img-key."""
    csv_caption_key: str = DataSettings.csv_caption_key
    """--csv-caption-key."""

    @classmethod
    def from_settings(cls, s: TrainSettings, image_size: int) -> EvalSettings | None:
        """The evaluation of a training run (None without --val-data); evaluates m pairs per pass."""
        if not s.eval.val_data:
            return None
        return cls(
            val_data=s.eval.val_data,
            val_num_samples=s.eval.val_num_samples,
            batch_size=s.optim.batch_size,
            zeroshot_classes=s.eval.zeroshot_classes,
            seed=s.data.seed,
            image_size=image_size,
            image_key=s.data.image_key,
            caption_key=s.data.caption_key,
            table=is_table(s.eval.val_data, s.data.dataset_type),
            csv_separator=s.data.csv_separator,
            csv_img_key=s.data.csv_img_key,
            csv_caption_key=s.data.csv_caption_key,
        )
