"""What every benchmark tells (``bench/report.py``): progress lines on stderr, named by the
command (``progress``); paths relative to the working directory under it (``shown_path``);
at its end (``publish``) the table on stdout and, with ``--output``, the table (and the
notes for the docs) kept as the benchmark's own section of the markdown file, rewritten in
place on the next run, the rest of the file untouched."""

from __future__ import annotations

from datetime import date
from pathlib import Path

from triton_disagg.bench.report import progress, publish, shown_path


def test_publish_prints_then_keeps_its_section_and_leaves_the_rest(tmp_path, capsys):
    doc, said = tmp_path / "docs" / "benchmarks.md", []
    publish("| a | 1 |", doc, "one", "First", said.append)
    publish("| b | 2 |", doc, "two", "Second", said.append, notes="How it was run.")
    publish("| a | 3 |", doc, "one", "First again", said.append)

    assert capsys.readouterr().out == "| a | 1 |\n| b | 2 |\n| a | 3 |\n"   # notes: docs only
    assert said == [f"section written to {doc}"] * 3
    today = date.today().isoformat()
    assert doc.read_text() == (
        "# Benchmarks\n\n"
        f"<!-- bench:one:start -->\n## First again\n\nMeasured {today}.\n\n| a | 3 |\n"
        "<!-- bench:one:end -->\n\n"
        f"<!-- bench:two:start -->\n## Second\n\nMeasured {today}.\n\n| b | 2 |\n\n"
        "How it was run.\n<!-- bench:two:end -->\n")


def test_publish_without_output_only_prints(tmp_path, capsys):
    said = []
    publish("| a | 1 |", None, "one", "First", said.append, notes="How it was run.")
    assert capsys.readouterr().out == "| a | 1 |\n"
    assert said == [] and list(tmp_path.iterdir()) == []


def test_progress_says_on_stderr_named_by_the_command(capsys):
    say = progress("handoff")
    say("starting")
    say("done")
    out, err = capsys.readouterr()
    assert out == "" and err == "[bench handoff] starting\n[bench handoff] done\n"


def test_shown_path_is_relative_under_the_working_directory_else_as_given(tmp_path,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shown_path(tmp_path / "work" / "engines" / "demo") == "work/engines/demo"
    assert shown_path(Path("/opt/engines/demo")) == "/opt/engines/demo"
