"""An open_clip model as a transformers folder: ``CLIPModel`` (or ``SiglipModel``) weights and config, the tokenizer,
the processor.

    ds-clip-export logs/RUN OUT --format transformers
    CLIPModel.from_pretrained(OUT), AutoModel, CLIPVisionModel, CLIPTextModel, AutoTokenizer, AutoProcessor
    (a SigLIP-architecture model: SiglipModel, SiglipVisionModel, SiglipTextModel; ds_clip.export.hf_siglip)

The format follows the model's architecture, not its loss: open_clip's own towers (a ViT with a class token, a
causal text transformer) map to ``CLIPModel`` (this module); the SigLIP architecture of open_clip's SigLIP configs
(a timm ``vit_*_siglip_*`` tower, a bidirectional text tower pooled at its last position, a Hugging Face tokenizer)
maps to ``SiglipModel`` (ds_clip.export.hf_siglip); ``target`` says which, and ``unmappable`` names what maps to neither.

The key mapping is ds_clip's own, written after transformers' converters from OpenAI/open_clip-style state
dicts (``models/clip/convert_clip_original_pytorch_to_hf.py``, ``models/metaclip_2/convert_metaclip_2_to_hf.py``):
open_clip's fused ``attn.in_proj_weight`` splits into q, k, v; its ``x @ proj`` projections become the transposed
weights of bias-free ``nn.Linear`` layers; ``ln_pre``/``ln_post``/``ln_final`` are ``pre_layrnorm`` (sic),
``post_layernorm``, ``final_layer_norm``.

What the towers compute must be what transformers' CLIP computes, or the export would load and give other
features. ``unmappable`` names the first thing that differs (CoCa's text decoder, a Hugging Face text tower,
a ResNet, attentional or average pooling, layer scale, custom attention blocks, a text tower without its causal
mask or pooled elsewhere than its end-of-text token, another tokenizer); ``ds-clip-export`` refuses it in one
line before anything is written.

Text pooling: open_clip's default ``pool_type="argmax"`` takes the end-of-text token (49407, the largest id of its
tokenizer); transformers' CLIP text model pools the first ``eos_token_id`` when that is not 2 (an old config
value, for which it takes the argmax). The config sets ``eos_token_id=49407``, so both pick the same position in
every transformers version (4.x and 5.x pool this way). The tokenizer pads with id 0 (``!``) as open_clip does,
so token ids are equal position by position; ``split_special_tokens`` keeps a ``!`` in a caption from being read
as that pad token (open_clip encodes it as an ordinary ``!``).

A CLIP-architecture model trained with the SigLIP loss (``--siglip``, ``init_logit_bias``) keeps CLIP's towers
(class token, causal text mask, end-of-text pooling), which transformers' ``SiglipModel`` cannot hold (its vision
tower has no class token and pools by attention, its text tower attends both ways and pools the last position): it
is exported as ``CLIPModel`` and the learnt bias is kept in the config as ``logit_bias``
(sigmoid(logits_per_image + logit_bias) are SigLIP's pair probabilities).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ds_clip.errors import UserError
from ds_clip.export import hf_siglip
from ds_clip.export.hf_towers import (
    RESAMPLE,
    UnmappableError,
    block_problem,
    eps,
    image_kwargs,
    layer_keys,
    load_strictly,
    refuse_leftovers,
    side,
)

INSTALL_HINT = "pip install 'ds_clip[hf]'"
# open_clip's CLIP tokenizer (SimpleTokenizer): its ids for the special tokens and the padding.
SOT_ID, EOT_ID, PAD_ID, CLIP_VOCAB = 49406, 49407, 0, 49408


class MissingTransformersError(UserError):
    """transformers is not installed."""


def require_transformers() -> None:
    """Refuse, naming the extra, when transformers cannot be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise MissingTransformersError(
            f"--format transformers needs the transformers package ({exc}); install it with {INSTALL_HINT}"
        ) from None


