"""Training recipes shipped with ds_clip (ds_clip/recipes/*.json): published runs that fix the global batch N.

    load_recipe("datacomp-medium")        # a shipped recipe, by name
    load_recipe("path/to/mine.json")      # a recipe of the user's own

A recipe file is {"description": ..., "source": ..., "settings": {FIELD: VALUE, ...}} with settings keyed by
the flags' dests (``global_batch_size``, ``lr``, ``warmup``...), as settings.json writes them. It never sets m,
W or k: N is fixed and k = N / (W*m) follows from the world size the job gets, so one recipe runs on any
number of GPUs. ds_clip.config applies it under the command line (flags given there win, except another N)
and checks every key and value against the flags. A low module (standard library and ds_clip.errors only),
beside ds_clip.presets, whose shipped files sit next to these in the wheel.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from ds_clip.errors import SettingsError

RECIPE_DIR = files("ds_clip") / "recipes"


def list_recipes() -> list[str]:
    """Names of the shipped recipes (file names without .json), sorted."""
    return sorted(p.name[: -len(".json")] for p in RECIPE_DIR.iterdir() if p.name.endswith(".json"))


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """A recipe name (ds_clip/recipes/<name>.json) or a path ending .json -> the recipe object, its "settings"
    a dict. SettingsError naming --recipe for a missing file, bad JSON or a missing "settings" object."""
    if name_or_path.endswith(".json"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise SettingsError(f"--recipe {name_or_path}: no such file")
    else:
        path = RECIPE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise SettingsError(
                f"--recipe {name_or_path!r} is neither a shipped recipe ({', '.join(list_recipes())}) nor a path "
                "ending .json"
            )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SettingsError(f"--recipe {name_or_path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise SettingsError(f'--recipe {name_or_path}: expected a JSON object with a "settings" object')
    return data


__all__ = ["RECIPE_DIR", "list_recipes", "load_recipe"]
