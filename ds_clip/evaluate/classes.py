"""Zero-shot class names and prompt templates (``--zeroshot-classes``), and a caption's label among them."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_clip.evaluate.settings import EvalError


def load_zeroshot(path: str) -> tuple[list[str], list[Callable[[str], str]]]:
    """Class names and prompt templates from ``path``.

    JSON: {"classnames": [...], "templates": ["a photo of a {c}.", ...] | "openai" | "simple"}; a text file:
    one class name a line, open_clip's SIMPLE_IMAGENET_TEMPLATES.
    """

    p = Path(path).expanduser()
    if not p.is_file():
        raise EvalError(f"--zeroshot-classes {path!r}: no such file")
    templates: Any = "simple"
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text())
            classnames = [str(c) for c in data["classnames"]]
            templates = data.get("templates", "simple")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise EvalError(
                f"--zeroshot-classes {path}: expected {{'classnames': [...], 'templates': [...]}}"
            ) from exc
    else:
        classnames = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    if not classnames:
        raise EvalError(f"--zeroshot-classes {path}: no class names")
    return classnames, parse_templates(templates, f"--zeroshot-classes {path}")


def parse_templates(templates: Any, where: str) -> list[Callable[[str], str]]:
    """Prompt templates: "simple" / "openai" (open_clip's SIMPLE_IMAGENET_TEMPLATES / OPENAI_IMAGENET_TEMPLATES)
    or a list of strings with "{c}"; ``where`` (the flag and file) names a bad value."""
    import open_clip

    if templates == "simple":
        return list(open_clip.SIMPLE_IMAGENET_TEMPLATES)
    if templates == "openai":
        return list(open_clip.OPENAI_IMAGENET_TEMPLATES)
    if (
        isinstance(templates, list)
        and templates
        and all(isinstance(t, str) and "{c}" in t for t in templates)
    ):
        return [(lambda c, t=t: t.replace("{c}", c)) for t in templates]
    raise EvalError(f"{where}: templates must be 'simple', 'openai' or strings with {{c}}")


def load_templates(value: str) -> list[Callable[[str], str]]:
    """--zeroshot-templates: "openai", "simple", or a file: a JSON list of strings with "{c}", or one template
    a line."""
    if value in ("openai", "simple"):
        return parse_templates(value, "--zeroshot-templates")
    p = Path(value).expanduser()
    if not p.is_file():
        raise EvalError(f"--zeroshot-templates {value!r}: not openai, simple or a file")
    text = p.read_text()
    try:
        templates = (
            json.loads(text)
            if p.suffix == ".json"
            else [ln.strip() for ln in text.splitlines() if ln.strip()]
        )
    except json.JSONDecodeError as exc:
        raise EvalError(f"--zeroshot-templates {value}: not JSON ({exc})") from None
    return parse_templates(templates, f"--zeroshot-templates {value}")


def folder_classes(folder: str, classnames: str | None = None) -> tuple[list[str], list[str]]:
    """(class folders, class names) of a --zeroshot-folder tree (one folder of images per class, sorted as
    torchvision's ImageFolder sorts them). Names: the folder names with "_" read as a space, or from
    --zeroshot-classnames, a JSON object {folder: class name} naming every folder (or a JSON list of names in
    the folders' sorted order)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise EvalError(f"--zeroshot-folder {folder!r}: no such folder")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    if len(folders) < 2:
        raise EvalError(
            f"--zeroshot-folder {folder}: expected one sub-folder of images per class, at least two classes "
            f"(zero-shot chooses among them), found {len(folders)}"
        )
    if classnames is None:
        return folders, [f.replace("_", " ") for f in folders]
    p = Path(classnames).expanduser()
    try:
        names = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EvalError(f"--zeroshot-classnames {classnames!r}: not a readable JSON file ({exc})") from None
    if isinstance(names, dict):
        missing = [f for f in folders if f not in names]
        if missing:
            raise EvalError(
                f"--zeroshot-classnames {classnames}: no name for {len(missing)} of the {len(folders)} class "
                f"folders of {folder} (first: {missing[0]!r})"
            )
        return folders, [str(names[f]) for f in folders]
    if isinstance(names, list) and len(names) == len(folders):
        return folders, [str(n) for n in names]
    raise EvalError(
        f"--zeroshot-classnames {classnames}: expected {{folder: class name}} or a list of {len(folders)} names "
        "(the class folders' sorted order)"
    )


def label_from_caption(caption: str, classnames: list[str]) -> int:
    """Index of the one class name found as whole words in ``caption``; -1 for none or several."""
    low = caption.lower()
    hits = [i for i, c in enumerate(classnames) if re.search(rf"\b{re.escape(c.lower())}\b", low)]
    return hits[0] if len(hits) == 1 else -1
