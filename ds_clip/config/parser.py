"""The command line of ds-clip-train: one flag per settings field (`add_flags`, `build_parser`), parsed into
validated settings (`parse_settings`).

Precedence: command-line flag > recipe (`--recipe`) > the DeepSpeed JSON (`--ds-config`: its batch keys, clipping,
optimizer, scheduler and precision, `config.ds_json`) > the fields' defaults. `TrainSettings.sources` records which
one each field came from, so a default the user did not choose never conflicts with the JSON.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import typing
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from ds_clip.config.answers import ANSWERED, Answered
from ds_clip.config.ds_json import lift_ds_json
from ds_clip.config.fields import LOCAL_DIR_PREFIX
from ds_clip.config.flags import Flag, base_type, flag_named, flags
from ds_clip.config.recipes import load_recipe
from ds_clip.config.sections import TrainSettings
from ds_clip.config.validation import FINAL_SYNC_SPARE_S, validate
from ds_clip.ds_config.presets import deepspeed_precision
from ds_clip.errors import SettingsError
from ds_clip.versions import versions_line


def _optional(kind: type):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _comma_list(text: str) -> list[str]:
    return [r.strip() for r in text.split(",") if r.strip()]


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    names: Iterable[str],
    **overrides: dict[str, Any],
) -> None:
    """Add the flags of fields `names` to `parser`; `overrides[name]` changes add_argument keywords
    (ds-clip-eval: `batch_size={"default": 64}`, `val_data={"required": True}`)."""
    for name in names:
        f = flag_named(name)
        m = f.meta
        kw: dict[str, Any] = {"dest": f.name}
        if f.is_switch:
            kw["action"] = "store_true"
        else:
            base = base_type(f.type)
            if m["nargs"]:  # several words, each of the list's item type (open_clip's nargs flags)
                kw["nargs"] = m["nargs"]
                kw["type"] = typing.get_args(base)[0]
            elif typing.get_origin(f.type) is list:
                kw["type"] = _comma_list
            elif base in (int, float):  # an optional number also takes "none"
                kw["type"] = _optional(base) if type(None) in typing.get_args(f.type) else base
            kw["default"] = (
                None if m["derived"] else (list(f.default) if isinstance(f.default, list) else f.default)
            )
            if m["choices"]:
                kw["choices"] = m["choices"]
            if m["metavar"]:
                kw["metavar"] = m["metavar"]
        kw.update(overrides.get(name, {}))
        shown = str(kw["default"]) if "default" in overrides.get(name, {}) else f.shown_default()
        kw["help"] = argparse.SUPPRESS if m["hidden"] else _help(f, None if kw.get("required") else shown)
        parser.add_argument(*f.options, **kw)


def _help(f: Flag, shown_default: str | None) -> str:
    """The --help line: the field's docstring, then its unit and default (none shown for a required flag)."""
    notes = [f"unit: {f.meta['unit']}"] if f.meta["unit"] else []
    notes += [] if f.is_switch or shown_default is None else [f"default: {shown_default}"]
    return (f.doc + (f" ({'; '.join(notes)})" if notes else "")).replace("%", "%%")


class _PrintVersions(argparse.Action):
    """--version: one unwrapped line (argparse's own version action folds it to the terminal's width)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions_line(), flush=True)
        parser.exit(0)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: the problem, the closest flag to a mistyped one (difflib) and a pointer
    to --help, instead of the whole usage (some 65 lines for ds-clip-train) before the one line that matters."""

    def error(self, message: str) -> typing.NoReturn:
        sys.stderr.write(
            f"{self.prog}: error: {self.explain(message)}; `{self.prog} --help` lists every flag\n"
        )
        sys.exit(2)

    def explain(self, message: str) -> str:
        """``message`` with "(did you mean --x?)" after each unrecognized flag that is close to a known one."""
        if not message.startswith("unrecognized arguments:"):
            return message
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        guesses = []  # (what was typed, the closest known flag)
        for word in message.split(":", 1)[1].split():
            typed = word.split("=", 1)[0]
            close = difflib.get_close_matches(typed, known, n=1, cutoff=0.6) if typed.startswith("--") else []
            guesses += [(typed, close[0])] if close else []
        if not guesses:
            return message
        if len(guesses) == 1:
            return f"{message} (did you mean {guesses[0][1]}?)"
        return f"{message} (did you mean {', '.join(f'{k} for {t}' for t, k in guesses)}?)"


