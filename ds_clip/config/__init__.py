"""Typed training settings, the one source of every flag: sections of fields -> CLI, --help, docs, checks.

    python -m ds_clip.train --help                    # every flag, by section, with units and defaults
    python scripts/gen_configuration_doc.py           # rewrites docs/configuration.md from these fields

Each field of a section is one flag: its type, default and docstring make the flag, its --help line and its
row in docs/configuration.md; small metadata (`opt(...)`) adds what the field cannot say (another flag name,
choices, a unit, how the flag relates to open_clip's). `ds-clip-eval` builds its shared flags (`--val-data`,
`--batch-size`, ...) from the same fields (`add_flags`).

Precedence: command-line flag > recipe > the DeepSpeed JSON (`--ds-config`) > the defaults of the fields. The
JSON's training keys (batch triple, clipping, optimizer, scheduler, precision) fill the fields whose flags were
left at their defaults (`ds_json`); `TrainSettings.sources` records where each value came from, and
`ds_clip.ds_config.resolve.resolve_deepspeed` writes the settings back into the JSON, "auto" keys included: it reads
`TrainSettings.deepspeed_request()` (the flags it needs) and the batch geometry, never the whole tree.

The modules, each importing only those below it (import-linter, pyproject.toml):

- `parser`: the command line (`build_parser`, `add_flags`) parsed into validated settings (`parse_settings`);
- `answers`: open_clip_train's flags ds_clip has no field for, each answered with one line (`ANSWERED`);
- `validation`: `validate`, every rule in one pass (cheap: no deepspeed, no torch.distributed);
- `resolve`: what a launch of W ranks derives at start (`resolve_geometry`, `resolve_deepspeed_for`);
- `ds_json`: a --ds-config file's training keys read as settings (`lift_ds_json`);
- `model_checks`, `checks`: the rules of each section (`check_data`, `check_eval`, `check_model_flags`, ...);
- `flags`: the fields read as flags (`flags`, `Flag`) and the flat settings dict (`settings_to_dict`);
- `sections`: the section dataclasses and `TrainSettings`, the whole tree;
- `fields`: a field's metadata (`opt`) and the choices fields share.
"""

from ds_clip.config.answers import ANSWERED, answer
from ds_clip.config.checks import check_data, check_eval, imagenet_class_folders
from ds_clip.config.fields import (
    BUILTIN_MODELS,
    DATASET_TYPES,
    DEFAULT_SYNTHETIC_SAMPLES,
    LOCAL_DIR_PREFIX,
    LOSS_IMPLS,
    LR_SCHEDULERS,
    PRECISIONS,
    REPORTERS,
)
from ds_clip.config.flags import Flag, flag_named, flags, settings_to_dict
from ds_clip.config.model_checks import aug_cfg_dict, check_model_flags
from ds_clip.config.parser import Parser, add_flags, build_parser, default_run_name, parse_settings
from ds_clip.config.resolve import resolve_deepspeed_for, resolve_ds_config, resolve_geometry
from ds_clip.config.sections import (
    CheckpointSettings,
    DataSettings,
    DistSettings,
    EmaSettings,
    EvalSectionSettings,
    LoggingSettings,
    LossSettings,
    ModelSettings,
    OptimSettings,
    TrainSettings,
)
from ds_clip.config.validation import validate
from ds_clip.errors import SettingsError

__all__ = [
    "ANSWERED",
    "Parser",
    "BUILTIN_MODELS",
    "CheckpointSettings",
    "DATASET_TYPES",
    "DEFAULT_SYNTHETIC_SAMPLES",
    "DataSettings",
    "DistSettings",
    "EmaSettings",
    "EvalSectionSettings",
    "Flag",
    "LOCAL_DIR_PREFIX",
    "LOSS_IMPLS",
    "LR_SCHEDULERS",
    "LoggingSettings",
    "LossSettings",
    "ModelSettings",
    "OptimSettings",
    "PRECISIONS",
    "REPORTERS",
    "SettingsError",
    "TrainSettings",
    "add_flags",
    "answer",
    "aug_cfg_dict",
    "build_parser",
    "check_data",
    "check_eval",
    "check_model_flags",
    "default_run_name",
    "flag_named",
    "flags",
    "imagenet_class_folders",
    "parse_settings",
    "resolve_deepspeed_for",
    "resolve_ds_config",
    "resolve_geometry",
    "settings_to_dict",
    "validate",
]
