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


def sample_seeds(seed: int, epoch: int, sample: SampleId) -> tuple[int, int, np.ndarray]:
    """Seeds of the (torch, Python `random`, numpy) generators for one sample: a hash of (seed, epoch, sample).

    The repr of a tuple of ints and strs is unambiguous (a ":" in a URL cannot shift the fields) and stable
    across Python versions; blake2b as for the synthetic pairs and the shard order. The three seeds come
    from disjoint bytes of one digest: 64 bits for torch (its limit), 128 for `random` and numpy.
    """
    text = repr(("augment", int(seed), int(epoch), sample))
    digest = hashlib.blake2b(text.encode(), digest_size=40).digest()
    return (
        int.from_bytes(digest[:8], "little"),
        int.from_bytes(digest[8:24], "little"),
        np.frombuffer(digest[24:40], dtype=np.uint32).copy(),
    )


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

    def __call__(self, image: Any, *, epoch: int, sample: SampleId) -> torch.Tensor:
        torch_gen = torch.default_generator  # CPU only: torch.manual_seed would also reseed CUDA
        saved_torch = torch_gen.get_state()
        saved_python = random.getstate()
        saved_numpy = np.random.get_state()
        try:
            torch_seed, python_seed, numpy_seed = sample_seeds(self.seed, epoch, sample)
            torch_gen.manual_seed(torch_seed)
            random.seed(python_seed)
            np.random.seed(numpy_seed)
            return self.transform(image)
        finally:
            torch_gen.set_state(saved_torch)
            random.setstate(saved_python)
            np.random.set_state(saved_numpy)

    def __repr__(self) -> str:
        return f"SeededTransform(seed={self.seed}, transform={self.transform!r})"


__all__ = ["SampleId", "SeededTransform", "sample_seeds"]