def build_parser() -> argparse.ArgumentParser:
    """The command line of `ds-clip-train` / `python -m ds_clip.train`: one flag per settings field."""
    p = Parser(
        prog="ds-clip-train",
        description="Train CLIP/SigLIP with DeepSpeed and exact cached-feature gradient accumulation: "
        "one optimizer step = accum-freq micro-batches of batch-size pairs on every rank. "
        "Steps are optimizer steps; pairs are image-text samples.",
    )
    p.add_argument(
        "--version", action=_PrintVersions, nargs=0, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
        help="print the versions of ds_clip, torch, DeepSpeed, open_clip, webdataset, huggingface_hub and "
        "transformers on one line, and exit",
    )  # fmt: skip
    for section, cls in TrainSettings.section_types().items():
        group = p.add_argument_group(section, (cls.__doc__ or "").split(": ", 1)[-1])
        add_flags(group, [f.name for f in flags() if f.section == section])
    group = p.add_argument_group(
        "open_clip flags ds_clip answers",
        "open_clip_train's flags with no ds_clip counterpart: exit 2 saying why",
    )
    for option, (takes_value, why) in ANSWERED.items():
        # A metavar of its own: argparse would otherwise derive one from dest and print "==SUPPRESS==".
        value = {"metavar": "VALUE"} if takes_value else {}
        group.add_argument(
            option, action=Answered, nargs="?" if takes_value else 0, dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS, help=why.replace("%", "%%"), **value,
        )  # fmt: skip
    return p


def parse_settings(argv: list[str] | None = None) -> TrainSettings:
    """Parse the command line (sys.argv[1:] when None), fill derived defaults, validate.

    Raises SettingsError for bad values; argparse itself exits 2 on malformed flags.
    """
    values: dict[str, Any] = vars(build_parser().parse_args(argv))
    given = _given(argv)
    sources = dict.fromkeys(given, "flag")
    if values["recipe"]:
        values, from_recipe = _with_recipe(values, given)
        sources.update(dict.fromkeys(from_recipe, "recipe"))
    if values["ds_config"]:
        sources.update(lift_ds_json(values["ds_config"], values, lambda name: _chosen(name, values, sources)))
    if values["epochs"] is None and values["max_steps"] is None:
        values["epochs"] = (
            1  # with --max-steps alone, it alone ends the run (ds_clip.training.schedule.RunLength)
        )
    if values["accum_freq"] is None and values["global_batch_size"] is None:
        values["accum_freq"] = 1  # with --global-batch-size, k is derived at start from the world size
    if values["dataset_type"] in (None, "auto"):  # a .csv/.tsv file is csv, other data shards, none synthetic
        values["dataset_type"] = _derived_dataset_type(values["train_data"])
    if values["precision"] is None:  # neither the flag nor the JSON's enabled precision section
        values["precision"] = "fp32"
    values["precision"] = deepspeed_precision(values["precision"])  # open_clip's names -> DeepSpeed's
    if values["siglip2"]:
        values["siglip"] = True  # SigLIP 2's objective is the sigmoid loss plus its other terms
    if values["delete_previous_checkpoint"] and values["keep_checkpoints"] is None:
        values["keep_checkpoints"] = 1  # open_clip's flag for --keep-checkpoints 1
    if (
        values["remote_sync"] is not None
        and "remote_sync_final_timeout" not in sources
        and values["remote_sync_final_timeout"] + FINAL_SYNC_SPARE_S
        > values["dist_timeout"]
        > FINAL_SYNC_SPARE_S
    ):
        # The default last sync must end within the --dist-timeout the user chose (check_final_sync_fits): a
        # default nobody passed is fitted to it, not refused; a value the user passed is theirs to change.
        values["remote_sync_final_timeout"] = int(values["dist_timeout"]) - FINAL_SYNC_SPARE_S
    s = TrainSettings.of(**values)
    s.sources = sources
    if s.logging.name is None:
        # An automatic name is new every run, so "latest" would silently start from scratch.
        if s.checkpoint.resume == "latest":
            raise SettingsError("--resume latest needs --name of the run to continue")
        s.logging.name = default_run_name(s)
    validate(s)
    return s