def _vision_problem(v: dict) -> str | None:
    if not isinstance(v.get("layers", 12), int):
        return "the ResNet image tower (vision_cfg.layers is a list)"
    if v.get("attentional_pool"):
        return "the image tower's attentional pooler (vision_cfg.attentional_pool)"
    if v.get("pool_type", "tok") != "tok":
        return (
            f"the image tower's pooling vision_cfg.pool_type={v['pool_type']!r} (CLIP pools the class token)"
        )
    if v.get("no_ln_pre"):
        return "an image tower without its pre-transformer LayerNorm (vision_cfg.no_ln_pre)"
    if v.get("pos_embed_type", "learnable") != "learnable":
        return f"the image tower's position embedding vision_cfg.pos_embed_type={v['pos_embed_type']!r}"
    for key in ("image_size", "patch_size"):
        size = v.get(key)
        if isinstance(size, (list, tuple)) and len(set(size)) != 1:
            return f"a non-square vision_cfg.{key} {list(size)}"
    return block_problem(v, "vision_cfg")


def _text_problem(t: dict) -> str | None:
    if t.get("hf_model_name"):
        return f"the Hugging Face text tower {t['hf_model_name']!r} (text_cfg.hf_model_name)"
    if t.get("hf_tokenizer_name"):
        return f"the tokenizer {t['hf_tokenizer_name']!r} (text_cfg.hf_tokenizer_name; only open_clip's CLIP tokenizer maps)"
    if t.get("tokenizer_kwargs") or t.get("tokenizer_mode"):
        return "open_clip tokenizer options (text_cfg.tokenizer_kwargs/tokenizer_mode)"
    if t.get("vocab_size", CLIP_VOCAB) != CLIP_VOCAB:
        return f"text_cfg.vocab_size {t['vocab_size']} (open_clip's CLIP tokenizer has {CLIP_VOCAB} ids)"
    if t.get("embed_cls"):
        return "the text tower's CLS token (text_cfg.embed_cls)"
    if t.get("no_causal_mask"):
        return "a text tower without its causal mask (text_cfg.no_causal_mask)"
    pool = t.get("pool_type", "argmax")
    if pool not in ("argmax", "eos") or (pool == "eos" and t.get("eos_id", 2) != EOT_ID):
        return f"the text tower's pooling text_cfg.pool_type={pool!r} (CLIP pools the end-of-text token)"
    if t.get("proj_bias") or t.get("proj_type", "linear") != "linear":
        return "the text projection of text_cfg.proj_bias/proj_type (CLIP's is one bias-free linear map)"
    return block_problem(t, "text_cfg")


def target(model_cfg: dict) -> str:
    """The transformers class this open_clip model maps to: ``SiglipModel`` for the SigLIP architecture (a timm
    image tower, ds_clip.export.hf_siglip), else ``CLIPModel`` (open_clip's own towers, whatever the loss trained them)."""
    return hf_siglip.TARGET if hf_siglip.is_siglip_architecture(model_cfg) else "CLIPModel"


def unmappable(model_cfg: dict, preprocess_cfg: dict | None = None) -> str | None:
    """What of this open_clip model (or its preprocessing) the transformers class it maps to (``target``) cannot
    represent, or None."""
    if model_cfg.get("multimodal_cfg"):
        return "CoCa's text decoder (multimodal_cfg)"
    if hf_siglip.is_siglip_architecture(model_cfg):
        problem = hf_siglip.unmappable(model_cfg, preprocess_cfg)
        if problem is None and model_cfg.get("init_logit_bias") is None:
            return "a SigLIP-architecture model without logit_bias (init_logit_bias; SiglipModel's sigmoid needs it)"
        return problem
    problem = _vision_problem(model_cfg.get("vision_cfg") or {}) or _text_problem(
        model_cfg.get("text_cfg") or {}
    )
    if problem:
        return problem
    p = preprocess_cfg or {}
    if p.get("resize_mode", "shortest") not in ("shortest", "squash"):
        return f"preprocess_cfg resize_mode {p['resize_mode']!r} (CLIPImageProcessor resizes the shortest side or squashes)"
    if p.get("interpolation", "bicubic") not in RESAMPLE:
        return f"preprocess_cfg interpolation {p['interpolation']!r}"
    return None


