"""Fields -> flags: the table of every ds-clip-train flag, read from the section dataclasses, and the flat
dict of settings (settings.json) keyed by the flags' dests.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
from dataclasses import MISSING, dataclass
from typing import Any

from ds_clip.config.sections import TrainSettings


@dataclass(frozen=True)
class Flag:
    """One flag, as the fields define it: what the parser, --help and docs/configuration.md show."""

    section: str
    name: str
    """The field name, also the argparse dest and the key in settings.json."""
    options: tuple[str, ...]
    """The option strings, the main one first."""
    type: Any
    default: Any
    doc: str
    meta: dict[str, Any]

    @property
    def option(self) -> str:
        return self.options[0]

    @property
    def is_switch(self) -> bool:
        return self.type is bool

    def shown_default(self) -> str:
        """The default as --help and the docs show it."""
        if self.meta["default_text"] is not None:
            return self.meta["default_text"]
        if self.is_switch:
            return "off"
        if self.default is None:
            return "none"
        if isinstance(self.default, list):
            return ",".join(self.default) or "none"
        return str(self.default)

    def type_text(self) -> str:
        """Type and unit, for the docs table."""
        if self.is_switch:
            return "switch"
        base = {int: "int", float: "float", str: "str"}.get(base_type(self.type), "list")
        return f"{base}, {self.meta['unit']}" if self.meta["unit"] else base


def base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args and typing.get_origin(tp) is not list else tp


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of `cls` (a string right after the annotated assignment), one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


@functools.cache
def flags() -> tuple[Flag, ...]:
    """Every flag of ds-clip-train, in section order, built from the section dataclasses."""
    out: list[Flag] = []
    for section, cls in TrainSettings.section_types().items():
        hints, docs = typing.get_type_hints(cls), _field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name not in docs:
                raise AssertionError(f"{cls.__name__}.{f.name} has no docstring (it is the flag's --help)")
            option = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            out.append(
                Flag(section, f.name, (option, *f.metadata["aliases"]), hints[f.name], default, docs[f.name],
                     dict(f.metadata))
            )  # fmt: skip
    names = [f.name for f in out]
    if len(names) != len(set(names)):
        raise AssertionError("field names must be unique across sections: each is a flag's dest")
    return tuple(out)


def flag_named(name: str) -> Flag:
    """The flag of field `name` (e.g. "batch_size")."""
    return next(f for f in flags() if f.name == name)


def settings_to_dict(s: TrainSettings) -> dict[str, Any]:
    """JSON-able copy of the settings for settings.json in the run folder: every field by its flat name
    (its flag's dest); `TrainSettings.of(**d)` reads it back."""
    return {f.name: _jsonable(getattr(getattr(s, f.section), f.name)) for f in flags()}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value
