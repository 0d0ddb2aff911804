"""What ds_clip's two transformers exports share (ds_clip.export.hf_clip: ``CLIPModel``; ds_clip.export.hf_siglip:
``SiglipModel``): open_clip's text transformer blocks in transformers' encoder-layer names (both classes name their
layers alike), the block options neither class has, and the one-line refusal of what does not map."""

from __future__ import annotations

from typing import Any

import torch

from ds_clip.errors import UserError

# Block options of open_clip's towers that transformers' CLIP and SigLIP layers do not have.
_CUSTOM_BLOCK = ("qk_norm", "scaled_cosine_attn", "scale_heads", "scale_attn_inner", "scale_attn", "scale_fc")
RESAMPLE = {"bicubic": 3, "bilinear": 2}  # PIL's codes, which transformers' image processors' resample takes


class UnmappableError(UserError):
    """A model (or preprocessing) that transformers' CLIP or SigLIP classes cannot represent; the message names it."""


def block_problem(cfg: dict, name: str) -> str | None:
    """The first option of an open_clip tower's transformer blocks that transformers' layers lack, or None."""
    if cfg.get("ls_init_value") is not None:
        return f"layer scale ({name}.ls_init_value)"
    if cfg.get("block_type") not in (None, "default") or any(cfg.get(k) for k in _CUSTOM_BLOCK):
        return f"custom attention blocks ({name}.block_type or one of {', '.join(_CUSTOM_BLOCK)})"
    if cfg.get("act_kwargs"):
        return f"activation options ({name}.act_kwargs)"
    if set(cfg.get("norm_kwargs") or {}) - {"eps"}:
        return f"LayerNorm options other than eps ({name}.norm_kwargs)"
    return None


def side(size: Any) -> int:
    return int(size[0]) if isinstance(size, (list, tuple)) else int(size)


def eps(cfg: dict) -> float:
    return float((cfg.get("norm_kwargs") or {}).get("eps", 1e-5))  # open_clip's LayerNorm default


def image_kwargs(model_cfg: dict, p: dict) -> tuple[int, dict[str, Any]]:
    """The image side and the settings CLIPImageProcessor and SiglipImageProcessor share, from open_clip's
    preprocess config ``p``: interpolation, 8-bit rescale, the model's mean and std, RGB conversion."""
    size = side(p.get("size") or model_cfg["vision_cfg"].get("image_size", 224))
    kwargs = {
        "do_resize": True,
        "resample": RESAMPLE[p.get("interpolation", "bicubic")],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(
            p.get("mean") or (0.48145466, 0.4578275, 0.40821073)
        ),  # open_clip's OPENAI_DATASET_MEAN
        "image_std": list(p.get("std") or (0.26862954, 0.26130258, 0.27577711)),  # and _STD
        "do_convert_rgb": True,
    }
    return size, kwargs


def layer_keys(
    src: str, dst: str, state: dict[str, torch.Tensor], out: dict[str, torch.Tensor], target: str
) -> set[str]:
    """Map open_clip's resblocks under ``src`` (``transformer.resblocks``) to transformers' layers under ``dst``
    (``target``, "CLIPModel" or "SiglipModel", names the class in a refusal); return the source keys used."""
    used = set()
    names = {
        "ln_1": "layer_norm1",
        "ln_2": "layer_norm2",
        "attn.out_proj": "self_attn.out_proj",
        "mlp.c_fc": "mlp.fc1",
        "mlp.c_proj": "mlp.fc2",
    }
    prefix = f"{src}."
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        index, rest = key[len(prefix) :].split(".", 1)
        layer = f"{dst}.{index}"
        if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
            kind = rest.rsplit("_", 1)[1]  # weight | bias
            for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                out[f"{layer}.self_attn.{name}.{kind}"] = part
        else:
            module, kind = rest.rsplit(".", 1)
            if module not in names:
                raise UnmappableError(
                    f"--format transformers: {key} cannot be mapped to transformers' {target}"
                )
            out[f"{layer}.{names[module]}.{kind}"] = value
        used.add(key)
    return used


def refuse_leftovers(state: dict, used: set[str], target: str) -> None:
    """Every open_clip tensor is used exactly once: one the mapping did not use is refused, never dropped."""
    left = sorted(set(state) - used)
    if left:
        raise UnmappableError(f"--format transformers: {left[0]} cannot be mapped to transformers' {target}")


def load_strictly(model, state: dict[str, torch.Tensor], target: str) -> None:
    """Load the mapped ``state`` into the transformers model: every key of the model filled, none left over."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UnmappableError(
            f"--format transformers: {target} {'lacks ' + missing[0] if missing else 'has no ' + unexpected[0]}"
        )
