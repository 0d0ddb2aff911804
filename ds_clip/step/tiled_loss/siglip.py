"""open_clip's ``SigLipLoss`` chunked: softplus summed block by block in the forward, sigmoid - onehot
pushed into the embeddings block by block in the backward."""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from ds_clip.step.tiled_loss.blocks import (
    DEFAULT_TILE_SIZE,
    EXP_FLOOR_ABS,
    blocks,
    check_common,
    compute_dtype,
    diagonal,
    dot,
    exp_,
    finish,
    out_dtype,
    scalar,
)


class _SiglipChunked(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        image_rows: torch.Tensor,
        text_cols: torch.Tensor,
        logit_scale: torch.Tensor,
        logit_bias: torch.Tensor,
        row_offset: int,
        tile: int,
    ) -> torch.Tensor:
        dtype = compute_dtype(image_rows, text_cols, logit_scale, logit_bias)
        scale, bias = scalar(logit_scale, dtype), scalar(logit_bias, dtype)
        # The scalar total is accumulated in float64 so that thousands of block sums lose nothing.
        total = torch.zeros((), dtype=torch.float64, device=image_rows.device)
        for b in blocks(image_rows, text_cols, scale, tile, dtype, row_offset, bias):
            logits = b.logits
            # -logsigmoid(-x) = softplus(x) for negatives; a positive adds -logsigmoid(x) =
            # softplus(x) - x, so: sum softplus over the block, minus the positive logits.
            if b.positives is not None:
                total -= diagonal(logits, b.positives).sum(dtype=torch.float64)
            # softplus(x) = max(x, 0) + log1p(exp(-|x|)), in place: one block of memory.
            total += logits.clamp_min(0).sum(dtype=torch.float64)
            total += exp_(logits.abs_().neg_()).log1p_().sum(dtype=torch.float64)
        ctx.save_for_backward(image_rows, text_cols, logit_scale, logit_bias)
        ctx.row_offset, ctx.tile, ctx.dtype = row_offset, tile, dtype
        return total.to(out_dtype(logit_scale, image_rows))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        image_rows, text_cols, logit_scale, logit_bias = ctx.saved_tensors
        dtype, tile, offset = ctx.dtype, ctx.tile, ctx.row_offset
        need = ctx.needs_input_grad
        scale, bias = scalar(logit_scale, dtype), scalar(logit_bias, dtype)
        coef = grad_out.detach().reshape(()).to(dtype)
        acc_x = (
            torch.zeros(image_rows.shape, dtype=dtype, device=image_rows.device)
            if need[0] or need[2]
            else None
        )
        acc_y = torch.zeros(text_cols.shape, dtype=dtype, device=text_cols.device) if need[1] else None
        grad_bias = torch.zeros((), dtype=torch.float64, device=image_rows.device)
        for b in blocks(image_rows, text_cols, scale, tile, dtype, offset, bias):
            # d/dx of -logsigmoid(z x) = -z sigmoid(-z x) = sigmoid(x) - [z = +1].
            grad = b.logits.clamp_(-EXP_FLOOR_ABS, EXP_FLOOR_ABS).sigmoid_()
            if b.positives is not None:
                diagonal(grad, b.positives).sub_(1.0)
            grad.mul_(coef)
            if need[3]:
                grad_bias += grad.sum(dtype=torch.float64)
            if acc_x is not None:
                acc_x[b.r0 : b.r1].addmm_(grad, b.cols)
            if acc_y is not None:
                acc_y[b.c0 : b.c1].addmm_(grad.T, b.rows)
        grad_scale = None
        if need[2]:
            grad_scale = dot(image_rows, acc_x, dtype).reshape(logit_scale.shape).to(logit_scale.dtype)
        return (
            finish(acc_x, scale, image_rows, need[0]),
            finish(acc_y, scale, text_cols, need[1]),
            grad_scale,
            grad_bias.reshape(logit_bias.shape).to(logit_bias.dtype) if need[3] else None,
            None,
            None,
        )


def siglip_loss_chunked(
    image_rows: torch.Tensor,
    text_cols: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor,
    row_offset: int = 0,
    tile_size: int = DEFAULT_TILE_SIZE,
) -> torch.Tensor:
    """Sum over rows i and all columns j of ``-logsigmoid(z_ij * (s * x_i . y_j + b))``, without the
    R x N logits matrix; ``z_ij = +1`` if ``j == row_offset + i`` else -1.

    The caller divides by its normaliser: in one process ``open_clip.SigLipLoss()(x, y, s, b)`` equals
    ``siglip_loss_chunked(x, y, s, b) / N``. Gradients flow to x, y, scale and bias.
    """
    check_common(
        {"image_rows": image_rows},
        {"text_cols": text_cols},
        {"logit_scale": logit_scale, "logit_bias": logit_bias},
        row_offset,
        tile_size,
    )
    return _SiglipChunked.apply(image_rows, text_cols, logit_scale, logit_bias, row_offset, tile_size)
