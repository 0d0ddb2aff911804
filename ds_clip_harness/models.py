"""Tiny open_clip model configs written as ``local-dir:`` folders (nothing is downloaded): the models of the
equivalence matrix (``CONFIGS``), the CLI runs (``E2E_MODEL``, ``COCA_E2E_MODEL``), the LiT starting point
and the distillation teachers (written with weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def coca_config(vision: dict, text: dict) -> dict:
    """open_clip's CoCa around a ViT and a text tower config: an attentional-pool image tower with output
    tokens, a text tower with a CLS token, and a one-block captioning decoder over the text tower's vocabulary
    (open_clip's CoCa needs embed_dim = text width = decoder width)."""
    return {
        "embed_dim": text["width"],
        "custom_text": True,
        "vision_cfg": {
            **vision,
            "attentional_pool": True,
            "attn_pooler_heads": 2,
            "attn_pooler_queries": 4,
            "output_tokens": True,
        },
        "text_cfg": {**text, "embed_cls": True, "output_tokens": True},
        "multimodal_cfg": {
            "context_length": text["context_length"],
            "vocab_size": text["vocab_size"],
            "width": text["width"],
            "heads": text["heads"],
            "layers": 1,
        },
    }


# For runs of the real CLI: the built-in captions go through open_clip's SimpleTokenizer, so the text
# tower needs its full vocabulary.
E2E_MODEL = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}

# The tiny CoCa of the trainer and launcher runs (the tokenizer's full vocabulary, as E2E_MODEL).
COCA_E2E_MODEL = coca_config(E2E_MODEL["vision_cfg"], E2E_MODEL["text_cfg"])

# The SigLIP architecture of open_clip's published SigLIP configs (ViT-B-16-SigLIP.json and kin), for the
# transformers SiglipModel export: open_clip's TimmModel passes no depth or width to timm, so the image tower is
# a published one, the smallest (timm's vit_base_patch32_siglip_256: 64 patches, tanh GELU, MAP pooling); the
# text tower is tiny, bidirectional, pooled at its last position, with the word-level tokenizer
# write_siglip_dir saves into the model's folder (open_clip reads a local-dir: model's tokenizer from there).
SIGLIP_WORDS = (
    "a an the of on in with next to them photo red green blue yellow white grey black purple orange small large center "
    "circle square triangle diamond star cross centre top bottom left right background wow 2"
).split()
SIGLIP_E2E_MODEL = {
    "embed_dim": 768,
    "init_logit_bias": -10,
    "custom_text": True,
    "vision_cfg": {
        "image_size": 256,
        "timm_model_name": "vit_base_patch32_siglip_256",
        "timm_model_pretrained": False,
        "timm_pool": "map",
        "timm_proj": "none",
    },
    "text_cfg": {
        "context_length": 16,
        "vocab_size": len(SIGLIP_WORDS) + 3,
        "hf_tokenizer_name": "",  # write_siglip_dir names the folder
        "tokenizer_kwargs": {"clean": "canonicalize"},
        "width": 64,
        "heads": 2,
        "layers": 1,
        "no_causal_mask": True,
        "proj_bias": True,
        "pool_type": "last",
        "norm_kwargs": {"eps": 1e-6},
        "act_kwargs": {"approximate": "tanh"},
    },
}
SIGLIP_PREPROCESS = {
    "size": [256, 256],
    "mean": [0.5, 0.5, 0.5],
    "std": [0.5, 0.5, 0.5],
    "interpolation": "bicubic",
    "resize_mode": "squash",
}


