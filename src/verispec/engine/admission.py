"""Admission by free KV blocks, and when the next step would run out of them, which request to preempt.

Counting only: how many blocks of the paged cache (state/paged_kv.py) the next step can take at most, and how many
a waiting request needs to be prefilled and take its first decode block. The engine admits a request only when
both fit in the free blocks (cached prefix blocks count as free: they are evicted on demand), and before every
step preempts the newest running request while the running ones' next step does not fit. A preempted request
frees its blocks and drafter and goes back to the front of the queue; readmitted, it recomputes its prompt and
output so far (through the prefix cache where its prompt blocks are still cached) and goes on where it stopped.
A request that could never run (longer than the context, or than the whole pool) is refused when added
(`check_room`).
"""

from __future__ import annotations

from os.path import commonprefix
from typing import Callable, Sequence

from verispec.engine.plan import LiveRequest, plan_step
from verispec.state.paged_kv import PagedKVCache
from verispec.state.request import Request


def step_blocks(running: Sequence[LiveRequest], cache: PagedKVCache, max_tokens: int,
                drafts: Callable[[LiveRequest], int]) -> int:
    """The most new blocks the next step can take: each decoding request's block (its pending token and at most
    `drafts(lv)` draft tokens), each prefill chunk as `plan_step` will plan it."""
    plan = plan_step(running, max_tokens)
    need = sum(cache.blocks_needed(lv.req.slot, 1 + drafts(lv)) for lv in plan.decode)  # type: ignore[arg-type]
    return need + sum(cache.blocks_needed(c.live.req.slot, c.length) for c in plan.prefill)  # type: ignore[arg-type]


def admission_blocks(req: Request, cache: PagedKVCache, hits: Sequence[int], k: int) -> int:
    """Free blocks admitting `req` takes: its whole (re)prefill and first decode block of k + 1 positions past
    the prefix hits, plus the hit blocks that now sit cached (taking them makes them used)."""
    B = cache.block_size
    positions = min(len(req.all_ids) + k, cache.max_len)
    own = -(-positions // B) - len(hits)
    return own + sum(cache.pool.ref[b] == 0 for b in hits)


class RequestTooLong(ValueError):
    """prompt + max_tokens can never fit in the context."""


def check_room(req: Request, cache: PagedKVCache) -> None:
    """Raise RequestTooLong where the request could never run: longer than the context, or its longest sequence
    needs more blocks than an otherwise empty pool has."""
    total = len(req.prompt_ids) + req.params.max_tokens
    if total > cache.max_len:
        raise RequestTooLong(
            f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) = {total} exceeds "
            f"the context of {cache.max_len} tokens; shorten the prompt or lower max_tokens"
        )
    if -(-total // cache.block_size) > cache.pool.num_blocks:
        raise RequestTooLong(
            f"prompt + max_tokens = {total} tokens need more KV blocks than the cache's "
            f"{cache.pool.num_blocks} of {cache.block_size}; raise kv_cache_memory_bytes or lower max_tokens"
        )


def prefix_pending(prompt: list[int], running: Sequence[LiveRequest], hit_blocks: int, block_size: int) -> bool:
    """A running request is still prefilling full prompt blocks that `prompt` shares past its `hit_blocks` cache
    hits: admitted now it would compute them again (requests sharing a system prompt that arrive together would all
    miss); it waits until they are committed, and so cached."""
    for lv in running:
        shared = len(commonprefix([prompt, lv.req.prompt_ids])) // block_size * block_size
        if shared > hit_blocks * block_size and lv.req.num_computed < shared:
            return True
    return False
