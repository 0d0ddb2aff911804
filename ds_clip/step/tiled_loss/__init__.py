"""Contrastive losses whose memory grows linearly in the batch: tiled CLIP, chunked SigLIP, tiled distillation.

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

The functions are pure (no communication): ``ds_clip/step/loss.py`` gathers columns across ranks and
calls them. Rows and columns may be the same tensor or columns may contain the rows (a
concatenation of gathered features): every input gets its own gradient and autograd adds them.

Modules: ``clip`` (``clip_loss_tiled``), ``siglip`` (``siglip_loss_chunked``), ``distill``
(``distill_clip_loss_tiled``) over ``softmax`` (per-row log-sum-exp and its gradient, block by block) and
``blocks`` (spans, positives, dtypes, accumulators, input checks).
"""

from ds_clip.step.tiled_loss.blocks import DEFAULT_TILE_SIZE
from ds_clip.step.tiled_loss.clip import clip_loss_tiled
from ds_clip.step.tiled_loss.distill import distill_clip_loss_tiled
from ds_clip.step.tiled_loss.siglip import siglip_loss_chunked

__all__ = ["DEFAULT_TILE_SIZE", "clip_loss_tiled", "distill_clip_loss_tiled", "siglip_loss_chunked"]
