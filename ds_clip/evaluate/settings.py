"""What one evaluation reads (``EvalSettings``), its error kind and the constants of the built-in validation
pairs: the layer every other evaluation module builds on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ds_clip.config import DataSettings, EvalSectionSettings, TrainSettings
from ds_clip.errors import UserError

SYNTHETIC = "synthetic"
SYNTHETIC_VAL_OFFSET = 2**40
DEFAULT_SYNTHETIC_VAL_SAMPLES = 512

# forward(image=..., text=...) -> open_clip's output dict (either input may be None).
Forward = Callable[..., dict]


class EvalError(UserError):
    """Bad evaluation input (a flag, file or pattern); the message names it."""


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
        )
