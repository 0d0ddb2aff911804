"""Every evaluation input looked at before the first training step (and before ds-clip-eval loads a model): an
unusable one is a one-line ``EvalError`` (exit 2) naming the flag and the file, never a failure after the last
step. Files only: no model, no process group, so every rank (or the one process) checks them in a second.

What "usable" means: --val-data is synthetic, or a CSV/TSV file whose header has the --csv-* columns and one of
whose first rows loads, or shards whose first local shard is a tar with a sample that has a decodable image
(--image-key) and a caption (--caption-key) (remote shards are read when evaluated); --zeroshot-classes parses;
each class-folder tree (--imagenet-val, --imagenet-v2, --zeroshot-folder with its class names and templates)
has an image, and one of its first 16 decodes (a bad image is skipped and counted when evaluated).
"""

from __future__ import annotations

from ds_clip.config import TrainSettings
from ds_clip.data.base import DataError
from ds_clip.data.table import check_image_paths
from ds_clip.evaluate.classes import folder_classes, load_templates, load_zeroshot
from ds_clip.evaluate.datasets import class_folder_samples, decode_image, imagenet_samples, table_rows
from ds_clip.evaluate.settings import SYNTHETIC, EvalError, EvalSettings

_PROBE = 16  # rows or samples looked at: one that loads is enough


def _no_tokens(captions: list[str]) -> list[list[int]]:
    return [[0] for _ in captions]


def _keep(image):
    return image


def check_val_data(s: EvalSettings) -> None:
    """Raise EvalError naming --val-data (or the --csv-*/--image-key/--caption-key flag) if it cannot be read."""
    if s.val_data == SYNTHETIC:
        return
    try:
        if s.table:
            _check_table(s)
        else:
            _check_shards(s)
    except DataError as exc:  # the data readers' errors already name the flag and the file
        raise EvalError(str(exc)) from None


def _check_table(s: EvalSettings) -> None:
    rows = table_rows(s, _keep, _no_tokens)
    if not len(rows):
        raise EvalError(f"--val-data {s.val_data!r} has a header but no rows")
    check_image_paths(s.val_data, rows.paths)
    probe = min(len(rows), _PROBE)
    outcomes = [rows.load(row) for row in range(probe)]
    if any(not isinstance(out[0], str) for out in outcomes):
        return
    raise EvalError(
        f"--val-data {s.val_data!r}: none of its first {probe} rows loads (row 0, {rows.paths[0]!r}: "
        f"{outcomes[0][1]}; --csv-img-key {s.csv_img_key!r}, --csv-caption-key {s.csv_caption_key!r})"
    )


def _check_shards(s: EvalSettings) -> None:
    from ds_clip.data.wds import SkipCounter, decode_sample, expand_urls, iter_shard
    from ds_clip.sources.urls import is_local

    local = [u for u in expand_urls(s.val_data, "--val-data") if is_local(u)]
    if not local:
        return  # pipe: commands and URLs are read when evaluated, not downloaded at start
    url = local[0]
    image_exts = tuple(k.strip().lower() for k in s.image_key.split(";") if k.strip())
    caption_exts = tuple(k.strip().lower() for k in s.caption_key.split(";") if k.strip())
    counter = SkipCounter()
    seen: list[tuple[str, str, list[str]]] = []
    for raw in iter_shard(url, counter, take=_PROBE):
        out = decode_sample(
            raw, image_exts=image_exts, caption_exts=caption_exts, preprocess=_keep, tokenizer=_no_tokens
        )
        if not isinstance(out, str):
            return
        seen.append((raw.key, out, sorted(raw.data)))
    pending, messages = counter.take()
    if "unreadable_shard" in pending:
        raise EvalError(
            f"--val-data {s.val_data!r}: {url} is not a readable tar shard ({messages[0].split(': ', 1)[-1]}); "
            "a CSV/TSV file is read as a table when its name ends in .csv or .tsv, or with --dataset-type csv"
        )
    if not seen:
        raise EvalError(f"--val-data {s.val_data!r}: shard {url} holds no sample")
    key, reason, members = seen[0]
    raise EvalError(
        f"--val-data {s.val_data!r}: no sample of {url} (of the first {len(seen)} read) has a decodable image "
        f"(--image-key {s.image_key}) and a caption (--caption-key {s.caption_key}): sample {key!r} holds "
        f"{', '.join('.' + m for m in members) or 'nothing'} ({reason})"
    )


def check_class_images(samples: list[tuple[str, int]], flag: str, folder: str) -> None:
    """A class-folder tree has an image, and one of its first images decodes (a bad one among them is a bad
    sample, skipped and counted when evaluated)."""
    if not samples:
        raise EvalError(f"{flag} {folder!r}: its class folders hold no image")
    probe = samples[:_PROBE]
    first = None
    for path, _ in probe:
        why = decode_image(path)
        if not isinstance(why, str):
            return
        first = first or f"{path!r}: {why}"
    raise EvalError(f"{flag} {folder!r}: none of its first {len(probe)} images decodes (first: {first})")


def check_train_inputs(s: TrainSettings) -> None:
    """Every evaluation input of a training run (the trainer calls it before any process group starts)."""
    ev = s.eval
    val = EvalSettings.from_settings(s, image_size=0)  # the image size only matters to synthetic pairs
    if val is not None:
        check_val_data(val)
    if ev.zeroshot_classes:
        load_zeroshot(ev.zeroshot_classes)
    for flag, folder in (("--imagenet-val", ev.imagenet_val), ("--imagenet-v2", ev.imagenet_v2)):
        if folder is not None:
            check_class_images(imagenet_samples(folder, flag), flag, folder)
    if ev.zeroshot_folder is not None:
        check_zeroshot_folder(ev.zeroshot_folder, ev.zeroshot_classnames, ev.zeroshot_templates)


def check_zeroshot_folder(folder: str, classnames: str | None, templates: str) -> None:
    """--zeroshot-folder: class folders with names (--zeroshot-classnames), templates, and a decodable image."""
    folders, _ = folder_classes(folder, classnames)
    load_templates(templates)
    check_class_images(
        class_folder_samples(folder, {f: i for i, f in enumerate(folders)}), "--zeroshot-folder", folder
    )


__all__ = ["check_class_images", "check_train_inputs", "check_val_data", "check_zeroshot_folder"]
