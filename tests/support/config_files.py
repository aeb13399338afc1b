"""What the config tests share: a ``disagg_config.yaml`` beside a stand-in engine
directory (``engines/demo`` with an ``engine.json``: the config checks the path, not
the weights), and the check that a mistake is one line naming what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import pytest

from triton_disagg.config.disagg import load_config
from triton_disagg.errors import UserError


def config_writer(tmp_path: Path, prefix: str = "") -> Callable[[str], Path]:
    """A function that writes ``prefix + text`` as ``tmp_path/disagg_config.yaml``."""
    (tmp_path / "engines" / "demo").mkdir(parents=True)
    (tmp_path / "engines" / "demo" / "engine.json").write_text("{}")

    def write(text: str) -> Path:
        path = tmp_path / "disagg_config.yaml"
        path.write_text(prefix + text)
        return path
    return write


def assert_one_line_error(path: Path, words: Sequence[str]) -> None:
    """Loading ``path`` fails with one line naming the file and every one of ``words``."""
    with pytest.raises(UserError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message and "disagg_config.yaml" in message
    for word in words:
        assert word in message, message
