"""Every relative link in README.md and docs/*.md points to a file that exists, and every #anchor to a heading
(or an explicit <a id=...>) of the page it names, with the anchors GitHub makes from headings. A page moved or a
heading renamed without its links would otherwise leave the front door pointing nowhere."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lower case, without punctuation, spaces as hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)  # `code` renders as its content
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link renders as its text
    text = re.sub(r"\\(.)", r"\1", text)  # backslash escapes
    kept = []
    for ch in text.lower():
        category = unicodedata.category(ch)
        if ch in " -" or category[0] in "LMN" or category == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(text):
        found.update(_HTML_ID.findall(line))
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link in prose, inline code spans left out."""
    out = []
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... are not checked
                out.append((number, target))
    return out


def test_slug_follows_github():
    assert slug("Side by side (`benchmarks/side_by_side.py`)") == "side-by-side-benchmarksside_by_sidepy"
    assert slug("open_clip_train's flags") == "open_clip_trains-flags"
    assert slug("--torchcompile") == "--torchcompile"
    assert slug("`model`: which open\\_clip model is trained") == "model-which-open_clip-model-is-trained"
    assert slug("W = 2, ZeRO 0–3, m = 8") == "w--2-zero-03-m--8"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for number, target in links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading or <a id> '{anchor}' in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_stays_a_front_door():
    """README.md says what ds_clip is, how to install and start, and links the docs; essays belong in docs/."""
    size = (ROOT / "README.md").stat().st_size
    assert size <= 12_000, f"README.md is {size} bytes: move detail into docs/ and link it"
