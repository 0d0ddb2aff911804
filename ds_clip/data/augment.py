"""Augmentation as a pure function of (seed, epoch, sample): the user's train transform, seeded per sample.

open_clip's train transform (torchvision's `RandomResizedCrop`, its SimCLR colour jitter and grayscale,
and with `aug_cfg={"use_timm": True, ...}` timm's crop, colour jitter and random erasing; timm's
RandAugment and AugMix) draws from the *global* generators of the process that runs it: torch's CPU
generator, Python's `random` and numpy's `np.random`. In a DataLoader worker those are seeded from a
base seed the DataLoader draws per iterator, so the same sample got different crops depending on the
worker it landed on, on `--workers`, on (W, k, m), and on whether the run was restarted; every rank also
drew the same crops in epoch 0.

`SeededTransform` wraps the transform unchanged. For each sample it saves the three global generators,
seeds each from a hash of (seed, epoch, sample identity), calls the transform, and restores the saved
states, so
- the draws of a sample depend on (seed, epoch, sample) alone: not on worker, rank, W, k, m, --workers,
  the order in which samples are processed, or a restart;
- nothing else in the worker or the training process (workers=0) sees its generators move.

Cost: saving and restoring numpy's global generator costs about 150 us per sample (its state is copied
through Python objects), as much as the crop itself on a 64 px image. So the wrapper reseeds only the
generators the transform can draw from: `generators_drawn` reads a Compose of torchvision's v1 transforms and
open_clip's own (open_clip's default train transform draws from torch's alone) and answers all three for
anything it does not know. A sample's tensor is the same either way: the seeds are the same, and a generator
the transform never draws from cannot change its output.

Limits: a transform that keeps its own generator object (a `torch.Generator`, `random.Random`,
`np.random.Generator` / `RandomState` instance) is not reseeded by this; nor are device (CUDA)
generators, since transforms run on the CPU. None of open_clip's, torchvision's or timm's per-sample
transforms keeps its own generator (open_clip 3.3.0, torchvision 0.29, timm 1.0.31).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SampleId = int | tuple[str, str]
"""Identity of a sample: its global index (synthetic data) or (shard URL, key) (webdataset)."""


def sample_seeds(
    seed: int, epoch: int, sample: SampleId, purpose: str = "augment"
) -> tuple[int, int, np.ndarray]:
    """Seeds of the (torch, Python `random`, numpy) generators for one sample: a hash of (seed, epoch, sample).

    The repr of a tuple of ints and strs is unambiguous (a ":" in a URL cannot shift the fields) and stable
    across Python versions; blake2b as for the synthetic pairs and the shard order. The three seeds come
    from disjoint bytes of one digest: 64 bits for torch (its limit), 128 for `random` and numpy.
    `purpose` keys another draw of the same sample apart from its augmentation (the region a sample's LocCa
    rows describe: ds_clip.data.regions), so that the two are independent, not the same stream read twice.
    """
    text = repr((purpose, int(seed), int(epoch), sample))
    digest = hashlib.blake2b(text.encode(), digest_size=40).digest()
    return (
        int.from_bytes(digest[:8], "little"),
        int.from_bytes(digest[8:24], "little"),
        np.frombuffer(digest[24:40], dtype=np.uint32).copy(),
    )


ALL_GENERATORS: frozenset[str] = frozenset({"torch", "python", "numpy"})

# Classes whose __call__ draws from no generator, or only from the ones named, by "module.qualname" of the exact
# type (a user's subclass lives in the user's module and is treated as unknown). torchvision's v1 random
# transforms draw from torch's generator (torch.rand, torch.randint, torch.empty().uniform_); RandomOrder and
# RandomChoice also from Python's `random`; open_clip's SimCLR jitter and grayscale and its ResizeKeepRatio
# from Python's `random`. Containers add what their members draw.
_TV = "torchvision.transforms.transforms."
_DRAWS: dict[str, frozenset[str]] = {
    **{
        _TV + name: frozenset()
        for name in (
            "Compose",
            "ToTensor",
            "PILToTensor",
            "ConvertImageDtype",
            "ToPILImage",
            "Normalize",
            "Resize",
            "CenterCrop",
            "Pad",
            "FiveCrop",
            "TenCrop",
            "LinearTransformation",
            "Grayscale",
        )
    },  # fmt: skip
    **{
        _TV + name: frozenset({"torch"})
        for name in (
            "RandomApply",
            "RandomCrop",
            "RandomHorizontalFlip",
            "RandomVerticalFlip",
            "RandomPerspective",
            "RandomResizedCrop",
            "ColorJitter",
            "RandomRotation",
            "RandomAffine",
            "RandomGrayscale",
            "RandomErasing",
            "GaussianBlur",
            "RandomInvert",
            "RandomPosterize",
            "RandomSolarize",
            "RandomAdjustSharpness",
            "RandomAutocontrast",
            "RandomEqualize",
            "ElasticTransform",
        )
    },  # fmt: skip
    _TV + "RandomOrder": frozenset({"torch", "python"}),
    _TV + "RandomChoice": frozenset({"torch", "python"}),
    "ds_clip.data.decode.FastCrop": frozenset({"torch"}),  # RandomResizedCrop's draw, from the JPEG header
    # Replays the geometric steps it lists in `transforms` (their draws are added as for a Compose).
    "ds_clip.data.regions.BoxGeometry": frozenset(),
    "open_clip.transform.MaybeConvertMode": frozenset(),
    "open_clip.transform.MaybeToTensor": frozenset(),
    "open_clip.transform.CenterCropOrPad": frozenset(),
    "open_clip.transform.ResizeKeepRatio": frozenset({"python"}),
    "open_clip.transform.color_jitter": frozenset({"python"}),
    "open_clip.transform.gray_scale": frozenset({"python"}),
}


def generators_drawn(transform: Any) -> frozenset[str]:
    """The global generators ("torch", "python", "numpy") `transform` can draw from; all three when unsure."""
    cls = type(transform)
    key = f"{cls.__module__}.{cls.__qualname__}"
    if key not in _DRAWS:
        return ALL_GENERATORS
    drawn = set(_DRAWS[key])
    for member in getattr(transform, "transforms", ()):  # Compose, RandomApply, RandomOrder, RandomChoice
        drawn |= generators_drawn(member)
        if drawn == ALL_GENERATORS:
            break
    return frozenset(drawn)


class SeededTransform:
    """`transform(image)` with the global torch (CPU), `random` and numpy generators seeded per sample.

    Call as `augment(image, epoch=e, sample=i)`; the generators' states before the call are restored
    after it (also when the transform raises). Picklable whenever `transform` is (DataLoader workers).
    """

    def __init__(self, transform: Callable[[Any], torch.Tensor], seed: int) -> None:
        if isinstance(transform, SeededTransform):
            transform = transform.transform  # never seed twice: the outer seed decides
        self.transform = transform
        self.seed = int(seed)
        self.generators = generators_drawn(transform)

    def __call__(self, image: Any, *, epoch: int, sample: SampleId) -> torch.Tensor:
        torch_gen = torch.default_generator  # CPU only: torch.manual_seed would also reseed CUDA
        use_torch, use_python, use_numpy = (name in self.generators for name in ("torch", "python", "numpy"))
        saved_torch = torch_gen.get_state() if use_torch else None
        saved_python = random.getstate() if use_python else None
        saved_numpy = np.random.get_state() if use_numpy else None
        try:
            torch_seed, python_seed, numpy_seed = sample_seeds(self.seed, epoch, sample)
            if use_torch:
                torch_gen.manual_seed(torch_seed)
            if use_python:
                random.seed(python_seed)
            if use_numpy:
                np.random.seed(numpy_seed)
            return self.transform(image)
        finally:
            if saved_torch is not None:
                torch_gen.set_state(saved_torch)
            if saved_python is not None:
                random.setstate(saved_python)
            if saved_numpy is not None:
                np.random.set_state(saved_numpy)

    def __repr__(self) -> str:
        return f"SeededTransform(seed={self.seed}, transform={self.transform!r})"


__all__ = ["ALL_GENERATORS", "SampleId", "SeededTransform", "generators_drawn", "sample_seeds"]
