"""Tiled CLIP / chunked SigLIP losses equal open_clip's dense losses, values and gradients, without the
N x N logits matrix.

Oracle: ``open_clip.ClipLoss()`` / ``open_clip.loss.SigLipLoss()`` in one process on the whole batch
(fp32, and float64 where a tighter reference helps). Relative error of a tensor = max |a - b| / max |b|.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss, SigLipLoss

from ds_clip.step.tiled_loss import clip_loss_tiled, siglip_loss_chunked

REPO_ROOT = Path(__file__).resolve().parents[1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def make_features(
    n: int, d: int, seed: int, dtype: torch.dtype = torch.float32, normalize: bool = True, noise: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(n, d, generator=gen, dtype=torch.float64)
    # Correlated pairs, like a trained model's, so positives and negatives both matter.
    text = image + noise * torch.randn(n, d, generator=gen, dtype=torch.float64)
    if normalize:
        image, text = F.normalize(image, dim=1), F.normalize(text, dim=1)
    return image.to(dtype), text.to(dtype)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def scalar(value: float, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype).requires_grad_(True)


def clip_reference(image, text, scale) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [leaf(image), leaf(text), leaf(scale)]
    loss = ClipLoss()(*leaves)
    return loss.detach(), list(torch.autograd.grad(loss, leaves))


def siglip_reference(image, text, scale, bias) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [leaf(image), leaf(text), leaf(scale), leaf(bias)]
    loss = SigLipLoss()(*leaves)
    return loss.detach(), list(torch.autograd.grad(loss, leaves))


# (N, d, tile, scale): N not a multiple of the tile, N smaller than a tile, N equal to a tile, odd d,
# a single-row tile, large logit scales.
CLIP_CASES = [
    (37, 5, 8, 1.0),
    (37, 5, 8, 100.0),
    (10, 3, 64, 14.3),
    (64, 16, 64, 100.0),
    (100, 17, 33, 100.0),
    (50, 9, 1, 30.0),
    (130, 32, 48, 100.0),
]


@pytest.mark.parametrize("global_path", [True, False], ids=["same-tensors", "separate-tensors"])
@pytest.mark.parametrize(("n", "d", "tile", "scale_value"), CLIP_CASES)
def test_clip_matches_open_clip(n: int, d: int, tile: int, scale_value: float, global_path: bool) -> None:
    """Global loss (offset 0) equals open_clip ClipLoss in value and in every gradient, incl. the scale,
    both when rows *are* cols (symmetric fast path) and when they are distinct tensors (general path)."""
    image, text = make_features(n, d, seed=n * 1000 + tile)
    scale = torch.tensor(scale_value)
    ref32, grads32 = clip_reference(image, text, scale)
    ref64, grads64 = clip_reference(image.double(), text.double(), scale.double())

    img, txt, s = leaf(image), leaf(text), leaf(scale)
    if global_path:
        loss = clip_loss_tiled(img, txt, img, txt, s, tile_size=tile)
    else:
        # Distinct tensor objects for rows and cols: autograd must add the two gradient slots.
        loss = clip_loss_tiled(img * 1, txt * 1, img * 1, txt * 1, s, tile_size=tile)
    grads = torch.autograd.grad(loss, [img, txt, s])

    assert loss.dtype == torch.float32
    assert rel_err(loss, ref32) <= 1e-5
    assert rel_err(loss, ref64) <= 1e-5
    for name, g, g32, g64 in zip(["image", "text", "scale"], grads, grads32, grads64):
        assert g.shape == g32.shape, name
        assert rel_err(g, g32) <= 1e-5, name
        assert rel_err(g, g64) <= 1e-5, name


def test_clip_precision_no_worse_than_open_clip_when_softmax_saturates() -> None:
    """Well-separated pairs at scale 100: softmax of the positive is 1 - tiny, so softmax - onehot
    cancels and any absolute error of the log-sum-exp turns into a large relative gradient error.
    Storing max + log-sum as one fp32 number made that error 2e-3 here (open_clip fp32: 3e-5); keeping
    them apart must stay within 2x of open_clip's own fp32 error against float64."""
    image, text = make_features(130, 32, seed=130048, noise=0.7)
    scale = torch.tensor(100.0)
    _, grads32 = clip_reference(image, text, scale)
    _, grads64 = clip_reference(image.double(), text.double(), scale.double())
    for global_path in (True, False):
        img, txt, s = leaf(image), leaf(text), leaf(scale)
        if global_path:
            loss = clip_loss_tiled(img, txt, img, txt, s, tile_size=48)
        else:
            loss = clip_loss_tiled(img * 1, txt * 1, img * 1, txt * 1, s, tile_size=48)
        grads = torch.autograd.grad(loss, [img, txt])
        for g, g32, g64 in zip(grads, grads32, grads64):
            assert rel_err(g, g64) <= 2 * rel_err(g32, g64) + 1e-6


