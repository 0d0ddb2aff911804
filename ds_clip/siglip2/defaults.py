"""SigLIP 2's defaults that follow from the model: the weights of its two self-supervised terms.

SigLIP 2 (Tschannen et al., 2025, section 2.3) weights the SILC self-distillation loss 1 and the TIPS masked
prediction loss 0.25, and scales both by a factor of the model size, "0.25, 0.5, 1.0 and 0.5 for the model size
B, L, So400m and g": image towers of width 768, 1024, 1152 and 1536. ``siglip2_size_factor`` holds that rule for
every width; ``--siglip2-silc-weight`` / ``--siglip2-tips-weight`` left unset (None) mean these defaults, which
the trainer and the export's model card both resolve here, from the same width (``image_tower_width``).
"""

from __future__ import annotations

from typing import Any

SILC_WEIGHT = 1.0
"""The paper's weight of the self-distillation loss, before the size factor."""
TIPS_WEIGHT = 0.25
"""The paper's weight of the masked prediction loss, before the size factor."""

# The paper's four sizes by image tower width: B/16 768, L/16 1024, So400m 1152, g (giant-opt) 1536.
_PAPER_FACTORS = {768: 0.25, 1024: 0.5, 1152: 1.0, 1536: 0.5}


def siglip2_size_factor(width: int) -> float:
    """The factor on both self-supervised weights for an image tower of ``width`` channels: the paper's for its
    four widths (768: 0.25, 1024: 0.5, 1152: 1.0, 1536: 0.5); below 1024 otherwise (S, Ti, any <= 768) the
    B value 0.25, from 1024 up otherwise (1280, 2048, ...) the So400m value 1.0."""
    if width <= 0:
        raise ValueError(f"an image tower width is a positive number of channels, got {width}")
    if width in _PAPER_FACTORS:
        return _PAPER_FACTORS[width]
    return 0.25 if width < 1024 else 1.0


def siglip2_selfsup_weights(
    silc_weight: float | None, tips_weight: float | None, width: int
) -> tuple[float, float]:
    """The (SILC, TIPS) weights a run trains with: each as given, or None for the paper's weight times
    ``siglip2_size_factor(width)``."""
    factor = siglip2_size_factor(width)
    return (
        SILC_WEIGHT * factor if silc_weight is None else float(silc_weight),
        TIPS_WEIGHT * factor if tips_weight is None else float(tips_weight),
    )


def image_tower_width(visual: Any) -> int | None:
    """The width of an open_clip image tower (``model.visual``) that the size factor reads: timm's ``embed_dim``
    for a timm tower (the SigLIP architecture), the transformer's width for open_clip's own ViT; None for a tower
    without one (a ResNet)."""
    trunk = getattr(visual, "trunk", None)
    if trunk is not None and getattr(trunk, "embed_dim", None):
        return int(trunk.embed_dim)
    transformer = getattr(visual, "transformer", None)
    if transformer is not None and getattr(transformer, "width", None):
        return int(transformer.width)
    return None


__all__ = [
    "SILC_WEIGHT",
    "TIPS_WEIGHT",
    "image_tower_width",
    "siglip2_selfsup_weights",
    "siglip2_size_factor",
]
