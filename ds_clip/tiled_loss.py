"""Contrastive losses whose memory grows linearly in the batch: tiled CLIP and chunked SigLIP.

With cached-feature accumulation the batch N is no longer bounded by activations but by the
N x N logits matrix of the loss (N = 64k: 16 GiB in fp32, and open_clip keeps several of them).
These functions compute exactly open_clip's ``ClipLoss`` / ``SigLipLoss`` values and gradients
while only ever holding one or two ``tile_size x tile_size`` blocks of logits:

- forward: logits are computed block by block; CLIP keeps a running (max, sum of exp) per row,
  i.e. an online log-sum-exp, and saves only the inputs and the [R] log-sum-exp vectors; SigLIP
  sums softplus block by block and saves only the inputs.
- backward: each block of logits is recomputed, turned into d loss / d logits
  (CLIP: (softmax - onehot) * 0.5 / R; SigLIP: sigmoid - onehot) and pushed into the embedding
  gradients with two matmuls, accumulated in fp32.

Everything runs in fp32 (float64 if an input is float64, which the gradcheck tests use) whatever
the input dtype: bf16/fp16 embeddings are up-cast one block at a time, and the gradients are cast
back to each input's dtype at the end.

The functions are pure (no communication): ``ds_clip/loss.py`` gathers columns across ranks and
calls them. Rows and columns may be the same tensor or columns may contain the rows (a
concatenation of gathered features): every input gets its own gradient and autograd adds them.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

DEFAULT_TILE_SIZE = 4096


# exp() of arguments below about -87 yields fp32 denormals or underflows, and the CPU kernels take a
# slow path there (measured: 14 ms instead of 0.2 ms for a 512 x 512 block whose entries lie near
# -90). Flooring the argument at -80 changes each result by less than exp(-80) = 1.8e-35, far below
# fp32 resolution of any sum it enters (every softmax row holds an exp(0) = 1).
_EXP_FLOOR_ABS = 80.0


def _exp_(t: torch.Tensor) -> torch.Tensor:
    """In-place exp with the argument floored at -80 (see _EXP_FLOOR_ABS)."""
    return t.clamp_min_(-_EXP_FLOOR_ABS).exp_()


def _spans(n: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile, n)) for start in range(0, n, tile)]


def _positive_span(
    row_start: int, row_end: int, col_start: int, col_end: int, row_offset: int
) -> tuple[int, int, int] | None:
    """Where the positives (column = row_offset + row) fall in a block: (first row, first column, count)
    in block coordinates, or None. Positives of consecutive rows form one diagonal segment."""
    lo = max(row_start, col_start - row_offset)
    hi = min(row_end, col_end - row_offset)
    if hi <= lo:
        return None
    return lo - row_start, lo + row_offset - col_start, hi - lo


def _diagonal(block: torch.Tensor, span: tuple[int, int, int]) -> torch.Tensor:
    """A writable view of the positive entries of ``block`` (see ``_positive_span``)."""
    r0, c0, n = span
    return block[r0 : r0 + n, c0 : c0 + n].diagonal()


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least fp32 (bf16/fp16 inputs are never accumulated in low precision); float64 stays float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _scalar(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A 0-dim tensor, not a Python float: no device sync on GPU.
    return t.detach().reshape(()).to(dtype)


# --------------------------------------------------------------------------------------------- CLIP


def _row_lse(
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    row_offset: int,
    tile: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row log-sum-exp of ``scale * rows @ cols.T`` as (max, log sum exp(logits - max)), and the
    positive logit of each row.

    The two parts are kept apart on purpose: max + log-sum rounded to one fp32 number carries an
    absolute error of half an ulp of the logits (4e-6 at scale 100), which becomes a relative error
    of every softmax entry and is amplified where softmax - onehot cancels. (logits - max) - log-sum,
    the order log_softmax uses, keeps the error at open_clip's level.
    """
    n_rows = rows.shape[0]
    row_max = torch.empty(n_rows, dtype=dtype, device=rows.device)
    log_sum = torch.empty(n_rows, dtype=dtype, device=rows.device)
    pos = torch.empty(n_rows, dtype=dtype, device=rows.device)
    for r0, r1 in _spans(n_rows, tile):
        row_block = rows[r0:r1].to(dtype)
        run_max = torch.full((r1 - r0,), float("-inf"), dtype=dtype, device=rows.device)
        run_sum = torch.zeros(r1 - r0, dtype=dtype, device=rows.device)
        for c0, c1 in _spans(cols.shape[0], tile):
            logits = row_block @ cols[c0:c1].to(dtype).T
            logits.mul_(scale)
            span = _positive_span(r0, r1, c0, c1, row_offset)
            if span is not None:
                # Taken from the very block the LSE sees, so loss = lse - pos is consistent.
                pos[r0 + span[0] : r0 + span[0] + span[2]] = _diagonal(logits, span)
            new_max = torch.maximum(run_max, logits.amax(dim=1))
            # Online LSE: rescale the old sum to the new max; exp(-inf) = 0 on the first block.
            run_sum.mul_(torch.exp(run_max - new_max))
            run_sum.add_(_exp_(logits.sub_(new_max[:, None])).sum(dim=1))
            run_max = new_max
        row_max[r0:r1] = run_max
        log_sum[r0:r1] = run_sum.log()
    return row_max, log_sum, pos


