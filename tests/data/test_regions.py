"""Region boxes for SigLIP 2's LocCa tasks (--siglip2), read from webdataset samples' json, on tar shards written
in tmp_path.

Contract pinned here: under `locca_tasks` a webdataset sample's text is [3, L]: row 0 the caption's tokens as
without it, row 1 `aref: <region caption> : x0 y0 x1 y1`, row 2 `gcap: x0 y0 x1 y1 : <region caption>`, the box
in 0..999 bins of the image the model sees, through the very crop (and flip) the image got; pixel and normalized
boxes alike; a region cropped away or malformed is counted and left out, never fatal, and the sample trains;
rows 1 and 2 are zeros without a usable region; the region picked is a function of (seed, epoch, sample) alone,
whatever (W, k, m) or a second pass; without `locca_tasks` texts are [L] and unchanged; a train transform whose
geometry cannot be followed is refused at build time.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re

import pytest
import torch
import torchvision.transforms as T
import webdataset as wds
from PIL import Image, ImageDraw

from ds_clip.data.augment import SeededTransform
from ds_clip.data.loader import DataError, DataSettings, build_train_data
from ds_clip.data.regions import BoxGeometry
from ds_clip.geometry import BatchGeometry
from tests.data.tokens import byte_tokenizer, detok

SQUASH = T.Compose([T.Resize((10, 10)), T.ToTensor()])  # no crop: boxes scale with the image


def png(width: int, height: int, box: tuple[int, int, int, int] | None = None) -> bytes:
    """A black image, with a white rectangle covering the pixels of `box` (x0, y0, x1, y1; x1, y1 exclusive)."""
    im = Image.new("RGB", (width, height))
    if box is not None:
        ImageDraw.Draw(im).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=(255, 255, 255))
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def write_shards(folder, samples: list[dict], per_shard: int) -> str:
    """Samples as {"key", "image", "caption", "json" (a dict or raw bytes, optional)}; the shards' brace pattern."""
    os.makedirs(folder, exist_ok=True)
    sizes = {}
    for start in range(0, len(samples), per_shard):
        name = f"{start // per_shard:05d}.tar"
        with wds.TarWriter(os.path.join(folder, name)) as sink:
            for s in samples[start : start + per_shard]:
                fields = {"__key__": s["key"], "png": s["image"], "txt": s["caption"].encode()}
                if "json" in s:
                    meta = s["json"]
                    fields["json"] = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
                sink.write(fields)
        sizes[name] = len(samples[start : start + per_shard])
    with open(os.path.join(folder, "sizes.json"), "w") as f:
        json.dump(sizes, f)
    return os.path.join(str(folder), f"{{00000..{len(sizes) - 1:05d}}}.tar")


def build(pattern: str, preprocess=SQUASH, *, locca_tasks=True, world_size=1, rank=0, k=1, m=2, **settings):
    s = DataSettings(dataset_type="webdataset", train_data=pattern, workers=0, shuffle_buffer=0, **settings)
    return build_train_data(
        s,
        preprocess=preprocess,
        tokenizer=byte_tokenizer,
        rank=rank,
        geometry=BatchGeometry(world_size, k, m),
        locca_tasks=locca_tasks,
    )


def rows_by_caption(data, epoch: int = 0) -> dict[str, tuple[str, str]]:
    """Caption -> (ARef row, GCap row) as strings ("" for an all-zero row) over one epoch."""
    out = {}
    for batch in data.iter_epoch(epoch):
        for _, texts in batch.micro_batches:
            assert texts.dtype == torch.long and texts.shape == (
                data.geometry.micro_batch_size,
                3,
                texts.shape[-1],
            )
            for caption, aref, gcap in texts:
                out[detok(caption)] = (detok(aref), detok(gcap))
    return out


def test_rows_are_the_aref_and_gcap_texts_of_pixel_and_normalized_boxes(tmp_path):
    """A squashing resize (no crop): a pixel box of a 200x100 image and a normalized one map to known bins."""
    pixels = {"regions": [{"box": [20, 10, 120, 60], "caption": "a red car"}]}
    normalized = {
        "box_format": "normalized",
        "regions": [{"box": [0.25, 0.5, 0.75, 1.0], "caption": " a dog "}],
    }
    pattern = write_shards(
        tmp_path,
        [
            {"key": "k0", "image": png(200, 100), "caption": "street", "json": pixels},
            {"key": "k1", "image": png(40, 80), "caption": "park", "json": normalized},
        ],
        per_shard=2,
    )
    assert rows_by_caption(build(pattern)) == {
        "street": ("aref: a red car : 100 100 600 600", "gcap: 100 100 600 600 : a red car"),
        "park": ("aref: a dog : 250 500 750 999", "gcap: 250 500 750 999 : a dog"),  # the far edge: bin 999
    }


