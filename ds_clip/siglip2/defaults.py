"""SigLIP 2's defaults that depend on the model."""

from __future__ import annotations

SIZE_FACTORS = {768: 0.25, 1024: 0.5, 1152: 1.0, 1536: 0.5}
"""SigLIP 2 (Sec. 2.3) re-weights both self-supervised losses by 0.25, 0.5, 1.0 and 0.5 for its B, L, So400m and g
image towers (widths 768, 1024, 1152, 1536), to balance global and dense quality."""

SILC_WEIGHT = 1.0
TIPS_WEIGHT = 0.25
"""The paper's weights of self-distillation and masked prediction, before the size factor."""


def siglip2_size_factor(width: int) -> float:
    """The paper's factor for an image tower of ``width``; a width it did not train takes B's factor below L's
    width and So400m's from it on (the paper gives no rule between its sizes)."""
    if width in SIZE_FACTORS:
        return SIZE_FACTORS[width]
    return 0.25 if width < 1024 else 1.0


def term_weights(silc: float | None, tips: float | None, width: int) -> tuple[float, float]:
    """(SILC, TIPS) weights: a passed flag as given, else the paper's weight times the size factor."""
    factor = siglip2_size_factor(width)
    return (SILC_WEIGHT * factor if silc is None else silc, TIPS_WEIGHT * factor if tips is None else tips)
