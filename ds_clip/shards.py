"""Write webdataset tar shards of (image, caption) pairs, with the sizes.json the loader reads.

    ds-clip-shards --synthetic 20000 --output data/shapes --samples-per-shard 1000 [--seed 0] [--image-size 64]
    ds-clip-shards --from-folder photos/ --output data/photos        # photos/a.jpg + photos/a.txt, ...
    ds-clip-shards --from-csv train.tsv --csv-img-key filepath --csv-caption-key title --output data/csv
    python -m ds_clip.shards ...                                      # the same without the console script

Samples are keyed by a running number and keep their image bytes untouched (folder, CSV) and their
image extension (jpg/jpeg/png/webp); captions go in as "txt". Shards are named 00000.tar, 00001.tar, ...
Inputs that cannot make a sample (no caption, empty caption, undecodable image, missing file) are
skipped and reported per reason. Bad arguments: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass

from PIL import Image

from ds_clip.config import Parser
from ds_clip.errors import UserError

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
SHARD_PATTERN = "%05d.tar"


class ShardError(UserError):
    """Bad input: reported as one line, exit status 2."""


@dataclass
class Sample:
    image: bytes
    ext: str  # tar member extension of the image
    caption: str


@dataclass
class Skip:
    reason: str
    source: str


def _checked(image: bytes, ext: str, caption: str | None, source: str) -> Sample | Skip:
    if caption is None:
        return Skip("no caption file", source)
    caption = caption.strip()
    if not caption:
        return Skip("empty caption", source)
    try:
        with Image.open(io.BytesIO(image)) as im:
            im.convert("RGB")  # a full decode: verify() misses truncated JPEG data
    except Exception:  # noqa: BLE001 - PIL raises many types for bad bytes
        return Skip("undecodable image", source)
    return Sample(image=image, ext=ext, caption=caption)


def from_folder(folder: str) -> Iterator[Sample | Skip]:
    """Images anywhere under `folder` with a caption in the same-named .txt file, in sorted path order."""
    # Checked here, not in the generator: bad input must fail before --overwrite removes anything.
    if not os.path.isdir(folder):
        raise ShardError(f"--from-folder {folder!r} is not a directory")
    return _folder_samples(folder)


def _folder_samples(folder: str) -> Iterator[Sample | Skip]:
    paths = sorted(os.path.join(d, f) for d, _, files in os.walk(folder) for f in files)
    images = {os.path.splitext(p)[0] for p in paths if p.rsplit(".", 1)[-1].lower() in IMAGE_EXTS}
    for path in paths:
        stem, dot_ext = os.path.splitext(path)
        ext = dot_ext[1:].lower()
        if ext == "txt" and stem not in images:
            yield Skip("caption without image", path)
        if ext not in IMAGE_EXTS:
            continue
        caption = None
        if os.path.isfile(stem + ".txt"):
            with open(stem + ".txt", encoding="utf-8", errors="replace") as f:
                caption = f.read()
        with open(path, "rb") as f:
            yield _checked(f.read(), ext, caption, path)


def from_csv(path: str, img_key: str, caption_key: str, separator: str) -> Iterator[Sample | Skip]:
    """Rows of a CSV/TSV file, read by the reader training and evaluation use (ds_clip.data.table: the same
    columns, separator, byte-order mark and refusal of a row with more or fewer fields than the header);
    relative image paths are tried from the working directory, then the file's folder."""
    from ds_clip.data.table import read_table

    if not os.path.isfile(path):
        raise ShardError(f"--from-csv {path!r} is not a file")
    paths, captions = read_table(path, img_key, caption_key, separator, "--from-csv")
    return _csv_samples(path, paths, captions)


def _csv_samples(path: str, paths: list[str], captions: list[str]) -> Iterator[Sample | Skip]:
    base = os.path.dirname(os.path.abspath(path))
    for line, (image_path, caption) in enumerate(zip(paths, captions), start=2):
        image_path = image_path.strip()
        source = f"{path}:{line}"
        if not image_path:
            yield Skip("no image path", source)
            continue
        if not os.path.isabs(image_path) and not os.path.isfile(image_path):
            image_path = os.path.join(base, image_path)
        if not os.path.isfile(image_path):
            yield Skip("image file not found", source)
            continue
        ext = image_path.rsplit(".", 1)[-1].lower()
        with open(image_path, "rb") as img:
            data = img.read()
        yield _checked(data, ext if ext in IMAGE_EXTS else "jpg", caption, source)


def from_synthetic(count: int, seed: int, image_size: int, image_format: str) -> Iterator[Sample | Skip]:
    """The built-in dataset's samples 0..count-1, as the synthetic loader renders them."""
    from ds_clip.data.synthetic import render_pair

    for index in range(count):
        image, caption = render_pair(seed, index, image_size)
        buf = io.BytesIO()
        if image_format == "jpg":
            image.save(buf, format="JPEG", quality=95)
        else:
            image.save(buf, format="PNG")
        yield Sample(image=buf.getvalue(), ext=image_format, caption=caption)


