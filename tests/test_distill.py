"""Distillation (--distill-model) in one process: the objective against open_clip's own DistillClipLoss, the
flags' refusals, and the teacher the engine builder makes. The multi-rank proofs (W2k2 == W4k1, one step
against the one-process oracle, dense and tiled, ZeRO 0-3) are distill cases of tests/test_equivalence.py;
resume == straight and "no teacher in the checkpoint or the export" are in tests/test_checkpoint.py; the
deepspeed launcher with --accum-freq 4 in tests/test_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss

from ds_clip.config import SettingsError, parse_settings
from ds_clip.step.loss import ContrastiveLoss, LossSpec, TeacherFeatures
from ds_clip.step.tiled_loss import distill_clip_loss_tiled
from ds_clip_harness.models import CONFIGS, TEACHER, write_pretrained_dir


def _features(n: int, d: int, seed: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(n, d, generator=g, dtype=torch.float64)
    text = image + 1.5 * torch.randn(n, d, generator=g, dtype=torch.float64)
    return F.normalize(image, dim=1).to(dtype), F.normalize(text, dim=1).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def _reference(image, text, scale, t_image, t_text, t_scale, rows: slice | None = None, offset: int = 0):
    """open_clip's DistillClipLoss (world size 1), or its local-loss rows (what rank r computes with
    --local-loss: rows of this rank against every column, labels offset by the rank)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (image, text, scale)]
    if rows is None:
        contrastive, distill = DistillClipLoss()(*leaves, t_image, t_text, t_scale)
    else:
        x, y, s = leaves
        per_image, per_text = s * x[rows] @ y.T, s * y[rows] @ x.T
        t_per_image, t_per_text = t_scale * t_image[rows] @ t_text.T, t_scale * t_text[rows] @ t_image.T
        labels = torch.arange(per_image.shape[0]) + offset
        loss = DistillClipLoss()
        contrastive = (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2
        distill = (loss.dist_loss(t_per_image, per_image) + loss.dist_loss(t_per_text, per_text)) / 2
    return contrastive, distill, leaves


# (N, student d, teacher d, tile, student scale, teacher scale): N not a multiple of the tile, a tile larger
# than N, one-row tiles, a teacher wider than the student, large scales.
CASES = [
    (37, 5, 9, 8, 14.3, 100.0),
    (10, 3, 3, 64, 1.0, 30.0),
    (50, 9, 4, 1, 100.0, 10.0),
    (64, 16, 24, 64, 50, 100),
]


@pytest.mark.parametrize(("n", "d", "dt", "tile", "s", "ts"), CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_tiled_distill_matches_open_clip(n, d, dt, tile, s, ts, dtype):
    """distill_clip_loss_tiled == open_clip's DistillClipLoss: both terms, and the gradients of the student's
    embeddings and scale for any weighting of the two terms (contrastive and distill enter the backward with
    their own weights), global rows (the same tensors as columns) and local rows (rank 1 of 3)."""
    image, text = _features(n, d, seed=n + tile, dtype=dtype)
    t_image, t_text = _features(n, dt, seed=7 * n + tile, dtype=dtype)
    scale, t_scale = torch.tensor(s, dtype=dtype), torch.tensor(ts, dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for rows in (None, slice(n // 3, 2 * (n // 3))):
        offset = 0 if rows is None else n // 3
        c_ref, d_ref, ref_leaves = _reference(image, text, scale, t_image, t_text, t_scale, rows, offset)
        x, y, sc = (t.detach().clone().requires_grad_(True) for t in (image, text, scale))
        if rows is None:
            c, dl = distill_clip_loss_tiled(
                x, y, x, y, sc, t_image, t_text, t_image, t_text, t_scale, 0, tile
            )
        else:
            c, dl = distill_clip_loss_tiled(
                x[rows],
                y[rows],
                x,
                y,
                sc,
                t_image[rows],
                t_text[rows],
                t_image,
                t_text,
                t_scale,
                offset,
                tile,
            )
        assert _rel(c, c_ref) <= tol and _rel(dl, d_ref) <= tol
        for w in (1.0, 0.3):
            grads = torch.autograd.grad(c + w * dl, [x, y, sc], retain_graph=True)
            ref = torch.autograd.grad(c_ref + w * d_ref, ref_leaves, retain_graph=True)
            for name, g, r in zip(("image", "text", "scale"), grads, ref):
                assert _rel(g, r) <= tol, (name, rows, w, _rel(g, r))


def test_teacher_gets_no_gradient_and_its_own_scale_scales_its_logits():
    """Only the student's tensors get gradients; the teacher's logit_scale (not the student's) sets the
    teacher's softmax: a sharper teacher changes the distill term, the student's scale alone does not make
    it equal to the contrastive term's target."""
    image, text = _features(12, 6, seed=1)
    t_image, t_text = _features(12, 6, seed=2)
    t_image.requires_grad_(True)
    scale = torch.tensor(10.0, dtype=torch.float64, requires_grad=True)
    c, d = distill_clip_loss_tiled(
        image, text, image, text, scale, t_image, t_text, t_image, t_text, scale * 5, 0, 5
    )
    assert not t_image.grad_fn and (c + d).requires_grad
    (c + d).backward()
    assert t_image.grad is None
    sharp = distill_clip_loss_tiled(
        image, text, image, text, scale, t_image, t_text, t_image, t_text, scale * 5
    )
    soft = distill_clip_loss_tiled(image, text, image, text, scale, t_image, t_text, t_image, t_text, scale)
    ref_sharp = DistillClipLoss()(image, text, scale, t_image, t_text, scale.detach() * 5)
    assert float(sharp[1]) == pytest.approx(float(ref_sharp[1]), rel=1e-12)
    assert float(sharp[1]) != pytest.approx(float(soft[1]), rel=1e-3)


@pytest.mark.parametrize("impl", ["dense", "tiled"])
def test_contrastive_loss_with_teacher_is_open_clip_distill_sum(impl):
    """ContrastiveLoss(LossSpec(distill=True)) in one process backpropagates contrastive + distill, as
    open_clip_train sums DistillClipLoss's two outputs, and reports both parts; the teacher's features are
    needed exactly when the loss distils."""
    image, text = _features(9, 4, seed=3, dtype=torch.float32)
    t_image, t_text = _features(9, 6, seed=4, dtype=torch.float32)
    scale, t_scale = torch.tensor(20.0), torch.tensor(50.0)
    c_ref, d_ref, leaves = _reference(image, text, scale, t_image, t_text, t_scale)
    ref = torch.autograd.grad(c_ref + d_ref, leaves)
    loss = ContrastiveLoss(LossSpec(distill=True, impl=impl, tile_size=4))
    x, y, s = (t.detach().clone().requires_grad_(True) for t in (image, text, scale))
    out = loss(x, y, s, teacher=TeacherFeatures(t_image, t_text, t_scale))
    assert float(out.value) == pytest.approx(float(c_ref + d_ref), rel=1e-6)
    assert float(out.parts["distill_loss"]) == pytest.approx(float(d_ref), rel=1e-6)
    for g, r in zip(torch.autograd.grad(out.backward_loss, [x, y, s]), ref):
        assert _rel(g, r) <= 1e-5
    with pytest.raises(ValueError, match="teacher"):
        loss(x, y, s)
    with pytest.raises(ValueError, match="teacher"):
        ContrastiveLoss(LossSpec())(x, y, s, teacher=TeacherFeatures(t_image, t_text, t_scale))


# ------------------------------------------------------------------------------------ flags and the teacher


def _dir(root: Path, name: str, cfg: dict, weights: bool = True) -> str:
    if weights:
        return write_pretrained_dir(root / name, cfg)
    (root / name).mkdir(parents=True)
    (root / name / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
    return f"local-dir:{root / name}"


def test_distill_flags_refused_with_one_line_naming_the_flag(tmp_path):
    """Exit-2 refusals before any process starts: --distill-pretrained alone, a missing or weightless
    local-dir: teacher, a named teacher without --distill-pretrained, --distill-pretrained with local-dir:,
    and SigLIP (open_clip has no SigLIP distillation)."""
    teacher = _dir(tmp_path, "teacher", TEACHER)
    empty = _dir(tmp_path, "empty", TEACHER, weights=False)
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"")
    bad = [
        (["--distill-pretrained", str(weights)], "--distill-pretrained needs --distill-model"),
        (["--distill-model", "local-dir:/nonexistent"], "--distill-model local-dir:/nonexistent"),
        (["--distill-model", empty], "holds no weights"),
        (["--distill-model", "ViT-B-32"], "needs --distill-pretrained"),
        (["--distill-model", "ViT-Q-99"], "--distill-model 'ViT-Q-99' is unknown"),
        (
            ["--distill-model", teacher, "--distill-pretrained", str(weights)],
            "--distill-pretrained is ignored",
        ),
        (["--distill-model", "ViT-B-32", "--distill-pretrained", "/nonexistent.pt"], "--distill-pretrained"),
        (["--distill-model", teacher, "--siglip", "--model", "ds-clip-tiny-siglip"], "--siglip"),
    ]
    for argv, needle in bad:
        with pytest.raises(SettingsError) as e:
            parse_settings(argv)
        assert needle in str(e.value) and "\n" not in str(e.value), (argv, str(e.value))
    s = parse_settings(["--distill-model", teacher, "--accum-freq", "4"])
    assert s.model.distill_model == teacher
    assert parse_settings(["--distill-model", "ViT-B-32", "--distill-pretrained", str(weights)])


def test_build_teacher_is_frozen_eval_and_leaves_the_rng_alone(tmp_path):
    """The engine builder's teacher: the folder's weights (not a seeded init), every parameter frozen, eval
    mode, the global RNG untouched (the student's random stream does not depend on having a teacher)."""
    from safetensors.torch import load_file

    from ds_clip.training.engine import build_model_bundle, build_teacher

    student = _dir(tmp_path, "student", CONFIGS["vit"], weights=False)
    teacher_dir = _dir(tmp_path, "teacher", TEACHER)
    s = parse_settings(["--model", student, "--distill-model", teacher_dir])
    bundle = build_model_bundle(s.model, seed=s.data.seed)
    before = torch.get_rng_state()
    teacher = build_teacher(s.model, bundle, seed=s.data.seed)
    assert torch.equal(torch.get_rng_state(), before)
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    saved = load_file(str(tmp_path / "teacher" / "open_clip_model.safetensors"))
    state = teacher.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert build_teacher(parse_settings(["--model", student]).model, bundle, seed=s.data.seed) is None


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"vision_cfg": {**TEACHER["vision_cfg"], "image_size": 32}},
            "image size (32, 32) (student: (16, 16))",
        ),
        ({"text_cfg": {**TEACHER["text_cfg"], "context_length": 12}}, "context length 12 (student: 8)"),
    ],
)
def test_teacher_reading_other_inputs_is_refused(tmp_path, change, needle):
    """A teacher with another image size or another context length would be fed the student's images and
    tokens: refused by the engine builder with a ModelError (exit 2) naming --distill-model."""
    from ds_clip.errors import UserError
    from ds_clip.training.engine import build_model_bundle, build_teacher

    student = _dir(tmp_path, "student", CONFIGS["vit"], weights=False)
    teacher = _dir(tmp_path, "teacher", {**TEACHER, **change})
    s = parse_settings(["--model", student, "--distill-model", teacher])
    with pytest.raises(UserError) as e:
        build_teacher(s.model, build_model_bundle(s.model, seed=s.data.seed), seed=s.data.seed)
    assert f"--distill-model {teacher}" in str(e.value) and needle in str(e.value), str(e.value)
    mean = parse_settings(
        ["--model", student, "--distill-model", _dir(tmp_path, "t2", TEACHER), "--image-mean", "0.5"]
    )
    with pytest.raises(UserError, match="image mean"):
        build_teacher(mean.model, build_model_bundle(mean.model, seed=mean.data.seed), seed=mean.data.seed)
