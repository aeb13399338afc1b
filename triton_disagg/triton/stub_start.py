"""A Python-backend stub's start, told in tritonserver's log, so that ``serve`` can see
where a start stands (:mod:`triton_disagg.triton.stuck_start`).

Every model's ``initialize`` is wrapped in :func:`watched_initialize`, which

- writes every thread's stack to the log (the stub's stderr) once, after
  ``STACKS_AFTER_SECONDS``: Triton gives a stub's start no deadline of its own, so without
  this a stuck start shows only as a model that never becomes ready;
- writes :func:`initialized_line` when ``initialize`` returns, and the exception with its
  traceback when it raises (Triton logs that error only once the stub has exited, which a
  stub Triton gave up on never does);
- registers ``STACKS_SIGNAL``: serve sends it to a stub it finds stuck and gets every
  thread's stack in the log.

Lines follow serve's ``--log-format`` (:mod:`triton_disagg.log_format`).
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import re
import signal
import sys
import time

STACKS_AFTER_SECONDS = 90.0     # a demo-engine stub starts in 1-10 s, a loaded host's in ~30
STACKS_SIGNAL = signal.SIGUSR2  # serve -> stub: write every thread's stack to the log
_INITIALIZED = re.compile(r"model instance (\S+) initialized in \d")

log = logging.getLogger(__name__)


def initialized_line(instance: str, seconds: float) -> str:
    """What a stub says once its ``initialize`` returned (:func:`initialized_instance`
    reads it back)."""
    return f"triton-disagg: model instance {instance} initialized in {seconds:.1f}s"


def initialized_instance(line: str) -> str | None:
    """The instance a log line says finished its ``initialize``, else None."""
    m = _INITIALIZED.search(line)
    return m.group(1) if m else None


def watched_initialize(initialize):
    """Decorate ``TritonPythonModel.initialize(self, args)`` as the module says (the
    deadline ``STACKS_AFTER_SECONDS`` is read at each call)."""
    @functools.wraps(initialize)
    def watched(self, args):
        instance = args.get("model_instance_name", "?")
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
        faulthandler.dump_traceback_later(STACKS_AFTER_SECONDS, file=sys.stderr)
        started = time.monotonic()
        try:
            result = initialize(self, args)
        except BaseException:
            _say(logging.ERROR, f"triton-disagg: model instance {instance} failed to "
                 f"initialize after {time.monotonic() - started:.1f}s", exc_info=True)
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()
        _say(logging.INFO, initialized_line(instance, time.monotonic() - started))
        return result
    return watched


def _say(level: int, message: str, exc_info: bool = False) -> None:
    """One line in the log whatever the format: logging where serve set it up (json),
    else straight to stderr (text mode leaves the stub's logging at its defaults)."""
    if logging.getLogger().handlers:
        log.log(level, message, exc_info=exc_info)
        return
    print(message, file=sys.stderr, flush=True)
    if exc_info:
        import traceback
        traceback.print_exc(file=sys.stderr)
