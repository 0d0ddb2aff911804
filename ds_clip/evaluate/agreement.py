"""How the ranks agree that an evaluation failed: a rank whose part fails (its samples unreadable, a forward
that raised) does not raise alone, which would leave the others waiting in the evaluation's next collective
until the process-group timeout ended the run; it says so at the next agreement point and every rank raises
``EvalFailed`` together."""

from __future__ import annotations

from ds_clip import distributed
from ds_clip.errors import UserError
from ds_clip.evaluate.settings import EvalFailed


def agree(error: str | None) -> None:
    """A collective: raise ``EvalFailed`` on every rank when any rank's part failed (``error``: what failed
    here, None if nothing), with the first failing rank's message. One 4-byte all-reduce when all went well;
    the messages travel only after a failure. Without it a rank that failed alone would leave the others
    waiting in the evaluation's next collective until the process-group timeout ended the run."""
    messages = distributed.failures(error)
    if not messages:
        return
    r, message = messages[0]
    raise EvalFailed(message if distributed.world_size() == 1 else f"rank {r}: {message}")


def describe(exc: BaseException) -> str:
    """One line for the log: the message of a UserError as it is, otherwise the type and the first line."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return text if isinstance(exc, UserError) else f"{type(exc).__name__}: {text}".rstrip(": ")
