"""The one shard expander (ds_clip.sources.urls.expand_shards) and its two callers.

Contract: braces, globs, "::" joining any mix of local paths, `file:` paths, `pipe:` commands and URLs;
local sources must match files and brace lists must be complete; every error names the flag and the
pattern. Config validation (`--train-data`, `--val-data`) and the webdataset reader expand alike, so a
glob that the reader reads is not refused at validation (it once was).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_clip.config import SettingsError, parse_settings
from ds_clip.data.loader import DataError
from ds_clip.data.wds import expand_urls
from ds_clip.sources.urls import ShardPatternError, expand_shards, is_local, shard_name, url_scheme


def _touch(folder: Path, *names: str) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return [str(folder / n) for n in names]


def test_braces_expand_in_order(tmp_path):
    files = _touch(tmp_path, *(f"{i:05d}.tar" for i in range(12)))
    assert expand_shards(str(tmp_path / "{00000..00011}.tar"), "--train-data") == files
    assert expand_shards(str(tmp_path / "{00003,00001}.tar"), "--train-data") == [files[3], files[1]]


def test_globs_match_files_sorted_and_skip_folders(tmp_path):
    files = _touch(tmp_path, "b.tar", "a.tar", "c.tar")
    (tmp_path / "d.tar").mkdir()  # a folder named like a shard is not a shard
    assert expand_shards(str(tmp_path / "*.tar"), "--train-data") == sorted(files)
    assert expand_shards(str(tmp_path / "[ab].tar"), "--train-data") == sorted(files[:2])


def test_sources_joined_by_double_colon_keep_their_order_and_kinds(tmp_path):
    a = _touch(tmp_path / "a", "0.tar", "1.tar")
    b = _touch(tmp_path / "b", "x.tar", "y.tar")
    pattern = "::".join(
        [
            str(tmp_path / "a" / "{0..1}.tar"),
            f"{tmp_path}/b/*.tar",
            "pipe:aws s3 cp s3://bucket/{0..1}.tar -",
            "https://host/shards/{00..01}.tar",
            f" file:{a[0]} ",  # blanks around a source are dropped; file: is a local path
            f"file://{b[0]}",
        ]
    )
    assert expand_shards(pattern, "--train-data") == [
        *a,
        *b,
        "pipe:aws s3 cp s3://bucket/0.tar -",
        "pipe:aws s3 cp s3://bucket/1.tar -",
        "https://host/shards/00.tar",
        "https://host/shards/01.tar",
        a[0],
        b[0],
    ]


def test_pipe_commands_and_urls_are_not_checked_here(tmp_path):
    # Only the reader can open them: expanded, kept as written, no error although nothing exists locally.
    assert expand_shards("pipe:cat /nowhere/{0..2}.tar", "--train-data") == [
        "pipe:cat /nowhere/0.tar",
        "pipe:cat /nowhere/1.tar",
        "pipe:cat /nowhere/2.tar",
    ]
    assert expand_shards("s3://b/*.tar", "--val-data") == ["s3://b/*.tar"]  # no glob on a URL


@pytest.mark.parametrize(
    "url, name",
    [
        ("/data/laion/00012.tar", "00012.tar"),
        ("relative/shards/00012.tar", "00012.tar"),
        ("00012.tar", "00012.tar"),
        ("file:/nvme/laion/00012.tar", "00012.tar"),
        ("file:///nvme/laion/00012.tar", "00012.tar"),
        ("s3://bucket/laion/00012.tar", "00012.tar"),
        ("https://host:8443/laion/00012.tar?X-Amz-Signature=abc&X-Amz-Expires=60", "00012.tar"),
        ("pipe:aws s3 cp s3://b/laion/00012.tar -", "00012.tar"),
        ("pipe:curl -L -s https://host/laion/00012.tar", "00012.tar"),
        ("pipe:curl -s -H 'Authorization: Bearer a/b+c=' \"https://host/x/00012.tar?sig=1\"", "00012.tar"),
        ("pipe:cat /data/laion/00012.tar", "00012.tar"),
        ("pipe:cat /data/laion/00012.tar | zcat", "00012.tar"),
        ("pipe:gsutil cat gs://b/laion/00012.tar", "00012.tar"),
        ("pipe:my-reader --part 12", "pipe:my-reader --part 12"),  # no URL, no tar: the command as written
        ("pipe:echo 'unbalanced", "pipe:echo 'unbalanced"),
    ],
)
def test_a_shard_is_named_by_its_last_path_component_whatever_reaches_it(url, name):
    assert shard_name(url) == name


def test_a_pipe_command_is_a_command_whatever_urls_it_holds():
    command = "pipe:aws s3 cp s3://b/{0..9}.tar -"
    assert url_scheme(command) == "pipe" and not is_local(command)
    assert (
        url_scheme("s3://b/0.tar") == "s3" and url_scheme("file:/x/0.tar") == "" and url_scheme("x.tar") == ""
    )


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    files = _touch(tmp_path / "shards", "0.tar")
    assert expand_shards("~/shards/{0..0}.tar", "--train-data") == files


@pytest.mark.parametrize("flag", ["--train-data", "--val-data"])
def test_a_pattern_that_matches_nothing_names_the_flag_and_the_pattern(tmp_path, flag):
    _touch(tmp_path, "0.tar")
    for pattern in (f"{tmp_path}/*.tgz", f"{tmp_path}/none-{{0..3}}.tar", f"file:{tmp_path}/x.tar"):
        with pytest.raises(ShardPatternError) as e:
            expand_shards(f"{tmp_path}/0.tar::{pattern}", flag)
        # the source at fault, not only the whole value
        assert str(e.value) == f"{flag} pattern {pattern!r} matches no file"


def test_missing_files_in_a_brace_list_are_an_error_naming_them(tmp_path):
    _touch(tmp_path, "0.tar", "2.tar")
    pattern = str(tmp_path / "{0..5}.tar")
    with pytest.raises(ShardPatternError) as e:
        expand_shards(pattern, "--val-data")
    msg = str(e.value)
    assert msg.startswith(f"--val-data pattern {pattern!r}: 4 of 6 shards are missing: ")
    assert str(tmp_path / "1.tar") in msg and str(tmp_path / "4.tar") in msg and "and 1 more" in msg
    assert str(tmp_path / "0.tar") not in msg.split("missing: ")[1]


def test_empty_patterns_and_sources_are_errors():
    with pytest.raises(ShardPatternError, match="^--train-data is empty"):
        expand_shards(" ", "--train-data")
    with pytest.raises(
        ShardPatternError, match="^--val-data 'a.tar:: ::b.tar' has an empty source between '::'"
    ):
        expand_shards("a.tar:: ::b.tar", "--val-data")


def test_validation_and_reader_expand_alike(tmp_path):
    """config validation used to refuse 'shards/*.tar' that the reader (and docs/data.md) accept."""
    files = _touch(tmp_path, "0.tar", "1.tar")
    glob_pattern = str(tmp_path / "*.tar")
    s = parse_settings(
        ["--dataset-type", "webdataset", "--train-data", glob_pattern, "--val-data", glob_pattern]
    )
    assert s.data.train_data == glob_pattern
    assert expand_urls(s.data.train_data) == files

    missing = str(tmp_path / "{0..2}.tar")
    with pytest.raises(SettingsError, match=r"^--train-data pattern .*: 1 of 3 shards are missing"):
        parse_settings(["--dataset-type", "webdataset", "--train-data", missing])
    with pytest.raises(SettingsError, match=r"^--val-data pattern .*matches no file"):
        parse_settings(["--val-data", str(tmp_path / "*.tgz")])
    # the reader raises its own error type (DataError, exit 2 in ds-clip-train) with the same message
    with pytest.raises(DataError, match=r"^--train-data pattern .*: 1 of 3 shards are missing"):
        expand_urls(missing)
    with pytest.raises(DataError, match=r"^--val-data pattern .*matches no file"):
        expand_urls(str(tmp_path / "*.tgz"), "--val-data")
