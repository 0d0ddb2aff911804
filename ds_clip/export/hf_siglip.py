"""An open_clip SigLIP-architecture model as a transformers folder: ``SiglipModel`` weights and config, its Hugging Face
tokenizer, ``SiglipProcessor``.

    ds-clip-export logs/RUN OUT --format transformers        (ds_clip.export.hf_clip picks this for a timm image tower)
    SiglipModel.from_pretrained(OUT), AutoModel, SiglipVisionModel, SiglipTextModel, AutoTokenizer, AutoProcessor

The architecture is that of open_clip's published SigLIP configs (``ViT-B-16-SigLIP.json`` and its kin): a timm
``vit_*_siglip_*`` image tower (no class token, MAP attention pooling, no projection: ``timm_proj: "none"``) and
open_clip's text transformer without its causal mask, pooled at its last position (``pool_type: "last"``), with a
biased projection (``proj_bias``), its tokenizer a Hugging Face one (``text_cfg.hf_tokenizer_name``). The key
mapping is ds_clip's own, written after transformers' ``models/siglip/convert_siglip_to_hf.py`` (big_vision
names) and timm's ``VisionTransformer``: timm's fused ``attn.qkv`` splits into q, k, v; the MAP head's ``q`` and
``kv`` projections are the ``in_proj`` of the head's ``nn.MultiheadAttention`` (q, then k, then v), its latent the
``probe``; the text tower's blocks map as in the CLIP export (ds_clip.export.hf_towers).

What the towers compute must be what transformers' SigLIP computes. ``unmappable`` names the first thing that
differs (another timm tower, a class or register token, layer scale, q/k norms, an image projection, a causal or
differently pooled text tower, open_clip's CLIP tokenizer, a resize other than ``squash``, ...), and ``ds-clip-export``
refuses it in one line before anything is written. The image tower's activation (exact GELU in
``vit_base_patch16_siglip_224``, tanh GELU in the others) and LayerNorm eps are read from the timm model itself,
the text tower's from ``text_cfg`` (``act_kwargs: {"approximate": "tanh"}``, ``norm_kwargs.eps``).

Tokenizer: open_clip cleans each caption before its Hugging Face tokenizer sees it (``tokenizer_kwargs.clean``:
``canonicalize`` for SigLIP: punctuation dropped, lower case, whitespace collapsed). The exported tokenizer holds
that cleaning as normalizers in front of its own (a ``PreTrainedTokenizerFast``, which transformers 4.x and 5.x
load from tokenizer.json as it is), pads and truncates to the context length, and returns ``input_ids`` alone:
SigLIP's text tower attends to the padding as open_clip's does, so an attention mask would change the features.
Captions are padded with ``padding="max_length"`` (the tower pools the last position).
"""

from __future__ import annotations

import re
import string
from typing import Any

import torch
from torch import nn

from ds_clip.export import hf_towers as towers

TARGET = "SiglipModel"
# open_clip's HFTokenizer cleaning (tokenizer_kwargs.clean) as tokenizers' normalizers: whitespace collapsed and
# stripped; "lower" lower-cases; "canonicalize" (big_vision's) also turns "_" into spaces and drops punctuation.
CLEANS = ("whitespace", "lower", "canonicalize")
_TEXT_ACTS = {None: "gelu", "none": "gelu", "tanh": "gelu_pytorch_tanh"}  # nn.GELU(approximate=...)


def is_siglip_architecture(model_cfg: dict) -> bool:
    """A timm image tower: the SigLIP architecture transformers' SiglipModel holds (CLIP's towers are open_clip's own)."""
    return bool((model_cfg.get("vision_cfg") or {}).get("timm_model_name"))


def timm_trunk(v: dict) -> nn.Module | None:
    """timm's model ``vision_cfg.timm_model_name`` as open_clip's TimmModel builds it with ``timm_proj: "none"``
    (no classifier, timm_pool as its pooling), on the meta device (its structure, no memory or initialisation), or
    None when timm cannot build it so (unmappable then names the tower)."""
    import timm

    try:
        with torch.device("meta"):
            return timm.create_model(
                v["timm_model_name"], pretrained=False, num_classes=0, global_pool=v.get("timm_pool", "avg")
            )
    except Exception:  # noqa: BLE001  timm: "Unknown model (...)", or a model that refuses this pooling
        return None


