"""The step-batch loader: what the trainer consumes, one optimizer step at a time.

Every optimizer step takes exactly k micro-batches of m pairs on each of W ranks (N = W*k*m).
`TrainData.iter_epoch` yields one `StepBatch` per optimizer step with exactly k full micro-batches,
and every rank yields the same number of steps, so no rank ever waits in a collective for a rank
whose data ran out. Micro-batch j of rank r has the global micro-batch index g = r*k + j, which the
step uses to derive per-micro-batch RNG state: equal on (W=4, k=1) and (W=2, k=2) for the same data.

Leftover rule: pairs that do not fill a whole global batch at the end of an epoch are not trained
(never a smaller step); a warning on logger "ds_clip.data" says how many.

Augmentation: both loaders wrap the `preprocess` they are given in a `SeededTransform` (data/augment.py),
so each sample's random draws are a function of (--seed, epoch, sample identity) alone; the caller passes
the user's train transform as it is.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from ds_clip.data.augment import SeededTransform
from ds_clip.data.synthetic import SyntheticCaptions
from ds_clip.errors import UserError

logger = logging.getLogger("ds_clip.data")

DATASET_TYPES = ("synthetic", "webdataset")


class DataError(UserError):
    """Bad data settings or unusable data; the message names the flag, file or pattern."""


@dataclass
class StepBatch:
    """The inputs of one optimizer step on this rank."""

    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    """Exactly k items: (images [m, 3, H, W] float, texts [m, L] long)."""
    micro_batch_ids: list[int]
    """Global micro-batch index g = rank*k + j of each item, for per-micro-batch RNG derivation."""
    step_in_epoch: int
    """0-based index of this optimizer step within its epoch."""


@dataclass
class DataSettings:
    """Settings of the training data (flag names in the docstrings)."""

    dataset_type: str = "synthetic"
    """--dataset-type: "synthetic" (built-in rendered shapes, no download) or "webdataset" (tar shards)."""
    train_data: str | None = None
    """--train-data: shard list, brace-expanded ("shards/{00000..00127}.tar"), sources joined by "::",
    local paths, globs or "pipe:" commands. Required for webdataset."""
    train_num_samples: int | None = None
    """--train-num-samples: pairs per epoch. Required for synthetic and resampled webdataset; in
    exact-epoch webdataset mode an optional cap on the counted size."""
    dataset_resampled: bool = False
    """--dataset-resampled: draw shards with replacement (seeded per epoch and rank); an epoch is then
    train_num_samples pairs. Without it, every sample is seen exactly once per epoch."""
    image_key: str = "jpg;jpeg;png;webp"
    """--image-key: ";"-separated tar member extensions tried in order for the image."""
    caption_key: str = "txt"
    """--caption-key: ";"-separated tar member extensions tried in order for the caption."""
    workers: int = 1
    """--workers: DataLoader worker processes per rank (0: load in the training process)."""
    seed: int = 0
    """--seed: seeds the synthetic dataset, the shard order, the sample shuffle and each sample's augmentation."""
    synthetic_image_size: int = 64
    """--synthetic-image-size: side in pixels at which synthetic images are rendered (preprocess resizes)."""
    shuffle_buffer: int = 1000
    """--shuffle-buffer: webdataset samples (undecoded) each worker shuffles over; 0 or 1 disables."""

    def validate(self) -> None:
        """Raise DataError naming the flag of the first invalid value."""
        if self.dataset_type not in DATASET_TYPES:
            raise DataError(f"--dataset-type must be one of {DATASET_TYPES}, got {self.dataset_type!r}")
        if self.workers < 0:
            raise DataError(f"--workers must be >= 0, got {self.workers}")
        if self.train_num_samples is not None and self.train_num_samples <= 0:
            raise DataError(f"--train-num-samples must be > 0, got {self.train_num_samples}")
        if self.synthetic_image_size < 8:
            raise DataError(f"--synthetic-image-size must be >= 8, got {self.synthetic_image_size}")
        if self.dataset_type == "synthetic" and self.train_num_samples is None:
            raise DataError("--dataset-type synthetic needs --train-num-samples (pairs per epoch)")
        if self.dataset_type == "webdataset":
            if not self.train_data:
                raise DataError("--dataset-type webdataset needs --train-data (a shard pattern)")
            if self.dataset_resampled and self.train_num_samples is None:
                raise DataError("--dataset-resampled needs --train-num-samples (it defines an epoch)")
        for flag, value in (("--image-key", self.image_key), ("--caption-key", self.caption_key)):
            if not [k for k in value.split(";") if k.strip()]:
                raise DataError(f"{flag} must name at least one extension, got {value!r}")


