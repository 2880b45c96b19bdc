"""Suffix draft trees against counting by hand: every node's path probability recomputed from the raw token counts,
and the chosen nodes are the most probable ones (best-first expansion = top-budget by path probability)."""

from __future__ import annotations

import random

import pytest

from verispec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter
from verispec.models.tree import path_to


def occurrences(toks, s, followed=False):
    n, end = len(s), len(toks) - len(s) - (1 if followed else 0)
    return sum(toks[i : i + n] == s for i in range(end + 1))


def reference(toks, budget, depth, cfg):
    """All candidate paths below the longest matched tail with their path probabilities, from raw counts."""
    D = cfg.max_tree_depth
    tail = toks[-(D - 1) :]
    m = max((n for n in range(1, min(len(tail), D - 1) + 1) if occurrences(toks, tail[-n:], True)), default=0)
    if m == 0:
        return {}
    limit = min(depth, max(1, int(cfg.max_spec_factor * m)))
    out, frontier = {}, [((), 1.0)]
    for _ in range(limit):
        nxt = []
        for path, score in frontier:
            s = tail[-m:] + list(path)
            if len(s) >= D:
                continue
            total = occurrences(toks, s, True)
            for x in set(toks):
                p = occurrences(toks, s + [x]) / total if total else 0.0
                if p > 0 and score * p >= cfg.min_token_prob:
                    out[path + (x,)] = score * p
                    nxt.append((path + (x,), score * p))
        frontier = nxt
    return out


@pytest.mark.parametrize("seed", range(30))
def test_request_trie_tree_is_the_most_probable_nodes(seed):
    rng = random.Random(seed)
    # shallow tries over long, repetitive sequences: short matches with several continuations of unequal counts
    cfg = SuffixConfig(max_tree_depth=rng.randint(3, 5), min_token_prob=rng.choice([0.0, 0.05, 0.2]),
                       max_spec_factor=rng.choice([1.0, 4.0]))
    toks = [rng.randrange(rng.randint(2, 4)) for _ in range(rng.randint(2, 60))]
    budget, depth = rng.randint(1, 10), rng.randint(1, 6)
    drafter = SuffixDrafter(SuffixCache(SuffixConfig(max_cached_requests=0)), cfg)
    tree = drafter.propose_tree(toks, budget, depth)
    # the best-first part: the request trie's most probable nodes below the match
    best, parents, scores = drafter._trie.speculate_tree(toks[-(cfg.max_tree_depth - 1):], budget, depth, cfg)
    want = reference(toks, budget, depth, cfg)
    got = [tuple(best[c] for c in path_to(parents, n)) for n in range(len(best))]
    assert set(got) <= set(want) and scores == pytest.approx([want[p] for p in got])  # real paths, true scores
    assert sorted(scores, reverse=True) == pytest.approx(sorted(want.values(), reverse=True)[:budget])
    # the drafter's tree: the chain drafter's proposal (cut to the budget) as its first path
    chain = drafter.propose(toks, depth).tokens[:budget]
    assert [tree.tokens[i] for i in path_to(tree.parents, len(chain) - 1)] == chain
    assert len(tree) <= budget and (len(tree) == budget or len(tree) >= len(set(got) | {tuple(chain)}) - 1)


def test_the_shared_cache_gives_trees_too():
    cache = SuffixCache()
    for out in ([1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 7]):
        cache.add_output(out)
    tree = SuffixDrafter(cache).propose_tree([9, 9, 1, 2], budget=4, depth=3)
    paths = {tuple(tree.tokens[c] for c in path_to(tree.parents, n)) for n in range(len(tree))}
    assert {(3,), (5,)} <= paths  # both continuations of (1, 2) seen before: 3 (twice) and 5 (once)


def test_a_likelier_sibling_beats_a_deeper_node():
    # after 9: 5 three times, 6 twice (p .6, .4); after 9 5: 7, 8, 4 once each (path probability .2 each)
    toks = [9, 5, 7, 9, 5, 8, 9, 5, 4, 9, 6, 1, 9, 6, 2, 3, 9]
    cfg = SuffixConfig(max_tree_depth=3, max_spec_factor=4.0, min_token_prob=0.0)
    drafter = SuffixDrafter(SuffixCache(SuffixConfig(max_cached_requests=0)), cfg)
    drafter.propose_tree(toks, budget=2, depth=3)
    tail = toks[-2:]
    assert drafter._trie.speculate_tree(tail, 2, 3, cfg)[:2] == ([5, 6], [-1, -1])
    best, parents, _ = drafter._trie.speculate_tree(tail, 5, 3, cfg)  # then three of the five grandchildren (.2)
    assert best[:2] == [5, 6] and len(best) == 5 and set(parents[2:]) <= {0, 1}
    # the drafter's tree: the chain (5, the most recent of the tied 7, 8, 4, then 9 after re-matching 9 5 4), then
    # the likeliest node not on it
    assert drafter.propose(toks, 3).tokens == [5, 4, 9]
    tree = drafter.propose_tree(toks, budget=4, depth=3)
    assert tree.tokens == (5, 4, 9, 6) and tree.parents == (-1, 0, 1, -1)
