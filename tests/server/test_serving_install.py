"""Serving runs without the ``[bench]`` extra. In a child Python where locust and
matplotlib are missing (``sys.modules[name] = None``: ``import`` raises ImportError and
``importlib.util.find_spec`` answers None, as for a package never installed), every module
of the library but the bench's imports: ``triton_disagg`` and ``launch``, ``clients`` and
``builders`` as installed under it (not the locustfile, which is locust's own). And each
``bench`` command that needs the extra stops in one line that names it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MISSING = ("locust", "matplotlib")
BLOCK = f"import sys\nfor name in {MISSING!r}:\n    sys.modules[name] = None\n"
IMPORT_ALL = BLOCK + textwrap.dedent("""
    import importlib, json, pkgutil

    ROOTS = ("triton_disagg", "triton_disagg.launch", "triton_disagg.clients",
             "triton_disagg.builders")
    LEFT_OUT = ("triton_disagg.bench", "triton_disagg.clients.locustfile",
                "triton_disagg.model_repo")

    def walk(package):
        yield package
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            name = f"{package}.{info.name}"
            if not name.startswith(LEFT_OUT):
                yield from (walk(name) if info.ispkg else [name])

    names = sorted({name for root in ROOTS for name in walk(root)})
    for name in names:
        importlib.import_module(name)
    print(json.dumps(names))
""")


def _child(code: str, *argv: str) -> subprocess.CompletedProcess:
    # A child Python: the modules must not already be imported, as they are in this one.
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=300)


def test_every_serving_module_imports_without_locust_or_matplotlib():
    run = _child(IMPORT_ALL)
    assert run.returncode == 0, run.stderr[-3000:]
    names = json.loads(run.stdout)
    assert {"triton_disagg.front.http_front", "triton_disagg.launch.serve_cli",
            "triton_disagg.clients.stream", "triton_disagg.clients.load",
            "triton_disagg.builders.build", "triton_disagg.cli"} <= set(names), names
    assert not [n for n in names if n.startswith("triton_disagg.bench")]


@pytest.mark.parametrize("argv, needs", [(["bench", "soak"], "locust"),
                                         (["bench", "serve"], "matplotlib")])
def test_a_bench_command_without_the_extra_says_which_in_one_line(argv, needs):
    run = _child(BLOCK + "from triton_disagg.cli import main\nsys.exit(main(sys.argv[1:]))",
                 *argv)
    assert run.returncode == 2, run.stderr[-3000:]
    (line,) = run.stderr.strip().splitlines()
    assert needs in line and "pip install 'triton-disagg[bench]'" in line, line