def write_shards(samples: Iterator[Sample | Skip], output: str, samples_per_shard: int) -> tuple[dict, dict]:
    """Write the samples; return ({shard name: count}, {skip reason: count})."""
    import webdataset as wds

    sizes: dict[str, int] = {}
    skipped: dict[str, int] = {}
    writer = None
    written = 0
    try:
        for item in samples:
            if isinstance(item, Skip):
                skipped[item.reason] = skipped.get(item.reason, 0) + 1
                continue
            if writer is None:  # opened lazily: no empty 00000.tar when nothing is valid
                # maxsize effectively off: shards must roll over by count alone, so that sizes are exact
                writer = wds.ShardWriter(
                    os.path.join(output, SHARD_PATTERN), maxcount=samples_per_shard, maxsize=1e18, verbose=0
                )
            writer.write(
                {"__key__": f"{written:09d}", item.ext: item.image, "txt": item.caption.encode("utf-8")}
            )
            name = SHARD_PATTERN % (written // samples_per_shard)
            sizes[name] = sizes.get(name, 0) + 1
            written += 1
    finally:
        if writer is not None:
            writer.close()
    return sizes, skipped


class _Parser(Parser):
    def error(self, message: str) -> typing.NoReturn:  # one line, not usage + message; the closest flag named
        raise ShardError(self.explain(message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ds-clip-shards", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-folder", metavar="DIR", help="images with same-named .txt captions")
    source.add_argument("--from-csv", metavar="FILE", help="CSV/TSV of image path and caption")
    source.add_argument("--synthetic", metavar="COUNT", type=int, help="COUNT pairs of the built-in dataset")
    parser.add_argument("--output", required=True, metavar="DIR", help="folder for the shards and sizes.json")
    parser.add_argument("--samples-per-shard", type=int, default=1000)
    parser.add_argument("--overwrite", action="store_true", help="replace shards already in --output")
    parser.add_argument("--csv-img-key", default="filepath", help="column of image paths (default filepath)")
    parser.add_argument("--csv-caption-key", default="title", help="column of captions (default title)")
    parser.add_argument("--csv-separator", default="\t", help="column separator (default: tab)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --synthetic")
    parser.add_argument("--image-size", type=int, default=64, help="side in pixels of --synthetic images")
    parser.add_argument(
        "--image-format", choices=("jpg", "png"), default="jpg", help="encoding of --synthetic"
    )
    return parser


def _prepare_output(output: str, overwrite: bool) -> None:
    if os.path.exists(output) and not os.path.isdir(output):
        raise ShardError(f"--output {output!r} exists and is not a directory")
    os.makedirs(output, exist_ok=True)
    existing = sorted(f for f in os.listdir(output) if f.endswith(".tar") or f == "sizes.json")
    if existing and not overwrite:
        raise ShardError(f"--output {output!r} already holds shards ({existing[0]}, ...); pass --overwrite")
    for name in existing:
        os.remove(os.path.join(output, name))


def run(argv: list[str] | None = None) -> str:
    """Parse, write, return the summary line; raises ShardError on bad input."""
    args = build_parser().parse_args(argv)
    if args.samples_per_shard < 1:
        raise ShardError(f"--samples-per-shard must be >= 1, got {args.samples_per_shard}")
    if args.synthetic is not None and args.synthetic < 1:
        raise ShardError(f"--synthetic must be >= 1, got {args.synthetic}")
    if args.image_size < 8:
        raise ShardError(f"--image-size must be >= 8, got {args.image_size}")
    if args.from_folder is not None:
        samples, what = from_folder(args.from_folder), args.from_folder
    elif args.from_csv is not None:
        separator = args.csv_separator.encode().decode("unicode_escape")  # "\t" typed on a shell
        if len(separator) != 1:
            raise ShardError(f"--csv-separator must be one character, got {args.csv_separator!r}")
        samples = from_csv(args.from_csv, args.csv_img_key, args.csv_caption_key, separator)
        what = args.from_csv
    else:
        samples = from_synthetic(args.synthetic, args.seed, args.image_size, args.image_format)
        what = f"synthetic seed {args.seed}"
    _prepare_output(args.output, args.overwrite)
    sizes, skipped = write_shards(samples, args.output, args.samples_per_shard)
    skip_text = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) or "nothing"
    if not sizes:
        raise ShardError(f"no valid sample in {what} (skipped: {skip_text})")
    with open(os.path.join(args.output, "sizes.json"), "w") as f:
        json.dump(sizes, f, indent=0, sort_keys=True)
    total = sum(sizes.values())
    last = SHARD_PATTERN % (len(sizes) - 1)
    return (
        f"wrote {total} samples in {len(sizes)} shard{'s' if len(sizes) > 1 else ''} to {args.output} "
        f"({SHARD_PATTERN % 0}..{last}, sizes.json); skipped {sum(skipped.values())}: {skip_text}"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        print(run(argv))
    except UserError as exc:  # ShardError, or the table reader's DataError
        print(f"ds-clip-shards: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
