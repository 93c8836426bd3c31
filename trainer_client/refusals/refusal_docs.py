"""The refusal table's docs, generated from what is registered: each table in docs/*.md between a begin
marker that names the drop-in packages it shows and an end marker is written from `compatibility.table`
(tests/trainer_client/test_refusal_docs.py keeps the docs equal to it).

    python -m trainer_client.refusals.refusal_docs            # rewrite the tables in docs/
    python -m trainer_client.refusals.refusal_docs --check    # exit 1, naming the files, if a table drifted

`<!-- refusal table: PACKAGES (...) -->` is the whole table with those packages' drop-ins, in that
order; `<!-- refusal table of: PACKAGE (...) -->` the rows that read that package's drop-in's source,
as its own page shows them. Importing a package registers its drop-in (and enables nothing).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

from trainer_client.refusals.compatibility import Rule, registered_by, rules_of, table
from trainer_client.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
BEGIN = re.compile(r"<!-- refusal table(?P<own> of)?: (?P<packages>[\w. ]+) \(generated: python -m trainer_client\.refusals\.refusal_docs\) -->\n")
END = "<!-- end of the generated refusal table -->"


def _sources(packages: list[str]) -> list[str]:
    """The refusal-table sources the packages' drop-ins registered, in the packages' order."""
    for package in packages:
        importlib.import_module(package)
    return [source for package in packages for source in registered_by(package)]


def whole_table(packages: list[str]) -> str:
    """Every row, in the order `check` reads them, with the packages' drop-ins (docs/trainer-client.md)."""
    sources = _sources(packages)

    def where(rule: Rule) -> str:
        return "; ".join(f"{place.source} `{place.path}`" for place in rule.places_in(sources))

    lines = ["| where | refused when | fix |", "|---|---|---|"]
    lines += [f"| {where(r)} | {r.refused_when} | {r.fix} |" for r in table(sources) if r.places_in(sources)]
    return "\n".join(lines)


def own_table(package: str) -> str:
    """The rows that read the package's drop-in's source: its paths, else the row's other places (its own page)."""
    sources = _sources([package])

    def setting(rule: Rule) -> str:
        places = rule.places_in(sources)
        return ", ".join(f"`{p.path}`" for p in places if p.source in sources) or ", ".join(f"{p.source} `{p.path}`" for p in places)

    lines = ["| setting | refused when | what to do |", "|---|---|---|"]
    lines += [f"| {setting(r)} | {r.refused_when} | {r.fix} |" for source in sources for r in rules_of(source)]
    return "\n".join(lines)


def generated(text: str) -> str:
    """`text` with every marked table written anew."""
    out, at = [], 0
    for begin in BEGIN.finditer(text):
        end = text.find(END, begin.end())
        if end < 0:
            raise InvalidArgumentError(f"the refusal table begun by {begin.group().strip()!r} has no end marker {END!r}")
        packages = begin["packages"].split()
        body = own_table(packages[0]) if begin["own"] else whole_table(packages)
        out += [text[at:begin.end()], body, "\n"]
        at = end
    return "".join(out) + text[at:]


def drifted(docs: Path) -> list[Path]:
    """The pages whose tables differ from what is registered."""
    return [page for page in sorted(docs.glob("*.md")) if generated(text := page.read_text()) != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a table differs from the registered rows")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="the folder of the pages (default: docs/)")
    args = parser.parse_args(argv)
    pages = drifted(args.docs)
    if args.check:
        for page in pages:
            print(f"{page}: its refusal table drifted from the registered rows; run python -m trainer_client.refusals.refusal_docs", file=sys.stderr)
        return 1 if pages else 0
    for page in pages:
        page.write_text(generated(page.read_text()))
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
