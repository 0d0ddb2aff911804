"""The validation samples one rank reads (of webdataset shards: its own shards when there are at least W; else,
and of other inputs, samples i with i % world == rank): held-out synthetic pairs, a CSV/TSV file (open_clip's
--val-data), webdataset shards; and the images of a class-folder tree."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from ds_clip.config import imagenet_class_folders
from ds_clip.data.table import CsvPairs
from ds_clip.evaluate.classes import label_from_caption
from ds_clip.evaluate.settings import (
    DEFAULT_SYNTHETIC_VAL_SAMPLES,
    SYNTHETIC,
    SYNTHETIC_VAL_OFFSET,
    EvalSettings,
)
from ds_clip.stop_signals import loader_workers

logger = logging.getLogger("ds_clip")

_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class _SyntheticVal(torch.utils.data.Dataset):
    """Held-out pairs of the built-in dataset: (index, image, tokens, label)."""

    def __init__(self, s: EvalSettings, indices: list[int], preprocess, tokenizer, classnames) -> None:
        self.s, self.indices, self.preprocess, self.tokenizer, self.classnames = (
            s, indices, preprocess, tokenizer, classnames
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        from ds_clip.data.synthetic import render_pair

        idx = self.indices[i]
        image, caption = render_pair(self.s.seed, SYNTHETIC_VAL_OFFSET + idx, self.s.image_size)
        label = label_from_caption(caption, self.classnames) if self.classnames else -1
        return idx, self.preprocess(image), torch.as_tensor(self.tokenizer([caption])[0]), label


def _wds_raw(urls: list[str], rank: int, world: int, limit: int | None, counter) -> Iterator:
    """(index, url, raw sample) of this rank's share of the shards' samples, the first ``limit`` in shard order.

    With at least as many shards as ranks each rank reads only its own shards (shards r, r + W, ...): the
    validation set is read once in all, not once per rank. With fewer shards (or a ``limit`` whose place in the
    shards is unknown without reading them: no sizes.json entry), every rank reads every shard and keeps samples
    i with i % W == rank. Either way the indices are unique and in shard order, so the gathered features are in
    the same order for any W."""
    from ds_clip.data.wds import iter_shard, listed_sizes

    sizes = listed_sizes(urls) if limit is not None and world > 1 and len(urls) >= world else None
    if world > 1 and len(urls) >= world and (limit is None or sizes is not None):
        for i in range(rank, len(urls), world):
            first = sum(sizes[:i]) if sizes is not None else i << 32  # unique, in shard order
            for pos, raw in enumerate(iter_shard(urls[i], counter)):
                if (limit is not None and first + pos >= limit) or (sizes is not None and pos >= sizes[i]):
                    break
                yield first + pos, urls[i], raw
        return
    index = 0
    for url in urls:
        for raw in iter_shard(url, counter):
            if limit is not None and index >= limit:
                return
            if index % world == rank:
                yield index, url, raw
            index += 1


def _wds_samples(s: EvalSettings, rank: int, world: int, preprocess, tokenizer, classnames) -> Iterator:
    from ds_clip.data.wds import SkipCounter, decode_sample, expand_urls

    image_exts = tuple(k.strip().lower() for k in s.image_key.split(";") if k.strip())
    caption_exts = tuple(k.strip().lower() for k in s.caption_key.split(";") if k.strip())
    counter = SkipCounter()
    urls = expand_urls(s.val_data, "--val-data")
    for index, url, raw in _wds_raw(urls, rank, world, s.val_num_samples, counter):
        out = decode_sample(
            raw,
            image_exts=image_exts,
            caption_exts=caption_exts,
            preprocess=preprocess,
            tokenizer=tokenizer,
        )
        if isinstance(out, str):
            counter.add(out, url, raw.key)
            continue
        label = -1
        if "cls" in raw.data:
            try:
                label = int(raw.data["cls"].decode().strip())
            except ValueError:
                label = -1
        elif classnames:
            label = label_from_caption(
                raw.data[next(e for e in caption_exts if e in raw.data)].decode(), classnames
            )
        yield index, out[0], out[1], label
    pending, messages = counter.take()
    for m in messages:
        logger.warning("val: %s", m)
    if pending:
        logger.warning("val rank %d: skipped %s", rank, pending)


def _plain(preprocess):
    """The model's preprocess with the (epoch, sample) keywords of the training data's seeded transform,
    which evaluation does not use (no augmentation)."""
    return lambda image, epoch=0, sample=0: preprocess(image)


def table_rows(s: EvalSettings, preprocess, tokenizer) -> CsvPairs:
    """The rows of a --val-data CSV/TSV file (open_clip's columns: --csv-img-key, --csv-caption-key,
    --csv-separator), read by the training data's reader; ``load(row)`` gives a pair or a skip reason."""
    from ds_clip.data.table import read_table

    paths, captions = read_table(
        os.path.expanduser(s.val_data), s.csv_img_key, s.csv_caption_key, s.csv_separator, "--val-data"
    )
    return CsvPairs(
        paths=paths, captions=captions, seed=0, preprocess=_plain(preprocess), tokenizer=tokenizer
    )


