"""The single-request decode loop: prefill, then steps of draft -> one target forward -> verify -> commit.

Without a drafter every step drafts nothing and verifies a block of one token: that is plain decoding, through
the same code, so the plain and speculative paths sample from identical distributions.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from verispec.drafters.base import EMPTY, Drafter
from verispec.kv_cache import KVCache
from verispec.models.llama import LlamaModel, Segment
from verispec.request import Request
from verispec.sampling import target_probs
from verispec.spec_length import SpecLengthController
from verispec.verify import EXACT, AcceptanceConfig, verify_greedy, verify_sampled

TokenCallback = Callable[[Request, list[int]], None]
StateCheck = Callable[[Request], None]


def prefill_chunks(n: int, chunk: int) -> Iterable[tuple[int, int]]:
    for s in range(0, n, chunk):
        yield s, min(chunk, n - s)


def decode(
    model: LlamaModel,
    cache: KVCache,
    req: Request,
    eos_ids: frozenset[int],
    drafter: Drafter | None = None,
    controller: SpecLengthController | None = None,
    rule: AcceptanceConfig = EXACT,
    on_tokens: TokenCallback | None = None,
    check_state: StateCheck | None = None,
    prefill_chunk: int = 2048,
) -> Request:
    """Decode `req` to completion in `cache` (its slot is allocated here and freed at the end)."""
    params = req.params
    total = len(req.prompt_ids) + params.max_tokens
    if total > cache.max_len:
        if drafter is not None:
            drafter.release()
        raise ValueError(
            f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"the context of {cache.max_len} tokens; shorten the prompt or lower max_tokens"
        )
    gen = None if params.greedy else params.make_generator(model.device)
    spec = req.spec
    spec.lossy = rule.lossy and not params.greedy
    req.slot = cache.allocate()
    try:
        prompt = torch.tensor(req.prompt_ids, dtype=torch.long, device=model.device)
        t0 = time.perf_counter()
        for start, n in prefill_chunks(len(req.prompt_ids) - 1, prefill_chunk):
            model(prompt[start : start + n], [Segment(req.slot, start, n)], cache)
            cache.commit(req.slot, n)
            req.num_computed += n
        req.stats.prefill_s = time.perf_counter() - t0
        # the last prompt token is the first block's "last": its logits give the first output token
        token = req.prompt_ids[-1]
        while not req.finished:
            t_sched = time.perf_counter()
            req.check(cache.length(req.slot))
            left = params.max_tokens - len(req.output_ids) - 1
            room = cache.max_len - req.num_computed - 1
            k = controller.choose(min(left, room)) if (drafter and controller and req.output_ids) else 0
            t_draft = time.perf_counter()
            draft = drafter.propose(req.all_ids, k) if k > 0 and drafter else EMPTY
            draft_tokens = draft.tokens[:k]
            g = len(draft_tokens)
            t_verify = time.perf_counter()
            block = torch.tensor([token] + draft_tokens, device=model.device)
            start = req.num_computed
            out = model(block, [Segment(req.slot, start, g + 1)], cache, logits_indices=range(g + 1))
            x = block[1:]
            if params.greedy:
                verdict = verify_greedy(x, out.logits)
            else:
                p = target_probs(out.logits, params.temperature, params.top_k, params.top_p)  # [g + 1, V]
                q = None if draft.probs is None else draft.probs[:g]
                verdict = verify_sampled(x, q, p, gen, rule)  # type: ignore[arg-type]
            t_state = time.perf_counter()
            cache.commit(req.slot, verdict.accepted + 1)
            req.num_computed += verdict.accepted + 1
            if drafter is not None and g:
                drafter.observe(verdict.accepted)
            first = not req.output_ids
            kept = req.append(verdict.tokens, eos_ids)
            token = verdict.tokens[-1]
            t_end = time.perf_counter()
            if controller is not None:
                controller.update(g, verdict.accepted, t_verify - t_draft)
            if not first:  # the first step finishes the prefill; it is not a decode step
                spec.record(g, verdict.accepted, draft_s=t_verify - t_draft, verify_s=t_state - t_verify,
                            sched_s=t_draft - t_sched, state_s=t_end - t_state)
            if on_tokens is not None and kept:
                on_tokens(req, kept)
            if check_state is not None:
                check_state(req)
    finally:
        if drafter is not None:
            drafter.release()
        cache.free(req.slot)
    return req
