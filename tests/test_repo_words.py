"""The repository speaks of ds_clip alone: no words about how it was made.

Code, comments, tests and docs say what the code does and why. References to a tracker's issue numbers, to
how a change reached the main branch, to the machines or sessions it was built in, or to notes kept outside the
repository mean nothing to a user of the wheel or a reader of the docs, and they age badly. This test keeps
every tracked text file free of them (the same pattern a pre-submit hook checks).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each alternative is a phrase about the making of the project, never about what ds_clip does. "session" alone
# is allowed (pytest sessions, sshd sessions, start_new_session); "issue" alone too (an issue a user files).
# The phrases are written in pieces so that this file does not contain them itself.
_ISSUE, _LANDING, _SESSION = "issue", "landing", "session"
PROCESS_WORDS = re.compile(
    "|".join(
        [
            f"this {_LANDING}", f"the {_LANDING}", "lent (gpu|" + "machine)", "was" + " lent", f"{_ISSUE} [0-9]+",
            f"{_ISSUE} #[0-9]+", f"this {_SESSION}", "shared/" + "notes", "facts" + " note",
        ]
    ),
    re.IGNORECASE,
)  # fmt: skip
# This file spells the phrases out in pieces in order to forbid them.
EXEMPT = {"tests/test_repo_words.py"}


def _tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:  # an unpacked sdist has no git metadata
        pytest.skip(f"not a git checkout ({e})")
    return [p for p in out.decode().split("\0") if p and p not in EXEMPT]


def test_no_words_about_how_the_project_was_made():
    hits = []
    for rel in _tracked_text_files():
        path = ROOT / rel
        if not path.is_file() or path.suffix in {".png", ".jpg", ".whl", ".tar", ".pt", ".safetensors"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "say what the code does instead:\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_is_for():
    for phrase in (
        f"fixed in {_ISSUE} 22",
        f"see {_ISSUE.title()} #7",
        f"this {_LANDING} adds",
        "no GPU was " + "lent",
        f"this {_SESSION}",
    ):
        assert PROCESS_WORDS.search(phrase), phrase
    for phrase in ("subprocess.Popen(start_new_session=True)", "an sshd session", "file an issue"):
        assert not PROCESS_WORDS.search(phrase), phrase
