"""Web-like images for the loader's benchmark and tests: what img2dataset keeps of the web, generated.

Most web images a CLIP dataset holds are JPEGs of 300-1500 px at quality 85-95 in a handful of aspect ratios,
with some PNG and some grayscale. `web_image(rng)` draws one such image: a smooth random field (a few
pixels of colour upscaled bicubically: sky, walls, out-of-focus background), shapes with hard edges, and
sensor-like noise (fine texture, so that the JPEG is not trivially small), encoded as the draw says.
"""

from __future__ import annotations

import io
import random

import numpy as np
from PIL import Image, ImageDraw

ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 3 / 2, 2 / 3)


def web_image(rng: random.Random, *, min_side: int = 300, max_side: int = 1500) -> tuple[bytes, str]:
    """(encoded bytes, extension "jpg" or "png") of one web-like image; a pure function of rng's state."""
    long_side = rng.randint(min_side, max_side)
    aspect = rng.choice(ASPECTS)
    w, h = (long_side, max(min_side // 2, round(long_side / aspect)))
    if aspect < 1:
        w, h = max(min_side // 2, round(long_side * aspect)), long_side
    np_rng = np.random.default_rng(rng.getrandbits(64))
    field = np_rng.integers(0, 256, size=(rng.randint(3, 8), rng.randint(3, 8), 3), dtype=np.uint8)
    image = Image.fromarray(field).resize((w, h), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(2, 8)):
        x0, y0 = rng.randrange(w), rng.randrange(h)
        x1, y1 = x0 + rng.randint(w // 10, w // 2), y0 + rng.randint(h // 10, h // 2)
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    pixels = np.asarray(image, dtype=np.int16) + np_rng.normal(0, 6, size=(h, w, 3)).astype(np.int16)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    if rng.random() < 0.1:
        image = image.convert("L")
    buf = io.BytesIO()
    if rng.random() < 0.1:
        image.save(buf, format="PNG", compress_level=1)
        return buf.getvalue(), "png"
    image.save(buf, format="JPEG", quality=rng.randint(85, 95))
    return buf.getvalue(), "jpg"


__all__ = ["ASPECTS", "web_image"]
