"""The shards of --train-data and their sizes: the expanded shard list, the per-shard weights of
--train-data-upsampling-factors, and the samples per shard (sizes.json beside the shards, img2dataset's
NNNNN_stats.json files, else a scan)."""

from __future__ import annotations

import json
import logging
import os
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ds_clip.data.base import DataError
from ds_clip.data.wds.samples import open_url, split_name
from ds_clip.sources.urls import ShardPatternError, expand_shards, is_local, is_pipe, local_path

logger = logging.getLogger("ds_clip.data")

SIZES_FILE = "sizes.json"
STATS_SUFFIX = "_stats.json"  # img2dataset's NNNNN_stats.json beside NNNNN.tar
FETCH_THREADS = 16  # size files fetched at once from remote storage


def expand_urls(train_data: str, flag: str = "--train-data") -> list[str]:
    """The shards of a --train-data/--val-data value: `ds_clip.sources.urls.expand_shards` (braces, globs,
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
        if is_local(url):
            tf = tarfile.open(local_path(url), mode="r:*")  # seekable: skips member data
            stream = None
        else:
            stream = open_url(url)
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


def _read_json(url: str) -> Any:
    """The JSON document at `url` (local or remote, through the shards' own opener); None when it is absent
    or cannot be read. A file that is there but is not JSON raises DataError naming it."""
    try:
        if is_local(url):
            if not os.path.isfile(local_path(url)):
                return None
            with open(local_path(url), "rb") as f:
                data = f.read()
        else:
            stream = open_url(url)
            try:
                data = stream.read()
            finally:
                stream.close()
    except Exception:  # noqa: BLE001 - absent or unreachable (a 404 through curl, NoSuchKey through s3fs, ...)
        return None
    if not data:
        return None  # curl -f prints nothing for a missing file
    try:
        return json.loads(data)
    except ValueError as exc:
        raise DataError(f"{url} is not JSON: {exc}") from None


def _sizes_table(url: str) -> dict[str, int]:
    table = _read_json(url)
    if table is None:
        return {}
    try:
        return {str(k): int(v) for k, v in table.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise DataError(f"{url} is not a JSON object of shard name -> sample count: {exc}") from None


def stats_url(url: str) -> str | None:
    """img2dataset's stats file of a shard: NNNNN_stats.json beside NNNNN.tar; None for `pipe:` sources."""
    if is_pipe(url) or not url.endswith(".tar"):
        return None
    return url[: -len(".tar")] + STATS_SUFFIX


def _stats_count(url: str) -> int | None:
    """The "successes" count of img2dataset's stats file at `url` (the samples its tar holds), None if absent."""
    stats = _read_json(url)
    if stats is None:
        return None
    successes = stats.get("successes") if isinstance(stats, dict) else None
    if not isinstance(successes, int) or successes < 0:
        raise DataError(f'{url} has no sample count: img2dataset\'s stats files hold an integer "successes"')
    return successes


def _folder(url: str) -> str:
    return os.path.dirname(os.path.abspath(local_path(url))) if is_local(url) else url.rsplit("/", 1)[0]


def _from_size_files(urls: list[str], pool: ThreadPoolExecutor) -> tuple[list[int | None], int, int]:
    """Samples per shard from sizes.json, then img2dataset's stats files (None where neither has it), and how
    many came from each."""
    sizes: list[int | None] = [None] * len(urls)
    folders = sorted({_folder(u) for u in urls if not is_pipe(u)})
    tables = dict(zip(folders, pool.map(lambda f: _sizes_table(f + "/" + SIZES_FILE), folders), strict=True))
    for i, url in enumerate(urls):
        if not is_pipe(url):
            sizes[i] = tables[_folder(url)].get(url.rsplit("/", 1)[-1])
    from_table = sum(s is not None for s in sizes)
    wanted = [i for i, s in enumerate(sizes) if s is None and stats_url(urls[i]) is not None]
    for i, count in zip(wanted, pool.map(lambda i: _stats_count(stats_url(urls[i])), wanted), strict=True):
        sizes[i] = count
    return sizes, from_table, sum(s is not None for s in sizes) - from_table


def listed_sizes(urls: list[str], *, threads: int = FETCH_THREADS) -> list[int] | None:
    """Samples per shard from the size files alone (sizes.json, img2dataset's stats files), without reading a
    shard; None when some shard has neither."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as pool:
        sizes, _, _ = _from_size_files(urls, pool)
    return None if None in sizes else [int(s) for s in sizes]  # type: ignore[arg-type]


def shard_sizes(urls: list[str], *, threads: int = FETCH_THREADS) -> tuple[list[int], str]:
    """Samples per shard, from the first source that has it: sizes.json beside the shards (open_clip's format,
    local or remote), img2dataset's NNNNN_stats.json beside each shard ("successes"; local or remote), a scan
    of the shard (tar headers only on a local disk, the whole stream otherwise). Files on remote storage are
    fetched `threads` at a time. Returns the sizes and where they came from, in words."""
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(urls)))) as pool:
        sizes, from_table, from_stats = _from_size_files(urls, pool)
        scan = [i for i, s in enumerate(sizes) if s is None]
        piped = sum(is_pipe(urls[i]) for i in scan)
        remote = sum(not is_local(urls[i]) for i in scan) - piped
        if piped:
            # No file lies beside a command, so no size file can spare this read.
            logger.warning(
                "counting the samples of %d pipe: shards by running each command to its end (a command has no "
                "%s beside it): --dataset-resampled with --train-num-samples starts without that read",
                piped,
                SIZES_FILE,
            )
        if remote:
            logger.warning(
                "counting the samples of %d remote shards by reading them whole (no %s entry or %s file beside "
                "them): write a %s (ds-clip-shards' format) to start without that read",
                remote,
                SIZES_FILE,
                f"NNNNN{STATS_SUFFIX}",
                SIZES_FILE,
            )
        for i, count in zip(scan, pool.map(lambda i: count_samples(urls[i]), scan), strict=True):
            sizes[i] = count
    parts = [
        f"{n} from {what}"
        for n, what in (
            (from_table, SIZES_FILE),
            (from_stats, f"img2dataset's NNNNN{STATS_SUFFIX} files"),
            (len(scan), "a scan of the shard (no size file)"),
        )
        if n
    ]
    counted = [int(s) for s in sizes]  # type: ignore[arg-type]
    return counted, f"{sum(counted)} samples in {len(urls)} shards, counts of {', '.join(parts)}"
