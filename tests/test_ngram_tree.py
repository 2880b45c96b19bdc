"""N-gram draft trees: the incremental index against the plain scan, and the weighing on a hand-worked example."""

from __future__ import annotations

import random

import pytest

from verispec.drafters.ngram import NgramConfig, NgramDrafter, continuation_tree, ngram_propose, ngram_tree
from verispec.models.tree import depths, path_to


@pytest.mark.parametrize("seed", range(25))
def test_incremental_tree_equals_the_scan_as_the_context_grows(seed):
    rng = random.Random(seed)
    vocab, n_max, n_min = rng.randint(2, 6), rng.randint(1, 4), 1
    budget, depth = rng.randint(1, 12), rng.randint(1, 5)
    drafter = NgramDrafter(NgramConfig(n_max, n_min))
    context = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
    for _ in range(15):
        got = drafter.propose_tree(context, budget, depth)
        want = ngram_tree(context, budget, depth, n_max, n_min)
        assert (got.tokens, got.parents) == (want.tokens, want.parents)
        assert len(got) <= budget and max(depths(got.parents)) <= depth
        chain = ngram_propose(context, depth, n_max, n_min)
        assert bool(chain) == bool(got.tokens)  # a tree exactly where the chain drafter has a proposal
        if chain:  # which it holds whole (cut to the budget) as one of its paths
            paths = {tuple(got.tokens[i] for i in path_to(got.parents, n)) for n in range(len(got))}
            assert tuple(chain[: min(len(chain), budget)]) in paths
        context += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]


def test_the_heaviest_prefixes_make_the_tree():
    # the first continuation (the chain) whole; then by weight (GRAM_WEIGHT = 4): (9, 5) 16, (9,) 16 + 1 = 17,
    # (1, 2, 4) 4, (6,) 1, (9, 7) 1
    conts = [(1, [1, 2, 3]), (1, [1, 2, 4]), (2, [9, 5]), (0, [6]), (0, [9, 7])]
    tree = continuation_tree(conts, budget=5)
    assert tree.tokens == (1, 9, 2, 5, 3) and tree.parents == (-1, -1, 0, 1, 2)
    assert [tree.tokens[n] for n in path_to(tree.parents, 4)] == [1, 2, 3]
    assert continuation_tree(conts, budget=6).tokens == (1, 9, 2, 5, 3, 4)
    assert continuation_tree(conts, budget=2).tokens == (1, 2)
    assert continuation_tree([], budget=4).tokens == ()
