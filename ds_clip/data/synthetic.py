"""Built-in captioned dataset: coloured shapes on a coloured background, rendered on the fly.

Every pair is a pure function of (seed, global sample index), so no download is needed, any
process can render any sample, and two runs that assign the same global indices to an optimizer
step train on exactly the same pairs whatever their (ranks, accumulation, micro-batch) split.

Cost per pair (64 px, open_clip's default train transform, one core): drawing and rendering about 12 us, the
transform about 130 us (open_clip's own synthetic data pays that too, on its one constant image), the tokens
cached per caption; so a benchmark's data loading is the transform's, as it would be for open_clip.

The factors (6 shape colours x 4 shapes x 2 sizes x 5 positions x 7 backgrounds = 1680 captions)
are enough that image-text retrieval is learnable and its recall measurable on a tiny model.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image, ImageDraw

from ds_clip.data.augment import SeededTransform

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 30),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPE_COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
SIZES: dict[str, float] = {"small": 0.22, "large": 0.46}  # shape extent as a fraction of the image side
POSITIONS: dict[str, tuple[float, float]] = {  # shape centre as fractions of (width, height)
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
    "center": (0.5, 0.5),
}


def _rng(seed: int, index: int) -> random.Random:
    # A hash of both numbers, not seed + index: (seed=1, index=0) and (seed=0, index=1) must differ,
    # and nothing may depend on the global RNG state (DataLoader workers each have their own).
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def render_pair(seed: int, index: int, image_size: int = 64) -> tuple[Image.Image, str]:
    """Render sample `index` of the dataset with `seed`: an RGB image and the caption that describes it."""
    rng = _rng(seed, index)
    colour = rng.choice(SHAPE_COLOURS)
    background = rng.choice([c for c in COLOURS if c != colour])
    shape = rng.choice(SHAPES)
    size = rng.choice(tuple(SIZES))
    position = rng.choice(tuple(POSITIONS))

    image = Image.new("RGB", (image_size, image_size), COLOURS[background])
    draw = ImageDraw.Draw(image)
    # Small jitter of centre and extent, so equal captions do not map to identical images.
    jitter = 0.04 * image_size
    cx = POSITIONS[position][0] * image_size + rng.uniform(-jitter, jitter)
    cy = POSITIONS[position][1] * image_size + rng.uniform(-jitter, jitter)
    half = SIZES[size] * image_size / 2 * rng.uniform(0.9, 1.1)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse((cx - half, cy - half, cx + half, cy + half), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    else:  # diamond
        draw.polygon([(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)], fill=fill)
    article = "an" if background[0] in "aeiou" else "a"
    caption = f"a {size} {colour} {shape} in the {position} on {article} {background} background"
    return image, caption


class SyntheticCaptions(torch.utils.data.Dataset):
    """Map-style dataset: `dataset[g]` is the (image tensor, token tensor) pair of global sample index g.

    `length` only matters for code that asks `len()` (evaluation sets); training indexes it by
    global sample index through a batch sampler and never asks. `offset` shifts every index, so a
    held-out evaluation set can use indices training never reaches (or simply another seed).

    A `SeededTransform` as `preprocess` draws its augmentation from (its seed, `epoch`, global sample
    index g + offset) alone (see ds_clip/data/augment.py); any other callable is called as it is.
    """

    def __init__(
        self,
        *,
        seed: int,
        preprocess: Callable[[Image.Image], torch.Tensor],
        tokenizer: Callable[[list[str]], Any],
        image_size: int = 64,
        length: int | None = None,
        offset: int = 0,
        epoch: int = 0,
    ) -> None:
        self.seed = seed
        self.preprocess = preprocess
        self.tokenizer = tokenizer
        self.image_size = image_size
        self.length = length
        self.offset = offset
        self.epoch = epoch
        # Tokens by caption: the 1680 captions repeat, and tokenizing one (open_clip's BPE with ftfy) costs
        # about a third of rendering and augmenting a 64 px pair. Filled lazily, per process (workers too).
        self._tokens: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("SyntheticCaptions is unbounded: pass length= to give it a size")
        return self.length

    def caption(self, index: int) -> str:
        """The caption of sample `index` (no rendering cost beyond the draw; used by evaluation)."""
        return render_pair(self.seed, index + self.offset, self.image_size)[1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            raise IndexError(f"negative sample index {index}")
        sample = index + self.offset
        image, caption = render_pair(self.seed, sample, self.image_size)
        if isinstance(self.preprocess, SeededTransform):
            pixels = self.preprocess(image, epoch=self.epoch, sample=sample)
        else:
            pixels = self.preprocess(image)
        tokens = self._tokens.get(caption)
        if tokens is None:
            tokens = self._tokens[caption] = torch.as_tensor(self.tokenizer([caption])[0])
        return pixels, tokens
