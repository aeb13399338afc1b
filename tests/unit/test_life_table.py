"""docs/architecture.md's "One request, file by file" table holds together without a server
(tests/server/test_request_life.py checks it against a traced request): rows numbered 1..N
in order, each file once and present in the checkout, the stated counts its own, and no path
longer than issue 28's bound."""

from __future__ import annotations

import life_table
from life_table import PATHS

REPO = life_table.DOC.parents[1]
MAX_FILES = 30         # a streamed request's files, per path (issue 28)


def test_rows_are_numbered_in_order_and_name_each_file_once():
    rows = life_table.rows()
    assert rows, f"no rows under {life_table.SECTION!r}"
    assert [row.number for row in rows] == list(range(1, len(rows) + 1))
    files = [row.file for row in rows]
    assert len(files) == len(set(files)), sorted(f for f in files if files.count(f) > 1)


def test_every_row_names_a_file_of_the_checkout():
    missing = [row.file for row in life_table.rows() if not (REPO / row.file).is_file()]
    assert not missing, f"rows naming no file (renamed or removed?): {missing}"


def test_the_stated_counts_are_the_tables():
    listed = life_table.files_by_path()
    assert life_table.stated_counts() == {path: len(listed[path]) for path in PATHS}


def test_a_streamed_request_crosses_at_most_30_files_on_each_path():
    counts = {path: len(files) for path, files in life_table.files_by_path().items()}
    assert all(n <= MAX_FILES for n in counts.values()), counts
