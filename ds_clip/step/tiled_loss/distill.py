"""open_clip's ``DistillClipLoss`` blockwise: the student's contrastive term and the cross-entropy against
the teacher's softmax, both from per-row log-sum-exps, without an N x N matrix."""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from ds_clip.step.tiled_loss.blocks import (
    DEFAULT_TILE_SIZE,
    blocks,
    check_common,
    compute_dtype,
    out_dtype,
    scalar,
    two_way_accumulators,
    two_way_grads,
)
from ds_clip.step.tiled_loss.softmax import TeacherRows, row_grad_accumulate, row_lse


def _teacher_weighted_logits(
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    row_max: torch.Tensor,
    teacher: TeacherRows,
    tile: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per row i: sum_j p_t(ij) * (s_ij - max_i), with s the student's logits and p_t the teacher's softmax.

    Then the row's distillation term -sum_j p_t(ij) log_softmax(s)_ij = log_sum_i - this (sum_j p_t = 1);
    shifting by the row max keeps the summands small, as log_softmax does."""
    out = torch.zeros(rows.shape[0], dtype=dtype, device=rows.device)
    for b in blocks(rows, cols, scale, tile, dtype):
        shifted = b.logits.sub_(row_max[b.r0 : b.r1, None])
        out[b.r0 : b.r1] += (teacher.probs(b.r0, b.r1, b.c0, b.c1, dtype).mul_(shifted)).sum(dim=1)
    return out


class _DistillTiled(torch.autograd.Function):
    """open_clip's DistillClipLoss, blockwise: rows against all columns (row i's positive at column
    row_offset + i) for the student, the teacher's rows and columns alike; returns (contrastive, distill).
    Only the student's embeddings and scale get gradients: the teacher's inputs are constants."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        image_rows: torch.Tensor,
        text_rows: torch.Tensor,
        image_cols: torch.Tensor,
        text_cols: torch.Tensor,
        logit_scale: torch.Tensor,
        teacher_image_rows: torch.Tensor,
        teacher_text_rows: torch.Tensor,
        teacher_image_cols: torch.Tensor,
        teacher_text_cols: torch.Tensor,
        teacher_logit_scale: torch.Tensor,
        row_offset: int,
        tile: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = compute_dtype(
            image_rows, text_rows, image_cols, text_cols, logit_scale, teacher_image_rows, teacher_text_rows,
            teacher_image_cols, teacher_text_cols, teacher_logit_scale,
        )  # fmt: skip
        scale, teacher_scale = scalar(logit_scale, dtype), scalar(teacher_logit_scale, dtype)
        contrastive, distill, saved = [], [], []
        for rows, cols, t_rows, t_cols in (
            (image_rows, text_cols, teacher_image_rows, teacher_text_cols),
            (text_rows, image_cols, teacher_text_rows, teacher_image_cols),
        ):
            row_max, log_sum, pos = row_lse(rows, cols, scale, row_offset, tile, dtype)
            teacher = TeacherRows.of(t_rows, t_cols, teacher_scale, tile, dtype)
            weighted = _teacher_weighted_logits(rows, cols, scale, row_max, teacher, tile, dtype)
            contrastive.append((row_max - pos + log_sum).mean())
            distill.append((log_sum - weighted).mean())
            saved += [row_max, log_sum, teacher.row_max, teacher.log_sum]
        ctx.save_for_backward(
            image_rows, text_rows, image_cols, text_cols, logit_scale, teacher_image_rows, teacher_text_rows,
            teacher_image_cols, teacher_text_cols, teacher_logit_scale, *saved,
        )  # fmt: skip
        ctx.row_offset, ctx.tile, ctx.dtype = row_offset, tile, dtype
        dtype_out = out_dtype(logit_scale, image_rows)
        return (0.5 * (contrastive[0] + contrastive[1])).to(dtype_out), (0.5 * (distill[0] + distill[1])).to(
            dtype_out
        )

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_contrastive: torch.Tensor, grad_distill: torch.Tensor):  # type: ignore[override]
        (ir, tr, ic, tc, logit_scale, t_ir, t_tr, t_ic, t_tc, t_scale_in, *saved) = ctx.saved_tensors
        dtype, tile, offset = ctx.dtype, ctx.tile, ctx.row_offset
        need = ctx.needs_input_grad
        scale, teacher_scale = scalar(logit_scale, dtype), scalar(t_scale_in, dtype)
        half_mean = 0.5 / ir.shape[0]
        coef = grad_contrastive.detach().reshape(()).to(dtype) * half_mean
        coef_t = grad_distill.detach().reshape(()).to(dtype) * half_mean

        inputs = (ir, tr, ic, tc)
        accs = acc_ir, acc_tr, acc_ic, acc_tc = two_way_accumulators(dtype, inputs, need)
        for (rows, cols, t_rows, t_cols, acc_rows, acc_cols), (row_max, log_sum, t_max, t_log_sum) in zip(
            ((ir, tc, t_ir, t_tc, acc_ir, acc_tc), (tr, ic, t_tr, t_ic, acc_tr, acc_ic)),
            (saved[:4], saved[4:]),
        ):
            if acc_rows is None and acc_cols is None:
                continue
            teacher = TeacherRows(t_rows, t_cols, teacher_scale, t_max, t_log_sum, coef_t)
            row_grad_accumulate(
                rows, cols, row_max, log_sum, scale, coef, offset, tile, dtype, acc_rows, acc_cols, teacher
            )
        return (*two_way_grads(inputs, accs, logit_scale, scale, dtype, need), *([None] * 7))


