"""AsyncEngine's calls (NOTE 5): run by the stepping thread between two steps, never starved by a
busy engine, errors handed to the caller, and still served once the thread has stopped."""

from __future__ import annotations

import asyncio
import threading
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


def test_a_call_made_while_the_engine_stops_runs_exactly_once() -> None:
    """The thread may or may not have left its loop when the call arrives; either way it runs once.
    (The narrower race, the thread stopping between the call's check and its queueing, is not forced.)"""
    front = AsyncEngine(BusyEngine(0.001))
    ran = []

    async def main() -> None:
        front._stop = True  # the thread leaves its loop; the call may land before or after that
        front._wake.set()
        assert await front.call(lambda: ran.append(1) or len(ran)) == 1

    asyncio.run(main())
    front.shutdown()
    assert ran == [1]


class AdmittingEngine(BusyEngine):
    """Records admissions and aborts (an unknown request's abort is a no-op, as in the reference
    engine); while ``gate`` is closed a step waits for it (at most 10 s), holding the engine lock,
    and sets ``gated`` once it is waiting."""

    def __init__(self):
        super().__init__(0.001)
        self.admitted: list[str] = []
        self.aborted: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.gated = threading.Event()

    def step(self) -> list:
        if not self.gate.is_set():
            self.gated.set()
        self.gate.wait(10.0)
        return super().step()

    def add_request(self, request) -> None:
        if request.request_id == "bad":
            raise ValueError("refused")
        self.admitted.append(request.request_id)

    def abort(self, request_id: str) -> list:
        self.aborted.append(request_id)
        return []


def _request(rid: str):
    from disagg.engine.protocol import EngineRequest, SamplingParams

    return EngineRequest(rid, [5, 6, 7], SamplingParams(max_tokens=1))


def test_admission_waits_for_the_step_without_blocking_the_event_loop() -> None:
    engine = AdmittingEngine()
    front = AsyncEngine(engine)

    async def main() -> None:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        tick = asyncio.create_task(ticker())
        engine.gate.clear()
        while not engine.gated.is_set():  # until the stepping thread is inside a step, holding the lock
            await asyncio.sleep(0.001)
        first = asyncio.create_task(front.generate(_request("r1")).__anext__())
        await asyncio.sleep(0.001)
        t0 = ticks
        await asyncio.sleep(0.1)
        assert not engine.admitted, "admitted during a step"
        # the ticker's 1 ms timer is due before this coroutine's 100 ms one, so a loop that is not
        # blocked ticks at least once whatever the machine's load (a loop blocked by the admission
        # would not get here before the gate's 10 s; the admission would then be in `admitted`)
        assert ticks - t0 >= 1, "the event loop stood still while the admission waited"
        first.cancel()  # the consumer leaves while its admission is still queued
        with pytest.raises(asyncio.CancelledError):
            await first
        engine.gate.set()
        with pytest.raises(ValueError, match="refused"):
            await front.generate(_request("bad")).__anext__()
        await asyncio.sleep(0.05)
        tick.cancel()

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
    assert engine.admitted == ["r1"] and engine.aborted == ["r1"], "admitted, then aborted at once"
