"""Writes the measured tables of docs/benchmarks.md from the records in benchmarks/results/, the one source of
every figure the page shows.

    python scripts/gen_benchmarks_doc.py            # rewrite the tables and the list of records in the page
    python scripts/gen_benchmarks_doc.py --check    # exit 1 if the page disagrees with its records

A record (benchmarks/results/<id>.json) is one benchmark run: its machine, date, load, the commands that
reproduce it, the raw files the benchmark wrote (benchmarks/results/raw/), its tables (columns and rows, as the
page prints them) and notes. The page's prose is written by hand; between the markers

    <!-- record: <id> <table name> -->  ...  <!-- /record -->   one table; the first from a record on the page
                                                               comes with the record's machine, date, load and
                                                               commands
    <!-- records -->  ...  <!-- /records -->                    a line per record no table above shows

this script writes what the record says. tests/test_benchmarks_doc.py fails when a figure on the page differs
from its record, when a record is missing a field, or when a raw file belongs to no record.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
COMMAND = "python scripts/gen_benchmarks_doc.py"
FIELDS = ("id", "title", "status", "machine", "date", "load", "commands", "raw", "tables", "notes")
STATUSES = ("current", "archived")

_BLOCK = re.compile(r"<!-- record: (?P<id>\S+) (?P<table>\S+) -->\n.*?<!-- /record -->", re.DOTALL)
_RECORDS = re.compile(r"<!-- records -->\n.*?<!-- /records -->", re.DOTALL)


def load_records(results: Path = RESULTS) -> dict[str, dict]:
    """Every record in `results`, by id; a record without one of FIELDS, or named other than its id, is refused."""
    records = {}
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        missing = [f for f in FIELDS if f not in record]
        if missing:
            raise ValueError(f"{path.name}: missing {', '.join(missing)}")
        if record["id"] != path.stem:
            raise ValueError(f"{path.name}: id {record['id']!r} is not the file's name")
        if record["status"] not in STATUSES:
            raise ValueError(f"{path.name}: status {record['status']!r} is not one of {STATUSES}")
        if record["status"] == "archived" and not record.get("changed_since"):
            raise ValueError(f"{path.name}: an archived record says what changed since (changed_since)")
        for table in record["tables"]:
            for row in table["rows"]:
                if len(row) != len(table["columns"]):
                    raise ValueError(f"{path.name}: table {table['name']!r} has a row of {len(row)} cells")
        records[record["id"]] = record
    return records


def _link(record: dict) -> str:
    return f"[{record['id']}](../benchmarks/results/{record['id']}.json)"


def _machine(record: dict) -> str:
    machine = record["machine"]
    return "Machine M" if machine.startswith("M:") else machine


def render_table(record: dict, name: str, first: bool = True) -> str:
    """The table `name` of `record` as the page prints it (only the record's `page_columns` where it names
    some); the record's first table on the page comes after its machine, date, load and commands."""
    tables = {t["name"]: t for t in record["tables"]}
    if name not in tables:
        raise KeyError(f"record {record['id']} has no table {name!r} (it has {', '.join(tables)})")
    table = tables[name]
    shown = table.get("page_columns", table["columns"])
    keep = [table["columns"].index(c) for c in shown]

    def line(cells):
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    rows = [line(shown), "|" + "---|" * len(shown)]
    rows += [line([row[i] for i in keep]) for row in table["rows"]]
    if not first:
        return f"Record {_link(record)}:\n\n" + "\n".join(rows) + "\n"
    head = f"{_machine(record)}, {record['date']}; load: {record['load']}. Record {_link(record)}:\n\n"
    return head + "```bash\n" + "\n".join(record["commands"]) + "\n```\n\n" + "\n".join(rows) + "\n"


def render_index(records: dict[str, dict], shown: set[str]) -> str:
    """One line per record that no table on the page comes from: current ones first, then the archived ones
    with what changed since."""
    lines = []
    for status in STATUSES:
        for record in records.values():
            if record["status"] != status or record["id"] in shown:
                continue
            line = f"- {_link(record)}: {record['title']}."
            if record.get("shown_in"):
                line += f" Shown in [{record['shown_in']}]({record['shown_in'].removeprefix('docs/')})."
            if status == "archived":
                line += f" **Since**: {record['changed_since']}."
            lines.append(line)
    return "\n".join(lines) + "\n"


def render(text: str | None = None, records: dict[str, dict] | None = None) -> str:
    """The page with every marked block rewritten from the records."""
    text = DOC.read_text(encoding="utf-8") if text is None else text
    records = load_records() if records is None else records

    shown: set[str] = set()

    def block(match: re.Match) -> str:
        if match["id"] not in records:
            raise KeyError(f"docs/benchmarks.md names no record {match['id']!r} in benchmarks/results/")
        body = render_table(records[match["id"]], match["table"], first=match["id"] not in shown)
        shown.add(match["id"])
        return f"<!-- record: {match['id']} {match['table']} -->\n{body}<!-- /record -->"

    text = _BLOCK.sub(block, text)
    index = render_index(records, shown)
    return _RECORDS.sub(lambda _: f"<!-- records -->\n{index}<!-- /records -->", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from its records")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if page != DOC.read_text(encoding="utf-8"):
            print(f"docs/benchmarks.md disagrees with benchmarks/results/: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
