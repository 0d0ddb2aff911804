"""CoCa's captioning term, split-invariant: the cross-entropy of the decoder's next-token logits, summed over
the non-pad tokens of every micro-batch on every rank and divided by the non-pad token count of the whole
global batch.

open_clip's ``CoCaLoss`` = ``clip_loss_weight`` x ``ClipLoss`` + ``caption_loss_weight`` x
``CrossEntropyLoss(ignore_index=pad_id)(logits.permute(0, 2, 1), labels)``: a mean over the non-pad tokens of
the batch it sees. ds_clip trains what that class returns for the WHOLE N-pair batch in one process: the
caption mean is over all N captions' tokens. A mean of per-micro-batch (or per-rank) means would weigh a
token of a short caption's batch more than one of a long caption's batch, and change with W, k and m.

How the step uses it (``ds_clip.step``): the cache pass computes each micro-batch's token-loss sum and
token count (micro-batch 0 with its kept graph, the others under no_grad: their decoder runs in that
forward anyway); one all-reduce of [sum, count] gives the global count (the normaliser) and the logged
value, and lets the non-finite guard see the caption term before any backward. The recompute pass
backpropagates ``caption_grad_coef x (token-loss sum of micro-batch j)``. The term is per sample, so it
needs no cache; nothing of it is kept across micro-batches (open_clip's accumulation keeps the k
micro-batches' decoder logits alive, k x m x L x V floats).

The cross-entropy runs in fp32 chunks of rows (``chunked_token_loss_sum``): the logits stay in the model's
dtype, and neither the forward nor the backward materialises an fp32 copy of all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_clip.distributed import all_reduce_sum

# Elements of one fp32 chunk of logits (rows x vocabulary): 2^24 floats = 64 MiB, ~340 rows of open_clip's
# 49408-token vocabulary.
CHUNK_ELEMENTS = 2**24


class _ChunkedTokenLossSum(torch.autograd.Function):
    """Σ over non-ignored rows of -log softmax(logits)[label], fp32 chunk by chunk.

    Saves the logits as they are (model dtype) and one fp32 log-sum-exp per row; the backward writes
    softmax - onehot chunk by chunk into a gradient of the logits' dtype.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, rows: int):
        vocab = logits.shape[-1]
        flat, lab = logits.reshape(-1, vocab), labels.reshape(-1)
        keep = lab != ignore_index
        safe = torch.where(keep, lab, torch.zeros_like(lab))
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        lses = []
        for s in range(0, flat.shape[0], rows):
            x = flat[s : s + rows].float()
            lse = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, safe[s : s + rows, None]).squeeze(1)
            total = total + ((lse - picked) * keep[s : s + rows]).sum()
            lses.append(lse)
        ctx.save_for_backward(logits, safe, keep, torch.cat(lses) if lses else flat.new_zeros(0).float())
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, safe, keep, lse = ctx.saved_tensors
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        grad = torch.empty_like(flat)
        rows = ctx.rows
        for s in range(0, flat.shape[0], rows):
            p = (flat[s : s + rows].float() - lse[s : s + rows, None]).exp_()
            p.scatter_add_(1, safe[s : s + rows, None], -torch.ones_like(p[:, :1]))
            p.mul_((keep[s : s + rows].float() * grad_total)[:, None])
            grad[s : s + rows] = p.to(grad.dtype)
        return grad.view_as(logits), None, None, None


def chunked_token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """fp32 sum of the per-token cross-entropy of ``logits`` [..., V] against ``labels`` [...], tokens equal
    to ``ignore_index`` left out: ``F.cross_entropy(..., ignore_index=..., reduction="sum")`` in fp32
    without an fp32 copy of the logits."""
    rows = max(1, chunk_elements // max(1, logits.shape[-1]))
    return _ChunkedTokenLossSum.apply(logits, labels, ignore_index, rows)


def is_captioning(model) -> bool:
    """An open_clip CoCa (a text decoder whose forward returns ``logits`` and ``labels``)."""
    import open_clip

    return isinstance(model, open_clip.CoCa)


def caption_loss_for(model, *, caption_weight: float, contrastive_weight: float, siglip: bool):
    """The caption objective of a CoCa model (None for other models, and with --siglip, which the step then
    refuses by name: open_clip's CoCa objective is contrastive CLIP + caption)."""
    if not is_captioning(model) or siglip:
        return None
    return CaptionLoss(
        caption_weight=caption_weight, contrastive_weight=contrastive_weight, pad_id=int(model.pad_id)
    )


@dataclass(frozen=True)
class CaptionLoss:
    """The CoCa objective's weights and pad id (open_clip's ``CoCaLoss`` arguments)."""

    caption_weight: float = 2.0
    """--coca-caption-loss-weight."""
    contrastive_weight: float = 1.0
    """--coca-contrastive-loss-weight: scales the contrastive term (its value and all its gradients)."""
    pad_id: int = 0
    """Token id that is not a target (the model's ``pad_id``; open_clip's tokenizer pads with 0)."""
    chunk_elements: int = CHUNK_ELEMENTS

    def sum_and_count(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
        """[token-loss sum, non-pad token count] of one micro-batch's forward output (fp64, on the output's
        device; differentiable in the sum when the forward was)."""
        logits, labels = out["logits"], out["labels"]
        total = chunked_token_loss_sum(logits, labels, self.pad_id, self.chunk_elements)
        count = (labels != self.pad_id).sum()
        return torch.stack([total.double(), count.double()])

    def token_loss_sum(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
        return chunked_token_loss_sum(out["logits"], out["labels"], self.pad_id, self.chunk_elements)

    @staticmethod
    def global_sum_and_count(parts: list[torch.Tensor]) -> torch.Tensor:
        """Σ over this rank's micro-batches, then over ranks (one 2-element all-reduce, on the device; no
        host sync). Every rank calls it."""
        local = torch.stack([p.detach() for p in parts]).sum(0)
        return all_reduce_sum(local)

    def value(self, global_sum_and_count: torch.Tensor) -> torch.Tensor:
        """The weighted caption term of the whole batch: weight x (token-loss sum / token count)."""
        total, count = global_sum_and_count.unbind()
        return (self.caption_weight * total / count.clamp(min=1)).float()

    def grad_coef(self, global_sum_and_count: torch.Tensor, world_size: int) -> torch.Tensor:
        """Factor on a micro-batch's token-loss sum in its surrogate: weight / (global token count), times W
        to undo DeepSpeed's average over ranks (each rank pushes only its own captions' part, as for the
        encoder term of the plain global gather in ``ds_clip.step.loss``)."""
        count = global_sum_and_count[1].clamp(min=1)
        return (self.caption_weight * world_size / count).float()
