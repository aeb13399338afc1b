"""Waiting on a condition instead of sleeping before an assert (import as ``from waiting
import wait_until``; ``servers`` re-exports it). A test that sleeps a fixed time and then
asserts is slow when the condition comes early and flaky when it comes late; one that
waits on the condition is neither, and its timeout still bounds how late it may come."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               poll: float = 0.01) -> float:
    """Seconds until ``predicate()`` held (polled every ``poll`` s); fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(poll)
    return time.monotonic() - start


async def wait_until_async(predicate: Callable[[], object], timeout: float, what: str,
                           poll: float = 0.01) -> float:
    """:func:`wait_until` on an event loop: it sleeps with ``asyncio.sleep``, so what the
    loop serves (a door under test) goes on meanwhile."""
    import asyncio

    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(poll)
    return time.monotonic() - start