def check_mappable(model_cfg: dict, preprocess_cfg: dict | None = None) -> None:
    problem = unmappable(model_cfg, preprocess_cfg)
    if problem:
        raise UnmappableError(
            f"--format transformers: {problem} cannot be mapped to transformers' {target(model_cfg)}; "
            "export it with --format open_clip"
        )


def clip_config_kwargs(model_cfg: dict, logit_scale: float, logit_bias: float | None) -> dict[str, Any]:
    """The keyword arguments of transformers' ``CLIPConfig`` for this open_clip model (plain dicts for the towers,
    which ``CLIPConfig`` accepts in 4.x and 5.x)."""
    v, t = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    act = "quick_gelu" if model_cfg.get("quick_gelu") else "gelu"  # open_clip: QuickGELU or nn.GELU (exact)
    embed_dim = int(model_cfg["embed_dim"])
    width, t_width = int(v.get("width", 768)), int(t.get("width", 512))
    vision = {
        "hidden_size": width,
        "intermediate_size": int(width * v.get("mlp_ratio", 4.0)),
        "num_hidden_layers": int(v.get("layers", 12)),
        "num_attention_heads": width // int(v.get("head_width", 64)),
        "image_size": side(v.get("image_size", 224)),
        "patch_size": side(v.get("patch_size", 16)),
        "num_channels": 3,
        "hidden_act": act,
        "layer_norm_eps": eps(v),
        "projection_dim": embed_dim,
    }
    text = {
        "vocab_size": int(t.get("vocab_size", CLIP_VOCAB)),
        "hidden_size": t_width,
        "intermediate_size": int(t_width * t.get("mlp_ratio", 4.0)),
        "num_hidden_layers": int(t.get("layers", 12)),
        "num_attention_heads": int(t.get("heads", 8)),
        "max_position_embeddings": int(t.get("context_length", 77)),
        "hidden_act": act,
        "layer_norm_eps": eps(t),
        "projection_dim": embed_dim,
        # eos_token_id 49407 (not the legacy 2): transformers then pools the first end-of-text token, the
        # position open_clip's argmax pooling takes (module docstring).
        "bos_token_id": SOT_ID,
        "eos_token_id": EOT_ID,
        "pad_token_id": PAD_ID,
    }
    kwargs: dict[str, Any] = {
        "text_config": text,
        "vision_config": vision,
        "projection_dim": embed_dim,
        "logit_scale_init_value": float(logit_scale),
    }
    if logit_bias is not None:
        kwargs["logit_bias"] = float(
            logit_bias
        )  # kept as a config attribute: CLIPModel has no bias parameter
    return kwargs


