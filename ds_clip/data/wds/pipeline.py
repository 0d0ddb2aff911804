"""The webdataset loader of one rank: the plan of an epoch (exact-epoch pieces or resampled draws), the
DataLoader workers that read, decode and batch their part, and the main process that takes their
micro-batches round-robin into step batches and records the position a resume starts from. The modes and
the order are described in ``ds_clip.data.wds``."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from ds_clip.data.augment import SeededTransform
from ds_clip.data.base import (
    REGION_REASONS,
    DataError,
    DataSettings,
    StepBatch,
    TrainData,
    loader_generator,
    prefetch_factor,
)
from ds_clip.data.decode import FastCrop
from ds_clip.data.regions import LoccaTexts
from ds_clip.data.wds.samples import RawSample, SkipCounter, decode_sample, iter_shard, shuffled
from ds_clip.data.wds.shardlist import expand_urls, shard_sizes, shard_weights
from ds_clip.geometry import BatchGeometry
from ds_clip.sources.urls import shard_name
from ds_clip.stop_signals import loader_workers

logger = logging.getLogger("ds_clip.data")

# What a sample's random draws are keyed by, recorded in the data position: a checkpoint without it keyed them
# by the shard's path as written, and its resume says the draws change.
DRAWS_KEYED_BY = "shard name, sample key"
_RESAMPLED_EMPTY_DRAWS = 10  # x number of shards drawn without one valid sample -> error, not an endless loop


def _seed(*parts: object) -> int:
    return int.from_bytes(
        hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little"
    )


@dataclass
class _Piece:
    url: str
    skip: int
    take: int


@dataclass
class _EpochPlan:
    """What every worker of this rank reads in one pass over an epoch."""

    epoch: int
    pieces: list[list[_Piece]] | None  # per worker (exact mode); None: resampled
    raw_skip: list[int]  # per worker: shuffled raw samples to pass over undecoded (resume)
    count: bool = True  # False on refill passes: their bad samples were counted already


@dataclass
class _Pipeline:
    """Everything a worker needs, picklable."""

    urls: list[str]
    rank: int
    workers: int
    micro_batch_size: int
    seed: int
    shuffle_buffer: int
    image_exts: tuple[str, ...]
    caption_exts: tuple[str, ...]
    augment: SeededTransform
    fast: SeededTransform | None  # a seeded FastCrop (--decode fast and open_clip's train transform)
    tokenizer: Callable[[list[str]], Any]
    weights: list[float] | None = None  # per shard, resampled mode with --train-data-upsampling-factors
    locca: LoccaTexts | None = None  # --siglip2: [3, L] texts (caption, ARef and GCap rows)
    plan: _EpochPlan | None = field(default=None)


def _report(counter: SkipCounter, raw: RawSample, reason: str, detail: str) -> None:
    """A region left out of a sample that still trains: counted and logged as bad samples are."""
    counter.add(reason, raw.url, f"sample {raw.key!r}: {detail}")


class _WorkerStream(torch.utils.data.IterableDataset):
    """Yields (images, texts, meta) per micro-batch, then one end marker (None, None, meta)."""

    def __init__(self, pipe: _Pipeline) -> None:
        self.pipe = pipe

    def _raw(self, worker: int, counter: SkipCounter, opened: list[int]) -> Iterator[RawSample]:
        p, plan = self.pipe, self.pipe.plan
        assert plan is not None
        if plan.pieces is not None:
            for piece in plan.pieces[worker]:
                opened[0] += 1
                yield from iter_shard(piece.url, counter, piece.skip, piece.take)
            return
        rng = random.Random(_seed("shards", p.seed, plan.epoch, p.rank, worker))
        empty_draws = 0
        while True:  # resampled: endless draws with replacement; the main process stops reading
            # Without factors rng.choice as before the flag existed: the same seed draws the same shards.
            url = rng.choices(p.urls, weights=p.weights)[0] if p.weights else rng.choice(p.urls)
            opened[0] += 1
            got = 0
            for sample in iter_shard(url, counter):
                got += 1
                yield sample
            empty_draws = 0 if got else empty_draws + 1
            if empty_draws >= _RESAMPLED_EMPTY_DRAWS * len(p.urls):
                raise DataError(f"{empty_draws} shard draws in a row gave no sample")

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None, dict[str, Any]]]:
        p, plan = self.pipe, self.pipe.plan
        assert plan is not None
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        counter = SkipCounter(enabled=plan.count)
        opened = [0]
        consumed, valid = 0, 0
        images: list[torch.Tensor] = []
        texts: list[torch.Tensor] = []

        def meta(**extra: Any) -> dict[str, Any]:
            skips, messages = counter.take()
            return {"worker": worker, "raw_end": consumed, "skips": skips, "messages": messages, **extra}

        try:
            rng = random.Random(_seed("samples", p.seed, plan.epoch, p.rank, worker))
            for raw in shuffled(self._raw(worker, counter, opened), p.shuffle_buffer, rng):
                consumed += 1
                if consumed <= plan.raw_skip[worker]:
                    continue  # trained before a restart: not decoded again
                # The sample's draws: a function of (seed, epoch, shard name, key) alone, never of the folder,
                # bucket or command that reaches the shard (sources.urls.shard_name).
                sample = (shard_name(raw.url), raw.key)
                regions = None
                if p.locca is not None:
                    regions = functools.partial(
                        p.locca,
                        meta=raw.data.get("json"),
                        epoch=plan.epoch,
                        sample=sample,
                        report=functools.partial(_report, counter, raw),
                    )
                out = decode_sample(
                    raw,
                    image_exts=p.image_exts,
                    caption_exts=p.caption_exts,
                    preprocess=functools.partial(p.augment, epoch=plan.epoch, sample=sample),
                    tokenizer=p.tokenizer,
                    fast=None
                    if p.fast is None
                    else functools.partial(p.fast, epoch=plan.epoch, sample=sample),
                    regions=regions,
                )
                if isinstance(out, str):
                    counter.add(out, raw.url, f"sample {raw.key!r}")
                    if (
                        plan.pieces is None
                        and valid == 0
                        and opened[0] >= _RESAMPLED_EMPTY_DRAWS * len(p.urls)
                    ):
                        raise DataError(f"{opened[0]} shard draws gave no valid sample")
                    continue
                valid += 1
                images.append(out[0])
                texts.append(out[1])
                if len(images) == p.micro_batch_size:
                    yield torch.stack(images), torch.stack(texts), meta()
                    images, texts = [], []
            if images:  # only when bad samples made this worker's share fall short of whole micro-batches
                yield torch.stack(images), torch.stack(texts), meta()
            yield None, None, meta(end=True)
        except DataError as exc:
            # Sent as data, not raised: a worker's exception would reach the user as a deep traceback.
            yield None, None, meta(end=True, fatal=str(exc))


class WebDatasetTrainData(TrainData):
    """Step batches from tar shards; see the module docstring for the two modes."""

    def __init__(
        self,
        settings: DataSettings,
        geometry: BatchGeometry,
        rank: int,
        preprocess: Callable[[Image.Image], torch.Tensor],
        tokenizer: Callable[[list[str]], Any],
        *,
        locca_tasks: bool = False,
    ) -> None:
        super().__init__(geometry, rank)
        assert settings.train_data is not None  # validated
        self.settings = settings
        self.workers = settings.workers
        self.urls = expand_urls(settings.train_data)
        self.resampled = settings.dataset_resampled
        n = geometry.global_batch
        slots = geometry.world_size * max(self.workers, 1)
        self.sizes: list[int] | None = None
        if self.resampled:
            assert settings.train_num_samples is not None  # validated
            available = settings.train_num_samples
            logger.info("samples per epoch: %d from --train-num-samples (resampled)", available)
        else:
            if slots > len(self.urls):
                raise DataError(
                    f"--train-data has {len(self.urls)} shards, fewer than ranks x workers = "
                    f"{geometry.world_size} x {max(self.workers, 1)} = {slots}: every worker needs at least "
                    "one shard in exact-epoch mode (make more, smaller shards, use fewer --workers, or "
                    "--dataset-resampled)"
                )
            # The exact-epoch plan needs every shard's count, also under --train-num-samples (which caps it).
            self.sizes, source = shard_sizes(self.urls)
            total = sum(self.sizes)
            available = min(total, settings.train_num_samples or total)
            cap = (
                f"; an epoch is --train-num-samples {available} of them" if settings.train_num_samples else ""
            )
            logger.info("samples: %s%s", source, cap)
        self.steps_per_epoch = available // n
        if self.steps_per_epoch == 0:
            raise DataError(
                f"--train-data {settings.train_data!r} has {available} samples, fewer than one global batch "
                f"N = W*k*m = {n}"
            )
        self.samples_per_epoch = self.steps_per_epoch * n
        if not self.resampled and self.samples_per_epoch < sum(self.sizes or []):
            logger.warning(
                "each epoch trains %d of the %d samples in %d shards; %d samples that do not fill a global "
                "batch of N=%d%s are left out (a different set each epoch: the shard order is reshuffled)",
                self.samples_per_epoch,
                sum(self.sizes or []),
                len(self.urls),
                sum(self.sizes or []) - self.samples_per_epoch,
                n,
                " or lie beyond --train-num-samples" if settings.train_num_samples else "",
            )
        fast = FastCrop.of(preprocess) if settings.decode == "fast" else None
        if fast is not None:
            self.image_normalize = (fast.mean, fast.std)
        logger.info(
            "decode: %s",
            "fast (crop chosen from the JPEG header, reduced-size decode, uint8, normalised on the accelerator)"
            if fast is not None
            else f"exact (--decode {settings.decode}"
            + ("" if settings.decode == "exact" else "; the train transform is not open_clip's plain crop")
            + ")",
        )
        # Built here, not in the workers: a transform whose geometry cannot be followed is a start-up error.
        locca = LoccaTexts.of(preprocess, tokenizer, settings.seed) if locca_tasks else None
        if locca is not None and rank == 0:
            logger.info(
                "--siglip2: texts are [3, L]: the caption, then one region's ARef and GCap rows from the samples' "
                ".json (zeros without one); boxes follow %r",
                locca.geometry.transform,
            )
        self._pipeline = _Pipeline(
            urls=self.urls,
            rank=rank,
            workers=self.workers,
            micro_batch_size=geometry.micro_batch_size,
            seed=settings.seed,
            shuffle_buffer=settings.shuffle_buffer,
            image_exts=tuple(e.strip().lower() for e in settings.image_key.split(";") if e.strip()),
            caption_exts=tuple(e.strip().lower() for e in settings.caption_key.split(";") if e.strip()),
            augment=SeededTransform(preprocess, settings.seed),
            fast=None if fast is None else SeededTransform(fast, settings.seed),
            tokenizer=tokenizer,
            weights=shard_weights(settings.train_data, settings.train_data_upsampling_factors),
            locca=locca,
        )
        self._raw_pos: list[int] = [0] * max(self.workers, 1)
        self._resume: dict[str, Any] | None = None

    # ------------------------------------------------------------------ plan of an epoch

    def _exact_pieces(self, epoch: int) -> list[list[_Piece]]:
        """Per worker, the (shard, skip, take) pieces of its contiguous range of this epoch's sequence."""
        assert self.sizes is not None
        g, nw = self.geometry, max(self.workers, 1)
        order = list(range(len(self.urls)))
        random.Random(_seed("order", self.settings.seed, epoch)).shuffle(order)
        micro_per_rank = self.steps_per_epoch * g.accum_freq
        rank_start = self.rank * micro_per_rank * g.micro_batch_size
        ranges, start = [], rank_start
        for w in range(nw):  # worker w gets micro-batches w, w+nw, ... of the rank: as many as it serves
            count = micro_per_rank // nw + (1 if w < micro_per_rank % nw else 0)
            ranges.append((start, start + count * g.micro_batch_size))
            start += count * g.micro_batch_size
        pieces: list[list[_Piece]] = [[] for _ in range(nw)]
        offset = 0
        for i in order:
            lo, hi = offset, offset + self.sizes[i]
            offset = hi
            for w, (a, b) in enumerate(ranges):
                if a < hi and lo < b:
                    pieces[w].append(_Piece(self.urls[i], max(a, lo) - lo, min(b, hi) - max(a, lo)))
        return pieces

    def _raw_skip(self, epoch: int, start_step: int) -> list[int]:
        nw, g = max(self.workers, 1), self.geometry
        r = self._resume
        if r and r["epoch"] == epoch and r["step_in_epoch"] == start_step and len(r["raw_pos"]) == nw:
            return list(r["raw_pos"])
        # No saved positions for this start: assume whole micro-batches (exact when no sample was bad).
        done = start_step * g.accum_freq
        return [((done - w + nw - 1) // nw) * g.micro_batch_size for w in range(nw)]

    # ------------------------------------------------------------------ iteration

    def _pass(self, plan: _EpochPlan, first_worker: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """One pass of the workers: full micro-batches (worker, images, texts) round-robin from
        `first_worker`, then whole micro-batches cut from the workers' short last pieces. Returns the
        remaining pieces (fewer than m pairs)."""
        nw, m = max(self.workers, 1), self.geometry.micro_batch_size
        loader = torch.utils.data.DataLoader(
            _WorkerStream(dataclasses.replace(self._pipeline, plan=plan)),
            batch_size=None,
            **loader_workers(
                self.workers
            ),  # forkserver; a stop signal is the rank's to handle (stop_signals)
            # Page-locked batches let the step copy them to the GPU with non_blocking=True.
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,
            prefetch_factor=prefetch_factor(self.geometry.accum_freq, self.workers),
            generator=loader_generator(
                self.settings.seed, plan.epoch, self.rank, first_worker, plan.raw_skip, plan.count
            ),
        )
        queues: list[deque] = [deque() for _ in range(nw)]
        ended: set[int] = set()
        tail: list[tuple[torch.Tensor, torch.Tensor]] = []
        rotation = deque((first_worker + i) % nw for i in range(nw))
        it = iter(loader)
        try:
            while rotation:
                w = rotation[0]
                if queues[w]:
                    images, texts, raw_end = queues[w].popleft()
                    if plan.count:
                        self._raw_pos[w] = raw_end
                    yield w, images, texts
                    rotation.rotate(-1)
                    continue
                if w in ended:
                    rotation.popleft()
                    continue
                images, texts, meta = next(it)
                for reason, n in meta["skips"].items():
                    self.skip_counts[reason] = self.skip_counts.get(reason, 0) + n
                for message in meta["messages"]:
                    logger.warning("rank %d: %s", self.rank, message)
                if "fatal" in meta:
                    raise DataError(f"--train-data {self.settings.train_data!r}: {meta['fatal']}")
                if meta.get("end"):
                    ended.add(meta["worker"])
                elif images.shape[0] == m:
                    queues[meta["worker"]].append((images, texts, meta["raw_end"]))
                else:
                    tail.append((images, texts))
        finally:
            # Stop the workers now, not whenever the iterator happens to be collected.
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if tail:
            images = torch.cat([t[0] for t in tail])
            texts = torch.cat([t[1] for t in tail])
            whole = images.shape[0] // m * m
            for i in range(0, whole, m):
                yield -1, images[i : i + m], texts[i : i + m]
            return [(images[whole:], texts[whole:])] if whole < images.shape[0] else []
        return []

    def _micro_batches(self, epoch: int, start_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g, nw = self.geometry, max(self.workers, 1)
        done = start_step * g.accum_freq
        needed = self.steps_per_epoch * g.accum_freq - done
        pieces = None if self.resampled else self._exact_pieces(epoch)
        plan = _EpochPlan(epoch=epoch, pieces=pieces, raw_skip=self._raw_skip(epoch, start_step))
        self._raw_pos = list(plan.raw_skip)
        carry, produced = yield from self._take(self._pass(plan, done % nw), needed)
        # Only exact mode gets here short: bad samples left this rank fewer pairs than its share. Every rank
        # must take the same number of steps, so refill from the start of this rank's share (logged).
        refill = _EpochPlan(epoch=epoch, pieces=pieces, raw_skip=[0] * nw, count=False)
        while produced < needed:
            short = (needed - produced) * g.micro_batch_size - sum(c[0].shape[0] for c in carry)
            logger.warning(
                "rank %d epoch %d: bad samples left this rank %d pairs short of its %d steps; repeating pairs "
                "from the start of its share so that all ranks take the same steps (skipped so far: %s)",
                self.rank,
                epoch,
                short,
                self.steps_per_epoch,
                self.skip_counts,
            )
            carry, got = yield from self._take(self._refill(refill, carry), needed - produced)
            if got == 0:
                raise DataError(
                    f"--train-data {self.settings.train_data!r}: rank {self.rank} found no valid sample in its "
                    f"share of epoch {epoch} (skipped: {self.skip_counts})"
                )
            produced += got

    def _refill(self, plan: _EpochPlan, carry: list) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Micro-batches cut from `carry` followed by another pass over the share."""
        m = self.geometry.micro_batch_size
        pending = list(carry)
        have = sum(c[0].shape[0] for c in pending)
        for _, images, texts in self._pass(plan, 0):
            pending.append((images, texts))
            have += images.shape[0]
            while have >= m:
                all_images, all_texts = torch.cat([c[0] for c in pending]), torch.cat([c[1] for c in pending])
                yield -1, all_images[:m], all_texts[:m]
                pending = [(all_images[m:], all_texts[m:])]
                have -= m
        return [c for c in pending if c[0].shape[0]]

    @staticmethod
    def _take(source: Iterator, limit: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield at most `limit` micro-batches of `source`; return (its leftover pieces, how many yielded)."""
        got = 0
        try:
            while got < limit:
                try:
                    _, images, texts = next(source)
                except StopIteration as stop:
                    return (stop.value or []), got
                yield images, texts
                got += 1
            return [], got
        finally:
            source.close()  # stops the workers of a pass that is not read to its end

    def iter_epoch(self, epoch: int, start_step: int = 0) -> Iterator[StepBatch]:
        self._check_start(epoch, start_step)
        g = self.geometry
        skips_before = dict(self.skip_counts)
        micro: list[tuple[torch.Tensor, torch.Tensor]] = []
        step = start_step
        for images, texts in self._micro_batches(epoch, start_step):
            micro.append((images, texts))
            if len(micro) == g.accum_freq:
                # Counted as trained once handed out: a state_dict() taken after this step resumes after it.
                self._advance(epoch, step)
                yield StepBatch(
                    micro_batches=micro, micro_batch_ids=g.micro_batch_ids(self.rank), step_in_epoch=step
                )
                micro, step = [], step + 1
        new = {
            k: v - skips_before.get(k, 0) for k, v in self.skip_counts.items() if v != skips_before.get(k, 0)
        }
        samples = {k: v for k, v in new.items() if k not in REGION_REASONS}
        regions = {k: v for k, v in new.items() if k in REGION_REASONS}
        if samples:
            logger.warning("rank %d epoch %d: skipped bad samples: %s", self.rank, epoch, samples)
        if regions:
            logger.warning(
                "rank %d epoch %d: left out regions of samples that trained: %s", self.rank, epoch, regions
            )

    def _advance(self, epoch: int, step: int) -> None:
        super()._advance(epoch, step)
        if self.step_in_epoch == 0:  # a new epoch starts: its workers start from the beginning
            self._raw_pos = [0] * max(self.workers, 1)

    # ------------------------------------------------------------------ position

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        # raw_pos is this rank's own: with bad data, an exact resume needs each rank's state back.
        state.update(
            mode="resampled" if self.resampled else "exact",
            workers=self.workers,
            rank=self.rank,
            raw_pos=list(self._raw_pos),
            draws_keyed_by=DRAWS_KEYED_BY,
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("draws_keyed_by") != DRAWS_KEYED_BY and self.rank == 0:
            logger.warning(
                "this checkpoint was saved by a ds_clip that keyed each sample's random draws (crops, "
                "augmentation) by the shard's path as written; they are keyed by the shard's name now, so from "
                "here on they differ from the ones the saved run would have made (docs/data.md)"
            )
        if state.get("workers") != self.workers or state.get("mode") != (
            "resampled" if self.resampled else "exact"
        ):
            logger.warning(
                "data position was saved with workers=%s mode=%s, now workers=%s: resuming at step %d of "
                "epoch %d, but the samples of the rest of this epoch are not exactly the unseen ones",
                state.get("workers"),
                state.get("mode"),
                self.workers,
                self.step_in_epoch,
                self.epoch,
            )
            self._resume = None
            return
        g = self.geometry
        same = (
            state.get("rank"),
            state.get("world_size"),
            state.get("accum_freq"),
            state.get("micro_batch_size"),
        )
        if same != (self.rank, g.world_size, g.accum_freq, g.micro_batch_size):
            # Another rank's (or another run shape's) positions: count whole micro-batches instead, which
            # is exact unless samples were skipped as bad before the saved step.
            self._resume = None
            return
        self._resume = {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "raw_pos": list(state["raw_pos"]),
        }
