"""The contrastive loss over the whole global batch, computed once per optimizer step.

The step hands in this rank's k·m embeddings as leaves; this module gathers the other ranks'
embeddings, computes the objective L of the full N = W·k·m batch, and says how the leaf gradients
must be weighted so that DeepSpeed's *average* over ranks yields exactly ∂L/∂θ:

================================  =========================  ===================  =================
variant                           what rank r backprops      ∂/∂(local x) gives    logit_scale/bias
================================  =========================  ===================  =================
global, plain gather              L (same on every rank)     ∂L/∂x  -> coef W      full -> coef 1
global, gather-with-grad          L; gather backward sums    W·∂L/∂x -> coef 1     full -> coef 1
local + gather-with-grad          loss_r, Σ_r loss_r = W·L   W·∂L/∂x -> coef 1     partial, mean = ∂L/∂s
SigLIP (local rows, all texts)    loss_r, Σ_r loss_r = W·L   W·∂L/∂x -> coef 1     partial, mean = ∂L/∂s
================================  =========================  ===================  =================

Distillation (``--distill-model``, open_clip's ``DistillClipLoss``: L = contrastive + distill) follows the
same rows: the teacher's embeddings are gathered like the student's but are constants, so the distill term
is one more function of the student's logits, global (same L on every rank: coef W with a plain gather, 1
with gather-with-grad) or local (loss_r over this rank's rows, Σ_r loss_r = W·L: coef 1). The student's
logit_scale gets its full gradient (coef 1); the teacher's scale gets none.

The "coef" is the factor the step applies to the leaf gradient before pushing it through the
encoders; DeepSpeed then divides the summed parameter gradients by W. ``logit_scale``/``logit_bias``
enter once per step (not once per micro-batch) with ``scalar_grad_coef``.

Local loss *without* gather-with-grad drops the gradient that other ranks' rows send to this rank's
embeddings: it is not the full-batch gradient, so it is refused.

Gathers (audit of open_clip's collectives): open_clip's ``ClipLoss`` with world_size > 1 calls
``open_clip.loss.gather_features`` (``dist.all_gather`` into ``zeros_like`` buffers, or
``torch.distributed.nn.all_gather`` with gather-with-grad), and ``SigLipLoss(dist_impl="gather")`` calls
``torch.distributed.nn.all_gather``: collectives outside ``ds_clip.distributed``, on whatever device the
features are. ds_clip therefore never gives open_clip a world size above one: ``_ClipLoss`` and
``_SigLipLoss`` below are open_clip's classes with only the gather replaced by ``gather_features`` of this
module, which gathers through ``ds_clip.distributed`` (tensors on the accelerator's device; the
with-grad backward sums each rank's rows over ranks, as ``torch.distributed.nn.all_gather`` does). The
logits, labels and reductions are open_clip's own code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from open_clip.loss import ClipLoss, DistillClipLoss, SigLipLoss

from ds_clip.distributed import all_gather_cat, all_gather_cat_with_grad, all_reduce_mean
from ds_clip.errors import UserError


@dataclass(frozen=True)
class LossSpec:
    """Which contrastive objective, and how it is computed across ranks."""

    siglip: bool = False
    """Sigmoid loss with a learnable bias (the model must have ``logit_bias``)."""
    local_loss: bool = False
    """Each rank computes only its rows against all columns (open_clip's --local-loss)."""
    gather_with_grad: bool = False
    """All-gather whose backward sends gradients back to the owning rank (open_clip's --gather-with-grad)."""
    impl: str = "dense"
    """'dense' (open_clip's own loss classes, N×N logits) or 'tiled' (ds_clip.step.tiled_loss, O(tile·N) memory)."""
    tile_size: int = 4096
    """Rows/columns per tile for impl='tiled'."""
    distill: bool = False
    """open_clip's DistillClipLoss (contrastive + distill against a frozen teacher's embeddings)."""


@dataclass
class LossOutput:
    backward_loss: torch.Tensor
    """The scalar this rank backpropagates (once per step)."""
    value: torch.Tensor
    """The full-batch objective L, detached, identical on every rank."""
    encoder_grad_coef: float
    """Factor on the leaf-embedding gradients (see the module table)."""
    scalar_grad_coef: float
    """Factor on the logit_scale / logit_bias gradients."""
    parts: dict[str, torch.Tensor] | None = None
    """With distillation: {"contrastive_loss", "distill_loss"}, detached, their sum is backward_loss (this
    rank's rows under --local-loss; no collective is spent on them)."""


@dataclass
class TeacherFeatures:
    """This rank's k·m teacher embeddings and the teacher's own exp(logit_scale): constants of the loss."""

    image_features: torch.Tensor
    text_features: torch.Tensor
    logit_scale: torch.Tensor


# From which global batch N on --loss-impl auto takes the tiled loss: where its time per forward+backward
# falls below the dense one's (benchmarks/bench_loss.py, one CPU thread, d = 512, quiet machine;
# docs/loss.md#where---loss-impl-auto-switches). The global CLIP loss runs tiled's symmetric path (one matmul per
# block for both directions) and is the faster from the smallest N measured on: 0.86x dense time at N = 128,
# 0.83x at 256, 0.71x at 512, 0.69x at 1024, 0.68x at 4096, 0.69x at 8192; below 128 the loss is under a
# millisecond either way. The --local-loss rows-vs-columns path (1.2-1.4x up to 8192) and SigLIP (1.1-1.5x up to
# 8192) stay slower than dense in time over the measured range; they go tiled from 8192 because the dense N x N
# matrices then cost over a GiB (SigLIP 1.4 GiB extra against 0.3 at 8192, growing with N squared) and the
# time difference is about a tenth. Distillation follows. The tiled loss never holds an N x N matrix.
TILED_FROM_N: dict[str, int] = {"clip": 128, "clip_local": 8192, "siglip": 8192, "distill": 8192}


def auto_kind(*, siglip: bool, local_loss: bool, distill: bool) -> str:
    """The key of TILED_FROM_N for a loss: which tiled path it would run."""
    if distill:
        return "distill"
    if siglip:
        return "siglip"
    return "clip_local" if local_loss else "clip"


def resolve_impl(
    impl: str, global_batch: int, *, siglip: bool = False, local_loss: bool = False, distill: bool = False
) -> str:
    """--loss-impl auto -> 'tiled' for N >= TILED_FROM_N of this loss, else 'dense'; other values unchanged."""
    if impl == "auto":
        kind = auto_kind(siglip=siglip, local_loss=local_loss, distill=distill)
        return "tiled" if global_batch >= TILED_FROM_N[kind] else "dense"
    return impl


class LossConfigError(UserError):
    """A loss configuration that would not train the full-batch objective."""


class ContrastiveLoss:
    """CLIP or SigLIP loss of the global batch, given this rank's embeddings."""

    def __init__(self, spec: LossSpec, rank: int = 0, world_size: int = 1):
        if spec.impl not in ("dense", "tiled"):
            raise LossConfigError(f"--loss-impl must be 'dense' or 'tiled', got {spec.impl!r}")
        if spec.distill and spec.siglip:
            raise LossConfigError(
                "--distill-model with --siglip: open_clip's distillation (DistillClipLoss) is a softmax CLIP loss"
            )
        if spec.local_loss and not spec.gather_with_grad and world_size > 1 and not spec.siglip:
            raise LossConfigError(
                "--local-loss without --gather-with-grad is not the full-batch gradient (each rank would "
                "miss the gradient that the other ranks' rows send to its embeddings); add --gather-with-grad"
            )
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        if spec.siglip:
            self._dense = _SigLipLoss(rank=rank, world_size=world_size, dist_impl="gather")
        elif spec.distill:
            self._dense = _DistillClipLoss(
                local_loss=spec.local_loss,
                gather_with_grad=spec.gather_with_grad,
                rank=rank,
                world_size=world_size,
            )
        else:
            self._dense = _ClipLoss(
                local_loss=spec.local_loss,
                gather_with_grad=spec.gather_with_grad,
                rank=rank,
                world_size=world_size,
            )

    @property
    def rank_losses_are_partial(self) -> bool:
        """True where each rank's loss covers only its own rows (the value is their mean)."""
        return self.world_size > 1 and (self.spec.siglip or self.spec.local_loss)

    def __call__(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor | None = None,
        teacher: TeacherFeatures | None = None,
    ) -> LossOutput:
        if self.spec.siglip and logit_bias is None:
            raise LossConfigError(
                "--siglip needs a model with logit_bias (e.g. a config with init_logit_bias)"
            )
        if (teacher is not None) != self.spec.distill:
            raise ValueError(
                "the teacher's features are needed exactly when the loss distils (LossSpec.distill)"
            )
        parts = None
        if teacher is not None:
            args = (teacher.image_features, teacher.text_features, teacher.logit_scale)
            if self.spec.impl == "dense":
                contrastive, distill = self._dense(image_features, text_features, logit_scale, *args)
            else:
                contrastive, distill = self._tiled_distill(image_features, text_features, logit_scale, *args)
            loss = contrastive + distill
            parts = {"contrastive_loss": contrastive.detach(), "distill_loss": distill.detach()}
        elif self.spec.impl == "dense":
            if self.spec.siglip:
                loss = self._dense(image_features, text_features, logit_scale, logit_bias)
            else:
                loss = self._dense(image_features, text_features, logit_scale)
        else:
            loss = self._tiled(image_features, text_features, logit_scale, logit_bias)
        value = all_reduce_mean(loss) if self.rank_losses_are_partial else loss.detach()
        plain_global_gather = (
            self.world_size > 1 and not self.rank_losses_are_partial and not self.spec.gather_with_grad
        )
        return LossOutput(
            backward_loss=loss,
            value=value,
            encoder_grad_coef=float(self.world_size) if plain_global_gather else 1.0,
            scalar_grad_coef=1.0,
            parts=parts,
        )

    def _tiled_distill(self, image, text, scale, t_image, t_text, t_scale):
        from ds_clip.step import tiled_loss

        tile = self.spec.tile_size
        if self.world_size == 1:
            return tiled_loss.distill_clip_loss_tiled(
                image, text, image, text, scale, t_image, t_text, t_image, t_text, t_scale, 0, tile
            )
        gather = dict(
            local_loss=self.spec.local_loss,
            gather_with_grad=self.spec.gather_with_grad,
            rank=self.rank,
            world_size=self.world_size,
        )
        all_image, all_text = gather_features(image, text, **gather)
        all_t_image, all_t_text = gather_features(t_image, t_text, **gather)
        if self.spec.local_loss:
            return tiled_loss.distill_clip_loss_tiled(
                image, text, all_image, all_text, scale, t_image, t_text, all_t_image, all_t_text, t_scale,
                self.rank * image.shape[0], tile,
            )  # fmt: skip
        return tiled_loss.distill_clip_loss_tiled(
            all_image, all_text, all_image, all_text, scale, all_t_image, all_t_text, all_t_image, all_t_text,
            t_scale, 0, tile,
        )  # fmt: skip

    def _tiled(self, image, text, scale, bias):
        from ds_clip.step import tiled_loss

        tile = self.spec.tile_size
        if self.spec.siglip:
            all_text = all_gather_cat_with_grad(text) if self.world_size > 1 else text
            total = tiled_loss.siglip_loss_chunked(
                image, all_text, scale, bias, row_offset=self.rank * image.shape[0], tile_size=tile
            )
            return total / image.shape[0]
        if self.world_size == 1:
            return tiled_loss.clip_loss_tiled(image, text, image, text, scale, 0, tile)
        all_image, all_text = gather_features(
            image,
            text,
            local_loss=self.spec.local_loss,
            gather_with_grad=self.spec.gather_with_grad,
            rank=self.rank,
            world_size=self.world_size,
        )
        if self.spec.local_loss:
            return tiled_loss.clip_loss_tiled(
                image, text, all_image, all_text, scale, self.rank * image.shape[0], tile
            )
        return tiled_loss.clip_loss_tiled(all_image, all_text, all_image, all_text, scale, 0, tile)


def gather_features(
    image: torch.Tensor,
    text: torch.Tensor,
    *,
    local_loss: bool,
    gather_with_grad: bool,
    rank: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """open_clip's ``gather_features`` (torch.distributed path), through ``ds_clip.distributed``.

    With grad: the gathered rows carry gradient back to their rank (summed over ranks). Without: the
    gathered copies are constants, and for the global loss this rank's own rows are put back as the live
    tensors, so its embeddings still get their gradient.
    """
    if gather_with_grad:
        return all_gather_cat_with_grad(image), all_gather_cat_with_grad(text)
    all_image, all_text = all_gather_cat(image), all_gather_cat(text)
    if not local_loss:
        all_image = _own_rows_live(all_image, image, rank, world_size)
        all_text = _own_rows_live(all_text, text, rank, world_size)
    return all_image, all_text


def _own_rows_live(gathered: torch.Tensor, mine: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    parts = list(gathered.chunk(world_size, dim=0))
    parts[rank] = mine
    return torch.cat(parts, dim=0)


class _ClipLoss(ClipLoss):
    """open_clip's ClipLoss; only its gather goes through ds_clip.distributed (see the module docstring)."""

    def get_logits(self, image_features, text_features, logit_scale, logit_bias=None):
        if self.world_size == 1:
            return super().get_logits(image_features, text_features, logit_scale, logit_bias)
        # open_clip 3.3's ClipLoss.get_logits, world_size > 1 branch, with our gather_features.
        all_image_features, all_text_features = gather_features(
            image_features,
            text_features,
            local_loss=self.local_loss,
            gather_with_grad=self.gather_with_grad,
            rank=self.rank,
            world_size=self.world_size,
        )
        if self.local_loss:
            logits_per_image = logit_scale * image_features @ all_text_features.T
            logits_per_text = logit_scale * text_features @ all_image_features.T
        else:
            logits_per_image = logit_scale * all_image_features @ all_text_features.T
            logits_per_text = logits_per_image.T
        if logit_bias is not None:
            logits_per_image += logit_bias
            logits_per_text += logit_bias
        return logits_per_image, logits_per_text


class _DistillClipLoss(_ClipLoss, DistillClipLoss):
    """open_clip's DistillClipLoss (its forward and dist_loss: contrastive + distill, the teacher's logits
    scaled by the teacher's own logit_scale); its gathers, of the student and of the teacher, go through
    _ClipLoss.get_logits, i.e. ds_clip.distributed."""


class _SigLipLoss(SigLipLoss):
    """open_clip's SigLipLoss (``dist_impl="gather"``) with its all-gather through ds_clip.distributed."""

    def forward(self, image_features, text_features, logit_scale, logit_bias, output_dict=False):
        if self.world_size == 1:
            return super().forward(image_features, text_features, logit_scale, logit_bias, output_dict)
        # open_clip 3.3's SigLipLoss.forward, dist_impl "gather" branch: this rank's positives and
        # negatives, plus every other rank's texts as negatives.
        loss = self._loss(image_features, text_features, logit_scale, logit_bias)
        all_text = all_gather_cat_with_grad(text_features).chunk(self.world_size, dim=0)
        for i in range(self.world_size):
            loss += float(i != self.rank) * self._loss(
                image_features, all_text[i], logit_scale, logit_bias, negative_only=True
            )
        return {"contrastive_loss": loss} if output_dict else loss
