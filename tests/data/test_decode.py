"""--decode fast: open_clip's train crop from the JPEG header and a reduced-size decode, normalised on the device.

Pinned here: `FastCrop.of` recognises open_clip's plain train transform and nothing else; the crop box of a
sample is the one the exact path draws for it (pixels within two levels where no reduction applies, PNG and
small JPEGs; close ones where it does); the distribution of crop scale and aspect ratio is torchvision's
RandomResizedCrop's (histograms against torchvision's own draws); the webdataset loader's uint8 micro-batches
are a function of (seed, epoch, sample) alone, whatever --workers and across a resume; a broken image is
counted as bad_image as in the exact path.
"""

from __future__ import annotations

import io
import math
import os
import random

import numpy as np
import open_clip
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from ds_clip.data.augment import SeededTransform
from ds_clip.data.decode import BadImage, FastCrop
from ds_clip.data.loader import DataSettings, build_train_data
from ds_clip.geometry import BatchGeometry
from ds_clip.shards import Sample, write_shards
from ds_clip.step.cached import normalize_images
from ds_clip_harness.webimages import web_image
from tests.data.tokens import byte_tokenizer, detok

SIZE = 64
TRAIN = open_clip.image_transform(
    SIZE, is_train=True
)  # RandomResizedCrop(scale 0.9-1) -> RGB -> tensor -> Normalize


def _exact(transform, seed: int):
    seeded = SeededTransform(transform, seed)

    def run(data: bytes, sample) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as im:
            return seeded(im.convert("RGB"), epoch=0, sample=sample)

    return run


def _psnr(a: torch.Tensor, b: torch.Tensor, fast: FastCrop) -> float:
    """PSNR in 8-bit pixel units between two normalised images."""
    std = torch.tensor(fast.std)[:, None, None]
    mse = (((a - b) * std * 255) ** 2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def test_only_open_clips_plain_train_transform_is_recognised():
    fast = FastCrop.of(TRAIN)
    assert fast is not None and fast.size == (SIZE, SIZE) and fast.scale == (0.9, 1.0)
    assert fast.mean == tuple(float(v) for v in open_clip.OPENAI_DATASET_MEAN)
    assert FastCrop.of(open_clip.image_transform(SIZE, is_train=False)) is None  # Resize + CenterCrop
    jitter = open_clip.image_transform(SIZE, is_train=True, aug_cfg={"gray_scale_prob": 0.2})
    assert FastCrop.of(jitter) is None
    assert FastCrop.of(T.Compose([T.Resize((8, 8)), T.ToTensor()])) is None
    nearest = T.Compose([T.RandomResizedCrop(SIZE, interpolation=T.InterpolationMode.NEAREST), T.ToTensor(),
                         T.Normalize((0.5,) * 3, (0.5,) * 3)])  # fmt: skip
    assert FastCrop.of(nearest) is None


def test_fast_pixels_are_within_two_levels_of_the_exact_paths_without_reduction_and_close_with_it():
    """Same seed, epoch and sample: PNG and JPEGs too small to reduce give the exact path's normalised tensor
    within two 8-bit levels (the same crop box; torchvision's uint8 resize against PIL's, same filter); JPEGs
    decoded at reduced size stay above 30 dB PSNR at 64 px (the reduced decode, and the box snapped to the
    reduced image's pixels: at most half an output pixel at this size)."""
    fast = FastCrop.of(TRAIN)
    exact, seeded = _exact(TRAIN, 7), SeededTransform(fast, 7)
    std = torch.tensor(fast.std)[:, None, None]
    rng = random.Random(1)
    near = reduced = 0
    for i in range(24):
        data, ext = web_image(rng, min_side=40, max_side=400)
        got = seeded(data, epoch=0, sample=("shard", str(i)))
        assert got.dtype == torch.uint8 and got.shape == (3, SIZE, SIZE) and got.is_contiguous()
        want = exact(data, ("shard", str(i)))
        normalised = normalize_images(got[None], fast.mean, fast.std)[0]
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
        if ext == "png" or min(width, height) < 2 * SIZE:  # no DCT reduction can apply
            assert ((normalised - want) * std * 255).abs().max().item() <= 2.0 + 1e-3, (i, ext)
            near += 1
        else:
            psnr = _psnr(normalised, want, fast)
            assert psnr > 30, (i, ext, psnr)
            reduced += psnr < math.inf
    assert near and reduced


def test_crop_scale_and_ratio_follow_torchvisions_random_resized_crop():
    """The fast path's boxes (the draws it makes per sample, before decoding) against torchvision's
    RandomResizedCrop on the same seeds: the very same boxes; and against torchvision's own draws on
    other seeds, histograms of crop scale (area fraction) and log aspect ratio within sampling noise
    (total variation < 0.05 over 4000 draws, 10 bins), for torchvision's default range and open_clip's."""
    for scale in ((0.08, 1.0), (0.9, 1.0)):
        crop = T.RandomResizedCrop(224, scale=scale)
        fast = FastCrop.of(T.Compose([crop, T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)]))
        sizes = [(1200, 800), (500, 500), (640, 1138)]
        ours, same_seed, other = [], [], []
        for i in range(4000):
            width, height = sizes[i % 3]
            image = Image.new("L", (width, height))
            torch.manual_seed(i)
            top, left, h, w = fast.box(image)
            torch.manual_seed(i)
            same_seed.append(
                T.RandomResizedCrop.get_params(image, list(scale), [3 / 4, 4 / 3]) == (top, left, h, w)
            )
            ours.append((h * w / (width * height), math.log(w / h)))
            torch.manual_seed(10**6 + i)
            th, tw = T.RandomResizedCrop.get_params(image, list(scale), [3 / 4, 4 / 3])[2:]
            other.append((th * tw / (width * height), math.log(tw / th)))
        assert all(same_seed)
        for k, (lo, hi) in enumerate(((scale[0], 1.0), (math.log(3 / 4), math.log(4 / 3)))):
            a = np.histogram([o[k] for o in ours], bins=10, range=(lo, hi))[0] / len(ours)
            b = np.histogram([o[k] for o in other], bins=10, range=(lo, hi))[0] / len(other)
            assert 0.5 * np.abs(a - b).sum() < 0.05, (scale, k, a, b)