def _identity(*modules: Any) -> bool:
    return all(m is None or isinstance(m, nn.Identity) for m in modules)


def _act(module: nn.Module) -> str | None:
    """transformers' hidden_act for a timm activation module, or None."""
    kind = type(module).__name__
    if kind == "GELUTanh":
        return "gelu_pytorch_tanh"
    if kind == "GELU":  # torch's (approximate "none" or "tanh") or timm's exact one
        return _TEXT_ACTS.get(getattr(module, "approximate", "none"))
    return None


def _trunk_problem(trunk: nn.Module | None, v: dict) -> str | None:
    name = f"the timm image tower {v['timm_model_name']!r} (vision_cfg.timm_model_name"
    if trunk is None or type(trunk).__name__ != "VisionTransformer":
        return f"{name}; SiglipModel holds timm's vit_*_siglip_* ViTs)"
    blocks = list(trunk.blocks)
    pool = getattr(trunk, "attn_pool", None)
    if trunk.cls_token is not None or getattr(trunk, "reg_token", None) is not None:
        return f"{name}: its class or register tokens)"
    if pool is None or trunk.global_pool != "map":
        return (
            f"{name} with vision_cfg.timm_pool {trunk.global_pool!r}: SiglipModel pools by attention, 'map')"
        )
    if (
        not _identity(trunk.norm_pre, trunk.fc_norm, trunk.patch_embed.norm)
        or trunk.patch_embed.proj.bias is None
    ):
        return (
            f"{name}: a LayerNorm before the blocks or after the pooling, or a patch embedding without bias)"
        )
    if getattr(trunk, "dynamic_img_size", False) or trunk.pos_embed is None:
        return f"{name}: dynamic image size or no learnt position embedding)"
    for b in blocks:
        if type(b).__name__ != "Block" or not _identity(b.ls1, b.ls2, b.attn.q_norm, b.attn.k_norm):
            return f"{name}: layer scale, q/k norms or another block type)"
        if type(b.mlp).__name__ != "Mlp" or not _identity(getattr(b.attn, "norm", None), b.mlp.norm):
            return f"{name}: norms inside its attention or MLP)"
        if not all(isinstance(n, nn.LayerNorm) for n in (b.norm1, b.norm2)) or _act(b.mlp.act) is None:
            return f"{name}: its norms or activation, which are not LayerNorm and GELU)"
    if (
        pool.latent_len != 1
        or pool.pos_embed is not None
        or pool.pool != "token"
        or not _identity(pool.q_norm, pool.k_norm)
    ):
        return f"{name}: its attention pooler's latents, position embedding or q/k norms)"
    if not isinstance(pool.norm, nn.LayerNorm) or pool.mlp.fc1.out_features != blocks[0].mlp.fc1.out_features:
        return f"{name}: its attention pooler's norm or MLP width)"
    if len({_act(b.mlp.act) for b in blocks} | {_act(pool.mlp.act)}) != 1:
        return f"{name}: activations that differ between layers)"
    if len({n.eps for b in blocks for n in (b.norm1, b.norm2)} | {trunk.norm.eps, pool.norm.eps}) != 1:
        return f"{name}: LayerNorm eps that differ between layers)"
    return None


def _vision_problem(v: dict, embed_dim: int, trunk: nn.Module | None) -> str | None:
    problem = _trunk_problem(trunk, v)
    if problem:
        return problem
    if v.get("timm_proj", "linear") != "none":
        return f"the image projection vision_cfg.timm_proj={v.get('timm_proj', 'linear')!r} (SiglipModel has none: 'none')"
    if trunk.embed_dim != embed_dim:
        return f"embed_dim {embed_dim} unlike the image tower's width {trunk.embed_dim} (SiglipModel has no image projection)"
    size = trunk.patch_embed.img_size
    if len(set(size)) != 1 or towers.side(v.get("image_size", 224)) != size[0]:
        return f"vision_cfg.image_size {v.get('image_size', 224)} unlike {v['timm_model_name']!r}'s square {list(size)}"
    return None


