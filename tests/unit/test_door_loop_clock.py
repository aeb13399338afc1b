"""The doors' loop clock (issue 27, rev27j M2): the time a door asks of a client is
measured less the door's own event-loop stalls, a stall in progress included."""

from __future__ import annotations

import asyncio
import time

import pytest

from triton_disagg.front.door_guards import LoopClock


def test_a_stall_of_the_loop_counts_at_most_half_while_it_lasts_and_after():
    """A stall is discounted (rev27j M2), but at most ``LAG_SHARE`` of it (rev27k L1: a
    client that keeps the loop busy stretched every other client's time 2.5 fold)."""
    async def main():
        clock = LoopClock(tick=0.02)
        clock.start()
        await asyncio.sleep(0.1)
        begun, wall = clock.now(), time.monotonic()
        time.sleep(0.5)                                    # the loop stalls
        assert 0.24 < clock.now() - begun < 0.3            # in progress: half counted
        await asyncio.sleep(0.1)
        assert 0.3 < clock.now() - begun < 0.45 < time.monotonic() - wall - 0.1
        await clock.stop()
        stopped = clock.now()
        await asyncio.sleep(0.2)
        assert 0.15 < clock.now() - stopped < 0.4          # stopped: monotonic time
    asyncio.run(main())


def test_work_finishes_by_its_deadline_on_the_clock_or_is_cancelled():
    async def main():
        clock = LoopClock(tick=0.02)
        clock.start()

        async def stalled_then_done() -> str:
            time.sleep(0.4)                                # the loop's stall: half counted
            await asyncio.sleep(0.1)
            return "done"
        assert await clock.finish_by(clock.now() + 0.35, stalled_then_done()) == "done"

        never = asyncio.get_running_loop().create_future()
        begun = time.monotonic()
        with pytest.raises(TimeoutError):
            await clock.finish_by(clock.now() + 0.2, never)
        assert never.cancelled() and 0.15 < time.monotonic() - begun < 0.5
        await clock.stop()
    asyncio.run(main())
