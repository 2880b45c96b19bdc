"""Suffix-trie drafter after SuffixDecoding (arXiv 2411.04975): continue the context's tail the way it continued
before, in this request's own tokens (a per-request trie, extended by O(depth) per token) or in the outputs of
earlier requests (the shared `SuffixCache`, oldest evicted beyond max_cached_requests).

Each trie matches the longest tail that occurred before WITH a next token, then walks to the most frequent next
token while the running product of empirical probabilities (child count / continued occurrences of the node)
stays >= min_token_prob, re-matching the extended tail where the walk hits the depth limit. Drafts are capped at
min(k, max(1, int(max_spec_factor * match_length))); the trie with the larger expected accepted length (sum of
the running products, returned as confidences) wins. The request trie holds up to max_tree_depth nodes per token;
the shared trie keeps a string seen once as a lazy leaf (a pointer into its output) instead of a chain of nodes.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from verispec.drafters.base import EMPTY, Draft
from verispec.models.tree import TreeDraft


@dataclass(frozen=True)
class SuffixConfig:
    """Trie depth (longest matched tail + continuation), draft cap per matched token, pruning, cache size (requests
    and tokens: the shared trie holds about a node per cached token, so its memory is bounded by the tokens)."""

    max_tree_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 1000
    max_cached_tokens: int = 1 << 18

    def __post_init__(self) -> None:
        for bad, rule in ((self.max_tree_depth < 2, "max_tree_depth >= 2"), (self.max_spec_factor <= 0,
                          "max_spec_factor > 0"), (not 0.0 <= self.min_token_prob <= 1.0, "0 <= min_token_prob <= 1"),
                          (self.max_cached_requests < 0, "max_cached_requests >= 0"),
                          (self.max_cached_tokens < 0, "max_cached_tokens >= 0")):
            if bad:
                raise ValueError(f"SuffixConfig needs {rule}: {self}")


class _Node:
    """The string spelled by the path from the root. count: its occurrences; total: occurrences followed by a next
    token (= sum of the children's counts); best: token of the most frequent child, None while unknown.
    A lazy leaf (seq is not None, count 1) keeps its one occurrence's continuation as seq[pos:] instead of nodes."""

    __slots__ = ("count", "total", "children", "best", "seq", "pos")

    def __init__(self) -> None:
        self.count = self.total = self.pos = 0
        self.children: dict[int, _Node] | None = None
        self.best: int | None = None
        self.seq: list[int] | None = None

    def bump(self, x: int) -> _Node:
        """Count one more occurrence of this string followed by x; returns the child for x."""
        ch = self.children
        if ch is None:
            ch = self.children = {}
        child = ch.get(x)
        if child is None:
            child = ch[x] = _Node()
        child.count += 1
        self.total += 1
        b = self.best
        if (b is None and len(ch) == 1) or (b is not None and child.count >= ch[b].count):
            self.best = x  # ties go to the most recent
        return child

    def best_child(self) -> int | None:
        """The most frequent next token (recomputed after an eviction made it unknown)."""
        if self.best is None and self.children:
            ch = self.children
            self.best = max(ch, key=lambda t: ch[t].count)
        return self.best


_Cursor = tuple[_Node, int]  # (node, tokens consumed inside a lazy leaf's continuation)


class _Trie:
    """Suffix trie of bounded depth: every substring of length <= depth of the inserted sequences."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self.tokens: list[int] = []  # extend()'s growing sequence
        self.active: list[_Cursor] = [(self.root, 0)]  # for extend(): cursors of the sequence's suffixes, by length

    def extend(self, x: int) -> None:
        """Append x to `tokens`, the one growing sequence, counting every suffix that ends at x. A string seen once
        is a lazy leaf into `tokens` (as in `add`), so a token costs a node only per suffix that occurred before,
        not one per suffix up to the depth (most of a suffix proposal's time went there).

        `active[i]` is the cursor of the sequence's suffix of length i (i < depth). A cursor inside a lazy leaf is
        that leaf's one occurrence, the current one: the appended token continues it, nothing to count. A child
        that is a lazy leaf and is reached again (its second occurrence) is materialised one level, its first
        occurrence's next token becoming a lazy leaf below it; a longer cursor of this step still inside that leaf
        then moves down to it."""
        toks = self.tokens
        toks.append(x)
        end = len(toks)
        nxt: list[_Cursor] = [(self.root, 0)]
        room = self.depth - 1  # cursors kept for the next token (the root's makes depth)
        for length, (node, extra) in enumerate(self.active):
            if extra and node.seq is None:  # materialised earlier in this step: move down to its one child
                assert node.children is not None and len(node.children) == 1
                while extra and node.seq is None:
                    (node,) = node.children.values()  # type: ignore[union-attr]
                    extra -= 1
            if node.seq is not None:  # the current occurrence's lazy leaf: x is its next token already
                if room:
                    nxt.append((node, extra + 1))
                    room -= 1
                continue
            child = node.children.get(x) if node.children else None
            if child is not None and child.seq is not None:
                # its second occurrence: the first one's next token goes one level down, unless that token is x
                # itself (the first occurrence ended just before it: the cursor one longer, further on in this
                # loop, counts that string as this step's)
                q = child.pos
                child.seq = None
                if length + 2 <= self.depth and q < end - 1:
                    leaf = child.bump(toks[q])
                    leaf.seq, leaf.pos = toks, q + 1
            child = node.bump(x)
            if child.count == 1:  # seen once: a lazy leaf
                child.seq, child.pos = toks, end
            if room:
                nxt.append((child, 0))
                room -= 1
        self.active = nxt

    def add(self, toks: list[int]) -> None:
        """Insert one whole sequence; a path stops at its first new node, which becomes a lazy leaf."""
        n = len(toks)
        for s in range(n):
            node = self.root
            for i in range(s, min(n, s + self.depth)):
                child = node.bump(toks[i])
                if child.count == 1:
                    child.seq, child.pos = toks, i + 1
                    break
                if child.seq is not None:  # a second occurrence: materialise the first one's next step
                    seq, p = child.seq, child.pos
                    child.seq = None
                    if p < len(seq) and i + 1 - s < self.depth:
                        leaf = child.bump(seq[p])
                        leaf.seq, leaf.pos = seq, p + 1
                node = child

    def remove(self, toks: list[int]) -> None:
        """Undo add(toks): uncount its paths; a node whose count reaches 0 goes with its subtree."""
        n = len(toks)
        for s in range(n):
            node = self.root
            for i in range(s, min(n, s + self.depth)):
                x = toks[i]
                assert node.children is not None
                child = node.children[x]
                node.total -= 1
                child.count -= 1
                if node.best == x:
                    node.best = None
                if child.count == 0:
                    del node.children[x]
                    break
                node = child

    def locate(self, toks: Sequence[int]) -> _Cursor | None:
        """The position reached by spelling toks from the root, or None if that string never occurred."""
        node, extra = self.root, 0
        for x in toks:
            if node.seq is not None:
                j = node.pos + extra
                if j >= len(node.seq) or node.seq[j] != x:
                    return None
                extra += 1
            else:
                child = node.children.get(x) if node.children else None
                if child is None:
                    return None
                node = child
        return node, extra

    def step(self, cur: _Cursor, depth: int) -> tuple[int, float, _Cursor] | None:
        """The most frequent next token after the string at cur (of length depth), its probability, new cursor."""
        node, extra = cur
        if depth >= self.depth:
            return None
        if node.seq is not None:
            j = node.pos + extra
            return (node.seq[j], 1.0, (node, extra + 1)) if j < len(node.seq) else None
        b = node.best_child()
        if b is None or not node.total:
            return None
        assert node.children is not None
        child = node.children[b]
        return b, child.count / node.total, (child, 0)

    def match(self, tail: Sequence[int]) -> tuple[int, _Cursor | None]:
        """The longest suffix of tail (<= depth-1 tokens) that occurred followed by a next token; binary search
        (a longer such suffix implies every shorter one)."""
        lo, hi = 1, min(len(tail), self.depth - 1)
        found: tuple[int, _Cursor | None] = (0, None)
        mid = hi  # probe the longest first: in repetitive text it usually continues
        while lo <= hi:
            cur = self.locate(tail[len(tail) - mid :])
            if cur is not None and self.step(cur, mid) is not None:
                found, lo = (mid, cur), mid + 1
            else:
                hi = mid - 1
            mid = (lo + hi) // 2
        return found

    def speculate(self, tail: list[int], k: int, cfg: SuffixConfig) -> tuple[list[int], list[float]]:
        """Greedy walk from the longest match; tokens and running-product confidences."""
        m, cur = self.match(tail)
        if cur is None:
            return [], []
        limit = min(k, max(1, int(cfg.max_spec_factor * m)))
        seq, toks, confs, prod, depth = list(tail), [], [], 1.0, m
        while len(toks) < limit:
            st = self.step(cur, depth)
            if st is None:  # depth limit or a string that never continued: re-match the extended tail
                depth, cur = self.match(seq)
                if cur is None:
                    break
                continue
            x, p, cur = st
            prod *= p
            if prod < cfg.min_token_prob:
                break
            toks.append(x)
            confs.append(prod)
            seq.append(x)
            depth += 1
        return toks, confs

    def children(self, cur: _Cursor, depth: int) -> list[tuple[int, float, _Cursor]]:
        """Every next token after the string at cur (of length depth), its probability, its cursor."""
        node, extra = cur
        if depth >= self.depth:
            return []
        if node.seq is not None:
            j = node.pos + extra
            return [(node.seq[j], 1.0, (node, extra + 1))] if j < len(node.seq) else []
        if not node.children or not node.total:
            return []
        return [(x, c.count / node.total, (c, 0)) for x, c in node.children.items()]

    def speculate_tree(self, tail: list[int], budget: int, depth: int, cfg: SuffixConfig
                       ) -> tuple[list[int], list[int], list[float]]:
        """Best-first from the longest match: the `budget` nodes of highest path probability (the product of the
        empirical probabilities from the match down; at least min_token_prob), at most min(depth, max_spec_factor
        * match length) deep, parents first: (tokens, parents, path probabilities). No re-match at the trie's depth
        limit, unlike the chain walk."""
        m, cur = self.match(tail)
        if cur is None or budget <= 0:
            return [], [], []
        limit = min(depth, max(1, int(cfg.max_spec_factor * m)))
        heap = [(-p, i, -1, x, c, 1) for i, (x, p, c) in enumerate(self.children(cur, m))]
        heapq.heapify(heap)
        toks: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        order = len(heap)
        while heap and len(toks) < budget:
            neg, _, parent, x, c, d = heapq.heappop(heap)
            if -neg < cfg.min_token_prob:
                break  # every other candidate is less likely still
            toks.append(x)
            parents.append(parent)
            scores.append(-neg)
            if d < limit:
                for y, p, c2 in self.children(c, m + d):
                    heapq.heappush(heap, (neg * p, order, len(toks) - 1, y, c2, d + 1))
                    order += 1
        return toks, parents, scores


def _merge(chain: list[int], toks: list[int], parents: list[int], budget: int) -> TreeDraft:
    """The chain as a path, then the nodes (tokens, parents: parents first, best first) not already on it, while
    the budget lasts; a node's parent is always placed before it (kept or already on the path)."""
    out_t, out_p = list(chain), list(range(-1, len(chain) - 1))
    at: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(out_t, out_p))}
    where: list[int] = []  # node i of the best-first tree -> its node in the merged tree
    for t, p in zip(toks, parents):
        parent = -1 if p < 0 else where[p]
        node = at.get((parent, t))
        if node is None:
            if len(out_t) >= budget:
                break
            node = at[(parent, t)] = len(out_t)
            out_t.append(t)
            out_p.append(parent)
        where.append(node)
    return TreeDraft(tuple(out_t), tuple(out_p))


