"""The trained parts SigLIP 2 adds to an open_clip SigLIP model, all under one submodule ``siglip2``: the LocCa
decoder, the two self-distillation heads and the mask token. Training-time parts: the export leaves them out.

Each part is an ``nn.Module`` whose own forward uses its parameters, so ZeRO-3 gathers them when it runs (a
parameter read outside its module's forward would be a partition, not the tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from open_clip.transformer import LayerNorm, ResidualAttentionBlock
from torch import nn
from torch.utils.checkpoint import checkpoint


class LocCaDecoder(nn.Module):
    """A transformer decoder over the image tower's un-pooled tokens (LocCa, Wan et al. 2024; SigLIP 2 Sec. 2.2):
    per layer a self-attention block (causal, or none for a parallel-prediction row) and a cross-attention block
    to the image tokens, open_clip's own blocks, as its CoCa decoder stacks them. Its token embedding and output
    layer are its own (the text tower is an encoder and is not shared)."""

    def __init__(
        self, *, vocab_size: int, context_length: int, width: int, heads: int, layers: int, image_width: int
    ) -> None:
        super().__init__()
        self.heads = heads
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, width))
        # CapPa's parallel prediction: every input position is this embedding, and no causal mask.
        self.mask_embedding = nn.Parameter(torch.empty(width))
        self.image_proj = nn.Linear(image_width, width)
        self.self_blocks = nn.ModuleList(ResidualAttentionBlock(width, heads) for _ in range(layers))
        self.cross_blocks = nn.ModuleList(
            ResidualAttentionBlock(width, heads, is_cross_attention=True) for _ in range(layers)
        )
        self.ln_final = LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.grad_checkpointing = False
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        nn.init.normal_(self.mask_embedding, std=0.02)
        nn.init.normal_(self.head.weight, std=width**-0.5)

    def forward(
        self, image_tokens: torch.Tensor, tokens: torch.Tensor, parallel: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits [B, L-1, V] of token rows [B, L] given their image's tokens [B, T, D_img];
        ``parallel`` [B] (bool): the row is predicted from mask embeddings, all positions at once."""
        inputs = tokens[:, :-1]
        n, length = inputs.shape
        x = self.token_embedding(inputs)
        x = torch.where(parallel[:, None, None], self.mask_embedding.to(x.dtype).expand_as(x), x)
        x = x + self.positional_embedding[:length].to(x.dtype)
        causal = torch.full((length, length), float("-inf"), device=x.device).triu_(1)
        mask = torch.where(parallel[:, None, None], torch.zeros_like(causal), causal)
        mask = mask.repeat_interleave(self.heads, dim=0)  # [B * heads, L, L]: nn.MultiheadAttention's layout
        memory = self.image_proj(image_tokens.to(x.dtype))
        for block, cross in zip(self.self_blocks, self.cross_blocks):
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, None, None, mask, use_reentrant=False)
                x = checkpoint(cross, x, memory, memory, None, use_reentrant=False)
            else:
                x = block(x, attn_mask=mask)
                x = cross(x, k_x=memory, v_x=memory)
        return self.head(self.ln_final(x))


class ProjectionHead(nn.Module):
    """DINO's head (Caron et al. 2021), which SILC and TIPS use: a 3-layer MLP to a bottleneck, L2-normalised,
    then a linear layer to K prototypes whose rows are L2-normalised (DINO's weight-normalised last layer with
    its gain fixed at 1). A LayerNorm first: the tower's tokens reach it before any final norm."""

    def __init__(self, in_dim: int, out_dim: int, *, width: int) -> None:
        super().__init__()
        hidden, bottleneck = head_dims(width)
        self.norm = nn.LayerNorm(in_dim)
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, bottleneck),
        )
        self.prototypes = nn.Parameter(torch.empty(out_dim, bottleneck))
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)
        nn.init.trunc_normal_(self.prototypes, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(self.norm(x)).float(), dim=-1)
        return x @ F.normalize(self.prototypes.float(), dim=-1).t()


def head_dims(width: int) -> tuple[int, int]:
    """(hidden, bottleneck) of a head on an image tower ``width`` wide: DINO's 2048 and 256 from width 256 on (its
    ViT-S and ViT-B alike); a narrower tower (a test model) gets 8 x its width, so its heads do not outweigh it."""
    hidden = 2048 if width >= 256 else 8 * width
    return hidden, min(256, hidden)


class PatchMasker(nn.Module):
    """TIPS' masked image modelling input: the patch embeddings at masked positions become one learned token."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.empty(width))
        nn.init.normal_(self.token, std=0.02)

    def forward(self, patches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``patches``: a patch embedding's output, [B, D, gh, gw] (open_clip's conv1) or [B, P, D] (timm's
        patch_embed); ``mask`` [B, P] bool, P = gh * gw in row-major order."""
        token = self.token.to(patches.dtype)
        if patches.dim() == 4 and patches.shape[1] == token.shape[0]:  # NCHW
            b, d, gh, gw = patches.shape
            m = mask.view(b, 1, gh, gw)
            return torch.where(m, token.view(1, d, 1, 1), patches)
        if patches.dim() == 4:  # NHWC
            b, gh, gw, d = patches.shape
            return torch.where(mask.view(b, gh, gw, 1), token, patches)
        return torch.where(mask[:, :, None], token, patches)


class Siglip2Parts(nn.Module):
    """What ``model.siglip2`` holds."""

    def __init__(
        self,
        *,
        decoder: LocCaDecoder,
        pooled_dim: int,
        token_dim: int,
        prototypes: int,
        patch_prototypes: int,
    ) -> None:
        super().__init__()
        self.decoder = decoder
        self.global_head = ProjectionHead(pooled_dim, prototypes, width=token_dim)
        self.patch_head = ProjectionHead(token_dim, patch_prototypes, width=token_dim)
        self.masker = PatchMasker(token_dim)
