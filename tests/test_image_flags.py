"""open_clip's image and augmentation flags (--force-image-size, --force-patch-dropout, --image-mean,
--image-std, --image-interpolation, --aug-cfg) reach both the model and the transforms, as they do through
open_clip.create_model_and_transforms in open_clip_train; bad values exit 2 naming the flag; augmentation
stays a function of (seed, epoch, sample) with timm's augmentations on, whatever --workers is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ds_clip.config import parse_settings
from ds_clip.geometry import BatchGeometry
from ds_clip_harness.models import E2E_MODEL

FLAGS = [
    "--force-image-size", "48", "--force-patch-dropout", "0.5", "--image-mean", "0.5", "0.4", "0.3",
    "--image-std", "0.25", "0.2", "0.15", "--image-interpolation", "bilinear",
    "--aug-cfg", "scale=(0.5,1.0)", "use_timm=True", "color_jitter=0.4", "re_prob=0.25",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("model")
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{folder}"


def _steps(transform) -> list:
    return list(getattr(transform, "transforms", [transform]))


def _find(transform, name: str):
    return next(t for t in _steps(transform) if type(t).__name__ == name)


def test_flags_parse_as_open_clip_writes_them(model_dir):
    s = parse_settings(["--model", model_dir, *FLAGS])
    m = s.model
    assert m.force_image_size == [48] and m.force_patch_dropout == 0.5
    assert m.image_mean == [0.5, 0.4, 0.3] and m.image_std == [0.25, 0.2, 0.15]
    assert m.image_interpolation == "bilinear"
    assert m.aug_cfg == ["scale=(0.5,1.0)", "use_timm=True", "color_jitter=0.4", "re_prob=0.25"]
    from ds_clip.config import aug_cfg_dict

    # open_clip_train's ParseKwargs: Python literals, else the bare string.
    assert aug_cfg_dict(m.aug_cfg) == {
        "scale": (0.5, 1.0),
        "use_timm": True,
        "color_jitter": 0.4,
        "re_prob": 0.25,
    }
    assert aug_cfg_dict(["color_jitter=warm"]) == {"color_jitter": "warm"}
    assert parse_settings(["--force-image-size", "32", "48"]).model.force_image_size == [32, 48]


def test_flags_reach_the_model_and_both_transforms(model_dir):
    """Unit test on the built bundle: image size and patch dropout in the model (and in the model config the
    trainer renders synthetic data at and checkpoints record), mean/std/interpolation in both transforms,
    the aug_cfg in the train transform (timm's crop at scale (0.5, 1), colour jitter, random erasing)."""
    import open_clip

    from ds_clip.training.engine import build_model_bundle

    b = build_model_bundle(parse_settings(["--model", model_dir, *FLAGS]).model, seed=0)
    assert tuple(b.model.visual.image_size) == (48, 48)
    assert b.model.visual.patch_dropout.prob == 0.5
    assert b.model_cfg["vision_cfg"]["image_size"] == 48 and b.model_cfg["vision_cfg"]["patch_dropout"] == 0.5
    # The positional embedding was built for 48 px: (48/16)^2 patches + class token.
    assert b.model.visual.positional_embedding.shape[0] == (48 // 16) ** 2 + 1
    pp = open_clip.get_model_preprocess_cfg(b.model)  # what checkpoints record as preprocess_cfg
    assert tuple(pp["mean"]) == (0.5, 0.4, 0.3) and tuple(pp["std"]) == (0.25, 0.2, 0.15)
    for transform in (b.preprocess_train, b.preprocess_val):
        norm = _find(transform, "Normalize")
        assert [round(float(v), 6) for v in torch.as_tensor(norm.mean)] == [0.5, 0.4, 0.3]
        assert [round(float(v), 6) for v in torch.as_tensor(norm.std)] == [0.25, 0.2, 0.15]
    crop = _steps(b.preprocess_train)[0]
    assert type(crop).__name__ == "RandomResizedCropAndInterpolation"  # timm's, from use_timm=True
    assert tuple(crop.size) == (48, 48) and tuple(crop.scale) == (0.5, 1.0)
    assert "bilinear" in str(crop.interpolation).lower()
    assert "bilinear" in str(_find(b.preprocess_val, "Resize").interpolation).lower()
    assert any(type(t).__name__ == "RandomErasing" for t in _steps(b.preprocess_train))
    from PIL import Image

    image = b.preprocess_val(Image.new("RGB", (64, 80), (10, 200, 30)))
    assert tuple(image.shape) == (3, 48, 48)
    with torch.no_grad():
        out = b.model(image=image[None], text=b.tokenizer(["a green square"]))
    assert out["image_features"].shape == (1, E2E_MODEL["embed_dim"])


def test_force_patch_dropout_zero_turns_it_off(tmp_path):
    cfg = {**E2E_MODEL, "vision_cfg": {**E2E_MODEL["vision_cfg"], "patch_dropout": 0.25}}
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
    from ds_clip.training.engine import build_model_bundle

    model = f"local-dir:{tmp_path}"
    assert type(
        build_model_bundle(parse_settings(["--model", model]).model, seed=0).model.visual.patch_dropout
    ).__name__ == ("PatchDropout")
    b = build_model_bundle(parse_settings(["--model", model, "--force-patch-dropout", "0"]).model, seed=0)
    assert isinstance(b.model.visual.patch_dropout, torch.nn.Identity)


def _first_images(model_dir: str, workers: int, epoch: int = 0) -> torch.Tensor:
    from ds_clip.data import build_train_data
    from ds_clip.training.engine import build_model_bundle

    s = parse_settings(
        ["--model", model_dir, *FLAGS, "--workers", str(workers), "--train-num-samples", "8", "--seed", "5",
         "--synthetic-image-size", "64"]
    )  # fmt: skip
    b = build_model_bundle(s.model, seed=s.data.seed)
    data = build_train_data(
        s.data, preprocess=b.preprocess_train, tokenizer=b.tokenizer, rank=0, geometry=BatchGeometry(1, 1, 4),
    )  # fmt: skip
    return torch.cat([step.micro_batches[0][0] for step in data.iter_epoch(epoch)])


def test_timm_augmentation_is_a_function_of_seed_epoch_and_sample(model_dir):
    """--aug-cfg use_timm=True (timm's crop, colour jitter, random erasing: they draw from the global torch,
    random and numpy generators): the same sample gets the same tensor with --workers 0 and 2; another
    epoch draws other crops."""
    a, b = _first_images(model_dir, 0), _first_images(model_dir, 2)
    assert tuple(a.shape) == (8, 3, 48, 48)
    assert torch.equal(a, b)
    assert not torch.equal(a, _first_images(model_dir, 0, epoch=1))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--force-patch-dropout", "1"], "--force-patch-dropout must be in [0, 1)"),
        (["--force-patch-dropout", "-0.1"], "--force-patch-dropout must be in [0, 1)"),
        (["--force-image-size", "0"], "--force-image-size takes one side or height and width"),
        (["--force-image-size", "32", "32", "32"], "--force-image-size takes one side or height and width"),
        (["--image-mean", "0.5", "0.5"], "--image-mean takes 1 or 3 values"),
        (["--image-std", "0.5", "0", "0.5"], "--image-std values must be > 0"),
        (["--aug-cfg", "scale"], "--aug-cfg: 'scale' is not KEY=VALUE"),
        (["--aug-cfg", "scael=(0.5,1.0)"], "--aug-cfg: unknown key 'scael'"),
    ],
)
def test_bad_values_exit_2_naming_the_flag(argv, needle, capsys):
    from ds_clip.train import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-clip-train: error: ") and needle in err, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--image-interpolation", "nearest"], "--image-interpolation: invalid choice"),
        (["--image-mean", "grey"], "--image-mean: invalid float value"),
        (["--force-image-size", "big"], "--force-image-size: invalid int value"),
    ],
)
def test_malformed_values_exit_2_from_argparse(argv, needle, capsys):
    from ds_clip.train import main

    assert main(argv) == 2 and needle in capsys.readouterr().err


