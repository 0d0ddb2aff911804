"""Webdataset pipeline: tar shards of (image, caption) pairs, split so that every step is full.

Two modes (see docs/data.md):
- exact-epoch (default): the shard list is shuffled by (seed, epoch) and laid end to end; each rank
  takes a contiguous range of steps_per_epoch*k*m samples of that sequence, each of its DataLoader
  workers a contiguous, micro-batch-aligned part of that range. Every sample is read by exactly one
  worker; the < N samples at the end of the sequence that do not fill a global batch are left out
  (a different set each epoch). This needs per-shard sample counts: `sizes.json` next to the shards
  (open_clip's format, written by `ds-clip-shards`) or, failing that, a scan of the tars at start-up.
- resampled: each worker draws shards with replacement, seeded by (seed, epoch, rank, worker);
  an epoch is --train-num-samples pairs. With --train-data-upsampling-factors each shard of "::"-joined
  source i is drawn with weight factor_i (open_clip's ResampledShards2 with expand_urls' weights).

Workers shuffle undecoded samples in a seeded buffer, decode, and send micro-batches of m pairs with
their skip counts and their position (raw samples consumed) attached; the main process takes the
micro-batches round-robin starting from a fixed worker, so the order is a pure function of (seed,
epoch, rank, W, k, m, workers), and a resumed run can make every worker skip exactly what it had
consumed without decoding it.

Augmentation: the worker calls the user's transform through a SeededTransform (data/augment.py) with the
sample's identity (shard URL as expanded from --train-data, sample key) and the epoch, so a sample's random
crop (and any other draw of the transform) is the same whatever rank, worker, --workers or restart reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import random
import re
import tarfile
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from webdataset.gopen import gopen

from ds_clip.data.augment import SeededTransform
from ds_clip.data.base import (
    DataError,
    DataSettings,
    StepBatch,
    TrainData,
    loader_generator,
    prefetch_factor,
)
from ds_clip.geometry import BatchGeometry
from ds_clip.urls import ShardPatternError, expand_shards

logger = logging.getLogger("ds_clip.data")

SIZES_FILE = "sizes.json"
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: "dir/k.a.b" -> dir/k, a.b
_LOGGED_PER_REASON = 5  # per worker and pass; the rest only counted (one bad shard must not flood the log)
_RESAMPLED_EMPTY_DRAWS = 10  # x number of shards drawn without one valid sample -> error, not an endless loop


# ----------------------------------------------------------------------------------------------------------
# Shard lists and sizes


def _is_local(url: str) -> bool:
    return "://" not in url and not url.startswith("pipe:")


def _local_path(url: str) -> str:
    return url[len("file:") :] if url.startswith("file:") else url


def expand_urls(train_data: str, flag: str = "--train-data") -> list[str]:
    """The shards of a --train-data/--val-data value: `ds_clip.urls.expand_shards` (braces, globs,
    "::", `pipe:`, `file:`, URLs; local shards must exist), its errors as DataError naming `flag`."""
    try:
        return expand_shards(train_data, flag)
    except ShardPatternError as exc:
        raise DataError(str(exc)) from None


def shard_weights(train_data: str, factors: str | None) -> list[float] | None:
    """Per shard of `expand_urls(train_data)`, the factor of its "::"-joined source (open_clip's
    expand_urls(urls, weights)); None without factors. The count and values were validated with the flag."""
    if factors is None:
        return None
    weights: list[float] = []
    for source, factor in zip(train_data.split("::"), factors.split("::"), strict=True):
        weights += [float(factor)] * len(expand_urls(source.strip()))
    return weights


def _split_name(name: str) -> tuple[str | None, str | None]:
    base = os.path.basename(name)
    if base.startswith("__") or base.startswith("."):  # webdataset metadata, macOS "._" files
        return None, None
    match = _KEY_EXT.match(name)
    if not match:
        return None, None
    return match.group(1), match.group(2).lower()


def count_samples(url: str) -> int:
    """Number of samples (runs of tar members sharing a key) in one shard; reads headers only where it can."""
    count, key = 0, None
    try:
        if _is_local(url):
            tf = tarfile.open(_local_path(url), mode="r:*")  # seekable: skips member data
            stream = None
        else:
            stream = gopen(url, "rb")
            tf = tarfile.open(fileobj=stream, mode="r|*")
        with tf:
            for info in tf:
                k, _ = _split_name(info.name) if info.isfile() else (None, None)
                if k is not None and k != key:
                    count, key = count + 1, k
        if stream is not None:
            stream.close()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        logger.warning("counting samples of shard %s stopped at %d: %s", url, count, exc)
    return count


def shard_sizes(urls: list[str]) -> list[int]:
    """Samples per shard: from sizes.json next to local shards where listed, else by scanning the shard."""
    tables: dict[str, dict[str, int]] = {}
    sizes: list[int] = []
    scanned = 0
    for url in urls:
        size = None
        if _is_local(url):
            path = _local_path(url)
            folder = os.path.dirname(os.path.abspath(path))
            if folder not in tables:
                tables[folder] = _read_sizes(os.path.join(folder, SIZES_FILE))
            size = tables[folder].get(os.path.basename(path))
        if size is None:
            size, scanned = count_samples(url), scanned + 1
        sizes.append(int(size))
    if scanned:
        logger.info(
            "counted samples of %d of %d shards by scanning them (no %s entry)",
            scanned,
            len(urls),
            SIZES_FILE,
        )
    return sizes


def _read_sizes(path: str) -> dict[str, int]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
        return {str(k): int(v) for k, v in table.items()}
    except (OSError, ValueError, AttributeError) as exc:
        raise DataError(f"{path} is not a JSON object of shard name -> sample count: {exc}") from exc


# ----------------------------------------------------------------------------------------------------------
# Reading, skipping and decoding samples (runs inside DataLoader workers)


@dataclass
class RawSample:
    url: str
    key: str
    data: dict[str, bytes]


class SkipCounter:
    """Counts bad samples per reason and keeps a message for the first few of each reason.

    Workers do not log: counts and messages travel with the next micro-batch to the main process, which
    adds them to `skip_counts` and logs them (one writer, whatever the worker start method).
    """

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.pending: dict[str, int] = {}
        self.messages: list[str] = []
        self.logged: dict[str, int] = {}

    def add(self, reason: str, url: str, detail: str = "", n: int = 1) -> None:
        if not self.enabled:
            return
        self.pending[reason] = self.pending.get(reason, 0) + n
        seen = self.logged.get(reason, 0)
        if seen < _LOGGED_PER_REASON:
            last = seen == _LOGGED_PER_REASON - 1
            suffix = " (further ones of this reason in this worker are only counted)" if last else ""
            self.messages.append(f"skipped {reason} in shard {url}: {detail}{suffix}")
        self.logged[reason] = seen + 1

    def take(self) -> tuple[dict[str, int], list[str]]:
        out = self.pending, self.messages
        self.pending, self.messages = {}, []
        return out


class _CountingReader:
    """Counts the bytes read: how a tar that breaks off exactly between members is told from a whole one
    (tarfile's stream mode takes both for the end of the archive)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.bytes_read = stream, 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.bytes_read += len(data)
        return data


def iter_shard(url: str, counter: SkipCounter, skip: int = 0, take: int | None = None) -> Iterator[RawSample]:
    """Samples of one shard (member bytes by lower-case extension), after the first `skip`, at most `take`.

    A shard that cannot be opened or is not a tar counts as "unreadable_shard", one that breaks off as
    "truncated_tar" (its sample in progress is dropped); fewer samples than planned as "short_shard".
    """
    stream = None
    index, key, current = -1, None, {}
    yielded = 0
    try:
        stream = gopen(url, "rb")
        reader = _CountingReader(stream)
        tf = tarfile.open(fileobj=reader, mode="r|*")
        for info in tf:
            k, ext = _split_name(info.name) if info.isfile() else (None, None)
            if k is None:
                continue
            if k != key:
                if key is not None and index >= skip:
                    yield RawSample(url, key, current)
                    yielded += 1
                index, key, current = index + 1, k, {}
                if take is not None and index >= skip + take:
                    return
            if index >= skip:
                member = tf.extractfile(info)
                current[ext] = member.read() if member is not None else b""
        # A whole (uncompressed) tar ends with a zero block after the last member; tarfile stops silently
        # when the bytes simply end there instead.
        if (
            getattr(tf.fileobj, "comptype", "tar") == "tar"
            and reader.bytes_read < tf.offset + tarfile.BLOCKSIZE
        ):
            raise tarfile.ReadError(f"data ends at byte {reader.bytes_read} without the end-of-archive block")
        if key is not None and index >= skip:
            yield RawSample(url, key, current)
            yielded += 1
        if take is not None and yielded < take:
            counter.add(
                "short_shard", url, f"{take - yielded} fewer samples than its size says", take - yielded
            )
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        counter.add("unreadable_shard" if index < 0 else "truncated_tar", url, f"{type(exc).__name__}: {exc}")
    finally:
        if stream is not None:
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - a pipe closed early exits non-zero; nothing to do about it
                pass


def shuffled(samples: Iterator[RawSample], bufsize: int, rng: random.Random) -> Iterator[RawSample]:
    """Seeded buffer shuffle (webdataset's scheme, deterministic for a given rng)."""
    if bufsize <= 1:
        yield from samples
        return
    buffer: list[RawSample] = []
    for sample in samples:
        if len(buffer) < bufsize:
            buffer.append(sample)
            continue
        i = rng.randrange(bufsize)
        buffer[i], sample = sample, buffer[i]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


def _first(data: dict[str, bytes], exts: tuple[str, ...]) -> bytes | None:
    for ext in exts:
        if ext in data:
            return data[ext]
    return None


def decode_sample(
    raw: RawSample,
    *,
    image_exts: tuple[str, ...],
    caption_exts: tuple[str, ...],
    preprocess: Callable[[Image.Image], torch.Tensor],
    tokenizer: Callable[[list[str]], Any],
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """The (image, tokens) pair of a raw sample, or the reason it is skipped."""
    image_bytes = _first(raw.data, image_exts)
    if image_bytes is None:
        return "missing_image"
    caption_bytes = _first(raw.data, caption_exts)
    if caption_bytes is None:
        return "missing_caption"
    try:
        caption = caption_bytes.decode("utf-8").strip()
    except UnicodeDecodeError:
        return "bad_caption"
    if not caption:
        return "missing_caption"
    try:
        with Image.open(io.BytesIO(image_bytes)) as im:
            image = im.convert("RGB")  # forces the full decode: a broken file fails here, not later
    except Exception:  # noqa: BLE001 - PIL raises many types for bad bytes; all mean "undecodable"
        return "bad_image"
    # preprocess/tokenizer errors are bugs, not bad data: let them propagate
    return preprocess(image), torch.as_tensor(tokenizer([caption])[0])


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
    tokenizer: Callable[[list[str]], Any]
    weights: list[float] | None = None  # per shard, resampled mode with --train-data-upsampling-factors
    plan: _EpochPlan | None = field(default=None)


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
                out = decode_sample(
                    raw,
                    image_exts=p.image_exts,
                    caption_exts=p.caption_exts,
                    # the sample's draws: a function of (seed, epoch, shard URL, key) alone
                    preprocess=functools.partial(p.augment, epoch=plan.epoch, sample=(raw.url, raw.key)),
                    tokenizer=p.tokenizer,
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


# ----------------------------------------------------------------------------------------------------------
# The rank's loader


class WebDatasetTrainData(TrainData):
    """Step batches from tar shards; see the module docstring for the two modes."""

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
        else:
            if slots > len(self.urls):
                raise DataError(
                    f"--train-data has {len(self.urls)} shards, fewer than ranks x workers = "
                    f"{geometry.world_size} x {max(self.workers, 1)} = {slots}: every worker needs at least "
                    "one shard in exact-epoch mode (make more, smaller shards, use fewer --workers, or "
                    "--dataset-resampled)"
                )
            self.sizes = shard_sizes(self.urls)
            total = sum(self.sizes)
            available = min(total, settings.train_num_samples or total)
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
            tokenizer=tokenizer,
            weights=shard_weights(settings.train_data, settings.train_data_upsampling_factors),
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
            num_workers=self.workers,
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
        if new:
            logger.warning("rank %d epoch %d: skipped bad samples: %s", self.rank, epoch, new)

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
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
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