def _chosen(name: str, values: dict[str, Any], sources: dict[str, str]) -> str | None:
    """How the user chose field ``name`` ("--lr 0.001", "--recipe datacomp-small (--lr 0.001)"), or None: the
    field is at its default, and a value in the DeepSpeed JSON may set it."""
    how = sources.get(name)
    if how not in ("flag", "recipe"):
        return None
    f = flag_named(name)
    value = values[name]
    shown = (
        f.option
        if f.is_switch
        else f"{f.option} {value if not isinstance(value, list) else ' '.join(map(str, value))}"
    )
    return shown if how == "flag" else f"--recipe {values['recipe']} ({shown})"


def _given(argv: list[str] | None) -> set[str]:
    """The dests of the flags given on this command line (a parser whose every default is SUPPRESS keeps only
    those), so that a recipe yields to them and to nothing else."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _recipe_value(f: Flag, value: Any, recipe: str) -> Any:
    """A recipe's value for flag `f`, checked against the field's type (a JSON int is also a float)."""
    where = f"--recipe {recipe}: {f.name}"
    if f.is_switch:
        if not isinstance(value, bool):
            raise SettingsError(f"{where} must be true or false (the switch {f.option}), got {value!r}")
        return value
    if value is None:
        return None
    base = base_type(f.type)
    if typing.get_origin(f.type) is list:
        if not isinstance(value, list):
            raise SettingsError(f"{where} must be a JSON list ({f.option}), got {value!r}")
        return list(value)
    ok = (
        isinstance(value, base) and not isinstance(value, bool)
        if base is not float
        else isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    if not ok:
        raise SettingsError(f"{where} must be a JSON {base.__name__} ({f.option}), got {value!r}")
    if f.meta["choices"] and value not in f.meta["choices"]:
        raise SettingsError(f"{where} must be one of {', '.join(f.meta['choices'])}, got {value!r}")
    return float(value) if base is float else value


def _with_recipe(values: dict[str, Any], given: set[str]) -> tuple[dict[str, Any], set[str]]:
    """`values` with the recipe's settings under the flags given on the command line, and the fields the recipe
    set. A given
    --global-batch-size other than the recipe's is refused: the recipe's N is the point of it."""
    recipe = values["recipe"]
    settings = load_recipe(recipe)["settings"]
    known = {f.name: f for f in flags()}
    for name in settings:
        if name not in known or name in ("recipe", "local_rank", "dry_run"):
            raise SettingsError(
                f"--recipe {recipe}: {name!r} is not a setting a recipe can set (a flag's dest)"
            )
    n = settings.get("global_batch_size")
    if n is not None and "global_batch_size" in given and values["global_batch_size"] != n:
        raise SettingsError(
            f"--global-batch-size {values['global_batch_size']} with --recipe {recipe}, whose global batch is "
            f"{n} pairs: the recipe fixes N (k follows from the world size); drop --global-batch-size or the recipe"
        )
    out = dict(values)
    for name, value in settings.items():
        if name not in given:
            out[name] = _recipe_value(known[name], value, recipe)
    return out, set(settings) - given


def default_run_name(s: TrainSettings, now: datetime | None = None) -> str:
    """ "YYYY_mm_dd-HH_MM_SS-model_<model>-m_<m>-k_<k>" ("-N_<N>" with a global batch: k follows from the world
    size), with characters unsafe in a folder name replaced. A local-dir: model is named by the last two folders
    of its path ("local-run7-export"): its last one alone is often a word like "model" or "out"."""
    stamp = (now or datetime.now()).strftime("%Y_%m_%d-%H_%M_%S")
    model = s.model.model
    if model.startswith(LOCAL_DIR_PREFIX):
        parts = Path(model[len(LOCAL_DIR_PREFIX) :]).expanduser().resolve().parts[1:][-2:]
        model = "-".join(["local", *parts])
    o = s.optim
    batch = f"k_{o.accum_freq}" if o.global_batch_size is None else f"N_{o.global_batch_size}"
    name = f"{stamp}-model_{model}-m_{o.batch_size}-{batch}"
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", name)


def _derived_dataset_type(train_data: str | None) -> str:
    """--dataset-type when not given: synthetic without --train-data, csv for a .csv/.tsv file (open_clip's
    "auto" looks at the same extension), else webdataset."""
    if not train_data:
        return "synthetic"
    return "csv" if train_data.rsplit(".", 1)[-1].lower() in ("csv", "tsv") else "webdataset"
