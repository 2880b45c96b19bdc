"""Model-free drafters (prompt lookup, suffix tries) on small token lists: no model, no GPU."""

from __future__ import annotations

import random
import time

import pytest

from verispec.drafters.ngram import NgramConfig, NgramDrafter, ngram_propose
from verispec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter


# ---------------------------------------------------------------- ngram


def test_ngram_config_validates():
    with pytest.raises(ValueError):
        NgramConfig(prompt_lookup_max=4, prompt_lookup_min=0)
    with pytest.raises(ValueError):
        NgramConfig(prompt_lookup_max=2, prompt_lookup_min=3)


def test_ngram_picks_most_recent_match():
    ctx = [1, 2, 10, 11, 1, 2, 20, 21, 5, 1, 2]
    assert ngram_propose(ctx, 2, 2, 1) == [20, 21]


def test_ngram_prefers_longer_n():
    # "2" last occurred before [9], but "1 2" only before [7, 8]
    ctx = [1, 2, 7, 8, 3, 2, 9, 1, 2]
    assert ngram_propose(ctx, 2, 2, 1) == [7, 8]
    assert ngram_propose(ctx, 2, 1, 1) == [9, 1]


def test_ngram_no_match_and_never_the_tail_itself():
    assert ngram_propose([1, 2, 3, 4], 3, 3, 1) == []
    assert ngram_propose([], 3, 3, 1) == []
    assert ngram_propose([5], 3, 3, 1) == []
    assert ngram_propose([1, 2, 1, 2], 0, 2, 1) == []
    # the only occurrence of (3, 4) is the tail: fall back to n=1 and also find nothing
    assert ngram_propose([1, 2, 3, 4], 3, 2, 1) == []
    d = NgramDrafter(NgramConfig(3, 1))
    assert d.propose([1, 2, 3, 4], 3).tokens == []
    assert d.propose([9, 9], 3).tokens == [9, 9, 9]  # a context that does not extend the last one: re-indexed


def test_ngram_continues_periodically_at_context_end():
    # most recent earlier "7" is at index 3: index 4 follows before the end, then the copy repeats with period 1
    assert ngram_propose([7, 1, 2, 7, 7], 5, 1, 1) == [7, 7, 7, 7, 7]
    # "1 2" at index 0: 3 1 2 follow before the end, period 3
    assert ngram_propose([1, 2, 3, 1, 2], 5, 2, 2) == [3, 1, 2, 3, 1]
    d = NgramDrafter(NgramConfig(2, 2))
    assert d.propose([1, 2, 3, 1, 2], 7).tokens == [3, 1, 2, 3, 1, 2, 3]


def test_ngram_incremental_equals_reference():
    rng = random.Random(1234)
    for trial in range(20):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        d = NgramDrafter(NgramConfig(hi, lo))
        ctx: list[int] = []
        for _ in range(200):
            ctx.extend(rng.randrange(4 if trial % 2 else 12) for _ in range(rng.randint(1, 3)))
            k = rng.randint(0, 6)
            draft = d.propose(list(ctx), k)
            assert draft.tokens == ngram_propose(ctx, k, hi, lo)
            assert draft.probs is None
        d.release()


# ---------------------------------------------------------------- suffix


def small(**kw) -> SuffixConfig:
    return SuffixConfig(**{"max_tree_depth": 8, **kw})


def test_suffix_config_validates():
    with pytest.raises(ValueError):
        SuffixConfig(max_tree_depth=1)
    with pytest.raises(ValueError):
        SuffixConfig(min_token_prob=1.5)


def test_suffix_repeats_own_pattern():
    d = SuffixDrafter(SuffixCache(small()), prompt_len=0)
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    draft = d.propose(ctx, 3)
    assert draft.tokens == [7, 8]  # match length 2 caps the draft at 2 (max_spec_factor 1)
    assert draft.probs is None and draft.confidence == [1.0, 1.0]
    d = SuffixDrafter(SuffixCache(small()), small(max_spec_factor=2.0), prompt_len=0)
    assert d.propose(ctx, 3).tokens == [7, 8, 9]


def test_suffix_extends_periodic_pattern_past_context_end():
    d = SuffixDrafter(SuffixCache(small()), prompt_len=0)
    # "1 2 3 1 2" (match length 5) continued once, with 3; the walk re-matches past the end of the context
    assert d.propose([1, 2, 3, 1, 2, 3, 1, 2], 6).tokens == [3, 1, 2, 3, 1]
    d = SuffixDrafter(SuffixCache(small()), small(max_spec_factor=2.0), prompt_len=0)
    assert d.propose([1, 2, 3, 1, 2, 3, 1, 2], 8).tokens == [3, 1, 2, 3, 1, 2, 3, 1]