# (N, d, tile, scale, bias): open_clip's SigLIP init is scale 10, bias -10.
SIGLIP_CASES = [
    (37, 5, 8, 10.0, -10.0),
    (10, 3, 64, 1.0, 0.0),
    (100, 17, 33, 100.0, -10.0),
    (64, 16, 64, 100.0, 3.0),
    (50, 9, 1, 30.0, -2.5),
]


@pytest.mark.parametrize(("n", "d", "tile", "scale_value", "bias_value"), SIGLIP_CASES)
def test_siglip_matches_open_clip(n: int, d: int, tile: int, scale_value: float, bias_value: float) -> None:
    """siglip_loss_chunked(x, y, s, b) / N equals open_clip SigLipLoss in value and all four gradients."""
    image, text = make_features(n, d, seed=n * 7 + tile)
    scale, bias = torch.tensor(scale_value), torch.tensor(bias_value)
    ref32, grads32 = siglip_reference(image, text, scale, bias)
    ref64, grads64 = siglip_reference(image.double(), text.double(), scale.double(), bias.double())

    x, y, s, b = leaf(image), leaf(text), leaf(scale), leaf(bias)
    loss = siglip_loss_chunked(x, y, s, b, tile_size=tile) / n
    grads = torch.autograd.grad(loss, [x, y, s, b])

    assert rel_err(loss, ref32) <= 1e-5
    assert rel_err(loss, ref64) <= 1e-5
    for name, g, g32, g64 in zip(["image", "text", "scale", "bias"], grads, grads32, grads64):
        assert g.shape == g32.shape, name
        assert rel_err(g, g32) <= 1e-5, name
        assert rel_err(g, g64) <= 1e-5, name


def test_gradcheck_float64() -> None:
    """Finite differences agree with the hand-written backward (float64 inputs compute in float64),
    for both CLIP paths (offset > 0 on the general one) and SigLIP; scale/bias of shape [1]."""
    image, text = make_features(7, 3, seed=1, dtype=torch.float64, normalize=False)
    img, txt = leaf(image), leaf(text)
    s = scalar(2.5, torch.float64, (1,))
    b = scalar(-1.5, torch.float64, (1,))
    rows_i, rows_t = leaf(image[2:5]), leaf(text[2:5])
    assert torch.autograd.gradcheck(
        lambda i, t, s: clip_loss_tiled(i, t, i, t, s, tile_size=3), (img, txt, s)
    )
    assert torch.autograd.gradcheck(
        lambda ri, rt, i, t, s: clip_loss_tiled(ri, rt, i, t, s, row_offset=2, tile_size=2),
        (rows_i, rows_t, img, txt, s),
    )
    assert torch.autograd.gradcheck(
        lambda x, y, s, b: siglip_loss_chunked(x, y, s, b, row_offset=2, tile_size=2), (rows_i, txt, s, b)
    )


