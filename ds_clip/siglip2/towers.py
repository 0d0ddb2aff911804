"""Where SigLIP 2's terms read an open_clip image tower (open_clip's own ViT or a timm trunk): its token sequence,
its patch embedding, its patch count, and the forward hooks that read and rewrite them. One place for the student
and the teacher."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def is_timm(visual: nn.Module) -> bool:
    return hasattr(visual, "trunk")


def token_module(visual: nn.Module) -> tuple[nn.Module, int]:
    """The module whose output is the image tower's token sequence [B, T, D] (outside any activation checkpoint,
    so its output keeps its graph), and how many of the T tokens precede the patches."""
    if is_timm(visual):
        return visual.trunk.norm, int(getattr(visual.trunk, "num_prefix_tokens", 1))
    return visual.transformer, 1


def num_patches(visual: nn.Module) -> int:
    if is_timm(visual):
        return int(visual.trunk.patch_embed.num_patches)
    grid = visual.grid_size
    return int(grid[0] * grid[1])


def embed_module(visual: nn.Module) -> nn.Module:
    """The patch embedding, whose output the masker rewrites."""
    return visual.trunk.patch_embed if is_timm(visual) else visual.conv1


class _Grab:
    output: torch.Tensor | None = None


@contextlib.contextmanager
def captured(module: nn.Module, batch: int) -> Iterator[_Grab]:
    grab = _Grab()

    def hook(_m, _args, out):
        out = out[0] if isinstance(out, tuple) else out
        grab.output = out if out.shape[0] == batch else out.transpose(0, 1)  # a sequence-first transformer

    handle = module.register_forward_hook(hook)
    try:
        yield grab
    finally:
        handle.remove()


@contextlib.contextmanager
def without_patch_dropout(visual: nn.Module) -> Iterator[None]:
    """FLIP's patch dropout (the model's config or --force-patch-dropout) applies to the image the sigmoid loss and
    the decoder see, not to the self-supervised views: masked prediction needs every patch at its position."""
    droppers = [m for m in visual.modules() if type(m).__name__ == "PatchDropout" and getattr(m, "prob", 0)]
    probs = [m.prob for m in droppers]
    for m in droppers:
        m.prob = 0.0
    try:
        yield
    finally:
        for m, p in zip(droppers, probs):
            m.prob = p


@contextlib.contextmanager
def masked(module: nn.Module, masker: nn.Module, mask: torch.Tensor) -> Iterator[None]:
    handle = module.register_forward_hook(lambda _m, _args, out: masker(out, mask))
    try:
        yield
    finally:
        handle.remove()