def clip_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip CLIP (or CustomTextCLIP with open_clip's text transformer) weights in transformers' CLIPModel names.

    Every open_clip tensor is used exactly once (an unknown one is refused, never dropped); ``logit_bias`` is left
    out (the config carries it)."""
    text = (
        "text." if any(k.startswith("text.") for k in state) else ""
    )  # CustomTextCLIP keeps the tower in .text
    out: dict[str, torch.Tensor] = {}
    direct = {
        "visual.class_embedding": "vision_model.embeddings.class_embedding",
        "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
        "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
        "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
        "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
        "visual.ln_post.weight": "vision_model.post_layernorm.weight",
        "visual.ln_post.bias": "vision_model.post_layernorm.bias",
        f"{text}token_embedding.weight": "text_model.embeddings.token_embedding.weight",
        f"{text}positional_embedding": "text_model.embeddings.position_embedding.weight",
        f"{text}ln_final.weight": "text_model.final_layer_norm.weight",
        f"{text}ln_final.bias": "text_model.final_layer_norm.bias",
        "logit_scale": "logit_scale",
    }
    transposed = {
        "visual.proj": "visual_projection.weight",
        f"{text}text_projection": "text_projection.weight",
    }
    used = {"logit_bias"}
    for src, dst in direct.items():
        if src in state:
            out[dst] = state[src]
            used.add(src)
    for src, dst in transposed.items():
        if src in state:
            out[dst] = state[src].t()  # open_clip computes x @ proj; nn.Linear computes x @ weight.T
            used.add(src)
    used |= layer_keys("visual.transformer.resblocks", "vision_model.encoder.layers", state, out, "CLIPModel")
    used |= layer_keys(f"{text}transformer.resblocks", "text_model.encoder.layers", state, out, "CLIPModel")
    refuse_leftovers(state, used, "CLIPModel")
    return {k: v.contiguous().clone() for k, v in out.items()}


def image_processor_kwargs(model_cfg: dict, preprocess_cfg: dict | None) -> dict[str, Any]:
    """``CLIPImageProcessor`` settings equal to open_clip's eval transform of this preprocess config."""
    p = preprocess_cfg or {}
    size, kwargs = image_kwargs(model_cfg, p)
    square = {"height": size, "width": size}
    if p.get("resize_mode", "shortest") == "squash":  # open_clip: Resize((s, s)), no crop
        kwargs.update(size=square, do_center_crop=False, crop_size=square)
    else:  # open_clip: Resize(s) of the shortest side, CenterCrop(s)
        kwargs.update(size={"shortest_edge": size}, do_center_crop=True, crop_size=square)
    return kwargs


def _clip_tokenizer_files(folder: Path) -> tuple[Path, Path]:
    """vocab.json and merges.txt of open_clip's SimpleTokenizer (the BPE file shipped inside open_clip), in
    the names transformers' CLIP tokenizer uses for the two special tokens."""
    from open_clip.tokenizer import SimpleTokenizer

    simple = SimpleTokenizer()
    vocab = dict(simple.encoder)
    vocab["<|startoftext|>"] = vocab.pop("<start_of_text>")
    vocab["<|endoftext|>"] = vocab.pop("<end_of_text>")
    if (vocab["<|startoftext|>"], vocab["<|endoftext|>"], len(vocab)) != (SOT_ID, EOT_ID, CLIP_VOCAB):
        raise UnmappableError(
            "--format transformers: this open_clip's tokenizer is not the 49408-id CLIP tokenizer"
        )
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.get)
    vocab_file, merges_file = folder / "vocab.json", folder / "merges.txt"
    vocab_file.write_text(json.dumps(vocab, ensure_ascii=False))
    # The header line: transformers' CLIP tokenizer skips the first line of merges.txt.
    merges_file.write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    return vocab_file, merges_file


def build_tokenizer(context_length: int):
    """transformers' CLIP tokenizer with open_clip's vocabulary, padding and truncation."""
    import tempfile

    try:  # transformers 4.x: the tokenizers-backed class is CLIPTokenizerFast (5.x keeps the name as an alias)
        from transformers import CLIPTokenizerFast as Tokenizer
    except ImportError:  # a release without the alias: CLIPTokenizer is the one (tokenizers-backed) class
        from transformers import CLIPTokenizer as Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        _clip_tokenizer_files(Path(tmp))
        # from_pretrained of a folder holding vocab.json and merges.txt: the constructor's own arguments differ
        # (4.x vocab_file/merges_file, 5.x vocab/merges), the folder loads the same in both.
        return Tokenizer.from_pretrained(
            tmp,
            pad_token="!",  # id 0, open_clip's padding
            model_max_length=context_length,  # truncation=True cuts at the context length, as open_clip does
            # A "!" in a caption stays an ordinary "!</w>" (id 256) instead of matching the pad token.
            split_special_tokens=True,
        )


def build_transformers(
    state: dict[str, torch.Tensor], model_cfg: dict, preprocess_cfg: dict | None, hf_tokenizer=None
):
    """transformers' ``CLIPModel`` holding ``state`` (the open_clip model's weights, as ds_clip.export loaded them
    strictly into open_clip's model: every CLIPModel key filled, no open_clip tensor left over) and its
    ``CLIPProcessor``, or for the SigLIP architecture ``SiglipModel`` and ``SiglipProcessor`` (``hf_tokenizer``:
    open_clip's HFTokenizer of the model); built in memory, so that a model that does not map is refused before
    anything is written."""
    if hf_siglip.is_siglip_architecture(model_cfg):
        return hf_siglip.build_siglip(state, model_cfg, preprocess_cfg, hf_tokenizer)
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    bias = state.get("logit_bias")
    config = CLIPConfig(
        **clip_config_kwargs(
            model_cfg, float(state["logit_scale"]), float(bias) if bias is not None else None
        )
    )
    config.architectures = ["CLIPModel"]
    model = CLIPModel(config)
    load_strictly(model, clip_state_dict(state), "CLIPModel")
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(**image_processor_kwargs(model_cfg, preprocess_cfg)),
        tokenizer=build_tokenizer(int(model_cfg["text_cfg"].get("context_length", 77))),
    )
    return model, processor


