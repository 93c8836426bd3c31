"""The code says what is; its history belongs in the git log: no comment, docstring or string of the
repository's code (docs/ and Markdown pages aside) cites an issue by its number."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_SUFFIXES = {".py", ".sh", ".toml", ".yaml", ".yml", ".proto", ".cfg", ".ini", ".tpl"}
CODE_NAMES = {"dev", "Dockerfile"}
# "issue 52", "issues 23 and 45", "Issue #7", "issue-44"; not "the issue's table" nor a PR number upstream.
CITATION = re.compile(r"\bissues?[ \t]*[-#]?[ \t]*\d+", re.IGNORECASE)


def code_files() -> list[Path]:
    found = []
    for directory, subdirectories, files in os.walk(ROOT):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".") and d not in ("__pycache__", "docs", "node_modules")]
        for name in files:
            path = Path(directory) / name
            if (path.suffix in CODE_SUFFIXES or name in CODE_NAMES) and path != Path(__file__).resolve():  # this file shows citations
                found.append(path)
    return sorted(found)


def test_the_scan_sees_the_code():
    names = {path.relative_to(ROOT).as_posix() for path in code_files()}
    assert {"batch_planner/identity.py", "trainer_client/dropin/patches.py", "pyproject.toml", "dev"} <= names


def test_the_pattern_finds_a_citation():
    cited = ["# 3: contiguous plans pad (issue 52)", '"""Issue 23\'s two bars."""', "# see issue #7", "issues 23 and 45"]
    assert all(CITATION.search(text) for text in cited)
    assert not any(CITATION.search(text) for text in ("# the issue's table", "# issues a collective", "PR #5154"))


def test_no_code_cites_an_issue_number():
    cited = [
        f"{path.relative_to(ROOT).as_posix()}:{number}: {line.strip()}"
        for path in code_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if CITATION.search(line)
    ]
    assert cited == [], "say what the code is or does; the history is the log's:\n" + "\n".join(cited)
