"""The augmented views of self-distillation and masked prediction, made on the device from the image the
sigmoid loss and the decoder see (SigLIP 2 keeps that one un-augmented, as SILC advises).

Every draw comes from torch's global CPU generator: the cached step seeds it per global micro-batch and restores
it before the recompute, so a sample gets the same views in both passes and whatever the (W, k) split.
Crops are torchvision's RandomResizedCrop rule (area share, log-uniform aspect ratio 3/4-4/3, ten tries, then
the centre), resized back to the model's input size with bilinear interpolation, and flipped with probability 1/2.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GLOBAL_SCALE = (0.4, 1.0)
"""SILC's global views: 40-100 % of the image area."""
LOCAL_SCALE = (0.05, 0.4)
"""SILC's local views: 5-40 % of the image area."""
RATIO = (3 / 4, 4 / 3)


def _crop_box(h: int, w: int, scale: tuple[float, float]) -> tuple[int, int, int, int]:
    area = h * w
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(*scale).item()
        ratio = math.exp(torch.empty(1).uniform_(*log_ratio).item())
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            top = int(torch.randint(0, h - ch + 1, (1,)).item())
            left = int(torch.randint(0, w - cw + 1, (1,)).item())
            return top, left, ch, cw
    side = min(h, w)
    return (h - side) // 2, (w - side) // 2, side, side


def crops(images: torch.Tensor, count: int, scale: tuple[float, float]) -> torch.Tensor:
    """``count`` random resized crops of each image [B, C, H, W] -> [B * count, C, H, W] (sample-major)."""
    b, _, h, w = images.shape
    out = []
    for i in range(b):
        for _ in range(count):
            top, left, ch, cw = _crop_box(h, w, scale)
            view = images[i : i + 1, :, top : top + ch, left : left + cw].float()
            view = F.interpolate(view, size=(h, w), mode="bilinear", align_corners=False, antialias=False)
            if torch.rand(1).item() < 0.5:
                view = view.flip(-1)
            out.append(view.to(images.dtype))
    return torch.cat(out)


def patch_mask(
    batch: int, patches: int, ratio: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """round(ratio * P) positions per image, uniformly at random: as a [B, P] bool mask (what the masker
    rewrites) and as their indices [B, n] in increasing order (what ``masked_rows`` reads). The same count in every
    image: the term's normaliser is known without a collective, and no boolean indexing waits for the device."""
    masked = max(1, round(ratio * patches))
    order = torch.stack([torch.randperm(patches) for _ in range(batch)])
    index = order.argsort(dim=1)[:, :masked].sort(dim=1).values
    return (order < masked).to(device), index.to(device)


def masked_rows(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of ``tokens`` [B, P, D] at ``index`` [B, n], as [B * n, D] (a gather: no host sync)."""
    picked = tokens.gather(1, index[:, :, None].expand(-1, -1, tokens.shape[-1]))
    return picked.reshape(-1, tokens.shape[-1])
