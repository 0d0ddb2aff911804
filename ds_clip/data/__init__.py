"""Training data: the built-in captioned dataset, the webdataset pipeline and the step-batch loader.

The trainer needs only `DataSettings`, `build_train_data` and the `StepBatch`es it yields; see
docs/data.md for the flags, modes, leftover rule and bad-data handling.
"""

from ds_clip.data.loader import DataError, DataSettings, StepBatch, TrainData, build_train_data
from ds_clip.data.synthetic import SyntheticCaptions, render_pair

__all__ = [
    "DataError",
    "DataSettings",
    "StepBatch",
    "SyntheticCaptions",
    "TrainData",
    "build_train_data",
    "render_pair",
]
