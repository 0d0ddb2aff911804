"""Row-wise softmax over blocks of ``scale * rows @ cols.T``: the online log-sum-exp of each row (the
forward of CLIP and distillation), the gradient of softmax - onehot pushed into the embeddings block by
block (their backward), and the teacher's softmax recomputed one block at a time (distillation)."""

from __future__ import annotations

import torch

from ds_clip.step.tiled_loss.blocks import blocks, diagonal, exp_, online_lse_update


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
    n_rows, device = rows.shape[0], rows.device
    row_max = torch.full((n_rows,), float("-inf"), dtype=dtype, device=device)
    run_sum = torch.zeros(n_rows, dtype=dtype, device=device)
    pos = torch.empty(n_rows, dtype=dtype, device=device)
    for b in blocks(rows, cols, scale, tile, dtype, row_offset):
        logits, r0, r1 = b.logits, b.r0, b.r1
        if b.positives is not None:
            # Taken from the very block the LSE sees, so loss = lse - pos is consistent.
            r, _, count = b.positives
            pos[r0 + r : r0 + r + count] = diagonal(logits, b.positives)
        online_lse_update(
            row_max[r0:r1], run_sum[r0:r1], logits.amax(dim=1),
            lambda new_max: exp_(logits.sub_(new_max[:, None])).sum(dim=1),  # noqa: B023 (called at once)
        )  # fmt: skip
    return row_max, run_sum.log_(), pos


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
    for b in blocks(rows, cols, scale, tile, dtype, row_offset):
        r0, r1, c0, c1, probs = b.r0, b.r1, b.c0, b.c1, b.logits
        exp_(probs.sub_(row_max[r0:r1, None]).sub_(log_sum[r0:r1, None]))
        if teacher is not None:
            teacher_probs = teacher.probs(r0, r1, c0, c1, dtype)
            probs.mul_(coef + teacher.coef).sub_(teacher_probs.mul_(teacher.coef))
            del teacher_probs
            if b.positives is not None:
                diagonal(probs, b.positives).sub_(coef)
        else:
            if b.positives is not None:
                diagonal(probs, b.positives).sub_(1.0)
            probs.mul_(coef)
        if acc_rows is not None:
            acc_rows[r0:r1].addmm_(probs, b.cols)
        if acc_cols is not None:
            acc_cols[c0:c1].addmm_(probs.T, b.rows)


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
