"""SigLIP 2's objective on an open_clip SigLIP model: ``attach`` adds the parts (``model.siglip2``) and a forward
that returns, beside the features the sigmoid loss uses, each term's per-sample sums (``out["aux"]``, the layout of
``ds_clip.step.aux``), so the cached step trains them exactly under --accum-freq. docs/siglip2.md gives the terms,
their formulas and where each default comes from.

- LocCa (Sec. 2.2): the decoder reads the image tower's un-pooled tokens of the forward the sigmoid loss uses and
  predicts the caption (and, where the data has boxes, a referring expression's box and a box's caption); a share of
  the captions is predicted in parallel (CapPa).
- SILC (Sec. 2.3): the student's global head on local views against the teacher's on a global view.
- TIPS (Sec. 2.3): the student's patch head, at its masked patches of the global view, against the teacher's at the
  same patches of the unmasked view.
Both self-supervised terms train from ``start_step`` on; before it they are not computed at all.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_clip.errors import UserError
from ds_clip.siglip2 import views
from ds_clip.siglip2.defaults import image_tower_width, siglip2_selfsup_weights
from ds_clip.siglip2.parts import LocCaDecoder, Siglip2Parts
from ds_clip.siglip2.teacher import EmaTeacher
from ds_clip.siglip2.towers import (
    captured,
    embed_module,
    is_timm,
    masked,
    num_patches,
    token_module,
    without_patch_dropout,
)
from ds_clip.step.aux import AuxTerms
from ds_clip.step.caption import chunked_token_loss_sum

TERMS = ("locca", "silc", "tips")
EXTRAS = ("locca_regions",)
PREFIX = "siglip2."
"""Every state-dict key of the training-time parts starts with it."""


class Siglip2Error(UserError):
    """--siglip2 on a model it cannot train (exit 2)."""


# ------------------------------------------------------------------------------------------- the objective


@dataclass
class Siglip2Runtime:
    """What the forward reads besides the model: the settings, the teacher, and whether the self-supervised
    terms train in this step (set by ``begin_step`` before the step's first forward, the same on every rank)."""

    weights: tuple[float, float, float]
    parallel_fraction: float
    local_views: int
    mask_ratio: float
    teacher_temp: float
    student_temp: float
    pad_id: int
    start_fraction: float
    teacher: EmaTeacher
    start_step: int = 0
    selfsup: bool = False

    def start(self, *, total_steps: int, engine) -> None:
        """The run's length is known: the first self-supervised step; the teacher beside the student's engine
        (partitioned like it under ZeRO-3: a collective, every rank)."""
        self.start_step = selfsup_start_step(self.start_fraction, total_steps)
        self.teacher.start(engine)

    @property
    def terms(self) -> AuxTerms:
        return AuxTerms(names=TERMS, weights=self.weights, extras=EXTRAS)

    def describe(self, dataset_type: str) -> str:
        locca, silc, tips = self.weights
        boxes = (
            "referring expressions and grounded captions where a sample's json has 'regions' (the log's 'regions' "
            "counts them; a sample without is captioning only)"
            if dataset_type == "webdataset"
            else f"captioning only: {dataset_type} data has no box annotations, so the referring-expression and "
            "grounded-captioning tasks are skipped"
        )
        return (
            f"--siglip2: sigmoid loss + LocCa decoder x {locca:g} ({self.parallel_fraction:g} of captions in "
            f"parallel; {boxes}) + from step {self.start_step + 1} on SILC self-distillation x {silc:g} "
            f"({self.local_views} local views) and TIPS masked prediction x {tips:g} (mask ratio "
            f"{self.mask_ratio:g}) against an EMA teacher (momentum {self.teacher.momentum:g})"
        )

    def begin_step(self, model: nn.Module, step: int) -> None:
        """Before step ``step`` (updates applied so far): the self-supervised terms from ``start_step`` on, the
        teacher copied from the student at the first such step (a collective under ZeRO-3: every rank)."""
        self.selfsup = step >= self.start_step
        if self.selfsup and not self.teacher.ready:
            self.teacher.reset_from(model)

    def after_update(self, model: nn.Module, center_sums: torch.Tensor | None) -> None:
        """After an applied update of a self-supervised step: the teacher's EMA and centers."""
        if self.selfsup:
            self.teacher.update(model, center_sums)


def _locca(
    model: nn.Module, rt: Siglip2Runtime, tokens: torch.Tensor, text: torch.Tensor
) -> list[torch.Tensor]:
    """[token-loss sum, target-token count, region rows] of the decoder on this micro-batch's rows: row 0 (the
    caption) of every sample, the others (referring expression, grounded caption) where present (not all 0).
    An absent row runs through the decoder with every target ignored: leaving it out would be a boolean index,
    a host sync in every micro-batch's forward."""
    rows = text if text.dim() == 3 else text[:, None]
    b, r, length = rows.shape
    parallel = (torch.rand(b) < rt.parallel_fraction).to(rows.device)
    flat = rows.reshape(b * r, length)
    is_caption = torch.arange(b * r, device=rows.device) % r == 0
    present = is_caption | flat.ne(0).any(dim=1)
    par = parallel.repeat_interleave(r) & is_caption
    logits = model.siglip2.decoder(tokens.repeat_interleave(r, dim=0), flat, par)
    labels = torch.where(present[:, None], flat[:, 1:], torch.full_like(flat[:, 1:], rt.pad_id))
    total = chunked_token_loss_sum(logits, labels, rt.pad_id)
    count = (labels != rt.pad_id).sum()
    return [total.double(), count.double(), (present & ~is_caption).sum().double()]


def _distill(
    student: torch.Tensor, teacher: torch.Tensor, center: torch.Tensor, rt: Siglip2Runtime
) -> torch.Tensor:
    """Σ over rows of DINO's cross-entropy: teacher softmax((t - center) / τ_t) against student
    log-softmax(s / τ_s)."""
    target = F.softmax((teacher - center) / rt.teacher_temp, dim=-1)
    return -(target * F.log_softmax(student / rt.student_temp, dim=-1)).sum()


def _selfsup(
    model: nn.Module, rt: Siglip2Runtime, image: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    visual, parts, teacher = model.visual, model.siglip2, rt.teacher
    b = image.shape[0]
    tokens_at, prefix = token_module(visual)
    global_view = views.crops(image, 1, views.GLOBAL_SCALE)
    local = views.crops(image, rt.local_views, views.LOCAL_SCALE)
    mask, index = views.patch_mask(b, num_patches(visual), rt.mask_ratio, image.device)
    t_global, t_patch = teacher(global_view, index)
    with without_patch_dropout(visual):
        # SILC: each local view of a sample against the teacher's global view of it.
        s_local = parts.global_head(visual(local))
        # TIPS: the masked patches of the student's global view against the teacher's same patches.
        with masked(embed_module(visual), parts.masker, mask), captured(tokens_at, b) as grab:
            visual(global_view)
    silc = _distill(s_local, t_global.repeat_interleave(rt.local_views, dim=0), teacher.center_global, rt)
    s_patch = parts.patch_head(views.masked_rows(grab.output[:, prefix:], index))
    tips = _distill(s_patch, t_patch, teacher.center_patch, rt)
    n_local, n_patch = float(s_local.shape[0]), float(s_patch.shape[0])
    center = torch.cat([t_global.sum(0), t_patch.sum(0), t_global.new_tensor([float(b), n_patch])]).double()
    return [silc.double(), silc.new_tensor(n_local, dtype=torch.float64), tips.double(),
            tips.new_tensor(n_patch, dtype=torch.float64)], center  # fmt: skip


def _forward(self: nn.Module, image: torch.Tensor | None = None, text: torch.Tensor | None = None):
    """open_clip's forward, plus the SigLIP 2 terms in training: ``text`` may be [B, R, L] (row 0 the caption,
    the others the decoder's box tasks), of which the text tower sees row 0."""
    rt: Siglip2Runtime = self.__dict__["_siglip2_runtime"]
    caption = text[:, 0] if text is not None and text.dim() == 3 else text
    if not (self.training and image is not None and text is not None):
        return type(self).forward(self, image, caption)
    tokens_at, _ = token_module(self.visual)
    with captured(tokens_at, image.shape[0]) as grab:
        out = type(self).forward(self, image, caption)
    aux = _locca(self, rt, grab.output, text)
    if rt.selfsup:
        selfsup, center = _selfsup(self, rt, image)
        out["aux_center"] = center
    else:
        zero = torch.zeros((), dtype=torch.float64, device=image.device)
        selfsup = [zero, zero, zero, zero]
    # Layout of ds_clip.step.aux: [locca sum, count, silc sum, count, tips sum, count, region rows].
    out["aux"] = torch.stack([aux[0], aux[1], *selfsup, aux[2]])
    return out


def runtime_of(model: nn.Module) -> Siglip2Runtime | None:
    return model.__dict__.get("_siglip2_runtime")


def attach(model: nn.Module, model_cfg: dict, loss, *, seed: int) -> Siglip2Runtime:
    """Add SigLIP 2's parts to ``model`` (before DeepSpeed sees it: ZeRO shards them with the rest) and its
    forward; the parts are initialised from ``seed`` without moving the global RNG. The engine's builder sets the
    run's ``start_step`` and moves the teacher to the engine's device (``start``)."""
    import open_clip

    if getattr(model, "logit_bias", None) is None:
        raise Siglip2Error(
            "--siglip2 trains a SigLIP model (one with a learnable logit_bias, e.g. ViT-B-16-SigLIP2 or "
            "ds-clip-tiny-siglip); this --model has none"
        )
    if isinstance(model, open_clip.CoCa):
        raise Siglip2Error(
            "--siglip2 on a CoCa model: SigLIP 2 brings its own decoder (LocCa); use a SigLIP model"
        )
    visual = model.visual
    if not (is_timm(visual) or isinstance(visual, open_clip.transformer.VisionTransformer)):
        raise Siglip2Error(f"--siglip2 needs a ViT image tower; this --model's is a {type(visual).__name__}")
    text_cfg = open_clip.model.CLIPTextCfg(**model_cfg.get("text_cfg", {}))
    width = image_tower_width(visual)
    layers = loss.siglip2_decoder_layers or max(1, text_cfg.layers // 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2_000_003)
        decoder = LocCaDecoder(
            vocab_size=text_cfg.vocab_size, context_length=text_cfg.context_length, width=text_cfg.width,
            heads=text_cfg.heads, layers=layers, image_width=width,
        )  # fmt: skip
        parts = Siglip2Parts(
            decoder=decoder, pooled_dim=int(model_cfg["embed_dim"]), token_dim=width,
            prototypes=loss.siglip2_prototypes, patch_prototypes=loss.siglip2_patch_prototypes,
        )  # fmt: skip
    if getattr(visual, "grad_checkpointing", False) or getattr(
        getattr(visual, "transformer", None), "grad_checkpointing", False
    ):
        decoder.grad_checkpointing = True
    model.siglip2 = parts
    silc, tips = siglip2_selfsup_weights(loss.siglip2_silc_weight, loss.siglip2_tips_weight, width)
    rt = Siglip2Runtime(
        weights=(loss.siglip2_locca_weight, silc, tips),
        parallel_fraction=loss.siglip2_parallel_fraction,
        local_views=loss.siglip2_local_views,
        mask_ratio=loss.siglip2_mask_ratio,
        teacher_temp=loss.siglip2_teacher_temp,
        student_temp=loss.siglip2_student_temp,
        pad_id=int(text_cfg.pad_id),
        start_fraction=loss.siglip2_selfsup_start,
        teacher=EmaTeacher(visual, parts.global_head, parts.patch_head, loss.siglip2_teacher_momentum),
    )
    model.__dict__["_siglip2_runtime"] = rt  # not a submodule: DeepSpeed must not see the teacher
    model.forward = types.MethodType(_forward, model)
    return rt


def selfsup_start_step(fraction: float, total_steps: int) -> int:
    """The first step (0-based: updates applied before it) of the self-supervised terms: floor(fraction x total)."""
    return int(math.floor(fraction * total_steps + 1e-9))