def test_help_shows_the_flags_with_units(capsys):
    from ds_clip.train import main

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in (
        "--force-image-size PX [PX ...]", "unit: pixels", "--force-patch-dropout P", "unit: fraction of patches",
        "--image-mean MEAN [MEAN ...]", "--image-std STD [STD ...]", "--image-interpolation {bicubic,bilinear,random}",
        "--aug-cfg [KEY=VALUE ...]",
    ):  # fmt: skip
        assert needle in text, needle


def test_a_short_run_of_the_trainer_with_the_flags_on(model_dir, tmp_path):
    """The real trainer (`python -m ds_clip.train`, what ds-clip-train runs; one process) trains 2 steps with all
    the image flags on: synthetic data rendered and transformed at the forced 48 px, the checkpoint records
    the model it trained (image size, patch dropout) and the preprocessing (mean, std)."""
    argv = [
        "--model", model_dir, *FLAGS, "--batch-size", "2", "--accum-freq", "2", "--max-steps", "2",
        "--train-num-samples", "16", "--workers", "1", "--logs", str(tmp_path), "--name", "flags",
        "--log-every-n-steps", "1", "--zero-stage", "1",
    ]  # fmt: skip
    # In its own process, as a user runs it: a run in the pytest process would leave its process group and
    # RANK/MASTER_PORT behind for every later test (tests/conftest.py refuses that).
    ran = subprocess.run(
        [sys.executable, "-m", "ds_clip.train", *argv], capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    settings = json.loads((tmp_path / "flags" / "settings.json").read_text())
    assert settings["force_image_size"] == [48] and settings["aug_cfg"][1] == "use_timm=True"
    metas = sorted((tmp_path / "flags" / "checkpoints").glob("*/ds_clip_meta.json"))
    assert metas
    meta = json.loads(metas[-1].read_text())
    assert meta["model_cfg"]["vision_cfg"]["image_size"] == 48
    assert meta["model_cfg"]["vision_cfg"]["patch_dropout"] == 0.5
    assert tuple(meta["preprocess_cfg"]["mean"]) == (0.5, 0.4, 0.3)
