"""img2dataset's shards, counted from their stats files, on a local disk and on S3.

The shards in tests/data/img2dataset were written by img2dataset itself (scripts/img2dataset_shards.py: 30
generated images served by http.server on 127.0.0.1, 3 of them missing (404) and 3 not images, `--resize_mode
no`, 10 URLs per shard): 23 samples in 3 shards, each shard beside its NNNNN_stats.json. The S3 API is moto's
server on 127.0.0.1 (the fixture of tests/test_remote.py), read through fsspec (s3fs), as a user's bucket.

Pinned here: without --train-num-samples the counts come, in this order, from sizes.json, from img2dataset's
"successes", and only then from a scan, and one log line says where they came from; every sample of the
shards trains exactly once per epoch from the bucket as from the disk; a stats file that is not JSON is one
line naming it; `ds-clip-train` trains the shards from the bucket under the launcher.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from ds_clip.data.loader import DataError
from ds_clip.data.wds import count_samples
from tests import launch
from tests.data.test_wds import build, captions
from tests.test_remote import _finish, _s3fs, model_dir, s3  # noqa: F401 - fixtures

FIXTURE = Path(__file__).resolve().parent / "img2dataset"
PATTERN = "{00000..00002}.tar"
COUNTS = [8, 7, 8]  # "successes" of the three stats files
BUCKET = "webshards"


def _captions_in_tars() -> list[str]:
    out = []
    for i in range(3):
        with tarfile.open(FIXTURE / f"{i:05d}.tar") as tf:
            out += [tf.extractfile(m).read().decode().strip() for m in tf if m.name.endswith(".txt")]
    return sorted(out)


def _counted_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("samples: ")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    return lines[0]


@pytest.fixture(scope="module")
def bucket(s3):  # noqa: F811 - the fixture imported above
    fs = _s3fs(s3)
    fs.mkdir(BUCKET)
    for name in sorted(os.listdir(FIXTURE)):
        fs.put(str(FIXTURE / name), f"{BUCKET}/i2d/{name}")
        if name.endswith(".tar"):
            fs.put(str(FIXTURE / name), f"{BUCKET}/bare/{name}")  # the tars alone: no size file of any kind
    return f"s3://{BUCKET}/i2d/{PATTERN}"


def test_img2dataset_counts_come_from_stats_files_on_disk_and_on_s3_and_every_sample_trains_once(
    tmp_path, caplog, bucket
):
    """The stats files' "successes" equal the samples in the tars (failed downloads are absent); the loader
    takes its counts from them, local and remote, and one line says so; an epoch trains each pair once."""
    assert [count_samples(str(FIXTURE / f"{i:05d}.tar")) for i in range(3)] == COUNTS
    expected = _captions_in_tars()
    assert len(expected) == sum(COUNTS)
    for pattern in (str(FIXTURE / PATTERN), bucket):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ds_clip.data"):
            data = build(pattern, m=2, k=1, workers=2, world_size=1)
            assert data.sizes == COUNTS and data.steps_per_epoch == 11
            line = _counted_line(caplog)
            assert (
                line
                == "samples: 23 samples in 3 shards, counts of 3 from img2dataset's NNNNN_stats.json files"
            )
            seen = sorted(c for step in captions(data, 0) for c in step)
        # N = 2: one pair left over; never one twice
        assert len(seen) == len(set(seen)) == 22 and set(seen) <= set(expected), pattern
        ranks = [build(pattern, m=1, k=1, world_size=2, rank=r) for r in (0, 1)]
        both = [c for d in ranks for step in captions(d, 0) for c in step]
        assert len(both) == len(set(both)) == 22 and set(both) <= set(expected), pattern


def test_remote_shards_without_size_files_are_scanned_whole_with_a_warning(caplog, bucket):
    with caplog.at_level(logging.INFO, logger="ds_clip.data"):
        data = build(bucket.replace("/i2d/", "/bare/"), m=2, k=1)
    assert data.sizes == COUNTS
    assert _counted_line(caplog).endswith("counts of 3 from a scan of the shard (no size file)")
    assert "counting the samples of 3 remote shards by reading them whole" in caplog.text


def test_counts_are_read_in_order_sizes_json_then_stats_then_a_scan(tmp_path, caplog):
    """sizes.json wins over a stats file; a shard with neither is scanned; the line names each source."""
    for name in os.listdir(FIXTURE):
        shutil.copy(FIXTURE / name, tmp_path / name)
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 8}))
    os.remove(tmp_path / "00002_stats.json")
    with caplog.at_level(logging.INFO, logger="ds_clip.data"):
        data = build(str(tmp_path / PATTERN), m=2, k=1)
    assert data.sizes == COUNTS
    assert _counted_line(caplog) == (
        "samples: 23 samples in 3 shards, counts of 1 from sizes.json, 1 from img2dataset's "
        "NNNNN_stats.json files, 1 from a scan of the shard (no size file)"
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_clip.data"):
        data = build(str(tmp_path / PATTERN), m=2, k=1, train_num_samples=10)
    assert data.steps_per_epoch == 5
    assert _counted_line(caplog).endswith("; an epoch is --train-num-samples 10 of them")
    (tmp_path / "00001_stats.json").write_text("{not json")
    with pytest.raises(DataError, match="00001_stats.json is not JSON"):
        build(str(tmp_path / PATTERN), m=2, k=1)
    (tmp_path / "00001_stats.json").write_text(json.dumps({"count": 10}))
    with pytest.raises(DataError, match='00001_stats.json has no sample count: .*"successes"'):
        build(str(tmp_path / PATTERN), m=2, k=1)


@pytest.mark.e2e
def test_ds_clip_train_trains_img2dataset_shards_from_s3_under_the_launcher(model_dir, tmp_path, s3, bucket):  # noqa: F811
    """`deepspeed --num_gpus 2 --module ds_clip.train --train-data s3://.../{00000..00002}.tar` without
    --train-num-samples: the counts come from the stats files in the bucket (the log line says so), and the
    run trains an epoch of 23 // (W k m = 8) = 2 steps, with the default --decode fast (uint8 micro-batches
    normalised by the step)."""
    args = [
        "--model", model_dir, "--batch-size", "2", "--accum-freq", "2", "--epochs", "1", "--workers", "1",
        "--log-every-n-steps", "1", "--logs", str(tmp_path), "--name", "i2d", "--report-to", "csv",
        "--warmup", "1", "--train-data", bucket,
    ]  # fmt: skip
    proc = launch.start(launch.deepspeed(*args), env=launch.environment(**s3), merge_stderr=True)
    code, out = _finish(proc)
    assert code == 0, out[-4000:]
    assert "samples: 23 samples in 3 shards, counts of 3 from img2dataset's NNNNN_stats.json files" in out, (
        out[-4000:]
    )
    assert "step 2/2" in out, out[-4000:]
    assert "decode: fast" in out  # open_clip's train transform: uint8 micro-batches, normalised in the step