def test_without_locca_tasks_texts_are_unchanged_and_row_0_is_todays_caption(tmp_path):
    meta = {"regions": [{"box": [0, 0, 5, 5], "caption": "corner"}]}
    samples = [{"key": f"k{i}", "image": png(20, 20), "caption": f"c{i}", "json": meta} for i in range(4)]
    pattern = write_shards(tmp_path, samples, per_shard=4)
    plain = [t for b in build(pattern, locca_tasks=False).iter_epoch(0) for _, t in b.micro_batches]
    rows = [t for b in build(pattern).iter_epoch(0) for _, t in b.micro_batches]
    assert all(t.shape == (2, 96) for t in plain) and all(t.shape == (2, 3, 96) for t in rows)
    assert all(torch.equal(p, r[:, 0]) for p, r in zip(plain, rows, strict=True))


def test_a_box_follows_the_crop_and_one_cropped_away_is_counted_and_left_out(tmp_path, caplog):
    """Resize(20) then CenterCrop(10) of a 40x20 image: the middle 10 px of a 40x20 resized image are kept."""
    center = T.Compose([T.Resize(20), T.CenterCrop(10), T.ToTensor()])
    inside = {"box": [16, 6, 24, 14], "caption": "middle"}  # crop window: x 15..25, y 5..15 of the original
    outside = {"box": [0, 0, 8, 8], "caption": "far left"}
    pattern = write_shards(
        tmp_path,
        [
            {"key": "k0", "image": png(40, 20), "caption": "both", "json": {"regions": [outside, inside]}},
            {"key": "k1", "image": png(40, 20), "caption": "lost", "json": {"regions": [outside]}},
        ],
        per_shard=2,
    )
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        data = build(pattern, center)
        rows = rows_by_caption(data)
    assert rows == {
        "both": ("aref: middle : 100 100 900 900", "gcap: 100 100 900 900 : middle"),
        "lost": ("", ""),  # its only region cropped away: the sample trains without one
    }
    assert data.skip_counts == {"region_outside_crop": 2} and data.skipped_samples() == 0
    assert "region_outside_crop" in caplog.text and "'k1'" in caplog.text and "00000.tar" in caplog.text
    assert (
        "left out regions of samples that trained" in caplog.text and "skipped bad samples" not in caplog.text
    )


@pytest.mark.parametrize("decode", ["fast", "exact"])
def test_a_random_crop_and_flip_move_the_box_with_the_image(tmp_path, decode):
    """The bins written for a white rectangle are where the rectangle is in the image the model gets, under
    random crops (and flips: exact path), both decodes: the replay draws what the transform drew."""
    steps = [T.RandomResizedCrop(32, scale=(0.3, 1.0))] + (
        [T.RandomHorizontalFlip()] if decode == "exact" else []
    )
    crop = T.Compose([*steps, T.ToTensor(), T.Normalize((0.0,) * 3, (1.0,) * 3)])  # --decode fast applies
    box = (60, 20, 140, 70)
    meta = {"regions": [{"box": list(box), "caption": "white"}]}
    samples = [
        {"key": f"k{i}", "image": png(200, 100, box), "caption": f"c{i}", "json": meta} for i in range(12)
    ]
    data = build(write_shards(tmp_path, samples, per_shard=12), crop, m=4, decode=decode)
    assert (data.image_normalize is not None) == (decode == "fast")
    checked = 0
    for batch in data.iter_epoch(0):
        for images, texts in batch.micro_batches:
            for image, rows in zip(images, texts, strict=True):
                gcap = detok(rows[2])
                lit = torch.nonzero(image.float().mean(0) > image.float().mean(0).max() / 2)
                if not gcap:  # the crop missed the rectangle
                    assert len(lit) == 0
                    continue
                bins = [int(v) for v in re.match(r"gcap: (\d+) (\d+) (\d+) (\d+) : white$", gcap).groups()]
                (y0, x0), (y1, x1) = lit.min(0).values.tolist(), (lit.max(0).values + 1).tolist()
                seen = [round(v * 1000 / 32) for v in (x0, y0, x1, y1)]
                assert max(abs(a - min(b, 999)) for a, b in zip(bins, seen)) <= 32, (
                    bins,
                    seen,
                )  # within 1 px
                checked += 1
    assert checked >= 8


