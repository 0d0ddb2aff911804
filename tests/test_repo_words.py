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
            f"this {_LANDING}", f"the {_LANDING}", "lent (gpu|" + "machine)", "was" + " lent", f"{_ISSUE}s? #?[0-9]+",
            f"this {_SESSION}", "shared/" + "notes", "facts" + " note",
        ]
    ),
    re.IGNORECASE,
)  # fmt: skip
# Paths of the machine a file was written on: a home folder, a temporary folder with a random name (pytest's,
# tempfile.mkdtemp's with or without a prefix), the workspace. They say nothing to a reader elsewhere. A script's
# documented default folder (/tmp/ds_clip_gpu_check) is not one of them.
_TMP, _HOME = "/" + "tmp/", "/" + "home/"
MACHINE_PATHS = re.compile(
    "|".join(
        [
            _TMP + "pytest-", _TMP + "tmp[a-z0-9_]{8}", _TMP + "[A-Za-z0-9_]+_[a-z0-9_]{8}(?![A-Za-z0-9_])",
            "(?<![A-Za-z0-9_.~])/" + "root/", _HOME + "[a-z_][a-z0-9_-]*/", "/" + "Users/[^/ ]+/", "/" + "work/",
        ]
    )
)  # fmt: skip
# Committed logs and benchmark records (benchmarks/results/) name no temporary folder at all: write <tmp> for one.
LOGGED_TMP = re.compile(_TMP)
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
        logged = rel.startswith("benchmarks/results/")
        for n, line in enumerate(text.splitlines(), 1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
            found = MACHINE_PATHS.search(line) or (LOGGED_TMP.search(line) if logged else None)
            if found:
                hits.append(f"{rel}:{n}: machine path {found.group(0)!r}: {line.strip()[:120]}")
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
    assert PROCESS_WORDS.search(f"without a GPU ({_ISSUE}s 13 and 22)")
    assert not PROCESS_WORDS.search("upstream DeepSpeed #7665, PR #8393")  # upstream references stay


def test_the_machine_path_pattern_catches_what_it_is_for():
    for path in (
        _TMP + "pytest-of-root/pytest-3/test_x0/run", _TMP + "tmp3zzlc7ke/logs", _TMP + "ds_clip_profile_i4qg1_ea/x",
        _TMP + "side_by_side_2wy3uym6", "cache " + "/" + "root/.cache/huggingface/hub", _HOME + "alice/data",
        "/" + "Users/bob/x", "/" + "work/main/.venv",
    ):  # fmt: skip
        assert MACHINE_PATHS.search(path), path
    for text in (
        _TMP + "ds_clip_gpu_check", _TMP + "ds_clip_offline_proof/out", "~/.cache/huggingface/hub", "--logs <tmp>",
        "torch.distributed", "a chroot/", "ds_clip/training/trainer.py", "--name run1 --logs ./logs",
    ):  # fmt: skip
        assert not MACHINE_PATHS.search(text), text
    assert LOGGED_TMP.search(_TMP + "largest.json") and not LOGGED_TMP.search("<tmp>/logs")
