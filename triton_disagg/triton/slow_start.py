"""A Python-backend stub whose model ``initialize`` hangs tells where: after
``STACKS_AFTER_SECONDS`` every thread's stack goes to tritonserver's log (the stub's
stderr), once, and the start goes on. Triton gives a stub's start no deadline of its own,
so without this a stuck start shows only as a model that never becomes ready."""

from __future__ import annotations

import faulthandler
import functools
import sys

STACKS_AFTER_SECONDS = 90.0     # a demo-engine stub starts in 1-10 s, a loaded host's in ~30


def stacks_if_slow(initialize):
    """Decorate ``TritonPythonModel.initialize``: stacks dumped if it runs past
    ``STACKS_AFTER_SECONDS`` (read at each call)."""
    @functools.wraps(initialize)
    def timed(self, args):
        faulthandler.dump_traceback_later(STACKS_AFTER_SECONDS, file=sys.stderr)
        try:
            return initialize(self, args)
        finally:
            faulthandler.cancel_dump_traceback_later()
    return timed
