"""What the loaders share: the step batch, the loader base class, the data error.

`DataSettings` is the `data` section of the training settings (ds_clip.config), used as it is; the batch
geometry (W, k, m) is the run's `ds_clip.geometry.BatchGeometry`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ds_clip.config import DATASET_TYPES, DataSettings, SettingsError, check_data
from ds_clip.errors import UserError
from ds_clip.geometry import BatchGeometry

logger = logging.getLogger("ds_clip.data")


class DataError(UserError):
    """Bad data settings or unusable data; the message names the flag, file or pattern."""

    same_on_every_rank = False  # each rank reads its own shards and rows: every rank says what it found


# Reasons counted in `skip_counts` that leave the sample in training: only its box annotations, or one of its
# regions, are left out (--siglip2's LocCa rows, ds_clip.data.regions). They are bad data worth counting and
# resuming with, but not skipped samples.
REGION_REASONS: frozenset[str] = frozenset({"bad_json", "bad_region", "region_outside_crop"})


def check_data_settings(settings: DataSettings) -> None:
    """The data section's rules (ds_clip.config.check_data) as a DataError, plus what a loader needs
    that the command line fills in: the number of synthetic pairs per epoch."""
    try:
        check_data(settings)
    except SettingsError as exc:
        raise DataError(str(exc)) from None
    if settings.dataset_type == "synthetic" and settings.train_num_samples is None:
        raise DataError("--dataset-type synthetic needs --train-num-samples (pairs per epoch)")


@dataclass
class StepBatch:
    """The inputs of one optimizer step on this rank."""

    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    """Exactly k items: (images [m, 3, H, W] float, texts [m, L] long; [m, 3, L] from webdataset shards under
    --siglip2: the caption, ARef and GCap rows, ds_clip.data.regions)."""
    micro_batch_ids: list[int]
    """Global micro-batch index g = rank*k + j of each item, for per-micro-batch RNG derivation."""
    step_in_epoch: int
    """0-based index of this optimizer step within its epoch."""


def prefetch_factor(accum_freq: int, workers: int) -> int | None:
    """Micro-batches each DataLoader worker may prepare ahead: enough for the workers to fill a whole step's k
    while the previous step computes (the step takes its k micro-batches at once; with fewer in the buffer
    it waits for the rest, e.g. 4 of 8 with one worker at k = 8), and at least DataLoader's usual 4.
    Host memory: up to k more micro-batches of inputs. None without workers (DataLoader's rule)."""
    if workers <= 0:
        return None
    return max(4, -(-accum_freq // workers))


def loader_generator(*parts: object) -> torch.Generator:
    """A generator for a DataLoader's worker base seed, seeded from `parts`.

    Without one, every DataLoader iterator draws its base seed from the training process's global torch
    generator: iterating the data would move the trainer's RNG, by an amount that depends on how many
    iterators were made (epochs, passes, restarts). Augmentation does not use the workers' generators
    (SeededTransform seeds per sample), so this only keeps the training process's generator untouched.
    """
    digest = hashlib.blake2b(repr(("loader",) + parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class TrainData:
    """Base of the two loaders. Subclasses set samples_per_epoch, steps_per_epoch, iter_epoch."""

    samples_per_epoch: int
    """Global pairs trained per epoch (= steps_per_epoch * N)."""
    steps_per_epoch: int
    """Optimizer steps per epoch, equal on every rank."""

    image_normalize: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    """(mean, std) when the micro-batches' images are uint8 (--decode fast): the step normalises them on the
    accelerator (``cached_step(image_normalize=...)``); None: they are the transform's float tensors."""

    exact_across_splits: bool = False
    """True when what step s trains depends on (seed, epoch, s, N) alone, not on the (W, k) split: then a
    position saved on one world size resumes the very same samples on another with the same N."""

    def __init__(self, geometry: BatchGeometry, rank: int) -> None:
        self.geometry, self.rank = geometry, rank
        self.skip_counts: dict[str, int] = {}
        self.epoch = 0
        self.step_in_epoch = 0

    def iter_epoch(self, epoch: int, start_step: int = 0) -> Iterator[StepBatch]:
        raise NotImplementedError

    def skipped_samples(self) -> int:
        """Samples this rank's loader skipped as bad so far (`skip_counts` less the regions left out of kept
        samples)."""
        return sum(n for reason, n in self.skip_counts.items() if reason not in REGION_REASONS)

    def _check_start(self, epoch: int, start_step: int) -> None:
        if epoch < 0 or not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(
                f"cannot start epoch {epoch} at step {start_step}: an epoch has {self.steps_per_epoch} steps"
            )

    def _advance(self, epoch: int, step: int) -> None:
        # Called after a StepBatch is handed out: the saved position is "next step to train".
        self.epoch, self.step_in_epoch = epoch, step + 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Position of the next step to train: pass `epoch`, `step_in_epoch` to iter_epoch on resume."""
        g = self.geometry
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "world_size": g.world_size,
            "accum_freq": g.accum_freq,
            "micro_batch_size": g.micro_batch_size,
            "skip_counts": dict(self.skip_counts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        g = self.geometry
        saved = (state.get("world_size"), state.get("accum_freq"), state.get("micro_batch_size"))
        saved_n = None if None in saved else saved[0] * saved[1] * saved[2]  # type: ignore[operator]
        same_samples = self.exact_across_splits and saved_n == g.global_batch
        if saved != (g.world_size, g.accum_freq, g.micro_batch_size) and not same_samples:
            logger.warning(
                "data position was saved with (W, k, m) = %s, now %s: the step count is kept, "
                "but which samples the rest of the epoch sees is not the same as without the restart",
                saved,
                (g.world_size, g.accum_freq, g.micro_batch_size),
            )
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.skip_counts = dict(state.get("skip_counts", {}))


__all__ = [
    "DATASET_TYPES",
    "DataError",
    "DataSettings",
    "REGION_REASONS",
    "StepBatch",
    "TrainData",
    "check_data_settings",
    "loader_generator",
]