def test_suffix_learns_from_previous_output():
    cache = SuffixCache(small())
    first = SuffixDrafter(cache, prompt_len=2)
    first.propose([100, 101, 40, 41, 42], 4)
    first.release([100, 101, 40, 41, 42, 43, 44])  # the finished stream, past the last proposal
    first.release([100, 101, 40, 41, 42, 43, 44])  # idempotent
    assert len(cache) == 1
    second = SuffixDrafter(cache, prompt_len=3)
    draft = second.propose([200, 201, 40, 41], 4)
    assert draft.tokens == [42, 43]  # capped at max_spec_factor * match length (2)
    assert SuffixDrafter(cache, small(max_spec_factor=3.0)).propose([200, 40, 41], 4).tokens == [42, 43, 44]


def test_suffix_release_without_the_stream_adds_nothing_to_the_shared_cache():
    """A request that did not finish with this drafter (preempted: its next drafter hands the whole output on;
    the drafter failed) leaves the shared cache as it was."""
    cache = SuffixCache(small())
    d = SuffixDrafter(cache, prompt_len=1)
    assert d.propose([9, 1, 2, 3, 1, 2], 1).tokens == [3]
    d.observe(1)
    d.release()
    assert len(cache) == 0
    d = SuffixDrafter(cache, prompt_len=1)
    d.propose([9, 1, 2, 3, 1, 2], 1)
    d.release([9, 1, 2, 3, 1, 2, 3, 5])
    assert list(cache._outputs) == [[1, 2, 3, 1, 2, 3, 5]]


def test_suffix_respects_k_and_spec_factor():
    ctx = list(range(10)) * 3
    for k in (0, 1, 3, 7):
        d = SuffixDrafter(SuffixCache(small()), prompt_len=0)
        assert len(d.propose(ctx, k).tokens) == min(k, 7)  # match length <= depth-1 = 7
    d = SuffixDrafter(SuffixCache(small()), small(max_spec_factor=0.5), prompt_len=0)
    assert d.propose(ctx, 10).tokens == [0, 1, 2]  # int(0.5 * 7)
    d = SuffixDrafter(SuffixCache(small()), small(max_spec_factor=0.01), prompt_len=0)
    assert d.propose(ctx, 10).tokens == [0]  # at least one token when something matched


def test_suffix_confidences_nonincreasing_in_unit_interval():
    rng = random.Random(7)
    cache = SuffixCache(small(min_token_prob=0.05))
    for _ in range(5):
        cache.add_output([rng.randrange(5) for _ in range(60)])
    d = SuffixDrafter(cache, small(min_token_prob=0.05, max_spec_factor=4.0), prompt_len=0)
    ctx: list[int] = []
    seen = 0
    for _ in range(300):
        ctx.append(rng.randrange(5))
        draft = d.propose(ctx, 6)
        conf = draft.confidence or []
        assert len(conf) == len(draft.tokens) <= 6
        assert all(0.05 <= c <= 1.0 for c in conf)
        assert all(a >= b for a, b in zip(conf, conf[1:]))
        seen += len(draft.tokens)
    assert seen > 0


def test_suffix_min_token_prob_prunes():
    # the longest tail that continued is "0 1": once with 2, once with 3 (p = 0.5 each)
    ctx = [1, 2, 0, 1, 2, 0, 1, 3, 0, 1]
    d = SuffixDrafter(SuffixCache(small()), small(min_token_prob=0.7), prompt_len=0)
    assert d.propose(ctx, 3).tokens == []
    d = SuffixDrafter(SuffixCache(small()), small(min_token_prob=0.5), prompt_len=0)
    draft = d.propose(ctx, 3)
    assert draft.tokens[:1] in ([2], [3]) and draft.confidence and draft.confidence[0] == 0.5


def test_suffix_empty_on_no_match():
    d = SuffixDrafter(SuffixCache(small()), prompt_len=0)
    draft = d.propose([1, 2, 3, 4, 5], 4)
    assert draft.tokens == [] and draft.probs is None
    assert d.propose([1, 2, 1], 4).tokens == [2]  # not an extension of the last context: rebuilt


def test_suffix_cache_eviction():
    cache = SuffixCache(small(max_cached_requests=2))
    a, b, c = [50, 51, 52, 53], [60, 61, 62, 63], [70, 71, 72, 73]
    for out in (a, b, c):
        cache.add_output(out)
    assert len(cache) == 2
    probe = lambda ctx: SuffixDrafter(cache, prompt_len=0).propose(ctx, 2).tokens  # noqa: E731
    assert probe([1, 50, 51]) == []
    assert probe([1, 60, 61]) == [62, 63]
    assert probe([1, 70, 71]) == [72, 73]
    zero = SuffixCache(small(max_cached_requests=0))
    zero.add_output([1, 2, 3])
    assert len(zero) == 0 and not zero.trie.root.children


def dump(node, depth: int = 8, prefix: tuple = (), out: dict | None = None) -> dict:
    """Canonical string -> count view of a trie (lazy leaves expanded up to the depth limit)."""
    out = {} if out is None else out
    for t, ch in (node.children or {}).items():
        s = prefix + (t,)
        out[s] = ch.count
        if ch.seq is None:
            dump(ch, depth, s, out)
        else:
            for j in range(ch.pos, min(len(ch.seq), ch.pos + depth - len(s))):
                s = s + (ch.seq[j],)
                out[s] = 1
    return out


