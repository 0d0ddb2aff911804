"""The DeepSpeed JSON of a run: a shipped preset or the user's file, resolved against the run's flags.

    resolve   preset or JSON + flags -> the resolved config (``resolve_deepspeed``), "auto" filled, files written
    rules     the rules that make a config fit the cached step, one function each
    presets   the presets shipped in ds_clip/ds_configs and the precision and optimizer names

Nothing here imports the settings tree (ds_clip.config): the resolver takes the flags it reads
(``DeepSpeedRequest``) and the batch geometry. Imports neither torch nor DeepSpeed.
"""

from ds_clip.ds_config.presets import PRESET_DIR, list_presets, load_preset
from ds_clip.ds_config.resolve import ResolvedDeepSpeed, resolve_deepspeed, step_engine_config

__all__ = [
    "PRESET_DIR",
    "ResolvedDeepSpeed",
    "list_presets",
    "load_preset",
    "resolve_deepspeed",
    "step_engine_config",
]
