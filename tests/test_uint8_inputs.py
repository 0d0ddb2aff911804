"""cached_step with uint8 images (--decode fast): normalised on the device where each micro-batch arrives, the
step trains exactly what it trains on the transform's float tensors of the same pixels.

One process group of 1 rank (gloo), the e2e tests' tiny model, k = 2 (a cache pass and a recompute): two engines built alike
take one step each, one on float32 images normalised by torchvision's ToTensor + Normalize on the CPU, the other
on the same pixels as uint8 with `image_normalize=(mean, std)`; loss and every weight after the step are
bit-equal. uint8 images without `image_normalize` are refused.
"""

from __future__ import annotations

import json

import pytest
import torch

from ds_clip_harness.groups import spawn_group
from ds_clip_harness.models import E2E_MODEL


def _group(model: str) -> dict:
    import torchvision.transforms.functional as F

    from ds_clip.step.cached import cached_step
    from tests.test_step_guards import _engine, _pairs

    out: dict = {}
    for kind in ("float", "uint8", "refused"):
        bundle, built = _engine(model, "--accum-freq", "2")
        side = int(bundle.model.visual.image_size[0])
        generator = torch.Generator().manual_seed(0)
        pixels = [
            torch.randint(0, 256, (2, 3, side, side), dtype=torch.uint8, generator=generator)
            for _ in range(2)
        ]
        normalize = bundle.preprocess_train.transforms[-1]  # open_clip's Normalize(mean, std)
        texts = [_pairs(bundle, 2 * j, 2)[1] for j in range(2)]  # the synthetic captions, as the e2e tests
        if kind == "float":
            images = [
                F.normalize(p.to(torch.float32).div(255), normalize.mean, normalize.std) for p in pixels
            ]
            result = cached_step(
                built.engine, list(zip(images, texts)), built.loss_fn, micro_batch_seeds=[1, 2]
            )
        elif kind == "uint8":
            stats = (tuple(normalize.mean), tuple(normalize.std))
            result = cached_step(
                built.engine,
                list(zip(pixels, texts)),
                built.loss_fn,
                micro_batch_seeds=[1, 2],
                image_normalize=stats,
            )
        else:
            try:
                cached_step(built.engine, list(zip(pixels, texts)), built.loss_fn)
            except ValueError as exc:
                out["refused"] = str(exc)
            continue
        out[kind] = {
            "loss": result.loss.item(),
            "weights": {n: p.detach().clone() for n, p in built.engine.module.named_parameters()},
        }
    return out


@pytest.mark.slow
def test_uint8_images_normalised_in_the_step_train_exactly_as_float_ones(tmp_path):
    (tmp_path / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}})
    )
    out = spawn_group(1, _group, f"local-dir:{tmp_path}")
    assert out["float"]["loss"] == out["uint8"]["loss"]
    a, b = out["float"]["weights"], out["uint8"]["weights"]
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert "image_normalize" in out["refused"]
