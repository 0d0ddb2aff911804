"""Augmentation is a pure function of (seed, epoch, sample), with open_clip's own random train transforms.

Contract pinned here: whatever the user's open_clip train transform (the default
RandomResizedCrop, or `aug_cfg` with timm's crop, colour jitter and random erasing; timm's RandAugment,
which draws from numpy), the loaders call it unchanged through `SeededTransform`, so the tensor a sample
becomes depends on (--seed, epoch, sample identity) alone: synthetic data by global sample index,
webdataset by (shard URL, key). The same sample gives the identical tensor with --workers 0, 1 and 2,
under any (W, k, m) with equal W*k*m, and across a mid-epoch resume; different samples, ranks and epochs
get different draws; and no generator of the calling process moves.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil

import numpy as np
import open_clip
import pytest
import torch
import torchvision.transforms as T
from PIL import Image
from timm.data import create_transform

from ds_clip.data.augment import ALL_GENERATORS, SeededTransform, generators_drawn
from ds_clip.data.decode import FastCrop
from ds_clip.data.loader import DataSettings, build_train_data
from ds_clip.data.synthetic import SyntheticCaptions, render_pair
from ds_clip.data.wds import SkipCounter, expand_urls, iter_shard
from ds_clip.geometry import BatchGeometry
from ds_clip.shards import Sample, write_shards
from ds_clip.sources.urls import shard_name
from ds_clip.step.cached import normalize_images
from tests.data.tokens import byte_tokenizer, detok

SIZE = 32  # transform output; synthetic pairs are rendered at 64 px, so every crop is a real resample
TIMM_AUG = {"use_timm": True, "scale": (0.5, 1.0), "color_jitter": 0.4, "re_prob": 0.5}
TRANSFORMS = {
    # open_clip's default train transform: RandomResizedCrop(scale=(0.9, 1.0)), torch's generator
    "open_clip_default": lambda: open_clip.image_transform(SIZE, is_train=True),
    # open_clip with timm augmentations: crop (random), colour jitter (torch), random erasing (both)
    "open_clip_timm_aug": lambda: open_clip.image_transform(SIZE, is_train=True, aug_cfg=TIMM_AUG),
    # open_clip's SimCLR-style jitter and grayscale (Python's random and torch)
    "open_clip_simclr": lambda: open_clip.image_transform(
        SIZE,
        is_train=True,
        aug_cfg={"color_jitter": (0.4, 0.4, 0.4, 0.1), "color_jitter_prob": 0.8, "gray_scale_prob": 0.5},
    ),
    # timm's RandAugment draws its ops from numpy's global generator; flips from torch's
    "timm_randaugment": lambda: create_transform(SIZE, is_training=True, auto_augment="rand-m9-n2-mstd0.5"),
}
LOADER_TRANSFORMS = ["open_clip_default", "open_clip_timm_aug"]


def rng_states():
    return torch.get_rng_state(), torch.initial_seed(), random.getstate(), np.random.get_state()


def assert_same_rng_states(a, b) -> None:
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
    assert a[3][0] == b[3][0] and np.array_equal(a[3][1], b[3][1]) and a[3][2:] == b[3][2:]


def noise_image(side: int = 64) -> Image.Image:
    """An image in which every crop, flip and colour change shows (a plain background would hide some)."""
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8))


def all_distinct(tensors: list[torch.Tensor]) -> bool:
    return all(not torch.equal(a, b) for i, a in enumerate(tensors) for b in tensors[i + 1 :])


# ----------------------------------------------------------------------------------------------------------
# The wrapper


@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")  # open_clip's own, for the SimCLR cfg
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_seeded_transform_is_a_function_of_seed_epoch_sample_and_restores_the_callers_rng(name):
    transform = TRANSFORMS[name]()
    image = noise_image()
    torch.manual_seed(11)
    assert not torch.equal(transform(image), transform(image))  # the transform itself is random

    augment = SeededTransform(transform, seed=3)
    first = augment(image, epoch=0, sample=5)
    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # the running generators must not matter
    assert torch.equal(augment(image, epoch=0, sample=5), first)
    assert torch.equal(pickle.loads(pickle.dumps(augment))(image, epoch=0, sample=5), first)  # workers
    assert torch.equal(SeededTransform(augment, seed=3)(image, epoch=0, sample=5), first)  # not nested

    others = [
        first,
        augment(image, epoch=1, sample=5),  # another epoch
        augment(image, epoch=0, sample=6),  # another sample
        augment(image, epoch=0, sample=("shard.tar", "5")),  # a webdataset identity
        SeededTransform(transform, seed=4)(image, epoch=0, sample=5),  # another --seed
    ]
    assert all_distinct(others)

    # The caller's torch (incl. initial_seed), random and numpy generators are where they were.
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    before = rng_states()
    augment(image, epoch=2, sample=9)
    assert_same_rng_states(rng_states(), before)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    assert (torch.equal(torch.rand(3), expected[0]), random.random(), np.random.rand()) == (
        True,
        *expected[1:],
    )


def test_seeded_transform_restores_the_rng_when_the_transform_raises():
    def broken(image):
        torch.rand(1), random.random(), np.random.rand()
        raise RuntimeError("bad transform")

    before = rng_states()
    with pytest.raises(RuntimeError, match="bad transform"):
        SeededTransform(broken, seed=0)(None, epoch=0, sample=0)
    assert_same_rng_states(rng_states(), before)


# ----------------------------------------------------------------------------------------------------------
# Synthetic data: identity = global sample index


def synthetic_pixels(transform, *, world_size, accum_freq, m, workers, samples=16, epoch=0, seed=5):
    """{global sample index: image tensor} over all ranks of one epoch of a (W, k, m) run."""
    settings = DataSettings(dataset_type="synthetic", train_num_samples=samples, workers=workers, seed=seed)
    out: dict[int, torch.Tensor] = {}
    for rank in range(world_size):
        data = build_train_data(
            settings,
            preprocess=transform,
            tokenizer=byte_tokenizer,
            rank=rank,
            geometry=BatchGeometry(world_size, accum_freq, m),
        )
        for batch in data.iter_epoch(epoch):
            for g, (images, _) in zip(batch.micro_batch_ids, batch.micro_batches):
                first = (
                    epoch * data.samples_per_epoch + batch.step_in_epoch * data.geometry.global_batch + g * m
                )
                for p in range(m):
                    out[first + p] = images[p]
    return out


def expected_synthetic(transform, indices, *, epoch=0, seed=5):
    augment = SeededTransform(transform, seed)
    return {i: augment(render_pair(seed, i, 64)[0], epoch=epoch, sample=i) for i in indices}


def assert_same_pixels(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    different = [i for i in a if not torch.equal(a[i], b[i])]
    assert not different, f"samples with different pixels: {different}"


@pytest.mark.parametrize("name", LOADER_TRANSFORMS)
def test_synthetic_same_index_same_pixels_for_any_workers_and_any_w_k_m(name):
    transform = TRANSFORMS[name]()
    reference = synthetic_pixels(transform, world_size=2, accum_freq=2, m=2, workers=0)
    assert sorted(reference) == list(range(16))
    # pure: the loader's tensor is the wrapped transform applied to (seed, epoch=0, index) and nothing else
    assert_same_pixels(reference, expected_synthetic(transform, range(16)))
    for workers in (1, 2):
        assert_same_pixels(
            synthetic_pixels(transform, world_size=2, accum_freq=2, m=2, workers=workers), reference
        )
    for w, k, m in ((4, 1, 2), (1, 2, 4), (2, 1, 4), (1, 8, 1)):  # all N = 8
        assert_same_pixels(synthetic_pixels(transform, world_size=w, accum_freq=k, m=m, workers=1), reference)


@pytest.mark.parametrize("name", LOADER_TRANSFORMS)
def test_synthetic_resume_mid_epoch_gives_the_same_pixels(name):
    transform = TRANSFORMS[name]()
    kwargs = dict(preprocess=transform, tokenizer=byte_tokenizer, rank=1, geometry=BatchGeometry(2, 2, 2))
    for workers in (0, 1, 2):
        settings = DataSettings(dataset_type="synthetic", train_num_samples=32, workers=workers, seed=5)
        whole = [b.micro_batches for b in build_train_data(settings, **kwargs).iter_epoch(1)]
        first = build_train_data(settings, **kwargs)
        head = []
        for batch in first.iter_epoch(1):
            head.append(batch.micro_batches)
            if len(head) == 2:
                break
        state = first.state_dict()
        assert (state["epoch"], state["step_in_epoch"]) == (1, 2)
        again = build_train_data(settings, **kwargs)
        again.load_state_dict(state)
        tail = [b.micro_batches for b in again.iter_epoch(state["epoch"], state["step_in_epoch"])]
        assert len(head + tail) == len(whole) == 4
        for got, want in zip(head + tail, whole):
            for (gi, gt), (wi, wt) in zip(got, want):
                assert torch.equal(gi, wi) and torch.equal(gt, wt)


def test_synthetic_epoch_enters_the_draw():
    transform = TRANSFORMS["open_clip_default"]()
    augment = SeededTransform(transform, seed=5)
    kwargs = dict(seed=5, preprocess=augment, tokenizer=byte_tokenizer, image_size=64)
    e0, e1 = SyntheticCaptions(epoch=0, **kwargs), SyntheticCaptions(epoch=1, **kwargs)
    for i in (0, 7, 123):
        assert torch.equal(e0[i][1], e1[i][1])  # the same pair ...
        assert not torch.equal(e0[i][0], e1[i][0])  # ... cropped differently in another epoch
        assert torch.equal(e1[i][0], augment(render_pair(5, i, 64)[0], epoch=1, sample=i))


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_the_data_leaves_the_training_process_rng_alone(workers):
    """Neither the transform (workers=0 runs it here) nor the DataLoader's worker seed moves our generators."""
    transform = TRANSFORMS["open_clip_timm_aug"]()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    before = rng_states()
    synthetic_pixels(transform, world_size=2, accum_freq=1, m=2, workers=workers, samples=8)
    assert_same_rng_states(rng_states(), before)


