"""FLOPs of an open_clip CLIP model from its config's shapes, and of ds_clip's cached step.

Used by scripts/gpu_check_capacity.py (model FLOP utilisation on one GPU); unit-tested in
tests/test_bench.py (known shapes -> known count). A multiply-add is 2 FLOPs. Counted:

* image tower (open_clip ``VisionTransformer``): the patch embedding (a convolution: 2·P·3p²·w for P
  patches of p×p pixels, width w), then per block on L = P + 1 tokens (the class token) the qkv, output
  and MLP projections, 2·L·(4w² + 2·w·h) with MLP width h = mlp_ratio·w, and the attention's two
  matrix products, 4·L²·w; the output projection of the pooled token, 2·w·E;
* text tower (open_clip ``TextTransformer``, causal): the same per-block count on its C = context_length
  tokens, the attention counted in full (the causal mask is applied to a full product), plus the
  projection of the pooled token, 2·w_t·E; the token embedding is a lookup (no FLOPs);
* layer norms, softmax, activations and biases are left out (under 1 % at these widths).

A backward costs two forwards. ds_clip's cached step on k micro-batches of m runs, per micro-batch, a
forward without graph (micro-batch 0: with graph), a recomputed forward with graph (micro-batches
1..k-1) and a backward: (4k - 1)·m forward-equivalents per step (``cached_step_flops``), against the
3k·m of a plain step over the same pairs (``model_flops``: the usual "model FLOPs" of an MFU figure).
The loss over N = k·m pairs adds 2·N²·E for the logits (forward) and twice that in backward.
"""

from __future__ import annotations

from typing import Any


def _blocks(tokens: int, width: int, layers: int, mlp_ratio: float) -> int:
    hidden = int(width * mlp_ratio)
    per_block = 2 * tokens * (4 * width * width + 2 * width * hidden) + 4 * tokens * tokens * width
    return layers * per_block


def _size(v: Any) -> int:
    return v if isinstance(v, int) else int(v[0])


def image_forward_flops(vision_cfg: dict[str, Any], embed_dim: int) -> int:
    """Forward FLOPs of one image through open_clip's ViT (config ``vision_cfg``)."""
    if "timm_model_name" in vision_cfg and vision_cfg["timm_model_name"]:
        raise ValueError("FLOPs are counted for open_clip's own ViT only, not timm towers")
    if isinstance(vision_cfg.get("layers"), (list, tuple)):
        raise ValueError("FLOPs are counted for ViT towers only, not ResNets")
    size, patch, width = _size(vision_cfg["image_size"]), _size(vision_cfg["patch_size"]), vision_cfg["width"]
    patches = (size // patch) ** 2
    embed = 2 * patches * (3 * patch * patch) * width
    blocks = _blocks(patches + 1, width, vision_cfg["layers"], vision_cfg.get("mlp_ratio", 4.0))
    return embed + blocks + 2 * width * embed_dim


def text_forward_flops(text_cfg: dict[str, Any], embed_dim: int) -> int:
    """Forward FLOPs of one caption through open_clip's text transformer (config ``text_cfg``)."""
    if text_cfg.get("hf_model_name"):
        raise ValueError("FLOPs are counted for open_clip's own text transformer only, not HF towers")
    width = text_cfg.get("width", 512)
    tokens = text_cfg.get("context_length", 77)
    blocks = _blocks(tokens, width, text_cfg.get("layers", 12), text_cfg.get("mlp_ratio", 4.0))
    return blocks + 2 * width * embed_dim


def pair_forward_flops(model_cfg: dict[str, Any]) -> int:
    """Forward FLOPs of one (image, caption) pair."""
    e = model_cfg["embed_dim"]
    return image_forward_flops(model_cfg["vision_cfg"], e) + text_forward_flops(model_cfg["text_cfg"], e)


def loss_flops(n: int, embed_dim: int) -> int:
    """Forward + backward FLOPs of the N x N logits (2·N²·E forward, twice that backward)."""
    return 3 * 2 * n * n * embed_dim


def cached_step_flops(model_cfg: dict[str, Any], m: int, k: int) -> int:
    """FLOPs ds_clip's cached step executes on k micro-batches of m: (4k-1)·m pair forwards + the loss."""
    return (4 * k - 1) * m * pair_forward_flops(model_cfg) + loss_flops(k * m, model_cfg["embed_dim"])


def model_flops(model_cfg: dict[str, Any], m: int, k: int) -> int:
    """FLOPs a plain step over the same N = k·m pairs needs (forward + backward, no recompute)."""
    return 3 * k * m * pair_forward_flops(model_cfg) + loss_flops(k * m, model_cfg["embed_dim"])
