"""docs/benchmarks.md prints what its records in benchmarks/results/ hold: a figure edited on the page, or a
record changed without regenerating the page (scripts/gen_benchmarks_doc.py), fails here. Every record names
its machine, date, load and commands; every raw file a benchmark wrote belongs to a record; the page stays a
page a user reads (at most 25 kB); the README's headline quotes the record it comes from."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from scripts import gen_benchmarks_doc as gen  # the repository root is on sys.path, as for tests.*

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"


def test_the_page_is_generated_from_its_records():
    assert DOC.read_text(encoding="utf-8") == gen.render(), f"docs/benchmarks.md is stale: run {gen.COMMAND}"


def test_a_figure_that_disagrees_with_its_record_is_caught():
    """Edit one figure on the page, or one cell of a record: either way the page no longer matches."""
    page = DOC.read_text(encoding="utf-8")
    records = gen.load_records()
    cell = records["2026-12-03_largest_batch"]["tables"][0]["rows"][2][2]
    assert f"| {cell} |" in page
    edited_page = page.replace(f"| {cell} |", "| **128k** (512) |", 1)
    assert gen.render(edited_page, records) != edited_page
    changed = copy.deepcopy(records)
    changed["2026-12-03_largest_batch"]["tables"][0]["rows"][2][2] = "**128k** (512)"
    assert gen.render(page, changed) != page
    with pytest.raises(KeyError, match="no record"):
        gen.render("<!-- record: no-such-run table -->\n<!-- /record -->\n", records)


def test_every_record_is_complete_and_every_raw_file_has_one():
    records = gen.load_records()  # refuses a record without machine, date, load, commands, rows, ...
    named: set[str] = set()
    for record in records.values():
        assert record["machine"] and record["date"] and record["load"] and record["commands"], record["id"]
        for raw in record["raw"]:
            assert (ROOT / raw).is_file(), f"{record['id']}: no {raw}"
            named.add(raw)
    raw_files = {str(p.relative_to(ROOT)) for p in (RESULTS / "raw").iterdir()}
    assert sorted(raw_files - named) == [], "raw files that no record names"


def test_every_record_is_on_the_page_and_the_page_stays_short():
    page = DOC.read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(\.\./benchmarks/results/([^)]+)\.json\)", page))
    assert sorted(set(gen.load_records()) - linked) == [], "records neither shown nor listed in the archive"
    assert DOC.stat().st_size <= 25_000, "docs/benchmarks.md is over 25 kB: move older tables to records"


def test_the_readme_headline_is_its_record():
    """README.md's first screen states the largest global batch of each method, with the command, as the record
    of that run has them."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headline = readme[readme.index("**Headline**") :].split("\n\n")[0]
    record = gen.load_records()["2026-12-03_largest_batch"]
    largest = {row[2].split()[0].strip("*") for row in record["tables"][0]["rows"]}
    assert set(re.findall(r"\b\d+k\b", headline)) == largest
    assert "docs/benchmarks.md#the-largest-global-batch" in headline
    command = "python benchmarks/bench_largest.py --memory-budget 16 --time-cap 180 --start-n 1024"
    assert command in record["commands"][0] and command in readme[: readme.index("## Install")]
