"""The one shard-pattern expander: a --train-data/--val-data value -> the list of shards to read.

    expand_shards("shards/{00000..00127}.tar", "--train-data")
    expand_shards("a/*.tar::pipe:aws s3 cp s3://b/{0..9}.tar -", "--train-data")

Syntax (webdataset's, plus globs): sources joined by "::", each brace-expanded ({0..9}, {a,b});
a local source (a path, or `file:PATH`) may hold globs (*, ?, [..]), matched sorted; `pipe:` commands
and URLs (`scheme://...`) are kept as written after brace expansion, since only the reader can open them.
Every local source must name at least one existing file, and a brace list must have all its files: a
missing shard would silently shrink the epoch. Config validation and the webdataset reader both call
`expand_shards`, so what validation accepts is exactly what the reader reads.

Only the standard library and braceexpand (installed with webdataset): cheap to import anywhere.
"""

from __future__ import annotations

import functools
import glob
import os
import shlex
from urllib.parse import urlparse

import braceexpand

from ds_clip.errors import UserError

_SHOWN_MISSING = 3  # missing shards named in an error; the rest counted


class ShardPatternError(UserError):
    """A shard pattern that names nothing, or names local files that do not exist.

    The message is one line naming the flag and the pattern (or the source within it) at fault.
    """


def is_pipe(url: str) -> bool:
    """A `pipe:` command (run by the shell; it may hold URLs, headers and quotes: never parsed as a URL)."""
    return url.startswith("pipe:")


def is_local(url: str) -> bool:
    """A local file (a path or `file:PATH`), as opposed to a `pipe:` command or a `scheme://` URL."""
    return not is_pipe(url) and (url.startswith("file:") or "://" not in url)


def url_scheme(url: str) -> str:
    """ "pipe" for a `pipe:` command, the scheme of a `scheme://` URL ("s3", "https", ...), "" for a local path
    (`file:` included). A command's own URLs (`pipe:aws s3 cp s3://b/0.tar -`) are not its scheme."""
    if is_pipe(url):
        return "pipe"
    if is_local(url):
        return ""
    return url.split("://", 1)[0]


_SHARD_SUFFIXES = (".tar", ".tgz", ".tar.gz", ".tar.bz2", ".tar.xz", ".tar.zst")


def _last_component(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


@functools.lru_cache(maxsize=65536)
def shard_name(url: str) -> str:
    """What identifies a shard whatever reaches it: the last path component of its path or URL (no folder,
    scheme, host or query string: a signed URL's signature changes, its object does not). For a `pipe:`
    command, the last path component of the last URL (`scheme://...`) among its arguments, else of its last
    argument that names a tar file (`pipe:cat /data/00000.tar`), else the command as written.

    Per-sample random draws are keyed by (shard name, sample key), so the same shards copied to another folder,
    mirrored to another bucket or read through `pipe:cat` train the same run (docs/data.md)."""
    if is_local(url):
        return _last_component(local_path(url)) or url
    if not is_pipe(url):
        return _last_component(urlparse(url).path) or url
    try:
        args = shlex.split(url[len("pipe:") :])
    except ValueError:  # unbalanced quotes: the shell will say so when the reader runs it
        return url
    urls = [a for a in args if "://" in a and not a.startswith("-")]
    if urls:
        return _last_component(urlparse(urls[-1]).path) or url
    tars = [a for a in args if _last_component(a.split("?", 1)[0]).endswith(_SHARD_SUFFIXES)]
    return _last_component(tars[-1].split("?", 1)[0]) if tars else url


def local_path(url: str) -> str:
    """The file system path of a local shard: `file:` (and `file://`) stripped, `~` expanded."""
    if url.startswith("file:"):
        url = urlparse(url).path if url.startswith("file://") else url[len("file:") :]
    return os.path.expanduser(url)


def expand_shards(pattern: str, flag: str) -> list[str]:
    """Expand a shard pattern into shards to read, in order; local shards as plain paths.

    `flag` ("--train-data", "--val-data") names the setting in error messages. Raises
    ShardPatternError for an empty pattern or source, a local source that matches no file, or a brace
    list with missing files.
    """
    if not pattern.strip():
        raise ShardPatternError(
            f"{flag} is empty: give a shard pattern such as 'shards/{{00000..00009}}.tar'"
        )
    sources = [source.strip() for source in pattern.split("::")]
    if not all(sources):
        raise ShardPatternError(f"{flag} {pattern!r} has an empty source between '::'")
    shards: list[str] = []
    for source in sources:
        expanded = list(braceexpand.braceexpand(source))
        if not is_local(source):
            shards.extend(expanded)  # pipe: commands and URLs: the reader opens them, nothing to check here
            continue
        found: list[str] = []
        missing: list[str] = []
        for item in expanded:
            path = local_path(item)
            if glob.has_magic(path):
                found.extend(sorted(p for p in glob.glob(path) if os.path.isfile(p)))
            elif os.path.isfile(path):
                found.append(path)
            else:
                missing.append(path)
        if not found:
            raise ShardPatternError(f"{flag} pattern {source!r} matches no file")
        if missing:
            more = f" and {len(missing) - _SHOWN_MISSING} more" if len(missing) > _SHOWN_MISSING else ""
            raise ShardPatternError(
                f"{flag} pattern {source!r}: {len(missing)} of {len(expanded)} shards are missing: "
                f"{', '.join(missing[:_SHOWN_MISSING])}{more}"
            )
        shards.extend(found)
    return shards
