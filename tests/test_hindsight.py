"""Hindsight-calibrated confidences of n-gram drafts (drafters/hindsight.py), against closed-form rates and a
brute-force scoring of every draft against the tokens that followed it."""

from __future__ import annotations

import random

import pytest

from verispec.drafters.hindsight import REQUEST_WEIGHT, HindsightScorer, SurvivalTable
from verispec.drafters.ngram import NgramConfig, NgramDrafter, ngram_propose


def _chain(rng: random.Random, rates: list[float]) -> tuple[int, bool]:
    """One draft of len(rates) positions, position j surviving with rates[j] given the ones before did."""
    for j, r in enumerate(rates):
        if rng.random() >= r:
            return j, True
    return len(rates), False


def test_table_estimates_known_conditional_rates_and_keeps_the_prior_where_unseen():
    rng = random.Random(7)
    rates = {1: [0.3, 0.5, 0.9], 4: [0.9, 0.8, 0.95]}
    table = SurvivalTable(horizon=1e9)
    for _ in range(20000):
        key = rng.choice((1, 4))
        table.add(key, *_chain(rng, rates[key]))
    for key, rs in rates.items():
        for j, r in enumerate(rs, 1):
            n = table.reached[(key, j)]
            assert table.rate(key, j) == pytest.approx(r, abs=4 * (r * (1 - r) / n) ** 0.5 + 0.01), (key, j)
    assert table.rate(2, 1) == table.prior and table.rate(1, 4) == table.prior  # never reached


def test_table_forgets_beyond_its_horizon():
    rng = random.Random(3)
    table = SurvivalTable(horizon=200)
    for rate in (0.9, 0.1):
        for _ in range(3000):
            table.add(0, *_chain(rng, [rate]))
        assert table.rate(0, 1) == pytest.approx(rate, abs=0.08)
        assert table.reached[(0, 1)] <= 200


def _match_length(ctx: list[int], n_max: int, n_min: int) -> int:
    """The tail length prompt lookup matches: the longest n whose tail occurs earlier, ending before the end."""
    for n in range(n_max, n_min - 1, -1):
        if len(ctx) >= n + 1 and any(ctx[i : i + n] == ctx[-n:] for i in range(len(ctx) - n)):
            return n
    return 0


@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_every_draft_is_scored_against_the_tokens_that_followed_it(seed, final):
    """A request's stream grows by 1-4 tokens per step (accepted drafts plus the bonus); the drafter proposes k
    tokens each step. Afterwards the shared table holds, per (match length, position), exactly the counts found by
    comparing each reference proposal (ngram_propose) with the stream after it: positions up to the first mismatch
    reached, the mismatch reached and failed, the rest unobserved. The stream ends some steps after the last
    proposal: release() given it (`final`) scores the last drafts against it; without it (the request did not
    finish with this drafter) only the drafts the seen tokens already decided count, the others stay unscored."""
    rng = random.Random(seed)
    n_max, n_min, k = rng.randint(2, 4), 1, rng.randint(2, 8)
    stream = [rng.randrange(5) for _ in range(rng.randint(5, 20))]
    stream += stream[: rng.randint(0, 10)] * 2  # some repetition, so that drafts survive
    for _ in range(60):
        stream.append(rng.randrange(3) if rng.random() < 0.3 else stream[-rng.randint(1, 6)])
    shared = SurvivalTable(horizon=1e9)
    drafter = NgramDrafter(NgramConfig(n_max, n_min), shared)
    proposals = []
    t = rng.randint(3, 8)
    while t < len(stream):
        ctx = stream[:t]
        draft = drafter.propose(ctx, k)
        ref = ngram_propose(ctx, k, n_max, n_min)
        assert draft.tokens == ref and (draft.confidence is None) == (not ref)
        if ref:
            proposals.append((t, _match_length(ctx, n_max, n_min), ref))
        seen = t  # the drafter sees the tokens up to its last proposal's context
        t += rng.randint(1, 4)
    drafter.release(stream if final else None)
    if final:
        seen = len(stream)
    want_reached: dict[tuple[int, int], int] = {}
    want_survived: dict[tuple[int, int], int] = {}
    for t, key, ref in proposals:
        after = stream[t:seen]
        decided = len(after) >= len(ref) or any(a != b for a, b in zip(after, ref))
        if not (final or decided):
            continue  # pending when the drafter was released without the stream: never scored
        for j, tok in enumerate(ref, 1):
            if j > len(after):
                break  # the request ended first: unobserved
            want_reached[(key, j)] = want_reached.get((key, j), 0) + 1
            if after[j - 1] != tok:
                break
            want_survived[(key, j)] = want_survived.get((key, j), 0) + 1
    assert shared.reached == pytest.approx({c: float(v) for c, v in want_reached.items()})
    assert {c: v for c, v in shared.survived.items() if v} == pytest.approx(
        {c: float(v) for c, v in want_survived.items()})


def test_confidence_moves_from_the_shared_rate_toward_the_request_s_own():
    shared = SurvivalTable(horizon=1e9)
    for _ in range(100):
        shared.add(3, 0, True)  # drafts of key 3 fail at once across requests
    scorer = HindsightScorer(shared)
    base = shared.rate(3, 1)
    assert scorer.confidence(3, 1) == pytest.approx([base])
    for i in range(16):  # this request's drafts of key 3 all survive position 1
        scorer.proposed(i, 3, [7])
    scorer.score([7] * 16)
    assert not scorer.pending
    want = (16 + REQUEST_WEIGHT * shared.rate(3, 1)) / (16 + REQUEST_WEIGHT)
    assert scorer.confidence(3, 1) == pytest.approx([want])
    assert want > 0.45 > base
