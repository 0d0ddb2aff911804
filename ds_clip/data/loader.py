"""The step-batch loader: what the trainer consumes, one optimizer step at a time.

Every optimizer step takes exactly k micro-batches of m pairs on each of W ranks (N = W*k*m).
`TrainData.iter_epoch` yields one `StepBatch` per optimizer step with exactly k full micro-batches,
and every rank yields the same number of steps, so no rank ever waits in a collective for a rank
whose data ran out. Micro-batch j of rank r has the global micro-batch index g = r*k + j, which the
step uses to derive per-micro-batch RNG state: equal on (W=4, k=1) and (W=2, k=2) for the same data.

Leftover rule: pairs that do not fill a whole global batch at the end of an epoch are not trained
(never a smaller step); a warning on logger "ds_clip.data" says how many.

Map-style data (synthetic pairs, CSV rows) share one machinery, `_MapTrainData`: a batch sampler hands
the DataLoader the m indices of each micro-batch, index = first + s*N + g*m + [0, m) for step s and global
micro-batch g, so what a step trains depends on (seed, epoch, s, N) alone, not on the (W, k) split or on
--workers. Synthetic data indexes global sample numbers (first = epoch*samples_per_epoch), CSV data the
positions of the epoch's seeded row order (first = 0; data/table.py maps a position to a row).

Augmentation: all loaders wrap the `preprocess` they are given in a `SeededTransform` (data/augment.py),
so each sample's random draws are a function of (--seed, epoch, sample identity) alone; the caller passes
the user's train transform as it is.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from PIL import Image

from ds_clip.data.augment import SeededTransform
from ds_clip.data.base import (
    DataError,
    DataSettings,
    StepBatch,
    TrainData,
    check_data_settings,
    loader_generator,
    prefetch_factor,
)
from ds_clip.data.synthetic import SyntheticCaptions
from ds_clip.data.table import CsvPairs, Report, check_image_paths, read_table
from ds_clip.data.wds import WebDatasetTrainData
from ds_clip.geometry import BatchGeometry
from ds_clip.stop_signals import loader_workers

logger = logging.getLogger("ds_clip.data")

# Side of a synthetic image when --synthetic-image-size is not set and no model filled it in.
SYNTHETIC_RENDER_SIZE = 64
_LOGGED_PER_REASON = 5  # replaced-row messages logged per reason and epoch; the rest only counted


class _StepIndexSampler:
    """Batch sampler of map-style data: yields the m dataset indices of each micro-batch of this rank."""

    def __init__(self, geometry: BatchGeometry, rank: int, base: int, start_step: int, steps: int) -> None:
        self.g, self.rank, self.base, self.start_step, self.steps = geometry, rank, base, start_step, steps

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.g.accum_freq

    def __iter__(self) -> Iterator[list[int]]:
        g, m, n = self.g, self.g.micro_batch_size, self.g.global_batch
        for s in range(self.start_step, self.steps):
            for gid in g.micro_batch_ids(self.rank):
                first = self.base + s * n + gid * m
                yield list(range(first, first + m))


def _collate(items: list[tuple]) -> tuple[torch.Tensor | None, torch.Tensor | None, list[Report]]:
    """(images, texts) of a micro-batch, plus the reports of rows replaced on the way (CSV; none for the
    synthetic data). (None, None, reports) when an item could not be loaded at all (reason "fatal")."""
    reports = [r for item in items for r in (item[2] if len(item) > 2 else ())]
    if any(item[0] is None for item in items):
        return None, None, reports
    return torch.stack([item[0] for item in items]), torch.stack([item[1] for item in items]), reports


class _MapTrainData(TrainData):
    """Step batches from a map-style dataset with an `epoch` attribute, indexed through _StepIndexSampler.

    Subclasses set dataset, workers, seed, steps_per_epoch, samples_per_epoch and `_first_index(epoch)`.
    """

    dataset: Any
    workers: int
    seed: int
    source: str = ""  # the file named in errors (CSV)
    exact_across_splits = True  # index = first + s*N + g*m + [0, m): a function of N, not of W or k

    def _first_index(self, epoch: int) -> int:
        raise NotImplementedError

    def iter_epoch(self, epoch: int, start_step: int = 0) -> Iterator[StepBatch]:
        self._check_start(epoch, start_step)
        g = self.geometry
        sampler = _StepIndexSampler(g, self.rank, self._first_index(epoch), start_step, self.steps_per_epoch)
        dataset = copy.copy(self.dataset)
        dataset.epoch = epoch  # a fresh copy per epoch: workers get it pickled (or forked) with the epoch set
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=_collate,
            **loader_workers(
                self.workers
            ),  # forkserver; a stop signal is the rank's to handle (stop_signals)
            # Page-locked batches let the step copy them to the GPU with non_blocking=True.
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,
            prefetch_factor=prefetch_factor(g.accum_freq, self.workers),
            generator=loader_generator(self.seed, epoch, self.rank, start_step),
        )
        ids = g.micro_batch_ids(self.rank)
        micro: list[tuple[torch.Tensor, torch.Tensor]] = []
        step = start_step
        skips_before = dict(self.skip_counts)
        logged: dict[str, int] = {}
        for images, texts, reports in loader:
            self._count(reports, logged)
            micro.append((images, texts))
            if len(micro) == g.accum_freq:
                # Counted as trained once handed out: a state_dict() taken after this step resumes after it.
                self._advance(epoch, step)
                yield StepBatch(micro_batches=micro, micro_batch_ids=list(ids), step_in_epoch=step)
                micro, step = [], step + 1
        new = {
            k: v - skips_before.get(k, 0) for k, v in self.skip_counts.items() if v != skips_before.get(k, 0)
        }
        if new:
            logger.warning("rank %d epoch %d: replaced bad rows: %s", self.rank, epoch, new)

    def _count(self, reports: list[Report], logged: dict[str, int]) -> None:
        # One writer: the main process counts and logs what the workers report with each micro-batch.
        for reason, message in reports:
            if reason == "fatal":
                raise DataError(f"--train-data {self.source!r}: {message} (--csv-img-key)")
            self.skip_counts[reason] = self.skip_counts.get(reason, 0) + 1
            seen = logged.get(reason, 0)
            if seen < _LOGGED_PER_REASON:
                last = " (further ones this epoch only counted)" if seen == _LOGGED_PER_REASON - 1 else ""
                logger.warning(
                    "rank %d: %s; the next row of the epoch's order trained instead%s",
                    self.rank,
                    message,
                    last,
                )
            logged[reason] = seen + 1


class SyntheticTrainData(_MapTrainData):
    """Rendered pairs assigned by global sample index: step s of epoch e, micro-batch g trains indices
    e*samples_per_epoch + s*N + g*m + [0, m). Each epoch renders new pairs (the index keeps growing)."""

    def __init__(
        self,
        settings: DataSettings,
        geometry: BatchGeometry,
        rank: int,
        preprocess: Callable[[Image.Image], torch.Tensor],
        tokenizer: Callable[[list[str]], Any],
    ) -> None:
        super().__init__(geometry, rank)
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
            image_size=settings.synthetic_image_size or SYNTHETIC_RENDER_SIZE,
        )

    def _first_index(self, epoch: int) -> int:
        return epoch * self.samples_per_epoch


class CsvTrainData(_MapTrainData):
    """Rows of a CSV/TSV file (open_clip's --dataset-type csv): step s of epoch e, micro-batch g trains the
    rows at positions s*N + g*m + [0, m) of the epoch's row order, seeded by (seed, e). Every row once per
    epoch, the positions beyond steps_per_epoch*N (< N of them, or beyond --train-num-samples) left out."""

    def __init__(
        self,
        settings: DataSettings,
        geometry: BatchGeometry,
        rank: int,
        preprocess: Callable[[Image.Image], torch.Tensor],
        tokenizer: Callable[[list[str]], Any],
    ) -> None:
        super().__init__(geometry, rank)
        assert settings.train_data is not None  # validated
        self.source = settings.train_data
        paths, captions = read_table(
            os.path.expanduser(settings.train_data),
            settings.csv_img_key,
            settings.csv_caption_key,
            settings.csv_separator,
        )
        n = geometry.global_batch
        available = min(len(paths), settings.train_num_samples or len(paths))
        self.steps_per_epoch = available // n
        if self.steps_per_epoch == 0:
            raise DataError(
                f"--train-data {settings.train_data!r} has {len(paths)} rows"
                f"{f' (--train-num-samples {available})' if available < len(paths) else ''}, fewer than one "
                f"global batch N = W*k*m = {n}"
            )
        check_image_paths(settings.train_data, paths)
        self.samples_per_epoch = self.steps_per_epoch * n
        if self.samples_per_epoch < len(paths):
            logger.warning(
                "each epoch trains %d of the %d rows of %s; %d rows that do not fill a global batch of N=%d%s "
                "are left out (a different set each epoch: the row order is reshuffled)",
                self.samples_per_epoch,
                len(paths),
                settings.train_data,
                len(paths) - self.samples_per_epoch,
                n,
                " or lie beyond --train-num-samples" if available < len(paths) else "",
            )
        self.workers = settings.workers
        self.seed = settings.seed
        self.dataset = CsvPairs(
            paths=paths,
            captions=captions,
            seed=settings.seed,
            preprocess=SeededTransform(preprocess, settings.seed),
            tokenizer=tokenizer,
        )

    def _first_index(self, epoch: int) -> int:
        return 0  # positions in the epoch's own row order


def build_train_data(
    settings: DataSettings,
    *,
    preprocess: Callable[[Image.Image], torch.Tensor],
    tokenizer: Callable[[list[str]], Any],
    rank: int,
    geometry: BatchGeometry,
    locca_tasks: bool = False,
) -> TrainData:
    """Build rank ``rank``'s loader of the run's ``geometry``: k micro-batches of m pairs per step on each of
    the W ranks.

    Pass the user's train transform as `preprocess`, unchanged: the loader wraps it in a SeededTransform
    with `settings.seed` itself (an already wrapped one is not wrapped twice).

    `locca_tasks` (--siglip2, the loss section's `siglip2`): webdataset texts are [3, L], the caption and one
    region's ARef and GCap rows read from each sample's json (ds_clip.data.regions, docs/data.md); synthetic
    and CSV data have no boxes and keep [L] texts.
    """
    check_data_settings(settings)
    if not 0 <= rank < geometry.world_size:
        raise DataError(f"rank {rank} is not in a world of size {geometry.world_size}")
    if settings.dataset_type == "synthetic":
        return SyntheticTrainData(settings, geometry, rank, preprocess, tokenizer)
    if settings.dataset_type == "csv":
        return CsvTrainData(settings, geometry, rank, preprocess, tokenizer)
    return WebDatasetTrainData(settings, geometry, rank, preprocess, tokenizer, locca_tasks=locca_tasks)


__all__ = [
    "CsvTrainData",
    "DataError",
    "DataSettings",
    "StepBatch",
    "SyntheticTrainData",
    "TrainData",
    "build_train_data",
]
