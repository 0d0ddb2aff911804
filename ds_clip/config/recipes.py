"""Training recipes shipped with ds_clip (ds_clip/recipes/*.json): published runs that fix the global batch N.

    load_recipe("datacomp-medium")        # a shipped recipe, by name
    load_recipe("path/to/mine.json")      # a recipe of the user's own

A recipe file is {"description": ..., "source": ..., "settings": {FIELD: VALUE, ...}} with settings keyed by
the flags' dests (``global_batch_size``, ``lr``, ``warmup``...), as settings.json writes them. It never sets m,
W or k: N is fixed and k = N / (W*m) follows from the world size the job gets, so one recipe runs on any
number of GPUs. ds_clip.config applies it under the command line (flags given there win, except another N)
and checks every key and value against the flags. A low module just above ds_clip.ds_config.presets, whose loader of
shipped JSON files it shares (their files sit side by side in the wheel).
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from ds_clip.ds_config.presets import load_shipped_json
from ds_clip.errors import SettingsError

RECIPE_DIR = files("ds_clip") / "recipes"


def list_recipes() -> list[str]:
    """Names of the shipped recipes (file names without .json), sorted."""
    return sorted(p.name[: -len(".json")] for p in RECIPE_DIR.iterdir() if p.name.endswith(".json"))


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """A recipe name (ds_clip/recipes/<name>.json) or a path ending .json -> the recipe object, its "settings"
    a dict. SettingsError naming --recipe for a missing file, bad JSON or a missing "settings" object."""
    _, data = load_shipped_json(
        name_or_path, RECIPE_DIR, flag="--recipe", kind="a shipped recipe", shipped=list_recipes
    )
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise SettingsError(f'--recipe {name_or_path}: expected a JSON object with a "settings" object')
    return data


__all__ = ["RECIPE_DIR", "list_recipes", "load_recipe"]
