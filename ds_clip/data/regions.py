"""Box annotations of a webdataset sample for SigLIP 2's LocCa tasks (--siglip2), as token rows.

A sample's json (the `<key>.json` img2dataset writes beside the image) may carry
`"regions": [{"box": [x0, y0, x1, y1], "caption": "a red car"}, ...]`, boxes in pixels of the original image
(x to the right, y down), or in [0, 1] of its width and height with `"box_format": "normalized"` at the top
level (docs/data.md, "Region boxes"). Under --siglip2 a sample's text is three rows of tokens: its caption as
without the flag, then for one of its regions the referring-expression row (ARef: the region's caption, then its
box) and the grounded-captioning row (GCap: the box, then the caption); rows 1 and 2 are all zeros (absent) for a
sample without a usable region.

The box is written in the coordinates of the image as the model sees it: `BoxGeometry` replays the geometric
steps of the train transform (a random crop's draw included) from the same seeded generators as the transform
itself (`SeededTransform`), so the box follows the very crop the image got; then it is quantised to 1000 bins
of the output's width and height. A region cropped away is left out and counted, as is a malformed one; the
sample itself always trains. The region is picked by the sample's own keyed draw (seed, epoch, shard name,
key), so it is the same whatever rank, worker, (W, k, m) or restart reads the sample.
"""

from __future__ import annotations

import json
import math
import random
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ds_clip.data.augment import SampleId, SeededTransform, generators_drawn, sample_seeds
from ds_clip.data.base import DataError

Box = tuple[float, float, float, float]
"""(x0, y0, x1, y1): left, top, right, bottom edges, x to the right and y down."""

BINS = 1000  # LocCa's quantisation: a coordinate is an integer 0..999
NORMALIZED = "normalized"
PIXELS = "pixels"

_TV = "torchvision.transforms.transforms."
_TIMM_CROP = "timm.data.transforms.RandomResizedCropAndInterpolation"
_CROP_RESIZE = {_TV + "RandomResizedCrop", _TIMM_CROP}  # get_params(img, scale, ratio), then resize to `size`
_RESIZE, _CENTER_CROP, _HFLIP = _TV + "Resize", _TV + "CenterCrop", _TV + "RandomHorizontalFlip"
_GEOMETRIC = _CROP_RESIZE | {_RESIZE, _CENTER_CROP, _HFLIP}
# Steps that change pixel values only, never where a pixel lands (a box needs nothing from them).
_PIXEL_ONLY = {
    *(
        _TV + name
        for name in (
            "ToTensor", "PILToTensor", "ConvertImageDtype", "ToPILImage", "Normalize", "Grayscale",
            "RandomGrayscale", "ColorJitter", "GaussianBlur", "RandomInvert", "RandomPosterize", "RandomSolarize",
            "RandomAdjustSharpness", "RandomAutocontrast", "RandomEqualize", "RandomErasing",
        )
    ),
    "open_clip.transform.MaybeConvertMode", "open_clip.transform.MaybeToTensor",
    "open_clip.transform._convert_to_rgb", "open_clip.transform.color_jitter", "open_clip.transform.gray_scale",
    "timm.data.transforms.MaybeToTensor", "timm.data.transforms.MaybePILToTensor", "timm.data.transforms.ToNumpy",
    "timm.data.transforms.ToTensor", "timm.data.random_erasing.RandomErasing",
}  # fmt: skip
_FOLLOWED = (
    "torchvision's RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip, "
    "timm's RandomResizedCropAndInterpolation"
)


def _name(obj: object) -> str:
    """ "module.qualname" of a transform's exact type (of a plain function: the function's own)."""
    kind = obj if isinstance(obj, types.FunctionType) else type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_pixel_only(step: object) -> bool:
    name = _name(step)
    if name == _TV + "RandomApply":  # pixel-only when all its members are
        return all(_is_pixel_only(member) for member in step.transforms)  # type: ignore[attr-defined]
    return name in _PIXEL_ONLY


# ---------------------------------------------------------------------- the sample's json


