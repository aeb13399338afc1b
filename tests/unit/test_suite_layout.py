"""The suite's own rules, checked on its files: each test file's name is unique across the
layers (pytest imports them by basename: a second ``test_x.py`` stops collection of the
whole suite); only the bench's tests (``test_bench_*``) import ``triton_disagg.bench``,
whose helpers the other tests do not need; and a unit test starts no process, except a
file that says why its children are trivially fake stubs."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
BENCH_IMPORT = re.compile(r"^\s*(from triton_disagg\.bench\b|from triton_disagg import bench\b"
                          r"|import triton_disagg\.bench\b)", re.M)
STARTS_A_PROCESS = re.compile(r"\b(subprocess|Popen|multiprocessing|os\.fork|os\.spawn)\b")
FAKE_STUB_NOTE = "trivially a fake stub"


def _files() -> list[Path]:
    return sorted(TESTS.rglob("*.py"))


def test_test_file_names_are_unique_across_the_layers():
    names = Counter(p.name for p in _files() if p.name.startswith("test_"))
    assert [n for n, count in names.items() if count > 1] == []


def test_only_the_bench_tests_import_the_bench():
    importers = [str(p.relative_to(TESTS)) for p in _files()
                 if BENCH_IMPORT.search(p.read_text()) and not p.name.startswith("test_bench_")]
    assert importers == []


def test_unit_tests_start_no_process():
    starters = [p.name for p in sorted((TESTS / "unit").glob("*.py"))
                if p != Path(__file__) and STARTS_A_PROCESS.search(p.read_text())
                and FAKE_STUB_NOTE not in p.read_text()]
    assert starters == []
