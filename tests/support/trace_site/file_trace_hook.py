"""Records which functions of ours each Python process runs (tests/support/request_trace.py).

Imported at start-up by the ``.pth`` file that :func:`request_trace.hooked_site` puts in
this interpreter's site-packages, by every Python process whose environment sets
``FILE_TRACE_DIR`` (the `serve` CLI, the HTTP front, each Triton stub: stubs run Python in
isolated mode, which ignores ``PYTHONPATH`` but still reads site-packages' ``.pth``
files, as coverage.py's subprocess measurement relies on). It installs a trace hook on
its threads that records each code object the first time it runs (one dict
lookup per Python call; ``sys.settrace`` with no local tracer: no line events). A daemon
thread polls ``FILE_TRACE_DIR/control`` (``"<seq> reset"`` or ``"<seq> dump"``) every
50 ms: reset forgets what was recorded, dump writes ``<pid>.<seq>.json`` (the functions of
files under ``FILE_TRACE_ROOTS``, os.pathsep-separated prefixes, as ``[file, name, line]``)
— a file, not a signal, since a stub's main thread sits in C++ and stubs are SIGKILLed
at shutdown. Each process announces itself in ``<pid>.proc`` (its command line).
"""

import json
import os
import sys
import threading

_DIR = os.environ.get("FILE_TRACE_DIR")
_POLL_SECONDS = 0.05


def _command_line() -> str:
    """This process's command line (an embedded interpreter, a stub, has no sys.argv yet)."""
    with open("/proc/self/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


def _install(directory: str) -> None:
    roots = tuple(r for r in os.environ.get("FILE_TRACE_ROOTS", "").split(os.pathsep) if r)
    seen: dict = {}                     # id(code) -> code, kept alive so ids stay unique
    state = {"seen": seen}

    def on_call(frame, event, arg):
        code = frame.f_code
        current = state["seen"]
        if id(code) not in current:
            current[id(code)] = code
        return None                     # no local tracing: 'call' events only

    def ours() -> list:
        return sorted({(c.co_filename, c.co_name, c.co_firstlineno)
                       for c in list(state["seen"].values()) if c.co_filename.startswith(roots)})

    def control_loop() -> None:
        done = None
        path = os.path.join(directory, "control")
        while True:
            threading.Event().wait(_POLL_SECONDS)
            try:
                with open(path) as f:
                    seq, action = f.read().split()
            except (OSError, ValueError):
                continue
            if seq == done:
                continue
            if action == "reset":
                state["seen"] = {}
            elif action == "dump":
                out = os.path.join(directory, f"{os.getpid()}.{seq}.json")
                with open(out + ".tmp", "w") as f:
                    json.dump(ours(), f)
                os.replace(out + ".tmp", out)
            with open(os.path.join(directory, f"{os.getpid()}.ack"), "w") as f:
                f.write(seq)
            done = seq

    with open(os.path.join(directory, f"{os.getpid()}.proc"), "w") as f:
        f.write(_command_line())
    threading.Thread(target=control_loop, name="file-trace-control", daemon=True).start()
    threading.settrace(on_call)
    sys.settrace(on_call)


if _DIR:
    _install(_DIR)