@pytest.mark.parametrize(("world_size", "tile"), [(3, 4), (4, 64)])
def test_clip_local_loss_simulated_ranks(world_size: int, tile: int) -> None:
    """W simulated ranks, rank r = rows r*R..(r+1)*R against all gathered columns (offset r*R):
    sum_r loss_r / W equals the global loss, and gradients reaching every rank's leaves through the
    concatenated (gathered-with-grad) columns equal open_clip's full-batch gradients."""
    rows_per_rank, d = 9, 6
    n = world_size * rows_per_rank
    image, text = make_features(n, d, seed=world_size)
    scale = torch.tensor(50.0)
    ref, ref_grads = clip_reference(image, text, scale)

    image_parts = [leaf(p) for p in image.split(rows_per_rank)]
    text_parts = [leaf(p) for p in text.split(rows_per_rank)]
    s = leaf(scale)
    image_cols, text_cols = torch.cat(image_parts), torch.cat(text_parts)
    total = sum(
        clip_loss_tiled(
            image_parts[r],
            text_parts[r],
            image_cols,
            text_cols,
            s,
            row_offset=r * rows_per_rank,
            tile_size=tile,
        )
        for r in range(world_size)
    )
    loss = total / world_size
    loss.backward()

    assert rel_err(loss, ref) <= 1e-5
    assert rel_err(torch.cat([p.grad for p in image_parts]), ref_grads[0]) <= 1e-5
    assert rel_err(torch.cat([p.grad for p in text_parts]), ref_grads[1]) <= 1e-5
    assert rel_err(s.grad, ref_grads[2]) <= 1e-5


def test_siglip_local_rows_sum_to_global() -> None:
    """Rank r's rows against all columns, offset r*R: the sum over ranks / N is open_clip's SigLipLoss."""
    world_size, rows_per_rank, d = 3, 8, 5
    n = world_size * rows_per_rank
    image, text = make_features(n, d, seed=5)
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    ref, ref_grads = siglip_reference(image, text, scale, bias)

    image_parts = [leaf(p) for p in image.split(rows_per_rank)]
    text_parts = [leaf(p) for p in text.split(rows_per_rank)]
    s, b = leaf(scale), leaf(bias)
    text_cols = torch.cat(text_parts)
    loss = (
        sum(
            siglip_loss_chunked(image_parts[r], text_cols, s, b, row_offset=r * rows_per_rank, tile_size=5)
            for r in range(world_size)
        )
        / n
    )
    loss.backward()
    assert rel_err(loss, ref) <= 1e-5
    assert rel_err(torch.cat([p.grad for p in image_parts]), ref_grads[0]) <= 1e-5
    assert rel_err(torch.cat([p.grad for p in text_parts]), ref_grads[1]) <= 1e-5
    assert rel_err(s.grad, ref_grads[2]) <= 1e-5
    assert rel_err(b.grad, ref_grads[3]) <= 1e-5


def test_only_requested_grads_and_scale_shape() -> None:
    """Columns gathered without grad (plain all_gather) still give row and scale gradients; a [1]-shaped
    scale gets a [1]-shaped gradient."""
    image, text = make_features(20, 4, seed=3)
    img, txt = leaf(image[5:10]), leaf(text[5:10])
    s = scalar(20.0, shape=(1,))
    loss = clip_loss_tiled(img, txt, image, text, s, row_offset=5, tile_size=6)
    loss.backward()
    assert img.grad is not None and txt.grad is not None
    assert s.grad is not None and s.grad.shape == (1,)


def test_clip_stable_at_huge_scale() -> None:
    """Max-subtracted LSE: scale 1e4 (logits ~1e4, exp overflows fp32 without it) stays finite and exact."""
    image, text = make_features(40, 8, seed=11)
    scale = torch.tensor(1.0e4)
    ref64, grads64 = clip_reference(image.double(), text.double(), scale.double())
    img, txt, s = leaf(image), leaf(text), leaf(scale)
    loss = clip_loss_tiled(img, txt, img, txt, s, tile_size=16)
    grads = torch.autograd.grad(loss, [img, txt, s])
    assert torch.isfinite(loss)
    # Logits of size 1e4 carry fp32 rounding of ~1e4 * 6e-8 = 6e-4 absolute; the loss is a sum of
    # differences of such logits, so compare in absolute terms at that scale.
    assert abs(loss.item() - ref64.item()) <= 1e-2
    for g, g64 in zip(grads, grads64):
        assert torch.isfinite(g).all()
        assert rel_err(g, g64) <= 1e-2


