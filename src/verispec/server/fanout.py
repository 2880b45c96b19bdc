"""`n` choices of one request: n engine requests (seeds seed + i), their events merged as they come.

Each choice is an independent engine request (its own prefill and KV; no prefix sharing), so the engine's
continuous batching decodes them together. Greedy choices are n identical copies, as with OpenAI and vLLM.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, AsyncIterator, Protocol, Sequence

from verispec.sampling import SamplingParams

SEED_SPACE = 2**64  # torch seeds: [-2^63, 2^64)


class EventSource(Protocol):
    def events(self) -> AsyncIterator[Any]: ...


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index`: seed + index when seeded (wrapped into torch's seed range), so
    each choice is reproducible and differs from the others."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    return replace(params, seed=seed - SEED_SPACE if seed >= SEED_SPACE else seed)


async def interleave(sources: Sequence[EventSource]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, event) from every source's `events()`, in the order they arrive, until all have ended."""
    if len(sources) == 1:  # no tasks for the common case
        async for ev in sources[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, Any, bool]] = asyncio.Queue()

    async def pump(i: int, src: EventSource) -> None:
        try:
            async for ev in src.events():
                queue.put_nowait((i, ev, False))
        finally:
            queue.put_nowait((i, None, True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            i, ev, done = await queue.get()
            if done:
                left -= 1
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()


async def drain(sources: Sequence[EventSource]) -> None:
    """Consume every source to its end, concurrently."""
    async for _ in interleave(sources):
        pass
