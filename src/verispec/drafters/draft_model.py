"""An independent smaller causal LM as drafter, with its own KV cache rolled back in step with the target.

propose(context, k): a chain, one draft forward per token; the drafted K/V that the target accepts are kept.
propose_tree(context, budget, depth): EAGLE-2's dynamic tree (drafters/tree_growth.py) from the draft model's top-k
per node, one draft forward per depth over the root and every node expanded so far (a tree segment: each row sees
the context, its ancestors and itself); nothing drafted is kept, the next proposal feeds the committed tokens."""

from __future__ import annotations

from typing import Sequence

import torch

from verispec.check.state import StateMismatch, check_kv
from verispec.drafters.base import Draft, drafted_confidence, greedy_pick
from verispec.drafters.tree_growth import Growth, frontier_width
from verispec.sampling import SamplingParams, target_probs
from verispec.models.llama import LlamaModel, Segment
from verispec.models.tree import TreeDraft
from verispec.state.kv_cache import KVCache


class IncompatibleDraftModel(ValueError):
    pass


def check_compatible(target: LlamaModel, draft: LlamaModel, target_tok=None, draft_tok=None) -> None:
    """Refuse a draft model whose token ids mean something else than the target's."""
    tv, dv = target.cfg.vocab_size, draft.cfg.vocab_size
    if target_tok is not None and draft_tok is not None:
        if target_tok.get_vocab() != draft_tok.get_vocab():
            raise IncompatibleDraftModel(
                "the draft model's tokenizer differs from the target's: token ids would not mean the same text; "
                "use a draft model of the same family (same tokenizer)"
            )
    elif tv != dv:
        raise IncompatibleDraftModel(
            f"the draft model's vocabulary has {dv} entries and the target's {tv}: token ids would not mean the "
            "same text; use a draft model with the target's tokenizer"
        )


