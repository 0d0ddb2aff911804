"""The webdataset pipeline, on tiny shards written in tmp_path by ds_clip.shards itself.

Contract pinned here: exact-epoch mode trains every sample exactly once per epoch across ranks and
workers, with the same number of full steps on every rank; a resumed run neither repeats nor skips;
resampled mode is a function of the seed; bad samples are skipped and counted, not fatal; patterns
that match nothing and data with no valid sample are errors, not hangs.
"""

from __future__ import annotations

import http.server
import io
import json
import logging
import os
import threading
from collections import Counter

import pytest
import torchvision.transforms as T
import webdataset as wds
from PIL import Image

from ds_clip.data.loader import DataError, DataSettings, build_train_data
from ds_clip.data.wds import expand_urls
from ds_clip.geometry import BatchGeometry
from ds_clip.shards import Sample, write_shards
from tests.data.tokens import byte_tokenizer, detok

PREPROCESS = T.Compose([T.Resize((8, 8)), T.ToTensor()])


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (i % 256, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def make_shards(folder, count: int, per_shard: int, prefix: str = "s") -> str:
    """Shards of pairs captioned "<prefix><i>"; returns the brace pattern of their paths."""
    os.makedirs(folder, exist_ok=True)
    samples = (Sample(image=png(i), ext="png", caption=f"{prefix}{i}") for i in range(count))
    sizes, _ = write_shards(samples, str(folder), per_shard)
    with open(os.path.join(folder, "sizes.json"), "w") as f:
        json.dump(sizes, f)
    return os.path.join(str(folder), f"{{00000..{len(sizes) - 1:05d}}}.tar")


def build(pattern: str, *, rank=0, world_size=1, m=2, k=2, workers=0, **settings):
    s = DataSettings(dataset_type="webdataset", train_data=pattern, workers=workers, **settings)
    return build_train_data(
        s,
        preprocess=PREPROCESS,
        tokenizer=byte_tokenizer,
        rank=rank,
        geometry=BatchGeometry(world_size, k, m),
    )


def captions(data, epoch: int, start_step: int = 0, stop_after: int | None = None) -> list[list[str]]:
    """Per step, the captions of the step's k*m pairs, in order."""
    out = []
    for batch in data.iter_epoch(epoch, start_step):
        assert len(batch.micro_batches) == data.geometry.accum_freq
        assert batch.micro_batch_ids == data.geometry.micro_batch_ids(data.rank)
        for images, _ in batch.micro_batches:
            assert images.shape == (data.geometry.micro_batch_size, 3, 8, 8)
        out.append([detok(t) for _, texts in batch.micro_batches for t in texts])
        if stop_after is not None and len(out) == stop_after:
            break
    return out


def test_exact_epoch_sees_every_sample_once_across_2_ranks_x_2_workers(tmp_path):
    pattern = make_shards(tmp_path, count=48, per_shard=6)  # 8 shards, N = 2*2*2 = 8: 6 steps
    per_rank = [build(pattern, rank=r, world_size=2, workers=2) for r in range(2)]
    for epoch in (0, 1):
        steps = [captions(d, epoch) for d in per_rank]
        assert [len(s) for s in steps] == [6, 6]
        seen = [c for s in steps for step in s for c in step]
        assert sorted(seen) == sorted(f"s{i}" for i in range(48))
        if epoch == 0:
            first = steps
    assert steps != first  # the order is reshuffled per epoch
    assert per_rank[0].skip_counts == {} and per_rank[0].samples_per_epoch == 48


def test_exact_epoch_leftover_is_left_out_with_a_warning(tmp_path, caplog):
    pattern = make_shards(tmp_path, count=21, per_shard=5)  # 5 shards, 21 samples; N = 8: 2 steps
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        data = [build(pattern, rank=r, world_size=2) for r in range(2)]
    assert data[0].steps_per_epoch == 2 and "5 samples that do not fill" in caplog.text
    seen = [c for d in data for step in captions(d, 0) for c in step]
    assert len(seen) == len(set(seen)) == 16
    # train_num_samples caps an exact epoch
    assert build(pattern, train_num_samples=9).steps_per_epoch == 2


def test_sizes_come_from_a_scan_without_sizes_json(tmp_path):
    pattern = make_shards(tmp_path, count=20, per_shard=7)
    os.remove(tmp_path / "sizes.json")
    data = build(pattern, m=2, k=1)
    assert data.sizes == [7, 7, 6] and data.steps_per_epoch == 10
    assert sorted(c for step in captions(data, 0) for c in step) == sorted(f"s{i}" for i in range(20))


def test_resume_neither_repeats_nor_skips_and_matches_the_uninterrupted_run(tmp_path):
    pattern = make_shards(tmp_path, count=64, per_shard=8)  # N = 8: 8 steps per epoch
    for rank in range(2):
        whole = captions(build(pattern, rank=rank, world_size=2, workers=2, shuffle_buffer=5), 0)
        first = build(pattern, rank=rank, world_size=2, workers=2, shuffle_buffer=5)
        head = captions(first, 0, stop_after=3)
        state = first.state_dict()
        assert (state["epoch"], state["step_in_epoch"]) == (0, 3)
        again = build(pattern, rank=rank, world_size=2, workers=2, shuffle_buffer=5)
        again.load_state_dict(state)
        tail = captions(again, state["epoch"], state["step_in_epoch"])
        assert head + tail == whole


def test_a_position_saved_before_draws_were_keyed_by_shard_name_says_the_draws_change(tmp_path, caplog):
    """A checkpoint from a ds_clip that keyed each sample's draws by the shard's path resumes with other draws:
    the resume says so in one line (on rank 0); a position saved now resumes without it."""
    pattern = make_shards(tmp_path, count=32, per_shard=8)
    first = build(pattern)
    captions(first, 0, stop_after=1)
    state = first.state_dict()
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        build(pattern).load_state_dict(state)
        assert "keyed" not in caplog.text
        old = {k: v for k, v in state.items() if k != "draws_keyed_by"}
        build(pattern, rank=1, world_size=2, k=1).load_state_dict(old)  # rank 1 stays quiet
        assert "keyed" not in caplog.text
        build(pattern).load_state_dict(old)
    lines = [r.getMessage() for r in caplog.records if "keyed" in r.getMessage()]
    assert len(lines) == 1 and "by the shard's path" in lines[0] and "differ" in lines[0]


def test_sources_joined_with_colons_and_pipe_commands(tmp_path):
    a = make_shards(tmp_path / "a", count=8, per_shard=4, prefix="a")
    b = make_shards(tmp_path / "b", count=8, per_shard=4, prefix="b")
    data = build(f"{a}::{b}", m=2, k=1, world_size=2, rank=0)
    other = build(f"{a}::{b}", m=2, k=1, world_size=2, rank=1)
    seen = sorted(c for d in (data, other) for step in captions(d, 0) for c in step)
    assert seen == sorted([f"a{i}" for i in range(8)] + [f"b{i}" for i in range(8)])
    piped = build(f"pipe:cat {tmp_path}/a/{{00000..00001}}.tar", m=2, k=1)  # no sizes.json: scanned
    assert sorted(c for step in captions(piped, 0) for c in step) == sorted(f"a{i}" for i in range(8))


@pytest.fixture
def shard_server(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/served, only to requests with the bearer token."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path / "served"), **kwargs)

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.headers.get("Authorization") != "Bearer t0k3n/x+y=":
                self.send_error(403)
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_pipe_commands_holding_urls_headers_and_quotes_are_run_as_commands(tmp_path, shard_server, caplog):
    """`pipe:curl ... http://...` (how open_clip users read LAION-style shards) is run by the shell wherever a
    shard is read: validated, counted (no sizes.json: a scan through the command), planned and read, with
    its header and quotes intact. Such a command once went to fsspec as a URL of protocol "pipe:curl ...
    http" and stopped the run at start."""
    from ds_clip.config import parse_settings
    from ds_clip.data.wds import shard_sizes

    make_shards(tmp_path / "served", count=16, per_shard=4)
    os.remove(tmp_path / "served" / "sizes.json")
    command = (
        "pipe:curl --noproxy '*' -s -f -H 'Authorization: Bearer t0k3n/x+y=' "
        f'"{shard_server}/{{00000..00003}}.tar"'
    )
    parse_settings(["--train-data", command, "--dataset-type", "webdataset"])
    urls = expand_urls(command)
    assert len(urls) == 4 and urls[0].endswith('/00000.tar"')
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        assert shard_sizes(urls)[0] == [4, 4, 4, 4]
    assert (
        "4 pipe: shards by running each command" in caplog.text and "sizes.json (ds-clip" not in caplog.text
    )
    data = build(command, m=2, k=2, workers=1)
    assert sorted(c for step in captions(data, 0) for c in step) == sorted(f"s{i}" for i in range(16))
    assert data.skip_counts == {}


def test_resampled_is_deterministic_for_a_seed(tmp_path):
    pattern = make_shards(tmp_path, count=30, per_shard=5)
    run = lambda seed, workers: captions(  # noqa: E731
        build(pattern, dataset_resampled=True, train_num_samples=20, seed=seed, workers=workers), 0
    )
    a = run(1, 2)
    assert len(a) == 5 and all(len(step) == 4 for step in a)
    assert a == run(1, 2)
    assert a != run(2, 2)
    assert Counter(c for step in a for c in step).most_common(1)[0][1] >= 1
    with pytest.raises(DataError, match="--train-num-samples"):
        build(pattern, dataset_resampled=True)


def _write_raw(path, members: list[tuple[str, bytes]]) -> None:
    with wds.TarWriter(str(path)) as sink:
        for key, fields in members:
            sink.write({"__key__": key, **fields})


def test_bad_samples_are_skipped_counted_and_ranks_stay_in_step(tmp_path, caplog):
    pattern = make_shards(tmp_path, count=24, per_shard=8)  # 3 good shards 00000..00002
    _write_raw(
        tmp_path / "00003.tar",
        [
            ("k0", {"png": png(1), "txt": b"good0"}),
            ("k1", {"jpg": b"\xff\xd8 not a jpeg", "txt": b"badjpeg"}),
            ("k2", {"png": png(2)}),  # no caption
            ("k3", {"png": png(3), "txt": b"good1"}),
        ],
    )
    truncated = tmp_path / "00004.tar"
    make_shards(tmp_path / "t", count=8, per_shard=8, prefix="t")
    raw = (tmp_path / "t" / "00000.tar").read_bytes()
    truncated.write_bytes(raw[: len(raw) // 2 + 100])
    sizes = json.loads((tmp_path / "sizes.json").read_text())
    sizes.update({"00003.tar": 4, "00004.tar": 8})
    (tmp_path / "sizes.json").write_text(json.dumps(sizes))
    pattern = str(tmp_path / "{00000..00004}.tar")
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        data = [build(pattern, rank=r, world_size=2, workers=1, shuffle_buffer=0) for r in range(2)]
        steps = [captions(d, 0) for d in data]
    assert data[0].steps_per_epoch == 4 and [len(s) for s in steps] == [4, 4]  # 36 counted -> 4 steps of 8
    counts = Counter()
    for d in data:
        counts.update(d.skip_counts)
    assert counts["bad_image"] == 1 and counts["missing_caption"] == 1 and counts["truncated_tar"] == 1
    assert "00004.tar" in caplog.text and "00003.tar" in caplog.text
    seen = Counter(c for s in steps for step in s for c in step)
    assert "badjpeg" not in seen and seen["good0"] >= 1 and seen["good1"] >= 1
    # 32 pairs trained: the 36 - 4 in the ranks' shares minus the 3 bad and the truncated ones, and the
    # short rank's refill repeats from the start of its share (each at most twice)
    assert sum(seen.values()) == 32 and max(seen.values()) <= 2
    assert len(seen) == 32 - sum(n - 1 for n in seen.values()) >= 24


def test_patterns_that_match_nothing_are_errors_naming_them(tmp_path):
    with pytest.raises(DataError, match=r"nothing-\{0\.\.3\}\.tar.*matches no file"):
        build(str(tmp_path / "nothing-{0..3}.tar"))
    with pytest.raises(DataError, match=r"\*\.tar.*matches no file"):
        build(str(tmp_path / "*.tar"))
    make_shards(tmp_path, count=4, per_shard=2)
    with pytest.raises(DataError, match="missing"):
        build(str(tmp_path / "{00000..00005}.tar"))
    with pytest.raises(DataError, match="--train-data"):
        build_train_data(
            DataSettings(dataset_type="webdataset"),
            preprocess=PREPROCESS,
            tokenizer=byte_tokenizer,
            rank=0,
            geometry=BatchGeometry(1, 1, 1),
        )


def test_more_ranks_times_workers_than_shards_is_an_error(tmp_path):
    pattern = make_shards(tmp_path, count=12, per_shard=4)  # 3 shards
    with pytest.raises(DataError, match=r"3 shards.*2 x 2 = 4"):
        build(pattern, world_size=2, workers=2, m=1, k=1)


def test_data_without_a_valid_sample_is_an_error_not_a_hang(tmp_path):
    _write_raw(tmp_path / "00000.tar", [(f"k{i}", {"jpg": b"junk", "txt": b"x"}) for i in range(4)])
    _write_raw(tmp_path / "00001.tar", [(f"k{i}", {"txt": b"no image"}) for i in range(4)])
    pattern = str(tmp_path / "{00000..00001}.tar")  # no sizes.json: scanned, 8 samples
    with pytest.raises(DataError, match="no valid sample"):
        captions(build(pattern, m=2, k=1, workers=1), 0)
    with pytest.raises(DataError, match="no valid sample"):
        captions(build(pattern, m=2, k=1, workers=0, dataset_resampled=True, train_num_samples=8), 0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "00000.tar").write_bytes(b"")
    with pytest.raises(DataError, match="0 samples"):
        build(str(tmp_path / "empty" / "00000.tar"))
