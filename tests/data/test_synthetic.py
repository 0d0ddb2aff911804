"""The built-in captioned dataset and the step-batch loader over it.

Contract pinned here: pairs are assigned by global sample index, so runs with the same global batch
N = W*k*m but different (W, k) train the same pairs in each optimizer step, with the same global
micro-batch index g for each micro-batch; rendering depends on (seed, index) alone.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torchvision.transforms as T

from ds_clip.data.loader import DataError, DataSettings, build_train_data
from ds_clip.data.synthetic import SyntheticCaptions, render_pair
from ds_clip.geometry import BatchGeometry
from tests.data.tokens import byte_tokenizer, detok

PREPROCESS = T.Compose([T.Resize((16, 16)), T.ToTensor()])


def steps_by_g(world_size: int, accum_freq: int, m: int, samples: int, workers: int = 0, epoch: int = 0):
    """{step: {g: [captions]}} over all ranks of a (W, k, m) run."""
    settings = DataSettings(dataset_type="synthetic", train_num_samples=samples, workers=workers, seed=3)
    out: dict[int, dict[int, list[str]]] = {}
    for rank in range(world_size):
        data = build_train_data(
            settings,
            preprocess=PREPROCESS,
            tokenizer=byte_tokenizer,
            rank=rank,
            geometry=BatchGeometry(world_size, accum_freq, m),
        )
        for batch in data.iter_epoch(epoch):
            assert len(batch.micro_batches) == accum_freq
            for g, (images, texts) in zip(batch.micro_batch_ids, batch.micro_batches):
                assert images.shape == (m, 3, 16, 16) and images.dtype == torch.float32
                assert texts.shape == (m, 96) and texts.dtype == torch.long
                out.setdefault(batch.step_in_epoch, {})[g] = [detok(t) for t in texts]
    return out


def test_render_is_a_function_of_seed_and_index_only():
    state = random.getstate()
    a_img, a_cap = render_pair(7, 12, 32)
    random.seed(999)  # the global RNG must not matter
    b_img, b_cap = render_pair(7, 12, 32)
    assert a_cap == b_cap and a_img.tobytes() == b_img.tobytes()
    assert a_img.size == (32, 32) and a_img.mode == "RGB"
    random.setstate(state)
    others = {render_pair(7, i)[1] for i in range(40)} | {render_pair(8, 12)[1]}
    assert len(others) > 30  # captions vary with the index and the seed
    assert render_pair(1, 0)[0].tobytes() != render_pair(0, 1)[0].tobytes()


def test_caption_describes_the_image():
    image, caption = render_pair(0, 5, 64)
    words = caption.split()
    assert words[0] == "a" and words[1] in ("small", "large") and caption.endswith("background")
    # the background colour named in the caption is the corner pixel opposite the shape
    from ds_clip.data.synthetic import COLOURS

    background = words[-2]
    corners = [image.getpixel(p) for p in ((0, 0), (63, 0), (0, 63), (63, 63))]
    assert COLOURS[background] in corners


def test_dataset_item_uses_preprocess_and_tokenizer():
    ds = SyntheticCaptions(seed=1, preprocess=PREPROCESS, tokenizer=byte_tokenizer, length=4)
    image, tokens = ds[2]
    assert image.shape == (3, 16, 16) and detok(tokens) == render_pair(1, 2)[1] == ds.caption(2)
    assert len(ds) == 4


def test_same_global_batch_same_pairs_per_step_w4k1_vs_w2k2():
    """(W=4, k=1) and (W=2, k=2) with m=2: every step trains the same pairs with the same g."""
    a = steps_by_g(world_size=4, accum_freq=1, m=2, samples=40)
    b = steps_by_g(world_size=2, accum_freq=2, m=2, samples=40)
    assert sorted(a) == list(range(5)) and a == b
    all_pairs = [c for step in a.values() for caps in step.values() for c in caps]
    assert len(all_pairs) == 40


def test_workers_give_the_same_batches_as_the_main_process():
    assert steps_by_g(2, 2, 2, 24, workers=2) == steps_by_g(2, 2, 2, 24, workers=0)


def test_epochs_use_fresh_indices_and_start_step_resumes():
    settings = DataSettings(dataset_type="synthetic", train_num_samples=16, workers=0)
    data = build_train_data(
        settings,
        preprocess=PREPROCESS,
        tokenizer=byte_tokenizer,
        rank=1,
        geometry=BatchGeometry(2, 2, 2),
    )
    full = [[detok(t) for _, tx in b.micro_batches for t in tx] for b in data.iter_epoch(0)]
    assert data.state_dict()["epoch"] == 1 and data.state_dict()["step_in_epoch"] == 0
    resumed = [[detok(t) for _, tx in b.micro_batches for t in tx] for b in data.iter_epoch(0, start_step=1)]
    assert resumed == full[1:]
    expected_first = [render_pair(0, 16 + 2 * 2 + i)[1] for i in range(4)]  # epoch 1: base 16, g = 2, 3
    first_of_epoch1 = next(iter(data.iter_epoch(1)))
    assert [detok(t) for _, tx in first_of_epoch1.micro_batches for t in tx] == expected_first
    assert data.state_dict()["step_in_epoch"] == 1


def test_leftover_is_logged_and_too_small_epoch_is_an_error(caplog):
    settings = DataSettings(dataset_type="synthetic", train_num_samples=42)
    kwargs = dict(preprocess=PREPROCESS, tokenizer=byte_tokenizer, rank=0, geometry=BatchGeometry(2, 2, 2))
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        data = build_train_data(settings, **kwargs)
    assert data.steps_per_epoch == 5 and data.samples_per_epoch == 40
    assert "2 fewer" in caplog.text
    with pytest.raises(DataError, match="--train-num-samples"):
        build_train_data(DataSettings(dataset_type="synthetic", train_num_samples=7), **kwargs)
    with pytest.raises(DataError, match="--train-num-samples"):
        build_train_data(DataSettings(dataset_type="synthetic"), **kwargs)
    with pytest.raises(DataError, match="--dataset-type"):
        build_train_data(DataSettings(dataset_type="csv", train_num_samples=8), **kwargs)


def test_tokens_are_cached_per_caption_and_equal_the_tokenizers():
    calls: list[str] = []

    def counting(texts: list[str]):
        calls.extend(texts)
        return byte_tokenizer(texts)

    ds = SyntheticCaptions(seed=3, preprocess=PREPROCESS, tokenizer=counting)
    captions = [ds.caption(i) for i in range(200)]
    for i in range(200):
        assert torch.equal(ds[i][1], torch.as_tensor(byte_tokenizer([captions[i]])[0]))
    assert sorted(calls) == sorted(set(captions))  # each distinct caption tokenized once
    assert len(set(captions)) < 200
