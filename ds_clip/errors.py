"""The two kinds of failure a user sees, and the exit status of each.

Every error ds_clip raises on purpose subclasses one of these; the entry points catch the two bases and
print one line (``ds-clip-train: error: ...``), so no caller needs to know which module raised what.

- ``UserError`` (exit 2, like argparse): bad input the user can fix by changing a flag, a file, a preset or
  the data. The message names the flag, file or JSON key.
- ``RunError`` (exit 1): the run itself failed (a lost rank, a checkpoint that cannot be used, too many
  non-finite steps). The message says what happened and how to continue (usually ``--resume latest``).
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input, named in the message. Exit status 2."""

    exit_code = 2
    same_on_every_rank = True
    """Raised alike by every rank (it follows from the settings, the model or a shared file): rank 0 prints it,
    once per job. False where ranks can differ (data read by one rank, a folder on one host): each prints."""


class SettingsError(UserError):
    """Bad settings: a flag, a preset or a JSON key. The message is one line naming it.

    The entry point prints ``ds-clip-train: error: <message>`` and exits with status 2, like argparse. Raised by
    ds_clip.config (flags), ds_clip.ds_config.presets and ds_clip.ds_config (the DeepSpeed JSON); both re-export it.
    """


class RunError(RuntimeError):
    """The run failed; the message says how to continue. Exit status 1."""

    exit_code = 1
