"""Block arithmetic shared by the tiled losses: the tile spans, where the positives fall in a block, the
floored in-place exp, the compute dtype, the fp32 gradient accumulators and the input checks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

DEFAULT_TILE_SIZE = 4096


# exp() of arguments below about -87 yields fp32 denormals or underflows, and the CPU kernels take a
# slow path there (measured: 14 ms instead of 0.2 ms for a 512 x 512 block whose entries lie near
# -90). Flooring the argument at -80 changes each result by less than exp(-80) = 1.8e-35, far below
# fp32 resolution of any sum it enters (every softmax row holds an exp(0) = 1).
EXP_FLOOR_ABS = 80.0


def exp_(t: torch.Tensor) -> torch.Tensor:
    """In-place exp with the argument floored at -80 (see EXP_FLOOR_ABS)."""
    return t.clamp_min_(-EXP_FLOOR_ABS).exp_()


def spans(n: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile, n)) for start in range(0, n, tile)]


@dataclass
class Block:
    """One tile of ``scale * rows @ cols.T (+ bias)``: rows r0:r1 against columns c0:c1."""

    r0: int
    r1: int
    c0: int
    c1: int
    rows: torch.Tensor
    """rows[r0:r1] in the compute dtype."""
    cols: torch.Tensor
    """cols[c0:c1] in the compute dtype."""
    logits: torch.Tensor
    """A fresh tensor: the loop that receives it may change it in place."""
    positives: tuple[int, int, int] | None
    """Where the positives fall in it (``positive_span``), or None."""


def blocks(
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    tile: int,
    dtype: torch.dtype,
    row_offset: int = 0,
    bias: torch.Tensor | None = None,
) -> Iterator[Block]:
    """The one block loop of every tiled loss (CLIP, SigLIP, distillation; forward and backward): row tiles in
    order, and within each the column tiles in order, each block computed as ``(rows @ cols.T) * scale (+ bias)``
    in ``dtype``. Only one block is alive at a time (plus the one being computed)."""
    for r0, r1 in spans(rows.shape[0], tile):
        row_block = rows[r0:r1].to(dtype)
        for c0, c1 in spans(cols.shape[0], tile):
            col_block = cols[c0:c1].to(dtype)
            logits = row_block @ col_block.T
            logits.mul_(scale)
            if bias is not None:
                logits.add_(bias)
            yield Block(
                r0, r1, c0, c1, row_block, col_block, logits, positive_span(r0, r1, c0, c1, row_offset)
            )


def online_lse_update(
    run_max: torch.Tensor, run_sum: torch.Tensor, block_max: torch.Tensor, shifted_exp_sum
) -> torch.Tensor:
    """One step of the online log-sum-exp over a slice of rows (or columns): rescale the running sum to the new
    max (exp(-inf) = 0 on the first block), add the block's ``shifted_exp_sum(new_max)``, store the new max in
    place. Returns the new max."""
    new_max = torch.maximum(run_max, block_max)
    run_sum.mul_(torch.exp(run_max - new_max))
    run_sum.add_(shifted_exp_sum(new_max))
    run_max.copy_(new_max)
    return new_max


def positive_span(
    row_start: int, row_end: int, col_start: int, col_end: int, row_offset: int
) -> tuple[int, int, int] | None:
    """Where the positives (column = row_offset + row) fall in a block: (first row, first column, count)
    in block coordinates, or None. Positives of consecutive rows form one diagonal segment."""
    lo = max(row_start, col_start - row_offset)
    hi = min(row_end, col_end - row_offset)
    if hi <= lo:
        return None
    return lo - row_start, lo + row_offset - col_start, hi - lo


def diagonal(block: torch.Tensor, span: tuple[int, int, int]) -> torch.Tensor:
    """A writable view of the positive entries of ``block`` (see ``positive_span``)."""
    r0, c0, n = span
    return block[r0 : r0 + n, c0 : c0 + n].diagonal()


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least fp32 (bf16/fp16 inputs are never accumulated in low precision); float64 stays float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def scalar(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A 0-dim tensor, not a Python float: no device sync on GPU.
    return t.detach().reshape(()).to(dtype)


def out_dtype(logit_scale: torch.Tensor, features: torch.Tensor) -> torch.dtype:
    # Like open_clip: the loss has the dtype that scale * features @ features.T would have.
    return torch.promote_types(logit_scale.dtype, features.dtype)


def dot(features: torch.Tensor, acc: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    assert acc is not None
    return torch.vdot(features.to(dtype).reshape(-1), acc.reshape(-1))


def acc_like(dtype: torch.dtype, t: torch.Tensor, needed: bool) -> torch.Tensor | None:
    """A zero gradient accumulator shaped like ``t`` in the compute dtype, or None where no gradient is needed."""
    return torch.zeros(t.shape, dtype=dtype, device=t.device) if needed else None


def finish(
    acc: torch.Tensor | None, scale: torch.Tensor, like: torch.Tensor, needed: bool
) -> torch.Tensor | None:
    if not needed or acc is None:
        return None
    return acc.mul_(scale).to(like.dtype)


def two_way_accumulators(
    dtype: torch.dtype, inputs: tuple[torch.Tensor, ...], need: tuple[bool, ...]
) -> tuple[torch.Tensor | None, ...]:
    """The fp32 gradient accumulators of (image_rows, text_rows, image_cols, text_cols) of a loss over both
    directions; ``need`` is ``ctx.needs_input_grad`` with the scale at index 4. The row accumulators also give
    d scale, so they are built when the scale needs a gradient."""
    ir, tr, ic, tc = inputs
    return (
        acc_like(dtype, ir, need[0] or need[4]),
        acc_like(dtype, tr, need[1] or need[4]),
        acc_like(dtype, ic, need[2]),
        acc_like(dtype, tc, need[3]),
    )


def two_way_grads(
    inputs: tuple[torch.Tensor, ...],
    accs: tuple[torch.Tensor | None, ...],
    logit_scale: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    need: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of (image_rows, text_rows, image_cols, text_cols, logit_scale) from the accumulators of
    ``two_way_accumulators``: d loss / d scale = sum_ij G_ij * raw_ij = <rows, G @ cols> for each direction."""
    grad_scale = None
    if need[4]:
        total = dot(inputs[0], accs[0], dtype) + dot(inputs[1], accs[1], dtype)
        grad_scale = total.reshape(logit_scale.shape).to(logit_scale.dtype)
    return (*(finish(a, scale, t, n) for a, t, n in zip(accs, inputs, need[:4])), grad_scale)


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


def check_common(
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
