"""ds-clip-eval: evaluate an exported (or any open_clip) model.

ds-clip-eval OUT --val-data synthetic --zeroshot-classes classes.json      # an exported folder
ds-clip-eval ViT-B-32 --pretrained OUT/open_clip_model.safetensors --val-data 'val/{0..3}.tar'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ds_clip.config import DataSettings, EvalSectionSettings, SettingsError, add_flags, check_data, check_eval
from ds_clip.evaluate.classes import load_zeroshot
from ds_clip.evaluate.runner import evaluate
from ds_clip.evaluate.settings import EVAL_BATCH_SIZE, EvalError, EvalSettings

# The flags ds-clip-eval shares with ds-clip-train, each defined once (ds_clip.config's fields).
SHARED_FLAGS = ("pretrained", "val_data", "val_num_samples", "batch_size", "zeroshot_classes", "seed",
                "image_key", "caption_key")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds-clip-eval",
        description="Evaluate an exported (or any open_clip) model: val loss, retrieval recall, zero-shot accuracy.",
    )
    p.add_argument(
        "model", help="exported folder (ds-clip-export OUT), local-dir:PATH, or an open_clip model name"
    )
    add_flags(p, SHARED_FLAGS, val_data={"required": True}, batch_size={"default": EVAL_BATCH_SIZE})
    p.add_argument("--out", metavar="JSON", default=None, help="also write the metrics to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            section = EvalSectionSettings(
                val_data=args.val_data,
                val_num_samples=args.val_num_samples,
                zeroshot_classes=args.zeroshot_classes,
            )
            check_eval(section, batch_size=args.batch_size)
            check_data(DataSettings(seed=args.seed, image_key=args.image_key, caption_key=args.caption_key))
        except SettingsError as exc:
            raise EvalError(str(exc)) from exc
        if args.zeroshot_classes:
            load_zeroshot(args.zeroshot_classes)
        name = args.model
        if Path(name).is_dir() and (Path(name) / "open_clip_config.json").is_file():
            name = f"local-dir:{name}"
        from ds_clip.export import resolve_pretrained
        from ds_clip.model import build_model, load_model_cfg

        try:
            bundle = build_model(name, pretrained=resolve_pretrained(args.pretrained), seed=None)
        except (RuntimeError, ValueError, FileNotFoundError) as exc:
            raise EvalError(f"cannot load model {args.model!r}: {exc}") from exc
    except EvalError as exc:
        print(f"ds-clip-eval: error: {exc}", file=sys.stderr)
        return 2
    model = bundle.model.eval()
    size = load_model_cfg(name)["vision_cfg"].get("image_size", 224)
    s = EvalSettings(
        **{name: getattr(args, name) for name in SHARED_FLAGS if name != "pretrained"},
        image_size=size if isinstance(size, int) else size[0],
    )
    metrics = evaluate(
        lambda image=None, text=None: model(image=image, text=text),
        s,
        preprocess=bundle.preprocess_val,
        tokenizer=bundle.tokenizer,
    )
    text = json.dumps(metrics, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
