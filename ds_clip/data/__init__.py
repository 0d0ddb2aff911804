"""Training data: the built-in captioned dataset, webdataset shards, CSV/TSV files and the step-batch loader.

The trainer needs only `DataSettings` (the `data` section of ds_clip.config's settings), `build_train_data`
and the `StepBatch`es it yields; see docs/data.md for the flags, modes, leftover rule and bad-data
handling. `build_train_data` takes the user's train transform as it is and seeds its draws per sample
itself (`SeededTransform`). Modules, each importing only those below it (import-linter, pyproject.toml):
loader -> wds | table -> regions (the box rows of --siglip2) -> base -> synthetic -> augment.
"""

from ds_clip.data.augment import SeededTransform
from ds_clip.data.base import DataError, DataSettings, StepBatch, TrainData
from ds_clip.data.loader import build_train_data
from ds_clip.data.synthetic import SyntheticCaptions, render_pair

__all__ = [
    "DataError",
    "DataSettings",
    "SeededTransform",
    "StepBatch",
    "SyntheticCaptions",
    "TrainData",
    "build_train_data",
    "render_pair",
]
