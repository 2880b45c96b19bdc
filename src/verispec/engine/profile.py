"""Profile what target forwards cost on this machine: the tables the scheduling policies read (engine/costs.py)."""

from __future__ import annotations

import statistics
import time

import torch

from verispec.engine.costs import CostTable, StepCosts, step_sizes
from verispec.models.llama import LlamaModel, Segment


def profile_costs(model: LlamaModel, sizes=(1, 2, 3, 4, 6, 8, 12, 16), context: int = 128, repeats: int = 3) -> CostTable:
    """Time one forward of each block size after `context` committed tokens (median of repeats)."""
    room = model.max_positions
    sizes = tuple(n for n in sizes if n < room) or (1,)
    context = max(1, min(context, room - max(sizes)))
    ids = torch.arange(context + max(sizes), device=model.device) % model.cfg.vocab_size  # [context + max size]
    cache, slot, _ = model.prefill_fresh(ids[:context], max_len=context + max(sizes))
    out = []
    for n in sizes:
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            model(ids[context : context + n], [Segment(slot, context, n)], cache, logits_indices=range(n))
            times.append(time.perf_counter() - t)
            cache.rollback(slot, context)
        out.append(statistics.median(times[1:]))
    return CostTable(tuple(sizes), tuple(out))


def profile_step_costs(model: LlamaModel, max_tokens: int, segments: int = 8, repeats: int = 2) -> StepCosts:
    """Profile one sequence's block sizes 1..max_tokens, and the extra cost of splitting a block over sequences."""
    table = profile_costs(model, step_sizes(max_tokens), repeats=repeats)
    n = segments
    ctx = max(1, min(64, model.max_positions - 1))
    cache = model.new_cache(ctx + 1, num_slots=n)
    slots = [cache.allocate() for _ in range(n)]
    ids = torch.arange(ctx + 1, device=model.device) % model.cfg.vocab_size  # [ctx + 1]
    for s in slots:
        model.prefill(ids[:ctx], cache, s)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        model(ids[ctx:].repeat(n), [Segment(s, ctx, 1) for s in slots], cache, logits_indices=range(n))
        times.append(time.perf_counter() - t)
        for s in slots:
            cache.rollback(s, ctx)
    per_segment = max(0.0, (statistics.median(times[1:]) - table(n)) / (n - 1))
    return StepCosts(table, per_segment)
