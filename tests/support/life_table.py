"""docs/architecture.md's "One request, file by file" table, read (``import life_table``).

Each row is ``| # | `file` | its part | path |``, path one of ``both``, ``OpenAI`` (the HTTP
front's SSE ``/v1/completions``), ``ensemble`` (a tritonclient gRPC stream to the
ensemble); the section states each path's count as "Now: N files (OpenAI), M (ensemble)".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
SECTION = "## One request, file by file"
PATHS = ("OpenAI", "ensemble")
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([^`]+)`\s*\|.*\|\s*(both|OpenAI|ensemble)\s*\|\s*$")
COUNTS = re.compile(r"Now: (\d+) files \(OpenAI\), (\d+) \(ensemble\)")


@dataclass(frozen=True)
class Row:
    number: int
    file: str                  # repo-relative
    path: str                  # both, OpenAI or ensemble


def section(doc: Path = DOC) -> str:
    """The section's text, up to the next heading."""
    return doc.read_text().split(SECTION, 1)[1].split("\n#", 1)[0]


def rows(doc: Path = DOC) -> list[Row]:
    return [Row(int(m.group(1)), m.group(2), m.group(3))
            for m in map(ROW.match, section(doc).splitlines()) if m]


def files_by_path(doc: Path = DOC) -> dict[str, set[str]]:
    """path -> the files the table lists for it."""
    listed: dict[str, set[str]] = {path: set() for path in PATHS}
    for row in rows(doc):
        for path in PATHS if row.path == "both" else (row.path,):
            listed[path].add(row.file)
    return listed


def stated_counts(doc: Path = DOC) -> dict[str, int]:
    """path -> the count the section's prose states."""
    found = COUNTS.search(section(doc))
    assert found, f"{doc.name}: no 'Now: N files (OpenAI), M (ensemble)' in {SECTION!r}"
    return dict(zip(PATHS, map(int, found.groups())))
