"""open_clip's ``ClipLoss`` blockwise: rows against all columns (local loss), and the global case where the
rows are the columns and one block serves both directions."""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from ds_clip.step.tiled_loss.blocks import (
    DEFAULT_TILE_SIZE,
    blocks,
    check_common,
    compute_dtype,
    diagonal,
    dot,
    exp_,
    finish,
    online_lse_update,
    out_dtype,
    scalar,
    two_way_accumulators,
    two_way_grads,
)
from ds_clip.step.tiled_loss.softmax import row_grad_accumulate, row_lse


class _ClipTiled(torch.autograd.Function):
    """General case: rows against all columns, row i's positive at column row_offset + i."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        image_rows: torch.Tensor,
        text_rows: torch.Tensor,
        image_cols: torch.Tensor,
        text_cols: torch.Tensor,
        logit_scale: torch.Tensor,
        row_offset: int,
        tile: int,
    ) -> torch.Tensor:
        dtype = compute_dtype(image_rows, text_rows, image_cols, text_cols, logit_scale)
        scale = scalar(logit_scale, dtype)
        max_i, log_sum_i, pos_i = row_lse(image_rows, text_cols, scale, row_offset, tile, dtype)
        max_t, log_sum_t, pos_t = row_lse(text_rows, image_cols, scale, row_offset, tile, dtype)
        ctx.save_for_backward(
            image_rows, text_rows, image_cols, text_cols, logit_scale, max_i, log_sum_i, max_t, log_sum_t
        )
        ctx.row_offset, ctx.tile, ctx.dtype = row_offset, tile, dtype
        loss = 0.5 * ((max_i - pos_i + log_sum_i).mean() + (max_t - pos_t + log_sum_t).mean())
        return loss.to(out_dtype(logit_scale, image_rows))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        (image_rows, text_rows, image_cols, text_cols, logit_scale, max_i, log_sum_i, max_t, log_sum_t) = (
            ctx.saved_tensors
        )
        dtype, tile, offset = ctx.dtype, ctx.tile, ctx.row_offset
        need = ctx.needs_input_grad
        scale = scalar(logit_scale, dtype)
        coef = grad_out.detach().reshape(()).to(dtype) * (0.5 / image_rows.shape[0])

        inputs = (image_rows, text_rows, image_cols, text_cols)
        accs = acc_ir, acc_tr, acc_ic, acc_tc = two_way_accumulators(dtype, inputs, need)
        if acc_ir is not None or acc_tc is not None:
            row_grad_accumulate(
                image_rows, text_cols, max_i, log_sum_i, scale, coef, offset, tile, dtype, acc_ir, acc_tc
            )
        if acc_tr is not None or acc_ic is not None:
            row_grad_accumulate(
                text_rows, image_cols, max_t, log_sum_t, scale, coef, offset, tile, dtype, acc_tr, acc_ic
            )
        return (*two_way_grads(inputs, accs, logit_scale, scale, dtype, need), None, None)


class _ClipTiledGlobal(torch.autograd.Function):
    """Rows are the columns (global loss): logits_per_text is the transpose of logits_per_image, so
    one block serves both directions (a column-wise online LSE for text->image) and the loss costs
    one matmul per block in forward and three in backward instead of two and six."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor, tile: int
    ) -> torch.Tensor:
        dtype = compute_dtype(image, text, logit_scale)
        scale = scalar(logit_scale, dtype)
        n, device = image.shape[0], image.device
        max_i = torch.full((n,), float("-inf"), dtype=dtype, device=device)
        sum_i = torch.zeros(n, dtype=dtype, device=device)
        pos = torch.empty(n, dtype=dtype, device=device)
        col_max = torch.full((n,), float("-inf"), dtype=dtype, device=device)
        col_sum = torch.zeros(n, dtype=dtype, device=device)
        for b in blocks(image, text, scale, tile, dtype):
            logits, r0, r1, c0, c1 = b.logits, b.r0, b.r1, b.c0, b.c1
            if b.positives is not None:
                r, _, count = b.positives
                pos[r0 + r : r0 + r + count] = diagonal(logits, b.positives)
            # text -> image direction: column j of this block is part of row j of logits_per_text.
            online_lse_update(
                col_max[c0:c1], col_sum[c0:c1], logits.amax(dim=0),
                lambda new_max: exp_(logits - new_max).sum(dim=0),  # noqa: B023 (called at once)
            )  # fmt: skip
            # image -> text direction, in place (the block is not needed afterwards).
            online_lse_update(
                max_i[r0:r1], sum_i[r0:r1], logits.amax(dim=1),
                lambda new_max: exp_(logits.sub_(new_max[:, None])).sum(dim=1),  # noqa: B023
            )  # fmt: skip
        log_sum_i = sum_i.log_()
        log_sum_t = col_sum.log()
        # Max and log-sum kept apart for precision, see row_lse.
        ctx.save_for_backward(image, text, logit_scale, max_i, log_sum_i, col_max, log_sum_t)
        ctx.tile, ctx.dtype = tile, dtype
        loss = 0.5 * ((max_i - pos + log_sum_i).mean() + (col_max - pos + log_sum_t).mean())
        return loss.to(out_dtype(logit_scale, image))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        image, text, logit_scale, max_i, log_sum_i, max_t, log_sum_t = ctx.saved_tensors
        dtype, tile = ctx.dtype, ctx.tile
        need = ctx.needs_input_grad
        scale = scalar(logit_scale, dtype)
        n = image.shape[0]
        coef = grad_out.detach().reshape(()).to(dtype) * (0.5 / n)
        acc_i = torch.zeros(image.shape, dtype=dtype, device=image.device) if need[0] or need[2] else None
        acc_t = torch.zeros(text.shape, dtype=dtype, device=text.device) if need[1] else None
        for b in blocks(image, text, scale, tile, dtype):
            logits, r0, r1, c0, c1 = b.logits, b.r0, b.r1, b.c0, b.c1
            # G = coef * (softmax_rows + softmax_cols - 2 * onehot): both directions at once.
            probs_t = exp_((logits - max_t[None, c0:c1]).sub_(log_sum_t[None, c0:c1]))
            probs = exp_(logits.sub_(max_i[r0:r1, None]).sub_(log_sum_i[r0:r1, None])).add_(probs_t)
            del probs_t
            if b.positives is not None:
                diagonal(probs, b.positives).sub_(2.0)
            probs.mul_(coef)
            if acc_i is not None:
                acc_i[r0:r1].addmm_(probs, b.cols)
            if acc_t is not None:
                acc_t[c0:c1].addmm_(probs.T, b.rows)
        grad_scale = None
        if need[2]:
            grad_scale = dot(image, acc_i, dtype).reshape(logit_scale.shape).to(logit_scale.dtype)
        return (
            finish(acc_i, scale, image, need[0]),
            finish(acc_t, scale, text, need[1]),
            grad_scale,
            None,
        )


