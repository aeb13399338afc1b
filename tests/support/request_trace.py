"""Which of our source files a request runs code in, traced in every Python process of a
real server (``import request_trace``; the hook is ``trace_site/file_trace_hook.py``).

:func:`hooked_site` makes this interpreter's processes load the hook (when their
environment asks for it); :func:`traced_env` is the environment a traced `serve` inherits
(its processes, Triton's stubs included, inherit it); :class:`Tracer` tells
its processes to reset or dump what they recorded. :func:`crossed_files` traces a request
from a reset to a dump and subtracts what the same processes ran while idle (before and
after), so that only the functions the request ran (not a background loop's idle turns)
name their files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sysconfig
import time
from pathlib import Path
from typing import Callable, Iterator

from waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
SITE = Path(__file__).parent / "trace_site"
ACK_TIMEOUT = 30.0
Function = tuple[str, str, int]          # (repo-relative file, name, first line)


@contextlib.contextmanager
def hooked_site() -> Iterator[None]:
    """While the block runs, a ``.pth`` file in this interpreter's site-packages imports the
    hook into every Python process of this environment that sets ``FILE_TRACE_DIR`` (inert
    in all others). A ``.pth``, not ``PYTHONPATH``: Triton's stubs run Python isolated."""
    pth = Path(sysconfig.get_paths()["purelib"]) / f"file-trace-{os.getpid()}.pth"
    pth.write_text(f"import os, sys; os.environ.get('FILE_TRACE_DIR') and ("
                   f"sys.path.insert(0, {str(SITE)!r}), __import__('file_trace_hook'), "
                   f"sys.path.remove({str(SITE)!r}))\n")
    try:
        yield
    finally:
        pth.unlink()


def traced_env(trace_dir: Path, work_dir: Path) -> dict[str, str]:
    """Our environment plus the hook's settings: recorded are files of this checkout and of
    the model repository `serve` renders under ``work_dir`` (its model.py files are copies)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "FILE_TRACE_DIR": str(trace_dir),
            "FILE_TRACE_ROOTS": os.pathsep.join((str(REPO) + "/", str(work_dir.resolve()) + "/"))}


def repo_file(path: str) -> str | None:
    """``path`` as the checkout names it: a rendered ``<model>/1/model.py`` is
    ``model_repo/<model>/1/model.py``; None for files that are not our source."""
    model = re.search(r"/([a-z_]+)/1/model\.py$", path)
    if model:
        return f"model_repo/{model.group(1)}/1/model.py"
    try:
        relative = Path(path).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return None
    return relative if relative.split("/")[0] in ("triton_disagg", "launch", "clients") else None


class Tracer:
    """The control file of every traced process under ``trace_dir``."""

    def __init__(self, trace_dir: Path):
        self.dir, self.seq = trace_dir, 0

    def processes(self) -> dict[int, str]:
        """pid -> command line of every traced process still alive."""
        return {int(p.stem): p.read_text() for p in self.dir.glob("*.proc")
                if Path(f"/proc/{p.stem}").exists()}

    def command(self, action: str) -> None:
        """``reset`` or ``dump``, returning once every live traced process has acted."""
        self.seq += 1
        (self.dir / "control.tmp").write_text(f"{self.seq} {action}")
        (self.dir / "control.tmp").replace(self.dir / "control")

        def acked() -> bool:
            for pid in self.processes():
                ack = self.dir / f"{pid}.ack"
                if not ack.exists() or ack.read_text() != str(self.seq):
                    return False
            return True
        wait_until(acked, ACK_TIMEOUT, f"every traced process acts on {action}")

    def dump(self) -> set[Function]:
        """The functions of our files that any live process ran since its last reset."""
        self.command("dump")
        ran: set[Function] = set()
        for pid in self.processes():
            for path, name, line in json.loads((self.dir / f"{pid}.{self.seq}.json").read_text()):
                relative = repo_file(path)
                if relative is not None:
                    ran.add((relative, name, line))
        return ran

    def span(self, during: Callable[[], None]) -> set[Function]:
        """What ran while ``during()`` ran (reset, run, dump)."""
        self.command("reset")
        during()
        return self.dump()


def crossed_files(tracer: Tracer, request: Callable[[], None], settle: Callable[[], None],
                  idle_seconds: float) -> set[str]:
    """Files in which ``request`` (then ``settle``: waiting for its after-effects, such as
    freed KV blocks) ran a function that the processes did not also run over
    ``idle_seconds`` of idling, measured before and after the request."""
    idle = tracer.span(lambda: time.sleep(idle_seconds))
    ran = tracer.span(lambda: (request(), settle()))
    idle |= tracer.span(lambda: time.sleep(idle_seconds))
    return {path for path, _, _ in ran - idle}
