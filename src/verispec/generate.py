"""Single-stream plain decoding: prefill, then one token per target forward."""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from verispec.kv_cache import KVCache
from verispec.models.llama import LlamaModel, Segment
from verispec.request import Request
from verispec.sampling import next_tokens

TokenCallback = Callable[[Request, list[int]], None]


def prefill_chunks(n: int, chunk: int) -> Iterable[tuple[int, int]]:
    for s in range(0, n, chunk):
        yield s, min(chunk, n - s)


def generate_plain(
    model: LlamaModel,
    cache: KVCache,
    req: Request,
    eos_ids: frozenset[int],
    on_tokens: TokenCallback | None = None,
    prefill_chunk: int = 2048,
) -> Request:
    """Decode `req` to completion in `cache` (slot allocated here and freed at the end)."""
    total = len(req.prompt_ids) + req.params.max_tokens
    if total > cache.max_len:
        raise ValueError(
            f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) = {total} exceeds "
            f"the context of {cache.max_len} tokens; shorten the prompt or lower max_tokens"
        )
    gen = None if req.params.greedy else req.params.make_generator()
    req.slot = cache.allocate()
    try:
        prompt = torch.tensor(req.prompt_ids, dtype=torch.long, device=model.device)
        t0 = time.perf_counter()
        for start, n in prefill_chunks(len(req.prompt_ids), prefill_chunk):
            out = model(prompt[start : start + n], [Segment(req.slot, start, n)], cache)
            cache.commit(req.slot, n)
            req.num_computed += n
        req.stats.prefill_s = time.perf_counter() - t0
        token = int(next_tokens(out.logits, req.params, gen)[0])
        _emit(req, [token], eos_ids, on_tokens)
        while not req.finished:
            req.check(cache.length(req.slot))
            pos = req.num_computed
            out = model(torch.tensor([token], device=model.device), [Segment(req.slot, pos, 1)], cache)
            cache.commit(req.slot, 1)
            req.num_computed += 1
            req.stats.steps += 1
            token = int(next_tokens(out.logits, req.params, gen)[0])
            _emit(req, [token], eos_ids, on_tokens)
    finally:
        cache.free(req.slot)
    return req


def _emit(req: Request, tokens: list[int], eos_ids: frozenset[int], on_tokens: TokenCallback | None) -> None:
    kept = req.append(tokens, eos_ids)
    if on_tokens is not None and kept:
        on_tokens(req, kept)
