"""Every ``triton-disagg`` command line the README and docs/*.md show in a ``bash`` block is
one the CLI takes: its subcommand and every flag parse with the CLI's own parser (what
``serve --help`` lists), so a renamed or removed flag fails here, not in a user's
terminal. (Running them is tests/server/test_readme.py's, test_deploy_doc.py's and
tests/cluster/test_netns_guide.py's.)"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from triton_disagg.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(?:\.venv/bin/)?triton-disagg (.*)$", re.M)


def _command_lines(doc: Path) -> list[list[str]]:
    """The words of the ``triton-disagg`` lines of ``doc``'s bash blocks (continuations
    joined), up to a trailing comment or shell operator (``&``, ``|``, ``>``, ...); a usage
    line (``[--flag ...]``) is no command."""
    blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
    lines = [line for block in blocks for line in COMMAND.findall(block.replace("\\\n", " "))]
    return [_words(line) for line in lines if " [--" not in line]


def _words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    operators = [i for i, word in enumerate(words) if set(word) <= set("();<>|&")]
    return words[:operators[0]] if operators else words


def _all_commands() -> list[tuple[str, list[str]]]:
    return [(doc.name, words) for doc in DOCS for words in _command_lines(doc)]


def test_the_readme_shows_the_guides_and_the_demos_commands():
    shown = [" ".join(words[:2]) for doc, words in _all_commands() if doc == "README.md"]
    for command in ("serve all", "serve context", "serve generation", "serve scheduler",
                    "launch k8s", "build", "run", "client"):
        assert any(s == command or s.startswith(command + " ") for s in shown), (command, shown)


@pytest.mark.parametrize("doc,words", _all_commands(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v[:2]))
def test_every_shown_command_parses(doc, words):
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            build_parser().parse_args(words)
        except SystemExit:
            pytest.fail(f"{doc}: triton-disagg {' '.join(words)}: {errors.getvalue().strip()}")
