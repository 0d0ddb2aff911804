"""Reading, skipping and decoding the samples of one tar shard (this runs inside DataLoader workers): members
grouped into samples by key, bad samples and broken shards counted per reason, a seeded shuffle buffer, and the
decode of one sample into an (image, tokens) pair."""

from __future__ import annotations

import io
import os
import random
import re
import tarfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from webdataset.gopen import gopen, gopen_schemes

from ds_clip.data.decode import BadImage
from ds_clip.sources.urls import url_scheme

_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: "dir/k.a.b" -> dir/k, a.b
_LOGGED_PER_REASON = 5  # per worker and pass; the rest only counted (one bad shard must not flood the log)


def split_name(name: str) -> tuple[str | None, str | None]:
    """(sample key, lower-case extension) of a tar member; (None, None) for webdataset metadata and hidden files."""
    base = os.path.basename(name)
    if base.startswith("__") or base.startswith("."):  # webdataset metadata, macOS "._" files
        return None, None
    match = _KEY_EXT.match(name)
    if not match:
        return None, None
    return match.group(1), match.group(2).lower()


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


def open_url(url: str) -> Any:
    """A binary read stream of a shard (or a file beside it): local paths, `file:`, `pipe:` and the schemes
    webdataset's gopen knows (http, https through curl, ...) through gopen; any other `scheme://` URL
    (s3://, gs://, az://, ...) through fsspec, as --remote-sync (s3fs for s3://; endpoint and credentials
    from the usual environment, e.g. AWS_ENDPOINT_URL)."""
    scheme = url_scheme(url)  # "pipe" for any pipe: command, whatever URLs it holds
    if scheme and scheme != "pipe" and scheme not in gopen_schemes:
        import fsspec

        return fsspec.open(url, "rb").open()
    return gopen(url, "rb")


def iter_shard(url: str, counter: SkipCounter, skip: int = 0, take: int | None = None) -> Iterator[RawSample]:
    """Samples of one shard (member bytes by lower-case extension), after the first `skip`, at most `take`.

    A shard that cannot be opened or is not a tar counts as "unreadable_shard", one that breaks off as
    "truncated_tar" (its sample in progress is dropped); fewer samples than planned as "short_shard".
    """
    stream = None
    index, key, current = -1, None, {}
    yielded = 0
    try:
        stream = open_url(url)
        reader = _CountingReader(stream)
        tf = tarfile.open(fileobj=reader, mode="r|*")
        for info in tf:
            k, ext = split_name(info.name) if info.isfile() else (None, None)
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
    fast: Callable[[bytes], torch.Tensor] | None = None,
    regions: Callable[[torch.Tensor, tuple[int, int]], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """The (image, tokens) pair of a raw sample, or the reason it is skipped. With `fast` (a seeded
    `FastCrop`, --decode fast) the image bytes go to it instead of a full decode and `preprocess`. With
    `regions` (--siglip2: a bound ds_clip.data.regions.LoccaTexts) the tokens are what it makes of the caption's
    tokens and the original image's (width, height): the [3, L] rows of the caption and one region."""
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
    if fast is not None:
        try:
            image_tensor = fast(image_bytes)
        except BadImage:
            return "bad_image"
        tokens = torch.as_tensor(tokenizer([caption])[0])
        if regions is None:
            return image_tensor, tokens
        with Image.open(io.BytesIO(image_bytes)) as im:  # the header again (FastCrop read it): the size alone
            return image_tensor, regions(tokens, im.size)
    try:
        with Image.open(io.BytesIO(image_bytes)) as im:
            image = im.convert("RGB")  # forces the full decode: a broken file fails here, not later
    except Exception:  # noqa: BLE001 - PIL raises many types for bad bytes; all mean "undecodable"
        return "bad_image"
    # preprocess/tokenizer errors are bugs, not bad data: let them propagate
    tokens = torch.as_tensor(tokenizer([caption])[0])
    return preprocess(image), tokens if regions is None else regions(tokens, image.size)