class DraftModelDrafter:
    """Per request. The draft cache always holds a prefix of the request's tokens: context[:n_cached]."""

    name = "draft_model"
    stops_early = True  # confidences: its probability of each drafted token (drafters/base.py drafted_confidence)

    def __init__(self, model: LlamaModel, cache: KVCache, params: SamplingParams) -> None:
        self.model, self.cache, self.params = model, cache, params
        self.slot = cache.allocate()
        self.n_cached = 0
        self.sampler = params.draft_sampler(model.device, stream="draft_model")  # coupled when seeded
        self._ctx_len = 0
        self._fed_drafts = 0

    def _step(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens after the cached prefix; returns the last position's logits [V]."""
        out = self.model(torch.tensor(tokens, device=self.model.device),
                         [Segment(self.slot, self.n_cached, len(tokens))], self.cache)
        self.cache.commit(self.slot, len(tokens))
        self.n_cached += len(tokens)
        return out.logits[0]

    def propose(self, context: Sequence[int], k: int, min_survival: float = 0.0) -> Draft:
        """Up to k tokens; fewer where the product of the confidences so far falls below min_survival."""
        assert self.n_cached < len(context), "the draft cache is ahead of the request"
        room = self.cache.max_len - len(context) - 1
        k = min(k, room)
        if k <= 0:
            return Draft([])
        logits = self._step(list(context[self.n_cached :]))
        self._ctx_len = len(context)
        tokens: list[int] = []
        probs, confs, survival = [], [], 1.0
        for i in range(k):
            if self.params.greedy:
                t, conf = greedy_pick(logits)
            else:
                q = target_probs(logits[None], self.params.temperature, self.params.top_k, self.params.top_p)[0]
                t = self.sampler.index(q, len(context) + i)
                probs.append(q)
                conf = drafted_confidence(logits, t, q)
            tokens.append(t)
            confs.append(conf)
            survival *= confs[-1]
            if i + 1 == k or survival < min_survival:
                break
            logits = self._step([t])
        self._fed_drafts = len(tokens) - 1
        return Draft(tokens, torch.stack(probs) if probs else None, confs)

    @torch.inference_mode()
    def propose_tree(self, context: Sequence[int], budget: int, depth: int, width: int | None = None
                     ) -> TreeDraft:
        """The `budget` most probable nodes (cumulative draft log-probability) of EAGLE-2's growth: the TREE_TOPK
        children of the `width` most probable newest nodes (None: frontier_width(budget)), depth by depth.
        Deterministic (top-k) nodes, so the target verifies them as point masses at any temperature. The draft cache
        keeps context[:-1] only."""
        return self._grow(context, budget, depth, width).best(budget)

    def _grow(self, context: Sequence[int], budget: int, depth: int, width: int | None = None) -> Growth:
        """width: nodes expanded per depth (None: frontier_width(budget))."""
        assert self.n_cached < len(context), "the draft cache is ahead of the request"
        depth = min(depth, budget, self.cache.max_len - len(context) - 1)
        tree = Growth(0, frontier_width(budget) if width is None else width, origin=len(context))
        if depth <= 0:
            return tree
        feed = list(context[self.n_cached :])  # the committed tokens the draft cache lacks, the root last
        out = self.model(torch.tensor(feed, device=self.model.device), [Segment(self.slot, self.n_cached, len(feed))],
                         self.cache)
        self.cache.commit(self.slot, len(feed) - 1)  # the root's K/V is rewritten by every tree forward
        self.n_cached = len(context) - 1
        self._ctx_len, self._fed_drafts = self.n_cached, 0  # observe() keeps exactly the committed context[:-1]
        self._expand(tree, [-1], out.logits[:1])
        for _ in range(depth - 1):
            frontier = tree.frontier()
            if not frontier:
                break
            run = sorted({a for i in frontier for a in tree.path(i)}, key=lambda i: (tree.depth[i], i))  # [n]
            if self.n_cached + 1 + len(run) > self.cache.max_len:
                break
            node = {n: j for j, n in enumerate(run)}  # each run node's index below the root (its row is j + 1)
            parents = tuple(-1 if tree.parent[i] < 0 else node[tree.parent[i]] for i in run)
            toks = torch.tensor([int(context[-1])] + [tree.token[i] for i in run], device=self.model.device)
            out = self.model(toks, [Segment(self.slot, self.n_cached, len(run) + 1, tree=parents)], self.cache,
                             logits_indices=[node[i] + 1 for i in frontier])
            self.cache.rollback(self.slot, self.n_cached)
            self._expand(tree, frontier, out.logits)  # [len(frontier), V]
        return tree

    def _expand(self, tree: Growth, parents: list[int], logits: torch.Tensor) -> None:
        """logits: [len(parents), V] below each parent; sampled requests draw the children from q as `propose`
        draws its tokens."""
        p = self.params
        q = None if p.greedy else target_probs(logits, p.temperature, p.top_k, p.top_p)
        tree.expand(parents, torch.log_softmax(logits.float(), -1), None, q, self.sampler)

    def observe(self, accepted: int) -> None:
        """Keep the cached drafts the target accepted; the rest of the draft KV becomes invisible."""
        keep = self._ctx_len + min(accepted, self._fed_drafts)
        self.cache.rollback(self.slot, keep)
        self.n_cached = keep
        self._fed_drafts = 0

    def check_own_state(self, tokens: Sequence[int]) -> None:
        """State oracle (see base.py): the draft cache must hold exactly a from-scratch forward of the draft model
        over tokens[:n_cached], tokens being the request's committed tokens."""
        if self.n_cached > len(tokens):
            raise StateMismatch(f"draft model: the cache holds {self.n_cached} positions, ahead of the request's "
                                f"{len(tokens)} committed tokens")
        check_kv(self.model, self.cache, self.slot, tokens[: self.n_cached], "draft model")

    def release(self, tokens: Sequence[int] | None = None) -> None:
        self.cache.free(self.slot)