@dataclass(frozen=True)
class Region:
    box: Box
    """In pixels of the original image, within its bounds."""
    caption: str


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _region(entry: object, scale: tuple[float, float], size: tuple[int, int]) -> Region | str:
    """The region of one entry of "regions" (its box scaled by `scale` to pixels), or what is wrong with it."""
    if not isinstance(entry, dict):
        return f"not an object: {entry!r:.80}"
    box, caption = entry.get("box"), entry.get("caption")
    if not isinstance(box, (list, tuple)) or len(box) != 4 or not all(_number(v) for v in box):
        return f'"box" is not 4 numbers: {box!r:.80}'
    if not isinstance(caption, str) or not caption.strip():
        return f'no "caption" (got {caption!r:.80})'
    x0, y0, x1, y1 = (float(v) * scale[i % 2] for i, v in enumerate(box))
    if not (x0 < x1 and y0 < y1):
        return f"empty or inverted box {list(box)} (needs x0 < x1 and y0 < y1)"
    width, height = size
    clipped = (max(x0, 0.0), max(y0, 0.0), min(x1, float(width)), min(y1, float(height)))
    if not (clipped[0] < clipped[2] and clipped[1] < clipped[3]):
        return f"box {list(box)} lies outside the {width}x{height} image"
    return Region(clipped, caption.strip())


def read_regions(meta: bytes | None, size: tuple[int, int]) -> tuple[list[Region], list[tuple[str, str]]]:
    """The well-formed regions of a sample's json bytes, boxes in pixels of its (width, height) image, and a
    (reason, detail) per problem: "bad_json" for json that is not an object, "bad_region" per malformed entry."""
    if meta is None:
        return [], []
    try:
        doc = json.loads(meta)
    except ValueError:  # also UnicodeDecodeError
        return [], [("bad_json", "its .json does not parse")]
    if not isinstance(doc, dict):
        return [], [("bad_json", "its .json is not an object")]
    entries = doc.get("regions")
    if entries is None:
        return [], []
    if not isinstance(entries, list):
        return [], [("bad_region", f'"regions" is not a list: {entries!r:.80}')]
    box_format = doc.get("box_format", PIXELS)
    if box_format not in (PIXELS, NORMALIZED):
        detail = f'"box_format" {box_format!r:.40} is neither "{PIXELS}" nor "{NORMALIZED}"'
        return [], [("bad_region", f"region {i}: {detail}") for i in range(len(entries))]
    scale = (float(size[0]), float(size[1])) if box_format == NORMALIZED else (1.0, 1.0)
    regions, problems = [], []
    for i, entry in enumerate(entries):
        out = _region(entry, scale, size)
        if isinstance(out, str):
            problems.append(("bad_region", f"region {i}: {out}"))
        else:
            regions.append(out)
    return regions, problems


# ---------------------------------------------------------------------- where the boxes land


@dataclass(frozen=True)
class _Map:
    """One step's map of coordinates, x' = sx x + tx and y' = sy y + ty, and the (width, height) it outputs."""

    sx: float
    tx: float
    sy: float
    ty: float
    width: int
    height: int


def _clip(box: Box, width: int, height: int) -> Box | None:
    x0, y0, x1, y1 = max(box[0], 0.0), max(box[1], 0.0), min(box[2], float(width)), min(box[3], float(height))
    return (x0, y0, x1, y1) if x0 < x1 and y0 < y1 else None


@dataclass(frozen=True)
class Placement:
    """Where the pixels of one original image land in the image the model sees (one sample's draws)."""

    size: tuple[int, int]
    """(width, height) of the original image."""
    maps: tuple[_Map, ...]

    @property
    def out_size(self) -> tuple[int, int]:
        """(width, height) of the image the model sees."""
        return (self.maps[-1].width, self.maps[-1].height) if self.maps else self.size

    def map_box(self, box: Box) -> Box | None:
        """`box` (original pixels) in output pixels, cut to what each crop keeps; None when nothing is kept."""
        out = _clip(box, *self.size)
        for m in self.maps:
            if out is None:
                return None
            xa, xb = sorted((m.sx * out[0] + m.tx, m.sx * out[2] + m.tx))  # a flip swaps the edges
            ya, yb = sorted((m.sy * out[1] + m.ty, m.sy * out[3] + m.ty))
            out = _clip((xa, ya, xb, yb), m.width, m.height)
        return out