def _table_samples(s: EvalSettings, rank: int, world: int, preprocess, tokenizer, classnames) -> Iterator:
    """Rows i with i % world == rank, in file order; a row whose image is missing or undecodable (or whose
    caption is empty) is skipped and counted, as a bad webdataset sample is."""
    rows = table_rows(s, preprocess, tokenizer)
    n = len(rows) if s.val_num_samples is None else min(len(rows), s.val_num_samples)
    skipped: dict[str, int] = {}
    first = ""
    for index in range(rank, n, world):
        out = rows.load(index)
        if isinstance(out[0], str):
            skipped[out[0]] = skipped.get(out[0], 0) + 1
            first = first or f"row {index} ({rows.paths[index]!r}): {out[1]}"
            continue
        label = label_from_caption(rows.captions[index], classnames) if classnames else -1
        yield index, out[0], out[1], label
    if skipped:
        logger.warning("val rank %d: skipped %s in %s (first: %s)", rank, skipped, s.val_data, first)


def iter_val_batches(
    s: EvalSettings,
    *,
    rank: int,
    world: int,
    preprocess,
    tokenizer,
    classnames: list[str] | None,
    workers: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's batches of (indices, images, tokens, labels): samples i with i % world == rank, of the
    synthetic pairs, a CSV/TSV file or webdataset shards."""
    if s.val_data == SYNTHETIC:
        n = s.val_num_samples or DEFAULT_SYNTHETIC_VAL_SAMPLES
        ds = _SyntheticVal(s, list(range(rank, n, world)), preprocess, tokenizer, classnames)
        yield from torch.utils.data.DataLoader(ds, batch_size=s.batch_size, **loader_workers(workers))
        return
    read = _table_samples if s.table else _wds_samples
    batch: list = []
    for sample in read(s, rank, world, preprocess, tokenizer, classnames):
        batch.append(sample)
        if len(batch) == s.batch_size:
            yield _collate(batch)
            batch = []
    if batch:
        yield _collate(batch)


def _collate(batch: list) -> tuple[torch.Tensor, ...]:
    idx, images, texts, labels = zip(*batch)
    return torch.tensor(idx), torch.stack(images), torch.stack(texts), torch.tensor(labels)


def _padding(s: EvalSettings, preprocess, tokenizer):
    # A rank with no sample at all still runs forwards; any valid input does.
    from ds_clip.data.synthetic import render_pair

    image, caption = render_pair(0, 0, s.image_size)
    return (
        torch.tensor([0]),
        preprocess(image).unsqueeze(0),
        torch.as_tensor(tokenizer([caption])),
        torch.tensor([-1]),
    )


def decode_image(path: str):
    """The RGB image at ``path``, or the reason it cannot be read (a str): a missing or undecodable file is a
    bad sample, skipped and counted, as in --val-data and the shards."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB")  # forces the full decode: a broken file fails here, not later
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad bytes; all mean "undecodable"
        return f"{type(exc).__name__}: {exc}"


class _ClassImages(torch.utils.data.Dataset):
    """(image, label, None), or (None, label, "path: why") for an image that cannot be read."""

    def __init__(self, samples: list[tuple[str, int]], preprocess) -> None:
        self.samples, self.preprocess = samples, preprocess

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        image = decode_image(path)
        if isinstance(image, str):
            return None, label, f"{path}: {image}"
        return self.preprocess(image), label, None


def collate_class_images(items: list) -> tuple[torch.Tensor | None, torch.Tensor, list[str]]:
    """(images, labels) of the readable items of a batch (None, empty when none is), and why the others were
    skipped."""
    good = [(image, label) for image, label, _ in items if image is not None]
    skipped = [why for _, _, why in items if why is not None]
    if not good:
        return None, torch.zeros(0, dtype=torch.long), skipped
    return torch.stack([g[0] for g in good]), torch.tensor([g[1] for g in good]), skipped


def class_folder_samples(folder: str, labels: dict[str, int]) -> list[tuple[str, int]]:
    """(image path, label) of every image of the class folders ``labels`` ({sub-folder: class index}) of
    ``folder``, in a fixed order (folders sorted, then files sorted)."""
    root = Path(folder).expanduser()
    return [
        (str(p), labels[name])
        for name in sorted(labels)
        for p in sorted((root / name).iterdir())
        if p.suffix.lower() in _IMAGE_SUFFIXES
    ]


def imagenet_samples(folder: str, flag: str) -> list[tuple[str, int]]:
    """(image path, class index into open_clip's IMAGENET_CLASSNAMES) of every image, in a fixed order."""
    return class_folder_samples(folder, imagenet_class_folders(folder, flag))
