"""The shards of --train-data and their sizes: the expanded shard list, the per-shard weights of
--train-data-upsampling-factors, and the samples per shard (sizes.json beside the shards, else a scan)."""

from __future__ import annotations

import json
import logging
import os
import tarfile
import zlib

from webdataset.gopen import gopen

from ds_clip.data.base import DataError
from ds_clip.data.wds.samples import split_name
from ds_clip.urls import ShardPatternError, expand_shards

logger = logging.getLogger("ds_clip.data")

SIZES_FILE = "sizes.json"


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
                k, _ = split_name(info.name) if info.isfile() else (None, None)
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
        size = _listed_size(url, tables)
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


def listed_sizes(urls: list[str]) -> list[int] | None:
    """Samples per shard from the sizes.json files beside local shards, without reading a shard; None when some
    shard is not listed (remote, or missing from its folder's table)."""
    tables: dict[str, dict[str, int]] = {}
    sizes = [_listed_size(url, tables) for url in urls]
    return None if None in sizes else [int(n) for n in sizes]


def _listed_size(url: str, tables: dict[str, dict[str, int]]) -> int | None:
    """The sizes.json entry of a local shard (``tables``: the tables read so far, by folder); None if none."""
    if not _is_local(url):
        return None
    path = _local_path(url)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in tables:
        tables[folder] = _read_sizes(os.path.join(folder, SIZES_FILE))
    return tables[folder].get(os.path.basename(path))


def _read_sizes(path: str) -> dict[str, int]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            table = json.load(f)
        return {str(k): int(v) for k, v in table.items()}
    except (OSError, ValueError, AttributeError) as exc:
        raise DataError(f"{path} is not a JSON object of shard name -> sample count: {exc}") from exc