def save_transformers(out: Path, built) -> None:
    """Write what ``build_transformers`` built into ``out``: config.json, model.safetensors, the tokenizer files
    and the image processor's, in the files both transformers 4.x and 5.x read.

    transformers 5.x saves a processor as processor_config.json (the image processor nested in it) and a
    tokenizer as tokenizer.json and tokenizer_config.json alone; 4.x reads the image processor from
    preprocessor_config.json only (AutoProcessor, CLIPProcessor and the zero-shot pipeline refuse a folder
    without it) and keeps the slow tokenizer's files beside tokenizer.json. Whichever version exports, the
    folder gets both: preprocessor_config.json, special_tokens_map.json and, for CLIP, vocab.json and merges.txt
    (open_clip's BPE files, the ones tokenizer.json was built from)."""
    model, processor = built
    out = Path(out)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    if not (out / PREPROCESSOR_FILE).is_file():
        (out / PREPROCESSOR_FILE).write_text(processor.image_processor.to_json_string())
    nested = out / PROCESSOR_FILE
    if nested.is_file():
        # 4.x passes every key of processor_config.json to the processor's constructor: a nested image processor
        # is refused there ("Received a dict for argument image_processor"); 5.x reads it from
        # preprocessor_config.json when processor_config.json does not hold it.
        held = json.loads(nested.read_text())
        kept = {k: v for k, v in held.items() if not isinstance(v, dict)}
        if kept != held:
            nested.write_text(json.dumps(kept, indent=2) + "\n")
    tokenizer = processor.tokenizer
    _old_style_merges(out / "tokenizer.json")
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class") == "TokenizersBackend":
        # 5.x's name for a tokenizer held by tokenizer.json alone (the SigLIP export's); 4.x knows it as
        # PreTrainedTokenizerFast, a name 5.x still loads as the same class.
        config_file.write_text(
            json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n"
        )
    if isinstance(model.config, _clip_config_class()) and not (out / "merges.txt").is_file():
        _clip_tokenizer_files(out)
    if not (out / SPECIAL_TOKENS_FILE).is_file():
        special = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        named = {k: str(getattr(tokenizer, k)) for k in special if getattr(tokenizer, k, None) is not None}
        (out / SPECIAL_TOKENS_FILE).write_text(json.dumps(named, indent=2, ensure_ascii=False) + "\n")


def _old_style_merges(path: Path) -> None:
    """tokenizers 0.20+ writes a BPE model's merges as pairs (["a", "b"]), which the tokenizers of transformers
    4.40-4.44 (0.19) cannot parse ("data did not match any variant of untagged enum ModelWrapper"); every release
    reads them as "a b" strings, the form written here when no token holds a space (CLIP's never do)."""
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    merges = (data.get("model") or {}).get("merges")
    if not merges or not isinstance(merges[0], list) or any(" " in a or " " in b for a, b in merges):
        return
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2))


# The image processor's and the special tokens' files of transformers 4.x (5.x reads them too).
PREPROCESSOR_FILE, SPECIAL_TOKENS_FILE = "preprocessor_config.json", "special_tokens_map.json"
PROCESSOR_FILE = "processor_config.json"  # 5.x's processor file


def _clip_config_class():
    from transformers import CLIPConfig

    return CLIPConfig


__all__ = [
    "INSTALL_HINT",
    "MissingTransformersError",
    "UnmappableError",
    "build_tokenizer",
    "build_transformers",
    "check_mappable",
    "clip_config_kwargs",
    "clip_state_dict",
    "image_processor_kwargs",
    "require_transformers",
    "save_transformers",
    "target",
    "unmappable",
]
