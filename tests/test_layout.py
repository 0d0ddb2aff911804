"""The layout (docs/code.md): ds_clip/ holds packages named for their job, the entry points and a few
foundations; the import paths users rely on keep working after the modules moved into packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ds_clip

PACKAGE = Path(ds_clip.__file__).parent
PACKAGES = {
    "checkpoint",
    "config",
    "data",
    "ds_config",
    "evaluate",
    "export",
    "models",
    "siglip2",
    "sources",
    "step",
    "training",
}
ENTRY_POINTS = {"train", "demo", "shards", "fetch", "preflight"}
FOUNDATIONS = {"distributed", "errors", "geometry", "host_memory", "shm", "stop_signals", "versions"}


def test_top_level_is_packages_entry_points_and_foundations():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == PACKAGES and modules == ENTRY_POINTS | FOUNDATIONS, (packages, modules)


def test_the_paths_users_rely_on_keep_working():
    import ds_clip.step
    from ds_clip.checkpoint import save
    from ds_clip.config import parse_settings
    from ds_clip.ds_config import load_preset, resolve_deepspeed, step_engine_config
    from ds_clip.step import StepResult, cached_step

    assert cached_step is ds_clip.cached_step and StepResult is ds_clip.StepResult
    assert step_engine_config is ds_clip.step_engine_config
    assert callable(save) and callable(parse_settings) and callable(resolve_deepspeed)
    assert load_preset("zero2_bf16")["zero_optimization"]["stage"] == 2
    for module in ("ds_clip.train", "ds_clip.export", "ds_clip.evaluate", "ds_clip.fetch", "ds_clip.shards"):
        proc = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0 and "usage:" in proc.stdout, (module, proc.stderr[-2000:])