def loader_generator(*parts: object) -> torch.Generator:
    """A generator for a DataLoader's worker base seed, seeded from `parts`.

    Without one, every DataLoader iterator draws its base seed from the training process's global torch
    generator: iterating the data would move the trainer's RNG, by an amount that depends on how many
    iterators were made (epochs, passes, restarts). Augmentation does not use the workers' generators
    (SeededTransform seeds per sample), so this only keeps the training process's generator untouched.
    """
    digest = hashlib.blake2b(repr(("loader",) + parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


@dataclass
class _Geometry:
    """The batch arithmetic shared by both kinds of data."""

    rank: int
    world_size: int
    micro_batch_size: int  # m
    accum_freq: int  # k

    @property
    def global_batch(self) -> int:  # N = W*k*m
        return self.world_size * self.accum_freq * self.micro_batch_size

    def micro_batch_ids(self) -> list[int]:
        return [self.rank * self.accum_freq + j for j in range(self.accum_freq)]


class TrainData:
    """Base of the two loaders. Subclasses set samples_per_epoch, steps_per_epoch, iter_epoch."""

    samples_per_epoch: int
    """Global pairs trained per epoch (= steps_per_epoch * N)."""
    steps_per_epoch: int
    """Optimizer steps per epoch, equal on every rank."""

    def __init__(self, geometry: _Geometry) -> None:
        self.geometry = geometry
        self.skip_counts: dict[str, int] = {}
        self.epoch = 0
        self.step_in_epoch = 0

    def iter_epoch(self, epoch: int, start_step: int = 0) -> Iterator[StepBatch]:
        raise NotImplementedError

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
        if saved != (g.world_size, g.accum_freq, g.micro_batch_size):
            logger.warning(
                "data position was saved with (W, k, m) = %s, now %s: the step count is kept, "
                "but which samples the rest of the epoch sees is not the same as without the restart",
                saved,
                (g.world_size, g.accum_freq, g.micro_batch_size),
            )
        self.epoch = int(state["epoch"])
        self.step_in_epoch = int(state["step_in_epoch"])
        self.skip_counts = dict(state.get("skip_counts", {}))


class _StepIndexSampler:
    """Batch sampler of the synthetic data: yields the m global sample indices of each micro-batch."""

    def __init__(self, geometry: _Geometry, base: int, start_step: int, steps: int) -> None:
        self.g, self.base, self.start_step, self.steps = geometry, base, start_step, steps

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.g.accum_freq

    def __iter__(self) -> Iterator[list[int]]:
        g, m, n = self.g, self.g.micro_batch_size, self.g.global_batch
        for s in range(self.start_step, self.steps):
            for gid in g.micro_batch_ids():
                first = self.base + s * n + gid * m
                yield list(range(first, first + m))


class SyntheticTrainData(TrainData):
    """Rendered pairs assigned by global sample index: step s of epoch e, micro-batch g trains indices
    e*samples_per_epoch + s*N + g*m + [0, m). Each epoch renders new pairs (the index keeps growing)."""

    def __init__(
        self,
        settings: DataSettings,
        geometry: _Geometry,
        preprocess: Callable[[Image.Image], torch.Tensor],
        tokenizer: Callable[[list[str]], Any],
    ) -> None:
        super().__init__(geometry)
        assert settings.train_num_samples is not None  # validated
        n = geometry.global_batch
        self.steps_per_epoch = settings.train_num_samples // n
        if self.steps_per_epoch == 0:
            raise DataError(
                f"--train-num-samples {settings.train_num_samples} is smaller than one global batch "
                f"N = W*k*m = {n}"
            )
        self.samples_per_epoch = self.steps_per_epoch * n
        if self.samples_per_epoch != settings.train_num_samples:
            logger.warning(
                "--train-num-samples %d is not a multiple of the global batch N=%d: each epoch trains "
                "%d steps = %d pairs (%d fewer)",
                settings.train_num_samples,
                n,
                self.steps_per_epoch,
                self.samples_per_epoch,
                settings.train_num_samples - self.samples_per_epoch,
            )
        self.workers = settings.workers
        self.seed = settings.seed
        # The augmentation of global sample i in epoch e is a function of (seed, e, i) alone.
        self.dataset = SyntheticCaptions(
            seed=settings.seed,
            preprocess=SeededTransform(preprocess, settings.seed),
            tokenizer=tokenizer,
            image_size=settings.synthetic_image_size,
        )

    def iter_epoch(self, epoch: int, start_step: int = 0) -> Iterator[StepBatch]:
        self._check_start(epoch, start_step)
        g = self.geometry
        sampler = _StepIndexSampler(g, epoch * self.samples_per_epoch, start_step, self.steps_per_epoch)
        dataset = copy.copy(self.dataset)
        dataset.epoch = epoch  # a fresh copy per epoch: workers get it pickled (or forked) with the epoch set
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.workers,
            persistent_workers=False,
            prefetch_factor=4 if self.workers > 0 else None,
            generator=loader_generator(self.seed, epoch, g.rank, start_step),
        )
        ids = g.micro_batch_ids()
        micro: list[tuple[torch.Tensor, torch.Tensor]] = []
        step = start_step
        for images, texts in loader:
            micro.append((images, texts))
            if len(micro) == g.accum_freq:
                # Counted as trained once handed out: a state_dict() taken after this step resumes after it.
                self._advance(epoch, step)
                yield StepBatch(micro_batches=micro, micro_batch_ids=list(ids), step_in_epoch=step)
                micro, step = [], step + 1


def build_train_data(
    settings: DataSettings,
    *,
    preprocess: Callable[[Image.Image], torch.Tensor],
    tokenizer: Callable[[list[str]], Any],
    rank: int,
    world_size: int,
    batch_size: int,
    accum_freq: int,
) -> TrainData:
    """Build this rank's loader. `batch_size` is the micro-batch size m per rank, `accum_freq` is k.

    Pass the user's train transform as `preprocess`, unchanged: the loader wraps it in a SeededTransform
    with `settings.seed` itself (an already wrapped one is not wrapped twice).
    """
    settings.validate()
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is not in a world of size {world_size}")
    if batch_size < 1:
        raise DataError(f"--batch-size must be >= 1, got {batch_size}")
    if accum_freq < 1:
        raise DataError(f"--accum-freq must be >= 1, got {accum_freq}")
    geometry = _Geometry(rank=rank, world_size=world_size, micro_batch_size=batch_size, accum_freq=accum_freq)
    if settings.dataset_type == "synthetic":
        return SyntheticTrainData(settings, geometry, preprocess, tokenizer)
    from ds_clip.data.wds import WebDatasetTrainData  # wds imports this module: import late

    return WebDatasetTrainData(settings, geometry, preprocess, tokenizer)


__all__ = [
    "DataError",
    "DataSettings",
    "StepBatch",
    "SyntheticTrainData",
    "TrainData",
    "build_train_data",
]