def _resized_size(
    height: int, width: int, size: int | Sequence[int], max_size: int | None
) -> tuple[int, int]:
    """(height, width) after torchvision's Resize (its `_compute_resized_output_size`, torchvision 0.29)."""
    if isinstance(size, Sequence) and len(size) == 2:
        return int(size[0]), int(size[1])  # both sides given: squash
    requested = int(size if isinstance(size, int) else size[0])  # the shorter side
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = requested, int(requested * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_long, new_short) if width <= height else (new_short, new_long)


def _stand_in(width: int, height: int) -> torch.Tensor:
    """An 'image' of that size for a crop's get_params, which reads the size alone (no memory behind it)."""
    return torch.empty(1, 1).expand(height, width)


class BoxGeometry:
    """The geometric steps of a train transform, replayed on an image size: call it as the transform is called,
    through a `SeededTransform` with the same seed, so its crop and flip draws are the transform's own.

    `transforms` lists the replayed steps; `generators_drawn` reads it, so a SeededTransform reseeds exactly the
    generators those steps draw from, with the very seeds the transform's call got (sample_seeds).
    """

    def __init__(self, steps: list[Any]) -> None:
        self.transforms = steps

    @classmethod
    def of(cls, transform: Any) -> BoxGeometry:
        """The geometry of `transform` (a Compose of steps, or one step); a DataError naming the step that
        cannot be followed: one that moves pixels in a way not replayed here, or a geometric step after a step
        whose random draws are not replayed (its draw would then differ from the transform's)."""
        steps = list(transform.transforms) if _name(transform) == _TV + "Compose" else [transform]
        replayed: list[Any] = []
        unreplayed = None  # the first step whose draws the replay does not make
        for step in steps:
            name = _name(step)
            if name in _GEOMETRIC:
                if unreplayed is not None:
                    raise DataError(
                        f"--siglip2 maps region boxes through the train transform, but its {name} comes after "
                        f"{unreplayed}, whose random draws are not replayed: the boxes could not follow its crop"
                    )
                replayed.append(step)
                if name == _TIMM_CROP and isinstance(step.interpolation, (list, tuple)):
                    unreplayed = f"{name} with a random interpolation"
            elif _is_pixel_only(step):
                if unreplayed is None and generators_drawn(step):
                    unreplayed = name
            else:
                raise DataError(
                    f"--siglip2 maps region boxes through the train transform, and does not know where its {name} "
                    f"moves pixels (it follows {_FOLLOWED}, and steps that change pixel values only)"
                )
        return cls(replayed)

    def __call__(self, size: tuple[int, int]) -> Placement:
        width, height = size
        maps: list[_Map] = []
        for step in self.transforms:
            name = _name(step)
            if name in _CROP_RESIZE:  # the transform's own first draw: get_params, then the resize
                top, left, h, w = step.get_params(_stand_in(width, height), step.scale, step.ratio)
                out_h, out_w = step.size
                m = _Map(out_w / w, -left * out_w / w, out_h / h, -top * out_h / h, out_w, out_h)
            elif name == _RESIZE:
                out_h, out_w = _resized_size(height, width, step.size, step.max_size)
                m = _Map(out_w / width, 0.0, out_h / height, 0.0, out_w, out_h)
            elif name == _CENTER_CROP:  # torchvision pads a crop larger than the image, then crops the middle
                out_h, out_w = step.size
                dx = (out_w - width) // 2 if out_w > width else -int(round((width - out_w) / 2.0))
                dy = (out_h - height) // 2 if out_h > height else -int(round((height - out_h) / 2.0))
                m = _Map(1.0, float(dx), 1.0, float(dy), out_w, out_h)
            else:  # _HFLIP: the same draw as its forward
                if not torch.rand(1) < step.p:
                    continue
                m = _Map(-1.0, float(width), 1.0, 0.0, width, height)
            maps.append(m)
            width, height = m.width, m.height
        return Placement(size, tuple(maps))

    def __repr__(self) -> str:
        return f"BoxGeometry({', '.join(_name(s).rsplit('.', 1)[-1] for s in self.transforms)})"