def test_broken_bytes_are_bad_images():
    fast = FastCrop.of(TRAIN)
    with pytest.raises(BadImage):
        fast(b"<html>not an image</html>")
    data, _ = web_image(random.Random(3), min_side=300, max_side=400)
    with pytest.raises(BadImage):
        fast(data[: len(data) // 3])  # a JPEG cut off in its scan data


def _jpeg_shards(folder, count: int, per_shard: int) -> str:
    rng = random.Random(5)
    samples = (Sample(*web_image(rng, min_side=100, max_side=300), caption=f"s{i}") for i in range(count))
    sizes, _ = write_shards(samples, str(folder), per_shard)
    return os.path.join(str(folder), f"{{00000..{len(sizes) - 1:05d}}}.tar")


def _images_by_caption(data, epoch: int, start_step: int = 0, stop_after: int | None = None):
    out = {}
    for n, batch in enumerate(data.iter_epoch(epoch, start_step)):
        if stop_after is not None and n == stop_after:
            break
        for images, texts in batch.micro_batches:
            assert images.dtype == torch.uint8
            for image, text in zip(images, texts, strict=True):
                out[detok(text)] = image
    return out


def test_loader_sends_uint8_crops_that_depend_on_the_sample_alone_and_resume_exactly(tmp_path):
    """--decode fast (the default) with open_clip's train transform: uint8 micro-batches, the step's (mean,
    std) on the loader; the same sample gets the same pixels with 0 or 2 workers, on either of 2 ranks, and
    after a resume; --decode exact sends the transform's float tensors."""
    pattern = _jpeg_shards(tmp_path, count=24, per_shard=6)

    def make(*, workers: int, world_size: int = 1, rank: int = 0, m: int = 2, decode: str = "fast"):
        settings = DataSettings(dataset_type="webdataset", train_data=pattern, workers=workers, decode=decode)
        geometry = BatchGeometry(world_size, 2, m)
        return build_train_data(
            settings, preprocess=TRAIN, tokenizer=byte_tokenizer, rank=rank, geometry=geometry
        )

    alone = make(workers=0)
    assert alone.image_normalize == (
        tuple(open_clip.OPENAI_DATASET_MEAN),
        tuple(open_clip.OPENAI_DATASET_STD),
    )
    one = _images_by_caption(alone, 1)
    two = {}
    for rank in (0, 1):
        two.update(_images_by_caption(make(workers=2, world_size=2, rank=rank, m=1), 1))
    assert one.keys() == two.keys() and all(torch.equal(one[c], two[c]) for c in one)
    first = make(workers=2)
    head = _images_by_caption(first, 1, stop_after=2)
    again = make(workers=2)
    again.load_state_dict(first.state_dict())
    tail = _images_by_caption(again, 1, start_step=2)
    assert head.keys().isdisjoint(tail.keys()) and {**head, **tail}.keys() == one.keys()
    assert all(torch.equal(one[c], t) for c, t in {**head, **tail}.items())
    exact = make(workers=0, decode="exact")
    assert exact.image_normalize is None
    batch = next(iter(exact.iter_epoch(1)))
    assert batch.micro_batches[0][0].dtype == torch.float32
