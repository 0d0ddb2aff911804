"""Tiny open_clip model configs written as `local-dir:` folders (no download, seconds on a CPU)."""

from __future__ import annotations

import json
from pathlib import Path

# For runs of the real CLI: the built-in captions go through open_clip's SimpleTokenizer, so the text
# tower needs its full vocabulary.
E2E_MODEL = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}

TEXT = {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}

VIT_VISION = {
    "image_size": 16,
    "layers": 1,
    "width": 32,
    "patch_size": 8,
    "head_width": 16,
    "patch_dropout": 0.25,
}

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
    # open_clip's ModifiedResNet: BatchNorm running statistics
    "resnet_bn": {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8},
        "text_cfg": TEXT,
    },
}


def write_model_dirs(root: Path) -> dict[str, str]:
    """Write every config as ROOT/NAME/open_clip_config.json; return NAME -> 'local-dir:...'."""
    names = {}
    for name, cfg in CONFIGS.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
        names[name] = f"local-dir:{d}"
    return names
