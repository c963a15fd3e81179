"""``n`` choices of one request: their generations, seeds, order and usage.

A request with ``n`` > 1 runs ``n`` generations of the same prompt, one per choice, each its own
sampling stream, and answers them as one response (choices ``0..n-1`` with their ``index``).

    choice 0:  prompt ─ prefill ─ first token ─ o o o o ...
    choice 1:                          └ resume ─ o o o ...     (the prompt's state, not a prefill)
    choice 2:                          └ resume ─ o o o o ...

NOTES
1. The prompt is computed once: choices 1..n-1 start only when choice 0 has its first token (or
   ended), so the prompt's state (published by the prefill, ``disagg.flow``) is there for
   them to resume from; they recompute at most the partial block after the last checkpoint.
2. Seeds as vLLM derives them (``vllm/v1/engine/parallel_sampling.py``): choice ``i`` of a
   request with ``seed`` s samples with seed ``s + i``, so a seeded request is reproducible and
   its choices differ; without a seed each choice draws its own randomness. Greedy choices are
   equal (they are the same computation).
3. Usage as OpenAI and vLLM count it: the prompt once, the completion tokens of every choice
   summed; ``cached_tokens`` is choice 0's (what the prompt itself reused).
4. One choice failing fails the response (an error event in a stream, the error status
   otherwise) and stops the others; so does the client leaving.
5. Each choice is one generation at the admission gate (``disagg.api.limits.AdmissionGate``):
   a request of ``n`` choices takes ``n`` running slots.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from disagg.messages import GenerateParams

_END = object()  # a choice's events are over


def choice_params(params: GenerateParams, n: int) -> list[GenerateParams]:
    """The generation of each of ``n`` choices (NOTE 2); ``params`` itself when ``n`` is 1."""
    if n == 1:
        return [params]
    seed = params.sampling.seed
    return [replace(params, request_id=f"{params.request_id}-{i}",
                    sampling=replace(params.sampling, seed=None if seed is None else seed + i))
            for i in range(n)]


async def merged(streams: list[AsyncIterator], first_ready: asyncio.Event, queue_size: int = 8) -> AsyncIterator:
    """The items of ``streams`` as they come; streams 1.. start once ``first_ready`` is set (NOTE 1).

    The first stream's error is raised once the others are stopped (NOTE 4); closing this
    generator stops them all (each stream is closed, which aborts its generation).
    """
    queue: asyncio.Queue = asyncio.Queue(queue_size)  # bounded: a slow client slows the choices

    async def pump(stream: AsyncIterator, wait: bool) -> None:
        try:
            if wait:
                await first_ready.wait()
            async for item in stream:
                await queue.put((item, None))
            await queue.put((_END, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which stops the rest
            await queue.put((_END, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(s, i > 0)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                running -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def summed_usage(usages: list[dict]) -> dict:
    """One usage for all choices (NOTE 3)."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion}
