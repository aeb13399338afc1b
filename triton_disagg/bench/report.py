"""Keep benchmark tables in one markdown file, one marked section per benchmark.

A section is everything between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->``; rewriting it leaves the rest of the file untouched.
"""

from __future__ import annotations

import re
from datetime import date
from pathlib import Path


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