def clip_loss_tiled(
    image_rows: torch.Tensor,
    text_rows: torch.Tensor,
    image_cols: torch.Tensor,
    text_cols: torch.Tensor,
    logit_scale: torch.Tensor,
    row_offset: int = 0,
    tile_size: int = DEFAULT_TILE_SIZE,
) -> torch.Tensor:
    """open_clip's ``ClipLoss`` value without the N x N logits matrix.

    Returns ``0.5 * (CE(s * image_rows @ text_cols.T, y) + CE(s * text_rows @ image_cols.T, y))`` with
    ``y_i = row_offset + i`` and CE the mean over the R rows; ``s = logit_scale`` is the already
    exponentiated scale (shape [] or [1]). Global loss: rows are cols (the same tensors), offset 0.
    Local loss: rows = this rank's slice, cols = all gathered features, offset = rank * R.

    Memory beyond inputs and fp32 gradients: about two ``tile_size x tile_size`` blocks (three in
    backward of the global case) plus O(N) vectors. Gradients flow to all five tensors.
    """
    rows = {"image_rows": image_rows, "text_rows": text_rows}
    cols = {"image_cols": image_cols, "text_cols": text_cols}
    check_common(rows, cols, {"logit_scale": logit_scale}, row_offset, tile_size)
    if image_rows is image_cols and text_rows is text_cols and row_offset == 0:
        # Same tensors: returning their grads once is the sum autograd would form from two slots.
        return _ClipTiledGlobal.apply(image_cols, text_cols, logit_scale, tile_size)
    return _ClipTiled.apply(image_rows, text_rows, image_cols, text_cols, logit_scale, row_offset, tile_size)
