"""The README's examples work as written: its Python snippets run against a real
`serve all` of the demo engine and print the offline engine's text; the example
disagg_config.yaml at the repository root loads."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import serving

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PROMPT, MAX_TOKENS = "The quick brown fox", 20


def _on_ports(code: str, served: serving.Served) -> str:
    """The README's default ports replaced by the test server's."""
    http_port = served.http.rsplit(":", 1)[1]
    grpc_port = served.grpc.rsplit(":", 1)[1]
    return code.replace("127.0.0.1:8000", f"127.0.0.1:{http_port}").replace(
        "127.0.0.1:8001", f"127.0.0.1:{grpc_port}")


def test_readme_python_examples_print_the_offline_text(demo_engine, tmp_path):
    snippets = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(snippets) >= 2, "the README lost its client examples"
    expected = serving.offline_text(demo_engine)(PROMPT, MAX_TOKENS)
    with serving.serve("all", ["--engine", str(demo_engine)], tmp_path / "run") as served:
        for code in snippets:
            assert PROMPT in code
            out = subprocess.run([sys.executable, "-c", _on_ports(code, served)],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == expected.strip(), code


def test_example_config_loads_as_written(demo_engine, tmp_path):
    """The root disagg_config.yaml, beside an engines/demo like the one `make demo` builds."""
    from triton_disagg.config import load_config

    config_path = tmp_path / "disagg_config.yaml"
    config_path.write_text((ROOT / "disagg_config.yaml").read_text())
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "demo").symlink_to(demo_engine)
    config = load_config(config_path)
    assert config.engine == demo_engine.resolve()  # relative to the config file, resolved
    assert config.context.cpus != config.generation.cpus
