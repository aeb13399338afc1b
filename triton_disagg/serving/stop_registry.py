"""Stop requests that reached the wrong generation instance.

Triton hands a ``stop`` request to any instance of the generation model, not
necessarily the one running the request it names (with two instances, none of
six cancels landed on the right one here). An instance that does not hold the
request leaves a mark in a directory that all instances of the model share; every
instance looks for the marks of its live requests each time it polls for
cancellation.

Invariants: a mark is an empty file named by the SHA-1 of the request id; the one
instance that deletes a mark is the one that acts on it; marks older than
``STALE_SECONDS`` (their request had already ended everywhere) are deleted by
whichever instance posts next.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

STALE_SECONDS = 60.0


class StopRegistry:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _mark(self, request_id: str) -> Path:
        return self.directory / hashlib.sha1(request_id.encode()).hexdigest()

    def post(self, request_id: str) -> None:
        """Ask whichever instance runs ``request_id`` to stop it."""
        self._prune()
        self._mark(request_id).touch()

    def take(self, request_id: str) -> bool:
        """True (once) if a stop was posted for ``request_id``."""
        try:
            self._mark(request_id).unlink()
        except FileNotFoundError:
            return False
        return True

    def _prune(self) -> None:
        cutoff = time.time() - STALE_SECONDS
        for entry in os.scandir(self.directory):
            try:
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass  # another instance took or pruned it meanwhile
