"""What a benchmark tells: its progress on stderr (:func:`progress`), its table on stdout,
kept in one markdown file, one marked section per benchmark (:func:`publish`).

A section is everything between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->``; rewriting it leaves the rest of the file untouched.
"""

from __future__ import annotations

import os
import re
import sys
from datetime import date
from pathlib import Path
from typing import Callable, Optional


def progress(command: str) -> Callable[[str], None]:
    """The ``say`` of ``bench <command>``: each message a line ``[bench <command>] ...`` on
    stderr, flushed at once (stdout carries the table alone)."""

    def say(message: str) -> None:
        print(f"[bench {command}] {message}", file=sys.stderr, flush=True)

    return say


def shown_path(path: Path) -> str:
    """``path`` as a report names it: relative to the working directory when it lies under
    it (the docs then name no one's home), else as given."""
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def replace_section(path: Path, name: str, title: str, body: str) -> None:
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n## {title}\n\nMeasured {date.today().isoformat()}.\n\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def publish(body: str, output: Optional[Path], name: str, title: str,
            say: Callable[[str], None], notes: str = "") -> None:
    """A benchmark's ending: print its table ``body`` on stdout; given ``output``, keep it,
    followed by ``notes`` (text for the docs alone) if any, as section ``name`` of that
    markdown file (:func:`replace_section`) and ``say`` so."""
    print(body)
    if output:
        replace_section(output, name, title, body + (f"\n\n{notes}" if notes else ""))
        say(f"section written to {output}")