def _row_grad_accumulate(
    rows: torch.Tensor,
    cols: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    scale: torch.Tensor,
    coef: torch.Tensor,
    row_offset: int,
    tile: int,
    dtype: torch.dtype,
    acc_rows: torch.Tensor | None,
    acc_cols: torch.Tensor | None,
    teacher: _TeacherRows | None = None,
) -> None:
    """Adds G @ cols to ``acc_rows`` and G.T @ rows to ``acc_cols``, G = coef * (softmax - onehot).

    With ``teacher`` (distillation): G = coef * (softmax - onehot) + coef_t * (softmax - teacher softmax),
    the gradient of contrastive + distill term with respect to the student's logits.

    The accumulators hold gradients without the factor ``scale`` (d logits / d rows = scale * cols);
    the caller multiplies once at the end and gets d scale = <rows, acc_rows> for free.
    """
    for r0, r1 in _spans(rows.shape[0], tile):
        row_block = rows[r0:r1].to(dtype)
        max_block, log_sum_block = row_max[r0:r1, None], log_sum[r0:r1, None]
        for c0, c1 in _spans(cols.shape[0], tile):
            col_block = cols[c0:c1].to(dtype)
            probs = row_block @ col_block.T
            _exp_(probs.mul_(scale).sub_(max_block).sub_(log_sum_block))
            span = _positive_span(r0, r1, c0, c1, row_offset)
            if teacher is not None:
                teacher_probs = teacher.probs(r0, r1, c0, c1, dtype)
                probs.mul_(coef + teacher.coef).sub_(teacher_probs.mul_(teacher.coef))
                del teacher_probs
                if span is not None:
                    _diagonal(probs, span).sub_(coef)
            else:
                if span is not None:
                    _diagonal(probs, span).sub_(1.0)
                probs.mul_(coef)
            if acc_rows is not None:
                acc_rows[r0:r1].addmm_(probs, col_block)
            if acc_cols is not None:
                acc_cols[c0:c1].addmm_(probs.T, row_block)


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
        dtype = _compute_dtype(image_rows, text_rows, image_cols, text_cols, logit_scale)
        scale = _scalar(logit_scale, dtype)
        max_i, log_sum_i, pos_i = _row_lse(image_rows, text_cols, scale, row_offset, tile, dtype)
        max_t, log_sum_t, pos_t = _row_lse(text_rows, image_cols, scale, row_offset, tile, dtype)
        ctx.save_for_backward(
            image_rows, text_rows, image_cols, text_cols, logit_scale, max_i, log_sum_i, max_t, log_sum_t
        )
        ctx.row_offset, ctx.tile, ctx.dtype = row_offset, tile, dtype
        loss = 0.5 * ((max_i - pos_i + log_sum_i).mean() + (max_t - pos_t + log_sum_t).mean())
        return loss.to(_out_dtype(logit_scale, image_rows))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        (image_rows, text_rows, image_cols, text_cols, logit_scale, max_i, log_sum_i, max_t, log_sum_t) = (
            ctx.saved_tensors
        )
        dtype, tile, offset = ctx.dtype, ctx.tile, ctx.row_offset
        need = ctx.needs_input_grad
        scale = _scalar(logit_scale, dtype)
        coef = grad_out.detach().reshape(()).to(dtype) * (0.5 / image_rows.shape[0])

        # The row accumulators also give d scale, so they are built when the scale needs a grad.
        acc_ir = _acc_like(dtype, image_rows, need[0] or need[4])
        acc_tr = _acc_like(dtype, text_rows, need[1] or need[4])
        acc_ic = _acc_like(dtype, image_cols, need[2])
        acc_tc = _acc_like(dtype, text_cols, need[3])
        if acc_ir is not None or acc_tc is not None:
            _row_grad_accumulate(
                image_rows, text_cols, max_i, log_sum_i, scale, coef, offset, tile, dtype, acc_ir, acc_tc
            )
        if acc_tr is not None or acc_ic is not None:
            _row_grad_accumulate(
                text_rows, image_cols, max_t, log_sum_t, scale, coef, offset, tile, dtype, acc_tr, acc_ic
            )

        grad_scale = None
        if need[4]:
            # d loss / d scale = sum_ij G_ij * raw_ij = <rows, G @ cols> for each direction.
            total = _dot(image_rows, acc_ir, dtype) + _dot(text_rows, acc_tr, dtype)
            grad_scale = total.reshape(logit_scale.shape).to(logit_scale.dtype)
        return (
            _finish(acc_ir, scale, image_rows, need[0]),
            _finish(acc_tr, scale, text_rows, need[1]),
            _finish(acc_ic, scale, image_cols, need[2]),
            _finish(acc_tc, scale, text_cols, need[3]),
            grad_scale,
            None,
            None,
        )


