"""State oracle: recompute a request's KV from scratch and compare it with what the live cache holds.

`--check-state` runs it after every decode step, for the target and for a drafter with a KV cache of its own.
A mismatch means an accepted position was not written, a rejected one leaked into later steps, or positions
fell out of step; the error names the layer and the first bad position.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from verispec.models.llama import LlamaModel
from verispec.sampling.grammar import Matcher
from verispec.state.kv_cache import KVCache
from verispec.state.paged_kv import PagedKVCache


class StateMismatch(AssertionError):
    pass


def default_atol(model: LlamaModel) -> float:
    return 1e-4 if model.dtype == torch.float32 else 5e-2


def check_kv(model: LlamaModel, cache: KVCache | PagedKVCache, slot: int, tokens: Sequence[int],
             what: str = "target", atol: float | None = None) -> None:
    """The cache's committed KV of `slot` must equal a from-scratch forward over `tokens` (read through its block
    table for a paged cache, whose invariants are checked first: tables, refcounts, shared blocks)."""
    if isinstance(cache, PagedKVCache):
        cache.check()
    n = cache.length(slot)
    if n != len(tokens):
        raise StateMismatch(f"{what}: cache holds {n} committed positions but the request has {len(tokens)} tokens")
    if n == 0:
        return
    atol = default_atol(model) if atol is None else atol
    fresh, s, _ = model.prefill_fresh(tokens)
    for layer in range(model.cfg.num_layers):
        for name, live, ref in zip("KV", cache.read(layer, slot, n), fresh.read(layer, s, n)):  # [K, n, hd]
            diff = (live.float() - ref.float()).abs().amax(dim=(0, 2))  # [n]
            bad = (diff > atol).nonzero()
            if bad.numel():
                p = int(bad[0, 0])
                raise StateMismatch(
                    f"{what}: {name} of layer {layer} differs at position {p} of {n} "
                    f"(max abs diff {float(diff[p]):.3g} > {atol:g}); later bad positions: {bad[1:6, 0].tolist()}"
                )


def check_matcher(live: Matcher, output: Sequence[int], fresh: Callable[[], Matcher]) -> None:
    """A request's grammar matcher (structured outputs) must be in the state of a matcher fed its committed output
    from scratch: the same tokens held, stopped / accepting alike, the same next mask. Speculation walks the live
    one over drafts and back every step; a rejected token left in it would show here."""
    ref = fresh()
    ref.commit(output)
    if live.consumed != ref.consumed or live.state_key() != ref.state_key():
        raise StateMismatch(f"grammar matcher: holds {live.consumed} tokens in a state that differs from the "
                            f"committed output's ({ref.consumed} tokens recomputed)")