# ----------------------------------------------------------------------------------------------------------
# Webdataset: identity = (shard URL, key)


def write_image_shards(folder, count: int, per_shard: int, same_image: bool = False) -> str:
    """Real tar shards of PNG images of the built-in dataset (or one image for all), captioned "s<i>"."""
    os.makedirs(folder, exist_ok=True)

    def png(i: int) -> bytes:
        buf = io.BytesIO()
        (noise_image(48) if same_image else render_pair(0, i, 48)[0]).save(buf, format="PNG")
        return buf.getvalue()

    sizes, _ = write_shards((Sample(png(i), "png", f"s{i}") for i in range(count)), str(folder), per_shard)
    with open(os.path.join(folder, "sizes.json"), "w") as f:
        json.dump(sizes, f)
    return os.path.join(str(folder), f"{{00000..{len(sizes) - 1:05d}}}.tar")


def pixels(data, images: torch.Tensor) -> torch.Tensor:
    """The float tensors the step trains on: uint8 images (--decode fast, open_clip's plain train transform)
    normalised as the step does; the transform's own tensors as they are."""
    return normalize_images(images, *data.image_normalize) if images.dtype == torch.uint8 else images


def wds_by_rank(pattern, transform, *, epoch=0, world_size=1, m=2, k=2, workers=0, seed=5, **settings):
    """Per rank, the (caption, image tensor) of every pair of one epoch, in training order."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    for rank in range(world_size):
        s = DataSettings(
            dataset_type="webdataset", train_data=pattern, workers=workers, seed=seed, **settings
        )
        data = build_train_data(
            s,
            preprocess=transform,
            tokenizer=byte_tokenizer,
            rank=rank,
            geometry=BatchGeometry(world_size, k, m),
        )
        out.append([])
        for batch in data.iter_epoch(epoch):
            for images, texts in batch.micro_batches:
                out[-1].extend((detok(tokens), image) for image, tokens in zip(pixels(data, images), texts))
    return out


def wds_pixels(pattern, transform, **kwargs) -> dict[str, torch.Tensor]:
    """{caption: image tensor} over all ranks of one epoch."""
    return dict(pair for rank in wds_by_rank(pattern, transform, **kwargs) for pair in rank)


def expected_wds(pattern, transform, *, epoch=0, seed=5) -> dict[str, torch.Tensor]:
    """Each sample read straight from its tar and augmented with its identity (shard name, key), by the decode the
    loader runs for `transform` (--decode fast, the default, for open_clip's plain train transform)."""
    fast = FastCrop.of(transform)
    augment, out = SeededTransform(fast or transform, seed), {}
    for url in expand_urls(pattern):
        for raw in iter_shard(url, SkipCounter()):
            sample = (shard_name(url), raw.key)
            if fast is not None:
                image = augment(raw.data["png"], epoch=epoch, sample=sample)
                image = normalize_images(image[None], fast.mean, fast.std)[0]
            else:
                image = augment(
                    Image.open(io.BytesIO(raw.data["png"])).convert("RGB"), epoch=epoch, sample=sample
                )
            out[raw.data["txt"].decode()] = image
    return out


@pytest.mark.parametrize("name", LOADER_TRANSFORMS)
def test_wds_same_url_and_key_same_pixels_for_any_workers_ranks_and_resume(tmp_path, name):
    transform = TRANSFORMS[name]()
    pattern = write_image_shards(tmp_path, count=24, per_shard=6)  # 4 shards
    reference = wds_pixels(pattern, transform, workers=0, shuffle_buffer=4)
    assert len(reference) == 24
    assert_same_pixels(reference, expected_wds(pattern, transform))
    for workers in (1, 2):
        assert_same_pixels(wds_pixels(pattern, transform, workers=workers, shuffle_buffer=4), reference)
    # another split over ranks and micro-batches: other workers read each sample, same pixels
    assert_same_pixels(wds_pixels(pattern, transform, world_size=2, m=3, k=1, workers=2), reference)

    # a mid-epoch resume, on each rank of 2, with --workers 0, 1, 2
    for workers in (0, 1, 2):
        settings = DataSettings(
            dataset_type="webdataset", train_data=pattern, workers=workers, seed=5, shuffle_buffer=4
        )
        kwargs = dict(preprocess=transform, tokenizer=byte_tokenizer, geometry=BatchGeometry(2, 2, 2))
        for rank in range(2):
            whole = [b.micro_batches for b in build_train_data(settings, rank=rank, **kwargs).iter_epoch(0)]
            first = build_train_data(settings, rank=rank, **kwargs)
            head = []
            for batch in first.iter_epoch(0):
                head.append(batch.micro_batches)
                if len(head) == 1:
                    break
            again = build_train_data(settings, rank=rank, **kwargs)
            again.load_state_dict(first.state_dict())
            tail = [b.micro_batches for b in again.iter_epoch(0, 1)]
            assert len(head + tail) == len(whole) == 3
            for got, want in zip(head + tail, whole):
                for (gi, gt), (wi, wt) in zip(got, want):
                    assert torch.equal(gt, wt) and torch.equal(gi, wi)
                    for image, tokens in zip(pixels(again, gi), gt):
                        assert torch.equal(image, reference[detok(tokens)])


def test_wds_the_same_shards_at_another_path_or_through_pipe_draw_alike(tmp_path):
    """The draws are keyed by the shard's name and the sample's key, not by where the shard lies: the same
    shards copied to another folder, and read through `pipe:cat` of that copy, give the same tensors bit for
    bit (with the path in the key, every crop differed). Shards of other names draw otherwise."""
    transform = TRANSFORMS["open_clip_default"]()
    pattern = write_image_shards(tmp_path / "a", count=8, per_shard=4)
    copy = tmp_path / "mounted" / "elsewhere"
    shutil.copytree(tmp_path / "a", copy)
    reference = wds_pixels(pattern, transform, workers=1)
    assert len(reference) == 8
    moved = str(copy / "{00000..00001}.tar")
    assert_same_pixels(wds_pixels(moved, transform, workers=1), reference)
    assert_same_pixels(wds_pixels(f"pipe:cat {moved}", transform, workers=1), reference)
    for old, new in (("00000", "00010"), ("00001", "00011")):
        os.rename(copy / f"{old}.tar", copy / f"{new}.tar")
    renamed = wds_pixels(str(copy / "{00010..00011}.tar"), transform, workers=1)
    assert sum(not torch.equal(renamed[c], reference[c]) for c in reference) >= 6


@pytest.mark.parametrize("name, least_distinct", [("open_clip_default", 12), ("open_clip_timm_aug", 16)])
def test_wds_every_sample_rank_and_epoch_gets_its_own_draw(tmp_path, name, least_distinct):
    """One image in every sample: the tensors differ only by their draws. Before the wrapper, rank 0 and
    rank 1 (each with one worker seeded alike) drew the same crop sequence in epoch 0.

    open_clip's default RandomResizedCrop(scale=(0.9, 1.0)) has few distinct boxes on a small square image
    (126 at 48 px, the whole image in 9 % of draws: measured over 20 000 draws), so some samples get equal
    crops by chance; with timm's augmentations every one of the 16 differs. A draw is a hash of the shard's
    name, not its path: the same draws wherever the test's folder is."""
    transform = TRANSFORMS[name]()
    pattern = write_image_shards(tmp_path / "shards", count=16, per_shard=4, same_image=True)
    ranks = wds_by_rank(pattern, transform, world_size=2, m=2, k=1, workers=1)
    epoch0 = dict(ranks[0] + ranks[1])
    epoch1 = wds_pixels(pattern, transform, world_size=2, m=2, k=1, workers=1, epoch=1)
    assert len(epoch0) == len(epoch1) == 16
    assert len({t.numpy().tobytes() for t in epoch0.values()}) >= least_distinct
    assert sum(not torch.equal(epoch0[c], epoch1[c]) for c in epoch0) >= least_distinct  # next epoch
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(*ranks))  # rank 1 does not repeat rank 0's crops
    assert_same_pixels(epoch1, expected_wds(pattern, transform, epoch=1))