def test_malformed_regions_are_counted_and_skipped_and_the_good_one_trains(tmp_path, caplog):
    meta = {
        "regions": [
            {"box": [1, 2, 3], "caption": "three numbers"},
            {"box": [5, 5, 2, 8], "caption": "inverted"},
            {"box": [4, 4, 4, 9], "caption": "empty"},
            {"box": [1, 1, 5, 5]},
            {"box": ["1", 1, 5, 5], "caption": "text numbers"},
            "not an object",
            {"box": [0, 0, 10, 5], "caption": "top half"},
        ]
    }
    pattern = write_shards(
        tmp_path,
        [
            {"key": "k0", "image": png(10, 10), "caption": "good", "json": meta},
            {"key": "k1", "image": png(10, 10), "caption": "broken json", "json": b"{not json"},
            {
                "key": "k2",
                "image": png(10, 10),
                "caption": "odd format",
                "json": {**meta, "box_format": "xywh"},
            },
            {
                "key": "k3",
                "image": png(10, 10),
                "caption": "bad list",
                "json": {"regions": {"box": [0, 0, 1, 1]}},
            },
        ],
        per_shard=4,
    )
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        data = build(pattern)
        rows = rows_by_caption(data)
    assert rows["good"] == ("aref: top half : 0 0 999 500", "gcap: 0 0 999 500 : top half")
    assert all(rows[c] == ("", "") for c in ("broken json", "odd format", "bad list"))
    assert data.skip_counts == {"bad_region": 6 + 7 + 1, "bad_json": 1} and data.skipped_samples() == 0
    assert "inverted" in caplog.text and '"box" is not 4 numbers' in caplog.text and "'k0'" in caplog.text


def test_samples_without_regions_have_zero_rows(tmp_path):
    pattern = write_shards(
        tmp_path,
        [
            {"key": "k0", "image": png(10, 10), "caption": "no json"},
            {"key": "k1", "image": png(10, 10), "caption": "no regions", "json": {"url": "x", "width": 10}},
            {"key": "k2", "image": png(10, 10), "caption": "empty", "json": {"regions": []}},
            {
                "key": "k3",
                "image": png(10, 10),
                "caption": "one",
                "json": {"regions": [{"box": [0, 0, 5, 5], "caption": "q"}]},
            },
        ],
        per_shard=4,
    )
    data = build(pattern)
    texts = torch.cat([t for b in data.iter_epoch(0) for _, t in b.micro_batches])
    assert texts.shape == (4, 3, 96) and texts[:3, 1:].eq(0).all() and texts[3, 1:].ne(0).any()
    assert data.skip_counts == {}


def test_the_region_picked_depends_on_the_sample_alone(tmp_path):
    """Four regions per sample: the same picks on a second pass and under another (W, k, m) with the same
    shards; another epoch picks anew."""
    regions = [{"box": [i, i, i + 4, i + 4], "caption": f"r{i}"} for i in range(4)]
    samples = [
        {"key": f"k{i}", "image": png(10, 10), "caption": f"c{i}", "json": {"regions": regions}}
        for i in range(16)
    ]
    pattern = write_shards(tmp_path, samples, per_shard=4)
    one = build(pattern, m=4)
    first = rows_by_caption(one)
    assert len(first) == 16 and len({aref for aref, _ in first.values()}) > 1
    assert rows_by_caption(one) == first
    split = {}
    for rank in (0, 1):
        split.update(rows_by_caption(build(pattern, world_size=2, rank=rank, k=2, m=1)))
    assert split == first
    assert rows_by_caption(one, epoch=1) != first


def test_a_transform_whose_geometry_cannot_be_followed_is_refused_and_other_data_keep_l_texts(tmp_path):
    pattern = write_shards(tmp_path, [{"key": "k0", "image": png(10, 10), "caption": "c"}] * 2, per_shard=2)
    with pytest.raises(DataError, match="RandomRotation"):
        build(pattern, T.Compose([T.RandomRotation(10), T.ToTensor()]))
    jitter_first = T.Compose([T.ColorJitter(0.4), T.RandomResizedCrop(8), T.ToTensor()])
    with pytest.raises(DataError, match="RandomResizedCrop comes after .*ColorJitter"):
        build(pattern, jitter_first)
    # a pixel step after the crop, and a seeded transform, are followed
    assert BoxGeometry.of(
        SeededTransform(T.Compose([T.RandomResizedCrop(8), T.ColorJitter(0.4)]), 0).transform
    )
    synthetic = DataSettings(dataset_type="synthetic", train_num_samples=4, workers=0, synthetic_image_size=8)
    data = build_train_data(
        synthetic,
        preprocess=SQUASH,
        tokenizer=byte_tokenizer,
        rank=0,
        geometry=BatchGeometry(1, 1, 2),
        locca_tasks=True,
    )
    texts = next(iter(data.iter_epoch(0))).micro_batches[0][1]
    assert texts.shape == (2, 96)