class SuffixCache:
    """Shared across requests (one per server): a suffix trie over the outputs of the last finished requests, at
    most max_cached_requests of them and max_cached_tokens tokens (the oldest evicted first; an output longer than
    that alone keeps its last max_cached_tokens). Other requests' tokens reach a request only as drafts, which its
    verification accepts only where the target would have produced them."""

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.trie = _Trie(self.config.max_tree_depth)
        self._outputs: deque[list[int]] = deque()
        self.tokens = 0  # in the cached outputs

    def add_output(self, tokens: Sequence[int]) -> None:
        """Remember one finished request's output; evicts the oldest beyond the bounds."""
        cap = self.config.max_cached_tokens
        toks = [int(t) for t in tokens][-cap:] if cap else []
        if not toks or self.config.max_cached_requests == 0:
            return
        self.trie.add(toks)
        self._outputs.append(toks)
        self.tokens += len(toks)
        while len(self._outputs) > self.config.max_cached_requests or self.tokens > cap:
            old = self._outputs.popleft()
            self.trie.remove(old)
            self.tokens -= len(old)

    def __len__(self) -> int:
        return len(self._outputs)


class SuffixDrafter:
    """Per request; deterministic (probs=None) with per-position confidences. prompt_len (default: the length of
    the first context proposed for) separates the output that release() hands to the shared cache."""

    name = "suffix"
    reads_context_only = True

    def __init__(self, cache: SuffixCache, config: SuffixConfig | None = None, prompt_len: int | None = None) -> None:
        self.cache = cache
        self.config = config or cache.config
        self.prompt_len = prompt_len
        self._trie = _Trie(self.config.max_tree_depth)
        self._released = False

    @property
    def _tokens(self) -> list[int]:
        """The context seen so far (the request trie's sequence)."""
        return self._trie.tokens

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self._tokens)
        if len(context) < n or (n and int(context[n - 1]) != self._tokens[-1]):
            self._trie, n = _Trie(self.config.max_tree_depth), 0  # not an extension: rebuild
        for t in context[n:]:
            self._trie.extend(int(t))

    def _best_chain(self, context: Sequence[int], k: int) -> tuple[_Trie | None, list[int], list[float], list[int]]:
        """Sync with `context`, then the chain of up to k tokens from whichever trie (this request's, the shared
        one) promises more (the larger sum of confidences): (that trie or None, tokens, confidences, the tail)."""
        if self.prompt_len is None:
            self.prompt_len = len(context)
        self._sync(context)
        tail = self._tokens[-(max(self.config.max_tree_depth, self.cache.config.max_tree_depth) - 1) :]
        best: tuple[_Trie | None, list[int], list[float], list[int]] = (None, [], [], tail)
        if k <= 0 or not self._tokens:
            return best
        for trie in (self._trie, self.cache.trie):
            toks, confs = trie.speculate(tail, k, self.config)
            if sum(confs) > sum(best[2]):
                best = (trie, toks, confs, tail)
        return best

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k tokens from whichever trie (this request's, the shared one) promises more; EMPTY if no match."""
        _, toks, confs, _ = self._best_chain(context, k)
        if not toks:
            return EMPTY
        return Draft(tokens=list(toks), confidence=list(confs))

    def propose_tree(self, context: Sequence[int], budget: int, depth: int) -> TreeDraft:
        """A tree of up to `budget` nodes from the trie whose chain promises more: that chain (`propose`'s walk,
        re-matching at the depth limit), then the trie's most probable other nodes below the match; empty if no
        match."""
        trie, chain, _, tail = self._best_chain(context, depth if budget > 0 else 0)
        if trie is None:
            return TreeDraft((), ())
        toks, parents, _ = trie.speculate_tree(tail, budget, depth, self.config)
        return _merge(chain[:budget], toks, parents, budget)

    def observe(self, accepted: int) -> None:
        """Nothing to do: accepted tokens arrive with the next context, and release() gets the finished stream."""

    def release(self, tokens: Sequence[int] | None = None) -> None:
        """Hand this request's output (`tokens` beyond the prompt) to the shared cache; with None (the request did
        not finish here: a preempted one is handed on whole by its next drafter) add nothing."""
        if self._released:
            return
        self._released = True
        if tokens is not None:
            self.cache.add_output([int(t) for t in tokens[self.prompt_len or 0 :]])
        self._trie = _Trie(self.config.max_tree_depth)