def distill_clip_loss_tiled(
    image_rows: torch.Tensor,
    text_rows: torch.Tensor,
    image_cols: torch.Tensor,
    text_cols: torch.Tensor,
    logit_scale: torch.Tensor,
    teacher_image_rows: torch.Tensor,
    teacher_text_rows: torch.Tensor,
    teacher_image_cols: torch.Tensor,
    teacher_text_cols: torch.Tensor,
    teacher_logit_scale: torch.Tensor,
    row_offset: int = 0,
    tile_size: int = DEFAULT_TILE_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """open_clip's ``DistillClipLoss`` (contrastive, distill) without an N x N logits matrix.

    contrastive is ``clip_loss_tiled`` of the student; distill is
    ``0.5 * (D(t_image_rows @ t_text_cols.T, image_rows @ text_cols.T) + D(text direction))`` with
    ``D(t, s) = mean_i -sum_j softmax(t_scale * t)_ij log_softmax(s_scale * s)_ij``: the teacher's own
    ``teacher_logit_scale`` scales the teacher's logits. Per row it needs the log-sum-exp of the teacher and
    of the student, then ``sum_j p_t(ij) s_ij``, all block by block, so memory stays O(tile^2 + N) beyond
    the inputs; the teacher's embeddings may have another width than the student's. Rows, columns and
    ``row_offset`` as in ``clip_loss_tiled`` (the teacher's rows and columns are split the same way).
    Gradients flow to the student's embeddings and scale only (the teacher's are detached).
    """
    rows = {"image_rows": image_rows, "text_rows": text_rows}
    cols = {"image_cols": image_cols, "text_cols": text_cols}
    check_common(rows, cols, {"logit_scale": logit_scale}, row_offset, tile_size)
    t_rows = {"teacher_image_rows": teacher_image_rows, "teacher_text_rows": teacher_text_rows}
    t_cols = {"teacher_image_cols": teacher_image_cols, "teacher_text_cols": teacher_text_cols}
    check_common(t_rows, t_cols, {"teacher_logit_scale": teacher_logit_scale}, row_offset, tile_size)
    if (teacher_image_rows.shape[0], teacher_image_cols.shape[0]) != (
        image_rows.shape[0],
        image_cols.shape[0],
    ):
        raise ValueError(
            f"teacher rows/columns {teacher_image_rows.shape[0]}/{teacher_image_cols.shape[0]} differ from the "
            f"student's {image_rows.shape[0]}/{image_cols.shape[0]}"
        )
    teacher = (t.detach() for t in (*t_rows.values(), *t_cols.values(), teacher_logit_scale))
    return _DistillTiled.apply(
        image_rows, text_rows, image_cols, text_cols, logit_scale, *teacher, row_offset, tile_size
    )
