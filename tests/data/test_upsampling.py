"""--train-data-upsampling-factors: open_clip's weighted resampling of "::"-joined webdataset sources.

Contract pinned here: with --dataset-resampled each shard of source i is drawn with weight factor_i (open_clip's
expand_urls(urls, weights) + ResampledShards2), so a source's share of the samples is
factor_i * shards_i / sum_j(factor_j * shards_j); the draws stay seeded per (seed, epoch, rank, worker);
the flag's misuses are errors naming it (ds-clip-train exits 2 with one line).
"""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest
import torchvision.transforms as T
from PIL import Image

from ds_clip.data.loader import DataSettings, build_train_data
from ds_clip.data.synthetic import render_pair
from ds_clip.geometry import BatchGeometry
from ds_clip.shards import Sample, write_shards
from ds_clip.train import main as train_main
from ds_clip_harness.models import E2E_MODEL
from tests import launch
from tests.data.tokens import byte_tokenizer, detok
from tests.test_e2e import _check_run, _run, _train_args

PREPROCESS = T.ToTensor()  # 1x1 images: the test measures shard draws, not decoding


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (1, 1), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def one_sample_shards(folder, count: int, caption: str) -> str:
    """`count` shards of one sample each, captioned `caption`: each shard draw is one sample, so the mix
    of 10k samples is 10k independent draws (the smallest variance a shard-level mix can have)."""
    folder.mkdir()
    image = png()
    sizes, _ = write_shards(
        (Sample(image=image, ext="png", caption=caption) for _ in range(count)), str(folder), 1
    )
    (folder / "sizes.json").write_text(json.dumps(sizes))
    return str(folder / f"{{00000..{count - 1:05d}}}.tar")


def source_shares(pattern: str, factors: str | None, samples: int = 10_000) -> dict[str, float]:
    settings = DataSettings(
        dataset_type="webdataset",
        train_data=pattern,
        dataset_resampled=True,
        train_num_samples=samples,
        train_data_upsampling_factors=factors,
        workers=0,
        shuffle_buffer=0,
        seed=11,
    )
    data = build_train_data(
        settings,
        preprocess=PREPROCESS,
        tokenizer=byte_tokenizer,
        rank=0,
        geometry=BatchGeometry(1, 1, 200),
    )
    counts = Counter(detok(t) for b in data.iter_epoch(0) for _, texts in b.micro_batches for t in texts)
    total = sum(counts.values())
    assert total == samples
    return {k: v / total for k, v in counts.items()}


def test_each_shard_of_source_i_is_drawn_with_weight_factor_i(tmp_path):
    """Source a: 1 shard, factor 3; source b: 3 shards, factor 1. Per-shard weights give a 3 : 3 mix,
    so a's share is 0.5 (uniform drawing would give 0.25, per-source weights 0.75). Over 10k one-sample
    shard draws the share's standard deviation is 0.005, so the 2-point tolerance is 4 sigma (and the
    draws are seeded: the test is deterministic)."""
    a = one_sample_shards(tmp_path / "a", 1, "a")
    b = one_sample_shards(tmp_path / "b", 3, "b")
    shares = source_shares(f"{a}::{b}", "3::1")
    assert abs(shares["a"] - 0.5) < 0.02, shares


def test_flag_misuse_exits_2_naming_the_flag(tmp_path, capsys):
    """As open_clip: factors need --dataset-resampled and one number per source; and each must be > 0."""
    a = one_sample_shards(tmp_path / "a", 1, "a")
    b = one_sample_shards(tmp_path / "b", 1, "b")
    resampled = ["--train-data", f"{a}::{b}", "--dataset-resampled", "--train-num-samples", "64"]
    for argv, needle in [
        (["--train-data", f"{a}::{b}", "--train-data-upsampling-factors", "1::2"], "--dataset-resampled"),
        ([*resampled, "--train-data-upsampling-factors", "1"], "has 1 factors but --train-data has 2"),
        ([*resampled, "--train-data-upsampling-factors", "1::0"], "positive"),
        ([*resampled, "--train-data-upsampling-factors", "1::-2"], "positive"),
        ([*resampled, "--train-data-upsampling-factors", "1::x"], "'x' is not a number"),
        ([*resampled, "--train-data-upsampling-factors", "1::nan"], "positive"),
    ]:
        assert train_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--train-data-upsampling-factors" in err and needle in err, err


@pytest.mark.e2e
@pytest.mark.slow
def test_ds_clip_train_with_upsampling_factors_under_the_deepspeed_launcher(tmp_path):
    """`deepspeed --num_gpus 2 --module ds_clip.train --train-data a::b --dataset-resampled
    --train-data-upsampling-factors 1::3` trains 2 steps of k*m*W pairs on 2 CPU ranks."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    patterns = []
    for name, first in (("a", 0), ("b", 1000)):
        folder = tmp_path / name
        folder.mkdir()
        pairs = (render_pair(0, first + i, 32) for i in range(16))
        samples = (Sample(image=_png(image), ext="png", caption=caption) for image, caption in pairs)
        sizes, _ = write_shards(samples, str(folder), 8)
        (folder / "sizes.json").write_text(json.dumps(sizes))
        patterns.append(str(folder / "{00000..00001}.tar"))
    args = _train_args(f"local-dir:{tmp_path / 'model'}", tmp_path, "mix", steps=2)
    data = ["--train-data", "::".join(patterns), "--dataset-resampled", "--train-num-samples", "64"]
    proc = _run(launch.deepspeed(*args, *data, "--train-data-upsampling-factors", "1::3"))
    _check_run(proc, tmp_path / "mix", steps=2)
    settings = json.loads((tmp_path / "mix" / "settings.json").read_text())
    assert settings["train_data_upsampling_factors"] == "1::3"


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
