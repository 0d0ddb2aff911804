"""ds-clip-eval: evaluate an exported (or any open_clip) model.

ds-clip-eval OUT --val-data synthetic --zeroshot-classes classes.json      # an exported folder
ds-clip-eval ViT-B-32 --pretrained OUT/open_clip_model.safetensors --val-data 'val/{0..3}.tar'
ds-clip-eval ViT-B-32 --pretrained laion2b_s34b_b79k --val-data ...      # an open_clip tag (docs/pretrained.md)
ds-clip-eval OUT --val-data val.csv --csv-separator , --zeroshot-folder pets/   # a CSV; your own classes
ds-clip-eval OUT --val-data val.txt --dataset-type csv                          # a table of another name
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ds_clip.config import (
    DataSettings,
    EvalSectionSettings,
    Parser,
    SettingsError,
    add_flags,
    check_data,
    check_eval,
)
from ds_clip.errors import UserError
from ds_clip.evaluate.classes import load_zeroshot
from ds_clip.evaluate.datasets import imagenet_samples
from ds_clip.evaluate.inputs import check_class_images, check_val_data, check_zeroshot_folder
from ds_clip.evaluate.runner import evaluate
from ds_clip.evaluate.settings import EVAL_BATCH_SIZE, EvalError, EvalFailed, EvalSettings, is_table
from ds_clip.evaluate.zeroshot import classify_folders, folder_task, imagenet_tasks

# The flags ds-clip-eval shares with ds-clip-train, each defined once (ds_clip.config's fields).
SHARED_FLAGS = ("pretrained", "cache_dir", "val_data", "val_num_samples", "batch_size", "zeroshot_classes", "seed",
                "image_key", "caption_key", "csv_separator", "csv_img_key", "csv_caption_key", "zeroshot_folder",
                "zeroshot_classnames", "zeroshot_templates", "imagenet_val", "imagenet_v2", "dataset_type")  # fmt: skip
_EVAL_FIELDS = ("val_data", "val_num_samples", "zeroshot_classes", "seed", "image_key", "caption_key",
                "csv_separator", "csv_img_key", "csv_caption_key", "batch_size")  # fmt: skip


def transformers_folder_message(folder: str) -> str:
    """The one line for a transformers folder (config.json, no open_clip_config.json): ds-clip-eval evaluates
    open_clip models, and ds-clip-export writes the same checkpoint as one."""
    try:
        kind = json.loads((Path(folder) / "config.json").read_text()).get("model_type") or "?"
    except (OSError, ValueError, AttributeError):
        kind = "?"
    return (
        f"{folder} is a transformers folder (config.json, model_type {kind}), not an open_clip model: export the "
        "same checkpoint in open_clip format (ds-clip-export RUN OUT) and pass OUT to ds-clip-eval"
    )


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="ds-clip-eval",
        description="Evaluate an exported (or any open_clip) model: val loss, retrieval recall, zero-shot accuracy "
        "(on --val-data, and on class folders: --zeroshot-folder, --imagenet-val, --imagenet-v2).",
    )
    p.add_argument(
        "model",
        help="exported folder (ds-clip-export OUT), local-dir:PATH, hf-hub:ORG/REPO, or an open_clip model name "
        "(with --pretrained TAG|FILE)",
    )
    # --dataset-type csv reads a --val-data table whose name does not end in .csv/.tsv, as in ds-clip-train.
    add_flags(p, SHARED_FLAGS, batch_size={"default": EVAL_BATCH_SIZE}, dataset_type={"default": "auto"})
    p.add_argument("--out", metavar="JSON", default=None, help="also write the metrics to this file")
    return p


def _check_inputs(args: argparse.Namespace) -> tuple[EvalSettings | None, dict[str, str]]:
    """Every input checked before a model is loaded: (the --val-data evaluation, the ImageNet folders)."""
    try:
        section = EvalSectionSettings(
            **{n: getattr(args, n) for n in SHARED_FLAGS if hasattr(EvalSectionSettings, n)}
        )
        check_eval(section, batch_size=args.batch_size)
        check_data(
            DataSettings(
                seed=args.seed, image_key=args.image_key, caption_key=args.caption_key,
                csv_separator=args.csv_separator, csv_img_key=args.csv_img_key, csv_caption_key=args.csv_caption_key,
            )
        )  # fmt: skip
    except SettingsError as exc:
        raise EvalError(str(exc)) from exc
    imagenet = {
        flag: folder
        for flag, folder in (("--imagenet-val", args.imagenet_val), ("--imagenet-v2", args.imagenet_v2))
        if folder is not None
    }
    if not args.val_data and not imagenet and not args.zeroshot_folder:
        raise EvalError(
            "nothing to evaluate: give --val-data, --zeroshot-folder, --imagenet-val or --imagenet-v2"
        )
    s = None
    if args.val_data:
        table = is_table(args.val_data, args.dataset_type)
        s = EvalSettings(**{n: getattr(args, n) for n in _EVAL_FIELDS}, table=table)
        check_val_data(s)
    if args.zeroshot_classes:
        load_zeroshot(args.zeroshot_classes)
    for flag, folder in imagenet.items():
        try:
            check_class_images(imagenet_samples(folder, flag), flag, folder)
        except SettingsError as exc:
            raise EvalError(str(exc)) from exc
    if args.zeroshot_folder:
        check_zeroshot_folder(args.zeroshot_folder, args.zeroshot_classnames, args.zeroshot_templates)
    return s, imagenet


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        s, imagenet = _check_inputs(args)
        name = args.model
        if Path(name).is_dir() and (Path(name) / "open_clip_config.json").is_file():
            name = f"local-dir:{name}"
        elif Path(name).is_dir() and (Path(name) / "config.json").is_file():
            raise EvalError(transformers_folder_message(args.model))
        from ds_clip.config.model_checks import check_pretrained
        from ds_clip.models.model import build_model, load_model_cfg
        from ds_clip.models.weights import resolve_pretrained

        if args.pretrained:
            try:
                check_pretrained(args.pretrained, model=name)
            except SettingsError as exc:
                raise EvalError(str(exc)) from exc
        try:  # published weights: fetched into --cache-dir unless cached; offline, refused when not cached
            bundle = build_model(
                name, pretrained=resolve_pretrained(args.pretrained), seed=None, cache_dir=args.cache_dir
            )
        except (RuntimeError, ValueError, FileNotFoundError) as exc:
            raise EvalError(f"cannot load model {args.model!r}: {exc}") from exc
    except (EvalError, UserError) as exc:
        print(f"ds-clip-eval: error: {exc}", file=sys.stderr)
        return 2
    model = bundle.model.eval()

    def forward(image=None, text=None):
        return model(image=image, text=text)

    metrics: dict[str, float] = {}
    try:
        if s is not None:
            size = load_model_cfg(name, args.cache_dir)["vision_cfg"].get("image_size", 224)
            s.image_size = size if isinstance(size, int) else size[0]
            metrics.update(evaluate(forward, s, preprocess=bundle.preprocess_val, tokenizer=bundle.tokenizer))
        tasks = imagenet_tasks(imagenet, bundle.tokenizer)
        if args.zeroshot_folder:
            tasks.append(folder_task(args.zeroshot_folder, args.zeroshot_classnames, args.zeroshot_templates))
        if tasks:
            metrics.update(
                classify_folders(
                    forward, tasks, preprocess=bundle.preprocess_val, tokenizer=bundle.tokenizer,
                    batch_size=args.batch_size, device="cpu",
                )
            )  # fmt: skip
    except EvalFailed as exc:
        print(f"ds-clip-eval: error: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(metrics, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
