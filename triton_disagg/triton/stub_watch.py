"""Watching tritonserver's Python-backend stub processes from outside.

Triton 2.51 does not restart a stub process that died (killed, out of memory, a crash
in native code), and its ``/v2/health/ready`` keeps answering 200: every later request
to that model fails at once with "Stub process '<instance>' is not healthy", for good,
and no load balancer or Kubernetes probe notices. ``serve`` therefore lists the model
instances' stubs as each model loads and once the server is ready
(:func:`model_instance_stubs`), and asks :func:`first_dead` of all it saw every half
second; a death restarts the whole server (see ``launch/serve_cli.py``). Listing as the
models load matters: a stub killed before the last listing is a zombie without argv,
which no listing names any more.

A stub is a child process of tritonserver running ``triton_python_backend_stub``; its
second-to-last argument is the model instance it serves (``generation_0_0``).
Invariant: a stub is dead once its ``/proc`` entry is gone or a zombie (its parent has
not reaped it yet); a live server never lets a healthy stub become either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"
INSTANCE_NAME = re.compile(r".+_\d+_\d+")     # generation_0_0: model, group, index


@dataclass(frozen=True)
class Stub:
    pid: int
    instance: str           # Triton's model instance name, e.g. generation_0_0


def stubs_of(server_pid: int) -> list[Stub]:
    """The stub processes that ``server_pid`` started, as they are now."""
    return sorted((Stub(pid, argv[-2].decode(errors="replace"))
                   for pid, argv in children_running(server_pid, STUB_BINARY)),
                  key=lambda s: s.instance)


def model_instance_stubs(server_pid: int) -> list[Stub]:
    """:func:`stubs_of` less those that are not a model instance's: Triton's auto-complete
    stub of a loading model is named after the model alone and exits once done, where an
    instance's is ``<model>_<group>_<index>`` for the server's life."""
    return [s for s in stubs_of(server_pid) if INSTANCE_NAME.fullmatch(s.instance)]


def children_running(parent_pid: int, binary: str) -> list[tuple[int, list[bytes]]]:
    """``(pid, argv)`` of the child processes of ``parent_pid`` whose ``argv[0]`` ends with
    ``binary``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
            parent = _parent_pid(entry)
        except (OSError, ValueError, IndexError):
            continue
        if parent == parent_pid and argv and argv[0].endswith(binary.encode()):
            found.append((int(entry.name), argv))
    return found


def first_dead(stubs: list[Stub]) -> Stub | None:
    """The first of ``stubs`` that is no longer running, else None."""
    for stub in stubs:
        try:
            state = _state(Path("/proc") / str(stub.pid))
        except (OSError, ValueError, IndexError):
            return stub
        if state in ("Z", "X"):
            return stub
    return None


def _stat_fields(entry: Path) -> list[str]:
    """``/proc/<pid>/stat`` after the command name (which may hold spaces and parentheses):
    state, parent pid, ..."""
    text = (entry / "stat").read_text()
    return text[text.rindex(")") + 2:].split()


def _parent_pid(entry: Path) -> int:
    return int(_stat_fields(entry)[1])


def _state(entry: Path) -> str:
    return _stat_fields(entry)[0]