def _text_problem(t: dict, quick_gelu: bool) -> str | None:
    if t.get("hf_model_name"):
        return f"the Hugging Face text tower {t['hf_model_name']!r} (text_cfg.hf_model_name)"
    if not t.get("hf_tokenizer_name"):
        return "open_clip's CLIP tokenizer with a SigLIP model (SiglipModel's export takes text_cfg.hf_tokenizer_name's)"
    if t.get("tokenizer_mode"):
        return f"the tokenizer mode text_cfg.tokenizer_mode={t['tokenizer_mode']!r}"
    kwargs = dict(t.get("tokenizer_kwargs") or {})
    if kwargs.pop("clean", "whitespace") not in CLEANS or kwargs:
        return f"open_clip tokenizer options text_cfg.tokenizer_kwargs={t['tokenizer_kwargs']} (only clean: {'/'.join(CLEANS)} maps)"
    if t.get("embed_cls"):
        return "the text tower's CLS token (text_cfg.embed_cls)"
    if not t.get("no_causal_mask"):
        return "a text tower with a causal mask (SigLIP's attends both ways: text_cfg.no_causal_mask)"
    if t.get("pool_type", "argmax") != "last":
        return f"the text tower's pooling text_cfg.pool_type={t.get('pool_type', 'argmax')!r} (SigLIP pools the last position)"
    if not t.get("proj_bias") or t.get("proj_type", "linear") != "linear":
        return "the text projection of text_cfg.proj_bias/proj_type (SigLIP's is one linear map with a bias)"
    act = dict(t.get("act_kwargs") or {})
    if quick_gelu or set(act) - {"approximate"} or act.get("approximate") not in _TEXT_ACTS:
        return f"the text tower's activation (quick_gelu or text_cfg.act_kwargs={t.get('act_kwargs')})"
    return towers.block_problem({**t, "act_kwargs": None}, "text_cfg")


def unmappable(model_cfg: dict, preprocess_cfg: dict | None = None) -> str | None:
    """What of this SigLIP-architecture model (or its preprocessing) transformers' SigLIP classes cannot represent."""
    v, t = model_cfg.get("vision_cfg") or {}, model_cfg.get("text_cfg") or {}
    trunk = timm_trunk(v)
    problem = _vision_problem(v, int(model_cfg["embed_dim"]), trunk) or _text_problem(
        t, bool(model_cfg.get("quick_gelu"))
    )
    if problem:
        return problem
    p = preprocess_cfg or {}
    if p.get("resize_mode", "shortest") != "squash":
        return f"preprocess_cfg resize_mode {p.get('resize_mode', 'shortest')!r} (SiglipImageProcessor squashes to its square size: 'squash')"
    if p.get("interpolation", "bicubic") not in towers.RESAMPLE:
        return f"preprocess_cfg interpolation {p['interpolation']!r}"
    if p.get("size") is not None and towers.side(p["size"]) != trunk.patch_embed.img_size[0]:
        return f"preprocess_cfg size {p['size']} unlike the image tower's {trunk.patch_embed.img_size[0]}"
    return None


