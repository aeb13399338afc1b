"""Can Triton's Python-backend stub start on this host? Asked before tritonserver starts.

The stub (``triton_python_backend_stub``) is an executable linked against the shared
``libpython<major>.<minor>.so.1.0`` of the Python it runs. Debian's and Ubuntu's
``python3`` ship that library in a separate package (``libpython3.11``, ...), and a
Python built without ``--enable-shared`` has none. When it is missing, every stub
fails with "error while loading shared libraries" and tritonserver keeps "loading";
this module turns that into one line naming what is missing and the command that
fixes it, in a fraction of a second.

Invariant: :func:`missing_libraries` asks the system's own loader (``ldd``) with the
environment the server will run with, so what it reports is what the stub would meet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from triton_disagg.errors import UserError

_APT_PYTHON_PREFIX = "/usr"   # Debian's / Ubuntu's own python3


def missing_libraries(executable: Path, env: dict[str, str]) -> list[str]:
    """Shared libraries ``executable`` needs that the loader cannot find under ``env``."""
    ldd = shutil.which("ldd")
    if ldd is None:   # no loader front-end (a distroless image): nothing to ask
        return []
    out = subprocess.run([ldd, str(executable)], env=env, capture_output=True, text=True,
                         timeout=30)
    # lines look like "\tlibpython3.11.so.1.0 => not found"
    return [line.split("=>")[0].strip() for line in out.stdout.splitlines()
            if line.rstrip().endswith("=> not found")]


_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def libpython_package(prefix: str = sys.base_prefix) -> str | None:
    """The Debian/Ubuntu package holding this Python's libpython, when apt supplies this
    Python (None for pyenv, conda or a source build)."""
    return f"libpython{_VERSION}" if prefix == _APT_PYTHON_PREFIX and _is_debian_like() else None


def libpython_fix(prefix: str = sys.base_prefix) -> str:
    """The command (or advice) that brings ``libpython<version>.so`` for this Python."""
    package = libpython_package(prefix)
    if package:
        sudo = "" if os.geteuid() == 0 else "sudo "
        return f"{sudo}apt-get update && {sudo}apt-get install -y {package}"
    return (f"use a Python {_VERSION} built with --enable-shared (pyenv: "
            f"PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install {_VERSION}; conda's Python has it)")


def check_stub(stub: Path, env: dict[str, str]) -> None:
    """Raise :class:`UserError` (one line) when ``stub`` cannot start under ``env``."""
    missing = missing_libraries(stub, env) if stub.is_file() else []
    if not missing:
        return
    libpython = [lib for lib in missing if lib.startswith("libpython")]
    if libpython:
        raise UserError(f"Triton's Python backend stub cannot start: {libpython[0]} (the shared "
                        f"library of the Python at {sys.executable}) is not installed; fix: "
                        f"{libpython_fix()}")
    raise UserError(f"Triton's Python backend stub cannot start: {', '.join(missing)} not found "
                    f"(checked with ldd {stub}); install the package that provides it")


def _is_debian_like() -> bool:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return False
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    ids = {fields.get("ID", "").strip('"')} | set(fields.get("ID_LIKE", "").strip('"').split())
    return bool(ids & {"debian", "ubuntu"})