class _ClipTiledGlobal(torch.autograd.Function):
    """Rows are the columns (global loss): logits_per_text is the transpose of logits_per_image, so
    one block serves both directions (a column-wise online LSE for text->image) and the loss costs
    one matmul per block in forward and three in backward instead of two and six."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor, tile: int
    ) -> torch.Tensor:
        dtype = _compute_dtype(image, text, logit_scale)
        scale = _scalar(logit_scale, dtype)
        n, device = image.shape[0], image.device
        max_i = torch.empty(n, dtype=dtype, device=device)
        log_sum_i = torch.empty(n, dtype=dtype, device=device)
        pos = torch.empty(n, dtype=dtype, device=device)
        col_max = torch.full((n,), float("-inf"), dtype=dtype, device=device)
        col_sum = torch.zeros(n, dtype=dtype, device=device)
        for r0, r1 in _spans(n, tile):
            image_block = image[r0:r1].to(dtype)
            row_max = torch.full((r1 - r0,), float("-inf"), dtype=dtype, device=device)
            row_sum = torch.zeros(r1 - r0, dtype=dtype, device=device)
            for c0, c1 in _spans(n, tile):
                logits = image_block @ text[c0:c1].to(dtype).T
                logits.mul_(scale)
                span = _positive_span(r0, r1, c0, c1, 0)
                if span is not None:
                    pos[r0 + span[0] : r0 + span[0] + span[2]] = _diagonal(logits, span)
                # text -> image direction: column j of this block is part of row j of logits_per_text.
                new_col_max = torch.maximum(col_max[c0:c1], logits.amax(dim=0))
                col_sum[c0:c1].mul_(torch.exp(col_max[c0:c1] - new_col_max))
                col_sum[c0:c1].add_(_exp_(logits - new_col_max).sum(dim=0))
                col_max[c0:c1] = new_col_max
                # image -> text direction, in place (the block is not needed afterwards).
                new_row_max = torch.maximum(row_max, logits.amax(dim=1))
                row_sum.mul_(torch.exp(row_max - new_row_max))
                row_sum.add_(_exp_(logits.sub_(new_row_max[:, None])).sum(dim=1))
                row_max = new_row_max
            max_i[r0:r1] = row_max
            log_sum_i[r0:r1] = row_sum.log()
        log_sum_t = col_sum.log()
        # Max and log-sum kept apart for precision, see _row_lse.
        ctx.save_for_backward(image, text, logit_scale, max_i, log_sum_i, col_max, log_sum_t)
        ctx.tile, ctx.dtype = tile, dtype
        loss = 0.5 * ((max_i - pos + log_sum_i).mean() + (col_max - pos + log_sum_t).mean())
        return loss.to(_out_dtype(logit_scale, image))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        image, text, logit_scale, max_i, log_sum_i, max_t, log_sum_t = ctx.saved_tensors
        dtype, tile = ctx.dtype, ctx.tile
        need = ctx.needs_input_grad
        scale = _scalar(logit_scale, dtype)
        n = image.shape[0]
        coef = grad_out.detach().reshape(()).to(dtype) * (0.5 / n)
        acc_i = torch.zeros(image.shape, dtype=dtype, device=image.device) if need[0] or need[2] else None
        acc_t = torch.zeros(text.shape, dtype=dtype, device=text.device) if need[1] else None
        for r0, r1 in _spans(n, tile):
            image_block = image[r0:r1].to(dtype)
            for c0, c1 in _spans(n, tile):
                text_block = text[c0:c1].to(dtype)
                logits = image_block @ text_block.T
                logits.mul_(scale)
                # G = coef * (softmax_rows + softmax_cols - 2 * onehot): both directions at once.
                probs_t = _exp_((logits - max_t[None, c0:c1]).sub_(log_sum_t[None, c0:c1]))
                probs = _exp_(logits.sub_(max_i[r0:r1, None]).sub_(log_sum_i[r0:r1, None])).add_(probs_t)
                del probs_t
                span = _positive_span(r0, r1, c0, c1, 0)
                if span is not None:
                    _diagonal(probs, span).sub_(2.0)
                probs.mul_(coef)
                if acc_i is not None:
                    acc_i[r0:r1].addmm_(probs, text_block)
                if acc_t is not None:
                    acc_t[c0:c1].addmm_(probs.T, image_block)
        grad_scale = None
        if need[2]:
            grad_scale = _dot(image, acc_i, dtype).reshape(logit_scale.shape).to(logit_scale.dtype)
        return (
            _finish(acc_i, scale, image, need[0]),
            _finish(acc_t, scale, text, need[1]),
            grad_scale,
            None,
        )


# ------------------------------------------------------------------------------------- distillation


class _TeacherRows:
    """The teacher's side of one direction of the distillation loss: its row and column embeddings, its scale,
    and each row's log-sum-exp (max and log-sum kept apart, as in _row_lse) once they are known."""

    def __init__(
        self,
        rows: torch.Tensor,
        cols: torch.Tensor,
        scale: torch.Tensor,
        row_max: torch.Tensor,
        log_sum: torch.Tensor,
        coef: torch.Tensor | None = None,
    ) -> None:
        self.rows, self.cols, self.scale, self.row_max, self.log_sum = rows, cols, scale, row_max, log_sum
        self.coef = coef
        """Weight of the distillation term's gradient (backward only)."""

    @classmethod
    def of(
        cls, rows: torch.Tensor, cols: torch.Tensor, scale: torch.Tensor, tile: int, dtype
    ) -> _TeacherRows:
        row_max, log_sum, _ = _row_lse(rows, cols, scale, 0, tile, dtype)
        return cls(rows, cols, scale, row_max, log_sum)

    def probs(self, r0: int, r1: int, c0: int, c1: int, dtype: torch.dtype) -> torch.Tensor:
        """softmax of the teacher's logits, rows r0:r1, columns c0:c1 (a fresh block)."""
        logits = self.rows[r0:r1].to(dtype) @ self.cols[c0:c1].to(dtype).T
        return _exp_(logits.mul_(self.scale).sub_(self.row_max[r0:r1, None]).sub_(self.log_sum[r0:r1, None]))