def test_suffix_eviction_equals_fresh_cache_of_the_survivors():
    rng = random.Random(5)
    outs = [[rng.randrange(3) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    cache = SuffixCache(small(max_cached_requests=3))
    for i, out in enumerate(outs):
        cache.add_output(out)
        fresh = SuffixCache(small(max_cached_requests=3))
        for kept in outs[max(0, i - 2) : i + 1]:
            fresh.add_output(kept)
        assert dump(cache.trie.root) == dump(fresh.trie.root)
        assert cache.trie.root.total == sum(map(len, outs[max(0, i - 2) : i + 1]))


def test_suffix_tries_count_every_substring():
    """Both the per-request trie (token by token) and the shared one (lazy leaves) count substrings exactly."""
    rng = random.Random(2)
    seqs = [[rng.randrange(3) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    cache = SuffixCache(small())
    for seq in seqs:
        cache.add_output(seq)
    d = SuffixDrafter(SuffixCache(small()), prompt_len=0)
    d.propose(seqs[0], 1)
    for counts, among in ((dump(cache.trie.root), seqs), (dump(d._trie.root), seqs[:1])):
        want: dict[tuple, int] = {}
        for seq in among:
            for n in range(1, 9):
                for i in range(len(seq) - n + 1):
                    want[tuple(seq[i : i + n])] = want.get(tuple(seq[i : i + n]), 0) + 1
        assert counts == want


@pytest.mark.parametrize("seed", range(40))
def test_request_trie_token_by_token_counts_every_substring_and_knows_the_most_frequent_next(seed):
    """The per-request trie, extended one token at a time (lazy leaves for strings seen once), checked after every
    token against counting by hand: every substring of length <= depth and its count; at every node that is not a
    lazy leaf, `total` = its occurrences followed by a next token (strings of length < depth), and `best` = the most
    frequent next token, ties to the one seen last (what the eager trie held)."""
    from verispec.drafters.suffix import _Trie

    rng = random.Random(seed)
    depth, alphabet = rng.randint(2, 6), rng.randint(1, 4)
    toks = [rng.randrange(alphabet) for _ in range(rng.randint(1, 70))]
    trie = _Trie(depth)
    for i, x in enumerate(toks):
        trie.extend(x)
        seen = toks[: i + 1]
        want: dict[tuple, int] = {}
        last: dict[tuple, int] = {}
        for n in range(1, depth + 1):
            for j in range(len(seen) - n + 1):
                sub = tuple(seen[j : j + n])
                want[sub] = want.get(sub, 0) + 1
                last[sub] = j
        assert dump(trie.root, depth) == want

        def check(node, prefix):
            if node.seq is not None:
                return
            if len(prefix) < depth:
                nexts = {s[-1]: c for s, c in want.items() if len(s) == len(prefix) + 1 and s[:-1] == prefix}
                assert node.total == sum(nexts.values()), prefix
                if nexts:
                    assert node.best_child() == max(nexts, key=lambda y: (nexts[y], last[prefix + (y,)])), prefix
            for t, ch in (node.children or {}).items():
                check(ch, prefix + (t,))
        check(trie.root, ())


def test_factory_builds_model_free_drafters():
    from verispec.config import SpeculativeConfig
    from verispec.drafters import DrafterFactory
    from verispec.sampling import SamplingParams

    ng = DrafterFactory(SpeculativeConfig(method="ngram", prompt_lookup_max=3, prompt_lookup_min=2))
    d = ng.new(SamplingParams(), prompt_len=4)
    assert d is not None and d.name == "ngram"
    assert d.propose([1, 2, 3, 9, 1, 2], 2).tokens == [3, 9]
    sf = DrafterFactory(SpeculativeConfig(method="suffix"))
    d = sf.new(SamplingParams(), prompt_len=2)
    assert d is not None and d.name == "suffix"
    d.propose([7, 8, 1, 2, 3, 4], 2)
    d.release([7, 8, 1, 2, 3, 4])
    d2 = sf.new(SamplingParams(), prompt_len=2)
    assert d2 is not None and d2.propose([5, 6, 1, 2], 2).tokens == [3, 4]


def test_speed_sanity_incremental():
    rng = random.Random(0)
    tokens = [rng.randrange(50) for _ in range(2500)] * 2  # second half repeats the first
    cache = SuffixCache()
    cache.add_output(tokens[:300])
    drafters = [NgramDrafter(), SuffixDrafter(cache, prompt_len=100)]
    for d in drafters:
        t0 = time.perf_counter()
        ctx: list[int] = []
        hits = 0
        for t in tokens:
            ctx.append(t)
            hits += len(d.propose(ctx, 5).tokens)
        d.release(ctx)
        print(f"{d.name}: {len(tokens)} steps in {time.perf_counter() - t0:.2f}s, {hits} draft tokens")
        assert hits > 2000
    assert len(cache) == 2
