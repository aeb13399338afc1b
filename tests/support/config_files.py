"""What the config tests share: a ``disagg_config.yaml`` beside a stand-in engine
directory (``engines/demo`` with an ``engine.json``: the config checks the path, not
the weights), the check that a mistake is one line naming what is wrong, the
three-role config the served tests start ``serve context|generation|scheduler`` from, and
the deployment guide's config on a host without GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import pytest

from triton_disagg.config.disagg import load_config
from triton_disagg.errors import UserError

GUIDE_CONFIG = Path(__file__).resolve().parent / "guide_disagg_config.yaml"


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


def three_roles_config(tmp_path: Path, engine: Path, ctx_port: int, gen_port: int,
                       extra: str = "", generation: str = "") -> Path:
    """``tmp_path/disagg_config.yaml`` for the three roles on this host: context on core 0
    at ``ctx_port``, generation on core 1 at ``gen_port``, direct_transfer; ``extra`` YAML
    lines appended; ``generation``: more keys of ``generation_server`` (", key: value")."""
    path = tmp_path / "disagg_config.yaml"
    path.write_text(f"model: {{engine: {engine}}}\n"
                    f"context_server: {{url: \"127.0.0.1:{ctx_port}\", cpus: [0]}}\n"
                    f"generation_server: {{url: \"127.0.0.1:{gen_port}\", cpus: [1]"
                    f"{generation}}}\n"
                    f"kv_cache: {{strategy: direct_transfer, max_size: 64MB}}\n{extra}")
    return path


def guide_config_as_written() -> str:
    """The deployment guide's ``disagg_config.yaml`` (:data:`GUIDE_CONFIG`) without its
    comments."""
    return "".join(line for line in GUIDE_CONFIG.read_text().splitlines(keepends=True)
                   if not line.startswith("#"))


def guide_config_on_cpus() -> str:
    """:func:`guide_config_as_written` but for its GPUs, which a host without any has not:
    one core per role in their place (context core 0, generation core 1)."""
    placed = guide_config_as_written().replace("gpus: [0, 1]", "cpus: [0]")
    placed = placed.replace("gpus: [2, 3]", "cpus: [1]")
    assert "gpus" not in placed, placed
    return placed