def siglip_config_kwargs(model_cfg: dict, trunk: nn.Module, tokenizer) -> dict[str, Any]:
    """The keyword arguments of transformers' ``SiglipConfig`` (plain dicts for the towers, as 4.x and 5.x take)."""
    t = model_cfg["text_cfg"]
    width = int(t.get("width", 512))
    block = trunk.blocks[0]
    vision = {
        "hidden_size": trunk.embed_dim,
        "intermediate_size": block.mlp.fc1.out_features,
        "num_hidden_layers": len(trunk.blocks),
        "num_attention_heads": block.attn.num_heads,
        "num_channels": 3,
        "image_size": trunk.patch_embed.img_size[0],
        "patch_size": trunk.patch_embed.patch_size[0],
        "hidden_act": _act(block.mlp.act),
        "layer_norm_eps": float(trunk.norm.eps),
    }
    text = {
        "vocab_size": int(t.get("vocab_size", 49408)),
        "hidden_size": width,
        "intermediate_size": int(width * t.get("mlp_ratio", 4.0)),
        "num_hidden_layers": int(t.get("layers", 12)),
        "num_attention_heads": int(t.get("heads", 8)),
        "max_position_embeddings": int(t.get("context_length", 77)),
        "hidden_act": _TEXT_ACTS[(t.get("act_kwargs") or {}).get("approximate")],
        "layer_norm_eps": towers.eps(t),
        "projection_size": int(model_cfg["embed_dim"]),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    return {"text_config": text, "vision_config": vision}


def siglip_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip SigLIP weights (a timm image tower in ``visual.trunk``) in transformers' SiglipModel names. Every
    open_clip tensor is used exactly once; an unknown one is refused, never dropped."""
    text = (
        "text." if any(k.startswith("text.") for k in state) else ""
    )  # CustomTextCLIP keeps the tower in .text
    trunk, vm, head = "visual.trunk.", "vision_model.", "vision_model.head."
    direct = {
        f"{trunk}patch_embed.proj.weight": f"{vm}embeddings.patch_embedding.weight",
        f"{trunk}patch_embed.proj.bias": f"{vm}embeddings.patch_embedding.bias",
        f"{trunk}norm.weight": f"{vm}post_layernorm.weight",
        f"{trunk}norm.bias": f"{vm}post_layernorm.bias",
        f"{trunk}attn_pool.latent": f"{head}probe",
        f"{trunk}attn_pool.proj.weight": f"{head}attention.out_proj.weight",
        f"{trunk}attn_pool.proj.bias": f"{head}attention.out_proj.bias",
        f"{trunk}attn_pool.norm.weight": f"{head}layernorm.weight",
        f"{trunk}attn_pool.norm.bias": f"{head}layernorm.bias",
        f"{text}token_embedding.weight": "text_model.embeddings.token_embedding.weight",
        f"{text}positional_embedding": "text_model.embeddings.position_embedding.weight",
        f"{text}ln_final.weight": "text_model.final_layer_norm.weight",
        f"{text}ln_final.bias": "text_model.final_layer_norm.bias",
        f"{text}text_projection.weight": "text_model.head.weight",
        f"{text}text_projection.bias": "text_model.head.bias",
    }
    for part in ("fc1", "fc2"):
        for kind in ("weight", "bias"):
            direct[f"{trunk}attn_pool.mlp.{part}.{kind}"] = f"{head}mlp.{part}.{kind}"
    out = {dst: state[src] for src, dst in direct.items() if src in state}
    used = {src for src in direct if src in state}
    out[f"{vm}embeddings.position_embedding.weight"] = state[f"{trunk}pos_embed"][0]  # (1, patches, width)
    for name in ("logit_scale", "logit_bias"):
        out[name] = state[name].reshape(1)  # open_clip: 0-dim; SiglipModel: shape (1,)
    for kind in (
        "weight",
        "bias",
    ):  # the MAP head's q and kv projections: nn.MultiheadAttention's in_proj (q, k, v)
        q, kv = f"{trunk}attn_pool.q.{kind}", f"{trunk}attn_pool.kv.{kind}"
        out[f"{head}attention.in_proj_{kind}"] = torch.cat([state[q], state[kv]])
        used |= {q, kv}
    used |= {f"{trunk}pos_embed", "logit_scale", "logit_bias"}
    used |= _vision_layer_keys(state, out)
    used |= towers.layer_keys(f"{text}transformer.resblocks", "text_model.encoder.layers", state, out, TARGET)
    towers.refuse_leftovers(state, used, TARGET)
    return {k: v.contiguous().clone() for k, v in out.items()}


def _vision_layer_keys(state: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> set[str]:
    """timm's blocks (``visual.trunk.blocks.N``) in SiglipVisionModel's encoder layers."""
    names = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # fmt: skip
    prefix, used = "visual.trunk.blocks.", set()
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        index, rest = key[len(prefix) :].split(".", 1)
        module, kind = rest.rsplit(".", 1)
        layer = f"vision_model.encoder.layers.{index}"
        if module == "attn.qkv":  # timm's fused projection: rows of q, then k, then v
            for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                out[f"{layer}.self_attn.{name}.{kind}"] = part
        elif module in names:
            out[f"{layer}.{names[module]}.{kind}"] = value
        else:
            continue  # left for refuse_leftovers to name
        used.add(key)
    return used


def _clean_normalizers(clean: str) -> list:
    """open_clip's caption cleaning ``clean`` (open_clip.tokenizer.get_clean_fn) as tokenizers' normalizers.
    ftfy's repair of mojibake and the HTML unescaping that open_clip also applies have no normalizer."""
    from tokenizers import Regex, normalizers

    spaces = [normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    if clean == "lower":
        return [*spaces, normalizers.Lowercase()]
    if (
        clean == "canonicalize"
    ):  # big_vision's: "_" to a space, punctuation dropped, lower case, spaces collapsed
        punctuation = Regex("[" + re.escape(string.punctuation) + "]")
        return [
            normalizers.Replace("_", " "),
            normalizers.Replace(punctuation, ""),
            normalizers.Lowercase(),
            *spaces,
        ]
    return spaces


def build_tokenizer(hf_tokenizer, clean: str, context_length: int):
    """open_clip's Hugging Face tokenizer with open_clip's cleaning in front of its normalizer, padding and
    truncating at the context length, returning input_ids alone; a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise_unmappable(
            f"the tokenizer {type(hf_tokenizer).__name__} without a tokenizers (tokenizer.json) backend"
        )
    backend = Tokenizer.from_str(backend.to_str())  # a copy: the caller's tokenizer is left as it was
    steps = _clean_normalizers(clean)
    backend.normalizer = normalizers.Sequence([*steps, backend.normalizer] if backend.normalizer else steps)
    special = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=context_length,
        model_input_names=["input_ids"],  # no attention mask: open_clip's tower attends to the padding too
        padding_side=hf_tokenizer.padding_side,
        truncation_side=hf_tokenizer.truncation_side,
        **{k: str(getattr(hf_tokenizer, k)) for k in special if getattr(hf_tokenizer, k, None) is not None},
    )


def raise_unmappable(problem: str) -> None:
    raise towers.UnmappableError(
        f"--format transformers: {problem} cannot be mapped to transformers' {TARGET}"
    )


def image_processor_kwargs(model_cfg: dict, preprocess_cfg: dict | None) -> dict[str, Any]:
    """``SiglipImageProcessor`` settings equal to open_clip's eval transform of this (squash) preprocess config."""
    size, kwargs = towers.image_kwargs(model_cfg, preprocess_cfg or {})
    return {**kwargs, "size": {"height": size, "width": size}}  # open_clip: Resize((s, s)), no crop


def build_siglip(state: dict[str, torch.Tensor], model_cfg: dict, preprocess_cfg: dict | None, tokenizer):
    """transformers' ``SiglipModel`` holding ``state`` (open_clip's weights, loaded strictly into open_clip's model)
    and its ``SiglipProcessor`` (``tokenizer``: open_clip's HFTokenizer of this model), built in memory."""
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor

    t = model_cfg["text_cfg"]
    context = int(t.get("context_length", 77))
    hf_tok = build_tokenizer(
        tokenizer.tokenizer, (t.get("tokenizer_kwargs") or {}).get("clean", "whitespace"), context
    )
    trunk = timm_trunk(model_cfg["vision_cfg"])
    config = SiglipConfig(**siglip_config_kwargs(model_cfg, trunk, hf_tok))
    config.architectures = [TARGET]
    model = SiglipModel(config)
    towers.load_strictly(model, siglip_state_dict(state), TARGET)
    image_processor = SiglipImageProcessor(**image_processor_kwargs(model_cfg, preprocess_cfg))
    return model, SiglipProcessor(image_processor=image_processor, tokenizer=hf_tok)


__all__ = [
    "TARGET",
    "build_siglip",
    "build_tokenizer",
    "image_processor_kwargs",
    "is_siglip_architecture",
    "siglip_config_kwargs",
    "siglip_state_dict",
    "timm_trunk",
    "unmappable",
]
