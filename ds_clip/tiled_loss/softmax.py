"""Row-wise softmax over blocks of ``scale * rows @ cols.T``: the online log-sum-exp of each row (the
forward of CLIP and distillation), the gradient of softmax - onehot pushed into the embeddings block by
block (their backward), and the teacher's softmax recomputed one block at a time (distillation)."""

from __future__ import annotations

import torch

from ds_clip.tiled_loss.blocks import diagonal, exp_, positive_span, spans


def row_lse(
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
    for r0, r1 in spans(n_rows, tile):
        row_block = rows[r0:r1].to(dtype)
        run_max = torch.full((r1 - r0,), float("-inf"), dtype=dtype, device=rows.device)
        run_sum = torch.zeros(r1 - r0, dtype=dtype, device=rows.device)
        for c0, c1 in spans(cols.shape[0], tile):
            logits = row_block @ cols[c0:c1].to(dtype).T
            logits.mul_(scale)
            span = positive_span(r0, r1, c0, c1, row_offset)
            if span is not None:
                # Taken from the very block the LSE sees, so loss = lse - pos is consistent.
                pos[r0 + span[0] : r0 + span[0] + span[2]] = diagonal(logits, span)
            new_max = torch.maximum(run_max, logits.amax(dim=1))
            # Online LSE: rescale the old sum to the new max; exp(-inf) = 0 on the first block.
            run_sum.mul_(torch.exp(run_max - new_max))
            run_sum.add_(exp_(logits.sub_(new_max[:, None])).sum(dim=1))
            run_max = new_max
        row_max[r0:r1] = run_max
        log_sum[r0:r1] = run_sum.log()
    return row_max, log_sum, pos


def row_grad_accumulate(
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
    teacher: TeacherRows | None = None,
) -> None:
    """Adds G @ cols to ``acc_rows`` and G.T @ rows to ``acc_cols``, G = coef * (softmax - onehot).

    With ``teacher`` (distillation): G = coef * (softmax - onehot) + coef_t * (softmax - teacher softmax),
    the gradient of contrastive + distill term with respect to the student's logits.

    The accumulators hold gradients without the factor ``scale`` (d logits / d rows = scale * cols);
    the caller multiplies once at the end and gets d scale = <rows, acc_rows> for free.
    """
    for r0, r1 in spans(rows.shape[0], tile):
        row_block = rows[r0:r1].to(dtype)
        max_block, log_sum_block = row_max[r0:r1, None], log_sum[r0:r1, None]
        for c0, c1 in spans(cols.shape[0], tile):
            col_block = cols[c0:c1].to(dtype)
            probs = row_block @ col_block.T
            exp_(probs.mul_(scale).sub_(max_block).sub_(log_sum_block))
            span = positive_span(r0, r1, c0, c1, row_offset)
            if teacher is not None:
                teacher_probs = teacher.probs(r0, r1, c0, c1, dtype)
                probs.mul_(coef + teacher.coef).sub_(teacher_probs.mul_(teacher.coef))
                del teacher_probs
                if span is not None:
                    diagonal(probs, span).sub_(coef)
            else:
                if span is not None:
                    diagonal(probs, span).sub_(1.0)
                probs.mul_(coef)
            if acc_rows is not None:
                acc_rows[r0:r1].addmm_(probs, col_block)
            if acc_cols is not None:
                acc_cols[c0:c1].addmm_(probs.T, row_block)


class TeacherRows:
    """The teacher's side of one direction of the distillation loss: its row and column embeddings, its scale,
    and each row's log-sum-exp (max and log-sum kept apart, as in row_lse) once they are known."""

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
    def of(cls, rows: torch.Tensor, cols: torch.Tensor, scale: torch.Tensor, tile: int, dtype) -> TeacherRows:
        row_max, log_sum, _ = row_lse(rows, cols, scale, 0, tile, dtype)
        return cls(rows, cols, scale, row_max, log_sum)

    def probs(self, r0: int, r1: int, c0: int, c1: int, dtype: torch.dtype) -> torch.Tensor:
        """softmax of the teacher's logits, rows r0:r1, columns c0:c1 (a fresh block)."""
        logits = self.rows[r0:r1].to(dtype) @ self.cols[c0:c1].to(dtype).T
        return exp_(logits.mul_(self.scale).sub_(self.row_max[r0:r1, None]).sub_(self.log_sum[r0:r1, None]))
