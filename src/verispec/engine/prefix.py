"""Prefix caching as the engine uses it: which requests share cached blocks, how many they take, and the drafter
features kept beside them.

A request takes the cached blocks its prompt starts with (never the block of its last prompt token, whose logits
it needs) and prefills from there. Where the engine's drafter reads the target's hidden states at every position
(EAGLE-3, DFlash, DSpark, MTP heads), the cache keeps those states beside the K/V of every committed position
(state/block_features.py), a hit takes only blocks whose states are kept for the drafter's layers, and the new
drafter is handed them before anything else, as if the request had prefilled them. A request that records every
layer's hidden states (`return_hidden_states`) prefills its whole prompt. A finished request names its output's
full blocks too, so the next turn of a conversation, whose prompt repeats the answer, finds them.
"""

from __future__ import annotations

from typing import Sequence

from verispec.drafters.base import Drafter, needs_features
from verispec.engine.admission import prefix_pending
from verispec.engine.plan import LiveRequest
from verispec.execution.runner import BatchOutput
from verispec.state.paged_kv import PagedKVCache
from verispec.state.request import Request


class PrefixSharing:
    def __init__(self, cache: PagedKVCache, feature_layers: Sequence[int]) -> None:
        self.cache = cache
        self.layers = tuple(feature_layers) or None  # what the drafters read of the target, if anything

    def shares(self, req: Request) -> bool:
        """The request takes part in prefix caching: not when it records every layer's hidden states."""
        return self.cache.prefix_caching and not req.params.return_hidden_states

    def hits(self, req: Request) -> list[int]:
        """Cached blocks of the request's prompt it need not prefill; never the last token's block. With a
        drafter that reads hidden states, only blocks whose states are kept for its layers."""
        if not self.shares(req):
            return []
        return self.cache.match(req.prompt_ids, len(req.all_ids) - 1, self.layers)

    def pending(self, req: Request, hit_blocks: int, running: Sequence[LiveRequest]) -> bool:
        """A running request is still computing prompt blocks this one shares (engine/admission.py)."""
        return self.shares(req) and prefix_pending(req.prompt_ids[: len(req.all_ids) - 1], running, hit_blocks,
                                                   self.cache.block_size)

    def feed(self, drafter: Drafter | None, req: Request, hits: Sequence[int]) -> None:
        """A new drafter of a request that took `hits`: the kept hidden states of those positions, first."""
        if hits and needs_features(drafter):
            drafter.add_features(self.cache.read_features(req.slot, req.num_computed))  # type: ignore

    def keep(self, req: Request, out: BatchOutput, block: int, n: int, rows: list[int] | None = None) -> None:
        """The n positions just committed from `block` (from the request's num_computed on; a tree's `rows`):
        their hidden states kept beside their K/V, where a drafter reads them and blocks are shared."""
        if self.layers is not None and self.cache.prefix_caching:
            self.cache.write_features(self.layers, req.slot, req.num_computed,  # type: ignore[arg-type]
                                      out.features(block, n, rows))

    def finish(self, req: Request) -> None:
        """Before the request's blocks are freed: name its output's full blocks as well (not after an error,
        whose K/V may be half committed)."""
        if req.slot is not None and self.shares(req) and req.finish_reason != "error":
            self.cache.register_tokens(req.slot, req.all_ids)