def write_siglip_dir(folder: Path) -> str:
    """FOLDER with SIGLIP_E2E_MODEL's open_clip_config.json (its hf_tokenizer_name: FOLDER) and a word-level
    Hugging Face tokenizer (pad 0, end-of-text 1 appended to every caption, unknown 2; as SigLIP's, the
    end-of-text is not the last position unless the caption fills the context); 'local-dir:FOLDER'."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *SIGLIP_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(folder))
    text_cfg = {**SIGLIP_E2E_MODEL["text_cfg"], "hf_tokenizer_name": str(folder)}
    config = {"model_cfg": {**SIGLIP_E2E_MODEL, "text_cfg": text_cfg}, "preprocess_cfg": SIGLIP_PREPROCESS}
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    return f"local-dir:{folder}"


TEXT = {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}

# A --distill-model teacher for E2E_MODEL students (the same image size and tokenizer, wider, its own
# embedding size); written with weights by write_pretrained_dir.
E2E_TEACHER = {
    "embed_dim": 24,
    "vision_cfg": {**E2E_MODEL["vision_cfg"], "width": 48, "head_width": 24},
    "text_cfg": {**E2E_MODEL["text_cfg"], "width": 48},
}

VIT_VISION = {
    "image_size": 16,
    "layers": 1,
    "width": 32,
    "patch_size": 8,
    "head_width": 16,
    "patch_dropout": 0.25,
}

COCA = coca_config(VIT_VISION, TEXT)

CONFIGS: dict[str, dict] = {
    # native open_clip ViT with FLIP-style patch dropout (draws from the CPU generator)
    "vit": {
        "embed_dim": 16,
        "vision_cfg": VIT_VISION,
        "text_cfg": TEXT,
    },
    "vit_siglip": {
        "embed_dim": 16,
        "init_logit_bias": -10.0,
        "vision_cfg": VIT_VISION,
        "text_cfg": TEXT,
    },
    # timm tower with nn.Dropout (head) and DropPath (stochastic depth)
    "timm_dropout": {
        "embed_dim": 16,
        "vision_cfg": {
            "image_size": 32,
            "timm_model_name": "test_vit",
            "timm_model_pretrained": False,
            "timm_pool": "avg",
            "timm_proj": "linear",
            "timm_drop": 0.2,
            "timm_drop_path": 0.1,
        },
        "text_cfg": TEXT,
    },
    # open_clip's CoCa: attentional-pool image tower with output tokens, a text tower with a CLS token and a
    # one-block captioning decoder over the 64-token vocabulary (its cross-attention reads the image tokens)
    "coca": COCA,
    # open_clip's ModifiedResNet: BatchNorm running statistics
    "resnet_bn": {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8},
        "text_cfg": TEXT,
    },
}


# A pretrained model as a LiT fine-tune starts from it: an open_clip folder (config + weights) as
# ds-clip-export writes it; its weights differ from what seed 0 would initialise.
PRETRAINED = {"lit": "vit"}
PRETRAINED_SEED = 1234

# A distillation teacher (--distill-model): the student's inputs (image size, tokenizer), another width and
# embedding size (the distill loss compares N x N logits, not embeddings), its own weights and patch dropout
# in its config, which only a teacher left in train mode would draw.
TEACHER = {
    "embed_dim": 24,
    "vision_cfg": {**VIT_VISION, "width": 48, "head_width": 24},
    "text_cfg": {**TEXT, "width": 48, "heads": 2},
}
TEACHER_SEED = 4321


def write_pretrained_dir(folder: Path, model_cfg: dict, seed: int = PRETRAINED_SEED) -> str:
    """FOLDER/open_clip_config.json and FOLDER/open_clip_model.safetensors of a tiny open_clip model
    initialised from ``seed`` (open_clip's own names and shapes, loaded strictly); 'local-dir:FOLDER'."""
    import open_clip
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}}))
    torch.manual_seed(seed)
    model = open_clip.CLIP(**model_cfg)
    save_file(
        {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
        str(folder / "open_clip_model.safetensors"),
    )
    return f"local-dir:{folder}"


def write_model_dirs(root: Path) -> dict[str, str]:
    """Write every config as ROOT/NAME/open_clip_config.json, and each PRETRAINED model with weights;
    return NAME -> 'local-dir:...'."""
    names = {}
    for name, cfg in CONFIGS.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
        names[name] = f"local-dir:{d}"
    for name, base in PRETRAINED.items():
        names[name] = write_pretrained_dir(root / name, CONFIGS[base])
    names["teacher"] = write_pretrained_dir(root / "teacher", TEACHER, seed=TEACHER_SEED)
    return names
