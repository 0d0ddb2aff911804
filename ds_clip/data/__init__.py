"""Training data: the built-in captioned dataset, the webdataset pipeline and the step-batch loader.

The trainer needs only `DataSettings`, `build_train_data` and the `StepBatch`es it yields; see
docs/data.md for the flags, modes, leftover rule and bad-data handling. `build_train_data` takes the
user's train transform as it is and seeds its draws per sample itself (`SeededTransform`).
"""

from ds_clip.data.augment import SeededTransform
from ds_clip.data.loader import DataError, DataSettings, StepBatch, TrainData, build_train_data
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
