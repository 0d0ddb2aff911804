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
    import open_clip

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
    if templates == "simple":
        fns = list(open_clip.SIMPLE_IMAGENET_TEMPLATES)
    elif templates == "openai":
        fns = list(open_clip.OPENAI_IMAGENET_TEMPLATES)
    elif (
        isinstance(templates, list)
        and templates
        and all(isinstance(t, str) and "{c}" in t for t in templates)
    ):
        fns = [(lambda c, t=t: t.replace("{c}", c)) for t in templates]
    else:
        raise EvalError(
            f"--zeroshot-classes {path}: templates must be 'simple', 'openai' or strings with {{c}}"
        )
    return classnames, fns


def label_from_caption(caption: str, classnames: list[str]) -> int:
    """Index of the one class name found as whole words in ``caption``; -1 for none or several."""
    low = caption.lower()
    hits = [i for i, c in enumerate(classnames) if re.search(rf"\b{re.escape(c.lower())}\b", low)]
    return hits[0] if len(hits) == 1 else -1