def test_wds_resampled_repeats_of_a_sample_in_an_epoch_get_its_one_draw(tmp_path):
    transform = TRANSFORMS["open_clip_default"]()
    pattern = write_image_shards(tmp_path, count=8, per_shard=4)
    s = DataSettings(
        dataset_type="webdataset", train_data=pattern, dataset_resampled=True, train_num_samples=40, seed=5
    )
    data = build_train_data(
        s, preprocess=transform, tokenizer=byte_tokenizer, rank=0, geometry=BatchGeometry(1, 1, 4)
    )
    expected = expected_wds(pattern, transform)
    seen = 0
    for batch in data.iter_epoch(0):
        for images, texts in batch.micro_batches:
            for image, tokens in zip(pixels(data, images), texts):
                assert torch.equal(image, expected[detok(tokens)])
                seen += 1
    assert seen == 40  # 8 samples drawn 40 times: every repeat is the same (seed, epoch, sample) draw


# ----------------------------------------------------------------------------------------------------------
# Only the generators a transform draws from are reseeded (numpy's save and restore costs ~150 us a sample)


@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")
def test_generators_drawn_reads_known_transforms_and_assumes_all_for_the_rest():
    assert generators_drawn(TRANSFORMS["open_clip_default"]()) == {"torch"}
    assert generators_drawn(TRANSFORMS["open_clip_simclr"]()) == {"torch", "python"}
    assert generators_drawn(TRANSFORMS["open_clip_timm_aug"]()) == ALL_GENERATORS  # timm classes: unknown
    assert generators_drawn(TRANSFORMS["timm_randaugment"]()) == ALL_GENERATORS
    assert generators_drawn(open_clip.image_transform(SIZE, is_train=False)) == frozenset()
    assert generators_drawn(T.RandomChoice([T.Resize(8), T.CenterCrop(8)])) == {"torch", "python"}
    assert (
        generators_drawn(T.Compose([T.RandomApply([T.Lambda(lambda x: x)]), T.ToTensor()])) == ALL_GENERATORS
    )

    class MyCrop(T.RandomResizedCrop):  # a subclass may draw from anything
        pass

    assert generators_drawn(T.Compose([MyCrop(8), T.ToTensor()])) == ALL_GENERATORS
    assert generators_drawn(lambda image: image) == ALL_GENERATORS


@pytest.mark.filterwarnings("ignore:Unused augmentation cfg items")
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_reseeding_fewer_generators_gives_the_pixels_of_reseeding_all(name):
    transform = TRANSFORMS[name]()
    image = noise_image()
    fewer = SeededTransform(transform, seed=3)
    every = SeededTransform(transform, seed=3)
    every.generators = ALL_GENERATORS
    for sample in (0, 7, ("shard.tar", "x")):
        torch.manual_seed(5), random.seed(5), np.random.seed(5)
        want = every(image, epoch=1, sample=sample)
        torch.manual_seed(6), random.seed(6), np.random.seed(6)
        assert torch.equal(fewer(image, epoch=1, sample=sample), want)
