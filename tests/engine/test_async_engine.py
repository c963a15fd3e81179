"""AsyncEngine's calls (NOTE 5): run by the stepping thread between two steps, never starved by a
busy engine, errors handed to the caller, and still served once the thread has stopped."""

from __future__ import annotations

import asyncio
import time

import pytest

from disagg.engine.async_engine import AsyncEngine


class BusyEngine:
    """Always has work; a step runs ``step_s``, letting go of the GIL now and then as a GPU
    engine's step does in every kernel launch and wait (``gil_free``), or never."""

    model_id, block_size, layout = "busy", 64, None

    def __init__(self, step_s: float = 0.01, gil_free: bool = True):
        self.step_s, self.gil_free, self.steps = step_s, gil_free, 0

    def has_work(self) -> bool:
        return True

    def step(self) -> list:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.step_s:
            if self.gil_free:
                time.sleep(0.0002)
        self.steps += 1
        return []

    def abort(self, request_id: str) -> list:
        return []


@pytest.mark.parametrize("gil_free", [True, False])
def test_a_call_waits_for_at_most_the_step_in_progress(gil_free: bool) -> None:
    engine = BusyEngine(gil_free=gil_free)
    front = AsyncEngine(engine)

    async def main() -> list[int]:
        waited = []
        for _ in range(30):
            before = engine.steps
            ran_at = await front.call(lambda: engine.steps)
            waited.append(ran_at - before)
            await asyncio.sleep(0.003)
        return waited

    try:
        waited = asyncio.run(main())
    finally:
        front.shutdown()
    assert max(waited) <= 1, f"steps a call waited: {waited}"


def test_a_calls_error_reaches_its_caller_and_the_thread_goes_on() -> None:
    engine = BusyEngine(0.001)
    front = AsyncEngine(engine)

    def boom():
        raise KeyError("no such request")

    async def main() -> int:
        with pytest.raises(KeyError, match="no such request"):
            await front.call(boom)
        return await front.call(lambda: 7)

    try:
        assert asyncio.run(main()) == 7
        assert front._thread.is_alive()
    finally:
        front.shutdown()


def test_calls_after_shutdown_run_in_the_callers_thread() -> None:
    front = AsyncEngine(BusyEngine(0.001))
    front.shutdown()
    assert not front._thread.is_alive()
    assert asyncio.run(front.call(lambda x: x + 1, 41)) == 42


def test_a_call_queued_as_the_thread_stops_runs_exactly_once() -> None:
    front = AsyncEngine(BusyEngine(0.001))
    ran = []

    async def main() -> None:
        front._stop = True  # the thread leaves its loop; the call may land before or after that
        front._wake.set()
        assert await front.call(lambda: ran.append(1) or len(ran)) == 1

    asyncio.run(main())
    front.shutdown()
    assert ran == [1]
