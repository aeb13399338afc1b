"""Imports point down the layers of docs/architecture.md (issue 28, item 3), read from the
source with ``ast`` (function-level imports included):

- the shared layers (config, engine, kv, routing, triton glue, and the top-level modules
  such as errors and protocol) import no role (front, context, generation) and nothing that
  starts processes or measures (launch, clients, builders, bench);
- a role imports no other role: front, context and generation meet only through the
  shared layers (protocol, kv, token_wire);
- nothing but the bench imports the bench.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "triton_disagg"
ROLES = {"front", "context", "generation"}
ABOVE_THE_LIBRARY = {"launch", "clients", "builders", "bench"}
# Packaged from top-level folders (pyproject's package-dir), by their import name.
FOLDERS = {"launch": ROOT / "launch", "clients": ROOT / "clients",
           "builders": ROOT / "builders", "model_repo": ROOT / "model_repo"}


def _layer(path: Path) -> str:
    """``triton_disagg/<layer>/...`` or a top-level module (``errors`` ...) or a folder."""
    for name, folder in FOLDERS.items():
        if folder in path.parents:
            return name
    parts = path.relative_to(LIBRARY).parts
    return parts[0] if len(parts) > 1 else Path(parts[0]).stem


def _imported_layers(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and
                 not node.level else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "triton_disagg" and len(parts) > 1:
                found.add(parts[1])
    return found


def _sources() -> list[Path]:
    paths = [p for p in LIBRARY.rglob("*.py")]
    for folder in FOLDERS.values():
        paths += folder.rglob("*.py")
    return sorted(p for p in paths if "__pycache__" not in p.parts)


def _violations(rule) -> list[str]:
    out = []
    for path in _sources():
        layer = _layer(path)
        for target in _imported_layers(path) - {layer}:
            if rule(layer, target):
                out.append(f"{path.relative_to(ROOT)} ({layer}) imports {target}")
    return out


def test_the_shared_layers_import_no_role_and_nothing_above_the_library():
    shared = lambda layer: layer not in ROLES | ABOVE_THE_LIBRARY | {"model_repo"}  # noqa: E731
    assert _violations(lambda layer, target: shared(layer) and
                       target in ROLES | ABOVE_THE_LIBRARY) == []


def test_a_role_imports_no_other_role():
    assert _violations(lambda layer, target: layer in ROLES and target in ROLES) == []


def test_only_the_bench_imports_the_bench():
    assert _violations(lambda layer, target: target == "bench") == []


def test_the_scan_sees_every_kind_of_import(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("import os\nfrom triton_disagg.front.orchestrator_call import Relay\n"
                      "def f():\n    import triton_disagg.context.prefill_loop\n"
                      "    from . import sibling\n")
    assert _imported_layers(source) == {"front", "context"}
    assert _layer(LIBRARY / "context" / "prefill_loop.py") == "context"
    assert _layer(LIBRARY / "errors.py") == "errors"
    assert _layer(ROOT / "launch" / "deploy.py") == "launch"