def test_bf16_inputs_computed_in_fp32() -> None:
    """bf16 embeddings: the loss equals the fp32 reference *on the same bf16-rounded values* to fp32
    rounding (1e-5), which a bf16 accumulation could not reach (bf16 keeps 8 mantissa bits: ~4e-3
    relative per logit, and N-term sums of them); gradients come back as bf16, so they can only be
    compared to the fp32 reference to bf16 rounding: one rounding of each gradient, 2^-8 = 3.9e-3
    relative to its largest entry, and we allow 1e-2."""
    n, d = 70, 12
    image, text = make_features(n, d, seed=2)
    image16, text16 = image.bfloat16(), text.bfloat16()
    scale = torch.tensor(30.0)
    bias = torch.tensor(-10.0)

    ref, ref_grads = clip_reference(image16.float(), text16.float(), scale)
    img, txt, s = leaf(image16), leaf(text16), leaf(scale)
    loss = clip_loss_tiled(img, txt, img, txt, s, tile_size=16)
    grads = torch.autograd.grad(loss, [img, txt, s])
    assert rel_err(loss, ref) <= 1e-5
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16
    assert grads[2].dtype == torch.float32
    assert rel_err(grads[2], ref_grads[2]) <= 1e-5  # the scale gradient is summed and returned in fp32
    for g, g_ref in zip(grads[:2], ref_grads[:2]):
        assert rel_err(g, g_ref) <= 1e-2

    sref, sref_grads = siglip_reference(image16.float(), text16.float(), scale, bias)
    x, y, s, b = leaf(image16), leaf(text16), leaf(scale), leaf(bias)
    sloss = siglip_loss_chunked(x, y, s, b, tile_size=16) / n
    sgrads = torch.autograd.grad(sloss, [x, y, s, b])
    assert rel_err(sloss, sref) <= 1e-5
    assert rel_err(sgrads[2], sref_grads[2]) <= 1e-5
    assert rel_err(sgrads[3], sref_grads[3]) <= 1e-5
    for g, g_ref in zip(sgrads[:2], sref_grads[:2]):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, g_ref) <= 1e-2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image_rows": torch.zeros(4)}, "image_rows must be a 2-D"),
        ({"text_cols": torch.zeros(8, 5)}, "feature dims differ"),
        ({"text_rows": torch.zeros(3, 4)}, "row counts differ"),
        ({"row_offset": 6}, "row_offset=6"),
        ({"row_offset": -1}, "row_offset=-1"),
        ({"tile_size": 0}, "tile_size"),
        ({"logit_scale": torch.ones(2)}, "logit_scale must be a tensor of shape"),
        ({"image_rows": torch.zeros(0, 4), "text_rows": torch.zeros(0, 4)}, "no rows"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs: dict, message: str) -> None:
    args = {
        "image_rows": torch.zeros(4, 4),
        "text_rows": torch.zeros(4, 4),
        "image_cols": torch.zeros(8, 4),
        "text_cols": torch.zeros(8, 4),
        "logit_scale": torch.tensor(1.0),
        "row_offset": 4,
        "tile_size": 3,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        clip_loss_tiled(**args)


# Runs in a fresh interpreter so that its peak RSS (VmHWM) belongs to these losses alone.
_MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    from open_clip.loss import ClipLoss
    from ds_clip.step.tiled_loss import clip_loss_tiled, distill_clip_loss_tiled, siglip_loss_chunked
    torch.set_num_threads(1)

    def status_bytes(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    def reset_peak():
        # Linux: "5" resets this process's peak RSS (VmHWM) to its current RSS, so a peak reached earlier
        # (an import that allocates and frees more than the matrix) cannot hide what the next case does.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def cases(n, d, tile):
        g = torch.Generator().manual_seed(0)
        img = torch.randn(n, d, generator=g).requires_grad_()
        txt = torch.randn(n, d, generator=g).requires_grad_()
        s = torch.tensor(10.0, requires_grad=True)
        b = torch.tensor(-10.0, requires_grad=True)
        half = n // 2
        t_img, t_txt = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)  # a teacher's, constants
        t_s = torch.tensor(20.0)
        return {
            "distill_global": lambda: sum(
                distill_clip_loss_tiled(img, txt, img, txt, s, t_img, t_txt, t_img, t_txt, t_s, 0, tile)
            ),
            "clip_global": lambda: clip_loss_tiled(img, txt, img, txt, s, tile_size=tile),
            "clip_local": lambda: clip_loss_tiled(img[half:], txt[half:], img, txt, s, half, tile),
            "siglip": lambda: siglip_loss_chunked(img, txt, s, b, tile_size=tile),
            "dense_clip": lambda: ClipLoss()(img, txt, s),  # positive control, must come last
        }

    n, d, tile = (int(a) for a in sys.argv[1:4])
    # Warm-up with blocks of the measured size: thread pools, allocator arenas, matmul buffers.
    for fn in cases(2 * tile, d, tile).values():
        fn().backward()
    result = {}
    for name, fn in cases(n, d, tile).items():
        reset_peak()
        before = status_bytes("VmRSS")
        fn().backward()
        result[name] = status_bytes("VmHWM") - before
    print(json.dumps(result))
    """
)


def test_memory_is_not_quadratic() -> None:
    """Peak memory of forward+backward stays far below one N x N fp32 matrix (CLIP global and local rows,
    SigLIP, and the distillation loss with its teacher's logits).

    How: a fresh subprocess (so nothing else of this test session inflates its memory) warms up,
    then runs each loss at N = 6144, d = 16, tile 512, and reports the growth of its peak resident
    set size (``VmHWM``, reset before each case: the kernel's high-water mark of real pages, so it sees
    every allocation torch makes, unlike tracemalloc). One N x N fp32 matrix is 144 MiB; the tiled losses need about
    three 1 MiB blocks plus O(N d) vectors, so the bound of 1/8 of the matrix (18 MiB) leaves room for
    allocator noise and still fails loudly if anything quadratic is materialised. Dense open_clip runs
    last as a positive control: the same probe must see at least one full N x N matrix there,
    which shows the measurement is able to catch what it guards against.
    """
    n, d, tile = 6144, 16, 512
    matrix_bytes = n * n * 4
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(n), str(d), str(tile)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    growth = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("clip_global", "clip_local", "siglip", "distill_global"):
        assert growth[name] < matrix_bytes / 8, (name, growth)
    assert growth["dense_clip"] > matrix_bytes, growth


def test_auto_switches_to_tiled_where_the_measured_curves_cross() -> None:
    """--loss-impl auto: the global CLIP loss is tiled from N = 128 on, --local-loss, SigLIP and distillation
    from N = 8192 on (docs/loss.md#where---loss-impl-auto-switches); explicit choices are kept."""
    from ds_clip.step.loss import TILED_FROM_N, resolve_impl

    assert TILED_FROM_N == {"clip": 128, "clip_local": 8192, "siglip": 8192, "distill": 8192}
    assert [resolve_impl("auto", n) for n in (64, 127, 128, 4096)] == ["dense", "dense", "tiled", "tiled"]
    for kind in (
        {"siglip": True},
        {"local_loss": True},
        {"distill": True},
        {"siglip": True, "local_loss": True},
    ):
        assert [resolve_impl("auto", n, **kind) for n in (1024, 8191, 8192)] == ["dense", "dense", "tiled"]
    assert resolve_impl("dense", 10**6) == "dense" and resolve_impl("tiled", 8) == "tiled"
