"""What a settings field is: its metadata (`opt`) and the choices and defaults fields share.

Each field of a section (ds_clip.config.sections) is one flag; `opt(...)` adds what the field's type, default
and docstring cannot say (another flag name, choices, a unit, how the flag relates to open_clip's).
"""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any

from ds_clip.ds_config.presets import DEEPSPEED_PRECISIONS

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