def _teacher_weighted_logits(
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    row_max: torch.Tensor,
    teacher: _TeacherRows,
    tile: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per row i: sum_j p_t(ij) * (s_ij - max_i), with s the student's logits and p_t the teacher's softmax.

    Then the row's distillation term -sum_j p_t(ij) log_softmax(s)_ij = log_sum_i - this (sum_j p_t = 1);
    shifting by the row max keeps the summands small, as log_softmax does."""
    out = torch.zeros(rows.shape[0], dtype=dtype, device=rows.device)
    for r0, r1 in _spans(rows.shape[0], tile):
        row_block = rows[r0:r1].to(dtype)
        for c0, c1 in _spans(cols.shape[0], tile):
            logits = row_block @ cols[c0:c1].to(dtype).T
            logits.mul_(scale).sub_(row_max[r0:r1, None])
            out[r0:r1] += (teacher.probs(r0, r1, c0, c1, dtype).mul_(logits)).sum(dim=1)
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
        dtype = _compute_dtype(
            image_rows, text_rows, image_cols, text_cols, logit_scale, teacher_image_rows, teacher_text_rows,
            teacher_image_cols, teacher_text_cols, teacher_logit_scale,
        )  # fmt: skip
        scale, teacher_scale = _scalar(logit_scale, dtype), _scalar(teacher_logit_scale, dtype)
        contrastive, distill, saved = [], [], []
        for rows, cols, t_rows, t_cols in (
            (image_rows, text_cols, teacher_image_rows, teacher_text_cols),
            (text_rows, image_cols, teacher_text_rows, teacher_image_cols),
        ):
            row_max, log_sum, pos = _row_lse(rows, cols, scale, row_offset, tile, dtype)
            teacher = _TeacherRows.of(t_rows, t_cols, teacher_scale, tile, dtype)
            weighted = _teacher_weighted_logits(rows, cols, scale, row_max, teacher, tile, dtype)
            contrastive.append((row_max - pos + log_sum).mean())
            distill.append((log_sum - weighted).mean())
            saved += [row_max, log_sum, teacher.row_max, teacher.log_sum]
        ctx.save_for_backward(
            image_rows, text_rows, image_cols, text_cols, logit_scale, teacher_image_rows, teacher_text_rows,
            teacher_image_cols, teacher_text_cols, teacher_logit_scale, *saved,
        )  # fmt: skip
        ctx.row_offset, ctx.tile, ctx.dtype = row_offset, tile, dtype
        out_dtype = _out_dtype(logit_scale, image_rows)
        return (0.5 * (contrastive[0] + contrastive[1])).to(out_dtype), (0.5 * (distill[0] + distill[1])).to(
            out_dtype
        )

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_contrastive: torch.Tensor, grad_distill: torch.Tensor):  # type: ignore[override]
        (ir, tr, ic, tc, logit_scale, t_ir, t_tr, t_ic, t_tc, t_scale_in, *saved) = ctx.saved_tensors
        dtype, tile, offset = ctx.dtype, ctx.tile, ctx.row_offset
        need = ctx.needs_input_grad
        scale, teacher_scale = _scalar(logit_scale, dtype), _scalar(t_scale_in, dtype)
        half_mean = 0.5 / ir.shape[0]
        coef = grad_contrastive.detach().reshape(()).to(dtype) * half_mean
        coef_t = grad_distill.detach().reshape(()).to(dtype) * half_mean

        acc_ir = _acc_like(dtype, ir, need[0] or need[4])
        acc_tr = _acc_like(dtype, tr, need[1] or need[4])
        acc_ic = _acc_like(dtype, ic, need[2])
        acc_tc = _acc_like(dtype, tc, need[3])
        for (rows, cols, t_rows, t_cols, acc_rows, acc_cols), (row_max, log_sum, t_max, t_log_sum) in zip(
            ((ir, tc, t_ir, t_tc, acc_ir, acc_tc), (tr, ic, t_tr, t_ic, acc_tr, acc_ic)),
            (saved[:4], saved[4:]),
        ):
            if acc_rows is None and acc_cols is None:
                continue
            teacher = _TeacherRows(t_rows, t_cols, teacher_scale, t_max, t_log_sum, coef_t)
            _row_grad_accumulate(
                rows, cols, row_max, log_sum, scale, coef, offset, tile, dtype, acc_rows, acc_cols, teacher
            )
        grad_scale = None
        if need[4]:
            total = _dot(ir, acc_ir, dtype) + _dot(tr, acc_tr, dtype)
            grad_scale = total.reshape(logit_scale.shape).to(logit_scale.dtype)
        return (
            _finish(acc_ir, scale, ir, need[0]),
            _finish(acc_tr, scale, tr, need[1]),
            _finish(acc_ic, scale, ic, need[2]),
            _finish(acc_tc, scale, tc, need[3]),
            grad_scale,
            *([None] * 7),
        )


# ------------------------------------------------------------------------------------------- SigLIP


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
        dtype = _compute_dtype(image_rows, text_cols, logit_scale, logit_bias)
        scale, bias = _scalar(logit_scale, dtype), _scalar(logit_bias, dtype)
        # The scalar total is accumulated in float64 so that thousands of block sums lose nothing.
        total = torch.zeros((), dtype=torch.float64, device=image_rows.device)
        for r0, r1 in _spans(image_rows.shape[0], tile):
            row_block = image_rows[r0:r1].to(dtype)
            for c0, c1 in _spans(text_cols.shape[0], tile):
                logits = row_block @ text_cols[c0:c1].to(dtype).T
                logits.mul_(scale).add_(bias)
                # -logsigmoid(-x) = softplus(x) for negatives; a positive adds -logsigmoid(x) =
                # softplus(x) - x, so: sum softplus over the block, minus the positive logits.
                span = _positive_span(r0, r1, c0, c1, row_offset)
                if span is not None:
                    total -= _diagonal(logits, span).sum(dtype=torch.float64)
                # softplus(x) = max(x, 0) + log1p(exp(-|x|)), in place: one block of memory.
                total += logits.clamp_min(0).sum(dtype=torch.float64)
                total += _exp_(logits.abs_().neg_()).log1p_().sum(dtype=torch.float64)
        ctx.save_for_backward(image_rows, text_cols, logit_scale, logit_bias)
        ctx.row_offset, ctx.tile, ctx.dtype = row_offset, tile, dtype
        return total.to(_out_dtype(logit_scale, image_rows))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        image_rows, text_cols, logit_scale, logit_bias = ctx.saved_tensors
        dtype, tile, offset = ctx.dtype, ctx.tile, ctx.row_offset
        need = ctx.needs_input_grad
        scale, bias = _scalar(logit_scale, dtype), _scalar(logit_bias, dtype)
        coef = grad_out.detach().reshape(()).to(dtype)
        acc_x = (
            torch.zeros(image_rows.shape, dtype=dtype, device=image_rows.device)
            if need[0] or need[2]
            else None
        )
        acc_y = torch.zeros(text_cols.shape, dtype=dtype, device=text_cols.device) if need[1] else None
        grad_bias = torch.zeros((), dtype=torch.float64, device=image_rows.device)
        for r0, r1 in _spans(image_rows.shape[0], tile):
            row_block = image_rows[r0:r1].to(dtype)
            for c0, c1 in _spans(text_cols.shape[0], tile):
                col_block = text_cols[c0:c1].to(dtype)
                # d/dx of -logsigmoid(z x) = -z sigmoid(-z x) = sigmoid(x) - [z = +1].
                grad = row_block @ col_block.T
                grad.mul_(scale).add_(bias).clamp_(-_EXP_FLOOR_ABS, _EXP_FLOOR_ABS).sigmoid_()
                span = _positive_span(r0, r1, c0, c1, offset)
                if span is not None:
                    _diagonal(grad, span).sub_(1.0)
                grad.mul_(coef)
                if need[3]:
                    grad_bias += grad.sum(dtype=torch.float64)
                if acc_x is not None:
                    acc_x[r0:r1].addmm_(grad, col_block)
                if acc_y is not None:
                    acc_y[c0:c1].addmm_(grad.T, row_block)
        grad_scale = None
        if need[2]:
            grad_scale = _dot(image_rows, acc_x, dtype).reshape(logit_scale.shape).to(logit_scale.dtype)
        return (
            _finish(acc_x, scale, image_rows, need[0]),
            _finish(acc_y, scale, text_cols, need[1]),
            grad_scale,
            grad_bias.reshape(logit_bias.shape).to(logit_bias.dtype) if need[3] else None,
            None,
            None,
        )


# ------------------------------------------------------------------------------------------ helpers


def _out_dtype(logit_scale: torch.Tensor, features: torch.Tensor) -> torch.dtype:
    # Like open_clip: the loss has the dtype that scale * features @ features.T would have.
    return torch.promote_types(logit_scale.dtype, features.dtype)


def _dot(features: torch.Tensor, acc: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    assert acc is not None
    return torch.vdot(features.to(dtype).reshape(-1), acc.reshape(-1))


def _acc_like(dtype: torch.dtype, t: torch.Tensor, needed: bool) -> torch.Tensor | None:
    """A zero gradient accumulator shaped like ``t`` in the compute dtype, or None where no gradient is needed."""
    return torch.zeros(t.shape, dtype=dtype, device=t.device) if needed else None


def _finish(
    acc: torch.Tensor | None, scale: torch.Tensor, like: torch.Tensor, needed: bool
) -> torch.Tensor | None:
    if not needed or acc is None:
        return None
    return acc.mul_(scale).to(like.dtype)


def _check_features(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D [rows, dim] tensor, got {shape}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_scalar(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dim() > 1:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape [] or [1], got {shape}")


def _check_common(
    rows: dict[str, torch.Tensor],
    cols: dict[str, torch.Tensor],
    scalars: dict[str, torch.Tensor],
    row_offset: int,
    tile_size: int,
) -> None:
    for name, t in {**rows, **cols}.items():
        _check_features(name, t)
    for name, t in scalars.items():
        _check_scalar(name, t)
    everything = {**rows, **cols, **scalars}
    dims = {name: t.shape[1] for name, t in {**rows, **cols}.items()}
    if len(set(dims.values())) != 1:
        raise ValueError(f"feature dims differ: {dims}")
    n_rows = {name: t.shape[0] for name, t in rows.items()}
    n_cols = {name: t.shape[0] for name, t in cols.items()}
    if len(set(n_rows.values())) != 1:
        raise ValueError(f"row counts differ: {n_rows}")
    if len(set(n_cols.values())) != 1:
        raise ValueError(f"column counts differ: {n_cols}")
    devices = {name: str(t.device) for name, t in everything.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    r, n = next(iter(n_rows.values())), next(iter(n_cols.values()))
    if r == 0:
        raise ValueError("no rows: the loss of an empty batch is undefined")
    if not isinstance(row_offset, int) or row_offset < 0 or row_offset + r > n:
        raise ValueError(
            f"row_offset={row_offset} with {r} rows must satisfy 0 <= row_offset <= {n - r} ({n} columns)"
        )
    if not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"tile_size must be a positive int, got {tile_size!r}")


# --------------------------------------------------------------------------------------- public API


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
    _check_common(rows, cols, {"logit_scale": logit_scale}, row_offset, tile_size)
    if image_rows is image_cols and text_rows is text_cols and row_offset == 0:
        # Same tensors: returning their grads once is the sum autograd would form from two slots.
        return _ClipTiledGlobal.apply(image_cols, text_cols, logit_scale, tile_size)
    return _ClipTiled.apply(image_rows, text_rows, image_cols, text_cols, logit_scale, row_offset, tile_size)


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
    _check_common(
        {"image_rows": image_rows},
        {"text_cols": text_cols},
        {"logit_scale": logit_scale, "logit_bias": logit_bias},
        row_offset,
        tile_size,
    )
    return _SiglipChunked.apply(image_rows, text_cols, logit_scale, logit_bias, row_offset, tile_size)


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
    _check_common(rows, cols, {"logit_scale": logit_scale}, row_offset, tile_size)
    t_rows = {"teacher_image_rows": teacher_image_rows, "teacher_text_rows": teacher_text_rows}
    t_cols = {"teacher_image_cols": teacher_image_cols, "teacher_text_cols": teacher_text_cols}
    _check_common(t_rows, t_cols, {"teacher_logit_scale": teacher_logit_scale}, row_offset, tile_size)
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