def quantise(box: Box, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """`box` in an image of (width, height) as integers 0..999: bin floor(1000 c / side), the far edge in bin 999."""
    sides = (size[0], size[1], size[0], size[1])
    return tuple(min(BINS - 1, max(0, math.floor(c * BINS / s))) for c, s in zip(box, sides))  # type: ignore[return-value]


def aref_text(caption: str, bins: tuple[int, int, int, int]) -> str:
    """The referring-expression sequence: given the region's caption, its box."""
    return f"aref: {caption} : {bins[0]} {bins[1]} {bins[2]} {bins[3]}"


def gcap_text(caption: str, bins: tuple[int, int, int, int]) -> str:
    """The grounded-captioning sequence: given the box, the region's caption."""
    return f"gcap: {bins[0]} {bins[1]} {bins[2]} {bins[3]} : {caption}"


# ---------------------------------------------------------------------- the sample's rows


@dataclass(frozen=True)
class LoccaTexts:
    """A sample's [3, L] texts under --siglip2: its caption's tokens, then the ARef and GCap rows of one region
    (zeros without one). Picklable whenever the transform and tokenizer are (DataLoader workers)."""

    geometry: SeededTransform
    """`BoxGeometry` of the train transform, seeded as the transform is."""
    tokenizer: Callable[[list[str]], Any]

    @classmethod
    def of(cls, preprocess: Any, tokenizer: Callable[[list[str]], Any], seed: int) -> LoccaTexts:
        """For the train transform `preprocess` (as the loader gets it) and the run's --seed; a DataError when
        the transform's geometry cannot be followed (BoxGeometry.of)."""
        if isinstance(preprocess, SeededTransform):
            preprocess = preprocess.transform
        return cls(SeededTransform(BoxGeometry.of(preprocess), seed), tokenizer)

    def __call__(
        self,
        caption_tokens: torch.Tensor,
        size: tuple[int, int],
        *,
        meta: bytes | None,
        epoch: int,
        sample: SampleId,
        report: Callable[[str, str], None],
    ) -> torch.Tensor:
        """Rows [caption_tokens, ARef, GCap] for a sample whose original image is `size` (width, height) and
        whose json is `meta`; `report(reason, detail)` gets each region left out."""
        regions, problems = read_regions(meta, size)
        for reason, detail in problems:
            report(reason, detail)
        rows = torch.zeros((2, caption_tokens.shape[-1]), dtype=caption_tokens.dtype)  # 0: absent
        if regions:  # no replay for a sample without regions: the common case costs a json parse alone
            placement = self.geometry(size, epoch=epoch, sample=sample)
            kept = []
            for region in regions:
                box = placement.map_box(region.box)
                if box is None:
                    report(
                        "region_outside_crop",
                        f"region {region.caption!r:.60} at {region.box} is cropped away",
                    )
                else:
                    kept.append((region, box))
            if kept:
                # Its own keyed draw, apart from the augmentation's: the pick does not follow the crop's numbers.
                _, python_seed, _ = sample_seeds(self.geometry.seed, epoch, sample, purpose="region")
                region, box = kept[random.Random(python_seed).randrange(len(kept))]
                bins = quantise(box, placement.out_size)
                texts = [aref_text(region.caption, bins), gcap_text(region.caption, bins)]
                rows = torch.as_tensor(self.tokenizer(texts)).to(caption_tokens.dtype)
        return torch.cat([caption_tokens.unsqueeze(0), rows])


__all__ = [
    "BINS",
    "Box",
    "BoxGeometry",
    "LoccaTexts",
    "Placement",
    "Region",
    "aref_text",
    "gcap_text",
    "quantise",
    "read_regions",
]
