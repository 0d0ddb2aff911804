"""The fast decode (--decode fast): open_clip's train transform run on the JPEG bytes, without a full decode.

open_clip's train transform is RandomResizedCrop(S, scale, ratio, bicubic) -> RGB -> ToTensor -> Normalize:
the full image is decoded (a 1500 px JPEG: ~2 Mpixel) and then a crop of it is resized to 224 px. `FastCrop`
runs the same transform in another order:

1. the crop box is drawn from the image size in the JPEG header, before any pixel is decoded, by torchvision's
   own `RandomResizedCrop.get_params` from the same generator (seeded per sample by `SeededTransform`): the
   very draw the exact path makes for that sample;
2. the JPEG is decoded at a reduced size by libjpeg's DCT scaling (PIL's `Image.draft`: 1/2, 1/4 or 1/8),
   the largest reduction that still leaves the crop at least S pixels on each side;
3. the crop (its box in the reduced image's pixels: each edge rounded to the nearest one, at most half a
   reduced pixel from the drawn box) is resized to S with the same filter (antialiased bicubic, PIL's
   coefficients) by torchvision's uint8 tensor resize, 3-4x faster than PIL's;
4. the micro-batch travels as uint8 and is normalised on the accelerator (`ds_clip.step.normalize_images`,
   with `mean`/`std` of the transform's Normalize): the float32 arithmetic of ToTensor + Normalize, on a 4x
   smaller host-to-device copy.

Where no reduction applies (PNG, WebP, a crop already under 2 S px) the crop is the drawn box itself and the
pixels differ from the exact path's by the resize's arithmetic alone (a level here and there); where it
applies, by the reduced decode and the rounded box too: see the PSNR in docs/data.md. Only a transform of
exactly that shape is recognised (`FastCrop.of`); any other one (colour jitter, timm's augmentations, a
user's own) is run as it is on the fully decoded image.
"""

from __future__ import annotations

import io
import math
import types
from dataclasses import dataclass

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as TF
from PIL import Image

_TV = "torchvision.transforms.transforms."
_TO_RGB = {"open_clip.transform.MaybeConvertMode", "open_clip.transform._convert_to_rgb"}
_TO_TENSOR = {_TV + "ToTensor", "open_clip.transform.MaybeToTensor"}
_FILTERS = (T.InterpolationMode.BICUBIC, T.InterpolationMode.BILINEAR)


class BadImage(Exception):
    """The bytes are not a decodable image (counted as "bad_image", as in the exact path)."""


def _name(obj: object) -> str:
    """ "module.qualname" of a transform's exact type (of a plain function: the function's own)."""
    kind = obj if isinstance(obj, types.FunctionType) else type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


@dataclass(frozen=True)
class FastCrop:
    """Image bytes -> uint8 CHW tensor of open_clip's train crop (normalised later on the accelerator)."""

    size: tuple[int, int]  # (height, width) of the output
    scale: tuple[float, float]
    ratio: tuple[float, float]
    interpolation: T.InterpolationMode
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of(cls, transform: object) -> FastCrop | None:
        """The fast equivalent of `transform` when it is RandomResizedCrop -> [to RGB] -> ToTensor ->
        Normalize (open_clip's train transform without augmentations); None for anything else."""
        steps = list(getattr(transform, "transforms", ()))
        if _name(transform) != _TV + "Compose" or len(steps) not in (3, 4):
            return None
        crop, *middle, to_tensor, norm = steps
        if _name(crop) != _TV + "RandomResizedCrop" or _name(norm) != _TV + "Normalize":
            return None
        if _name(to_tensor) not in _TO_TENSOR or any(_name(m) not in _TO_RGB for m in middle):
            return None
        if crop.interpolation not in _FILTERS or norm.inplace or len(crop.size) != 2:
            return None
        return cls(
            size=(int(crop.size[0]), int(crop.size[1])),
            scale=tuple(map(float, crop.scale)),
            ratio=tuple(map(float, crop.ratio)),
            interpolation=crop.interpolation,
            mean=tuple(map(float, norm.mean)),
            std=tuple(map(float, norm.std)),
        )

    def box(self, image: Image.Image) -> tuple[int, int, int, int]:
        """(top, left, h, w) of the crop of `image` (only its size is read: an image not yet decoded will do),
        drawn by torchvision's RandomResizedCrop from the global torch generator."""
        return T.RandomResizedCrop.get_params(image, list(self.scale), list(self.ratio))

    def __call__(self, data: bytes) -> torch.Tensor:
        out_h, out_w = self.size
        try:
            im = Image.open(io.BytesIO(data))
            width, height = im.size
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad bytes
            raise BadImage(str(exc)) from None
        top, left, h, w = self.box(im)  # the draw happens before decoding, as in the exact path
        left_end, top_end = left + w, top + h
        try:
            reduced = None
            if im.format == "JPEG":
                request = (math.ceil(width * out_w / w), math.ceil(height * out_h / h))
                reduced = im.draft(im.mode, request)
            if reduced is not None and reduced[1][2] < width:
                fx, fy = reduced[1][2] / width, reduced[1][3] / height  # reduced px per original px
                left, top = round(left * fx), round(top * fy)
                right, bottom = max(left + 1, round(left_end * fx)), max(top + 1, round(top_end * fy))
            else:  # full size: torchvision's crop
                right, bottom = left_end, top_end
            im = im.convert("RGB") if im.mode != "RGB" else im
            pixels = np.array(im.crop((left, top, right, bottom)))  # decodes; HWC uint8, writable
        except Exception as exc:  # noqa: BLE001 - a broken file fails in the decode
            raise BadImage(str(exc)) from None
        chw = torch.from_numpy(pixels).permute(2, 0, 1)
        out = TF.resize(chw, [out_h, out_w], interpolation=self.interpolation, antialias=True)
        return out.contiguous()


__all__ = ["BadImage", "FastCrop"]
