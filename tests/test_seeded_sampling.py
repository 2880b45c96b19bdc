"""Seeded sampling by the exponential race over per-position noise (sampling/coupled.py), as pure functions.

Oracles are closed forms: the race's token against p itself, Gumbel top-2 against P(a, b) = q_a q_b / (1 - q_a),
and seeded speculative verification of chains and trees (drafts coupled, independent or arbitrary) against a
Markov target's exact sequence distribution P(x1) P(x2|x1) P(x3|x2), by chi-square across seeds. The strongest
form is checked on every sample: seeded speculative output == seeded plain output. Negative controls: noise not
keyed by position, and a rule that accepts a probable draft token without its race, must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

import verispec.sampling.coupled as coupled
from tests.helpers import chi2_pvalue
from verispec.drafters.tree_growth import Growth
from verispec.execution.tree_verify import verify_tree_seeded
from verispec.execution.verify import Verdict, verify, verify_seeded
from verispec.sampling import DraftSampler, SamplingParams
from verispec.sampling.coupled import race_index, race_top

V, LENGTH, BASE = 5, 3, 7  # vocabulary, continuation length, the absolute position of the first sampled token


def markov(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(V, V, generator=g), -1)  # [V, V] next-token distributions


P, Q = markov(0, 1.5), markov(1, 1.5)  # the target's and the drafter's rows


def exact() -> torch.Tensor:
    return (P[0][:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)


def index(x: list[int]) -> int:
    return (x[0] * V + x[1]) * V + x[2]


def chain_draft(kind: str, last: int, seed: int, pos: int, g: torch.Generator, k: int = 2) -> list[int]:
    """k drafted tokens after `last` for positions pos..: coupled to the target's noise, independent draws from Q,
    or arbitrary (uniform, not what q says)."""
    out: list[int] = []
    sampler = DraftSampler(g, seed if kind == "coupled" else None)
    for j in range(k):
        if kind == "arbitrary":
            out.append(int(torch.randint(V, (), generator=g)))
        else:
            out.append(sampler.index(Q[out[-1] if out else last], pos + j))
    return out


def generate(seed: int, draft: str | None, g: torch.Generator) -> tuple[list[int], int, int]:
    """LENGTH tokens after token 0 by seeded verification (draft None: plain decoding, no draft); returns them,
    drafted and accepted counts."""
    out: list[int] = []
    drafted = accepted = 0
    while len(out) < LENGTH:
        last, pos = out[-1] if out else 0, BASE + len(out)
        d = [] if draft is None else chain_draft(draft, last, seed, pos, g)
        v = verify_seeded(d, P[[last] + d], seed, pos)
        out += v.tokens
        drafted, accepted = drafted + len(d), accepted + v.accepted
    return out[:LENGTH], drafted, accepted


def counts_of(draft: str | None, n: int, check_plain: bool = True) -> tuple[torch.Tensor, float]:
    g = torch.Generator().manual_seed(99)  # the drafter's own randomness (independent / arbitrary drafts)
    counts = torch.zeros(V**LENGTH)
    drafted = accepted = 0
    for seed in range(n):
        x, d, a = generate(seed, draft, g)
        if check_plain and draft is not None:
            assert x == generate(seed, None, g)[0], f"seed {seed}: speculative output differs from plain output"
        counts[index(x)] += 1
        drafted, accepted = drafted + d, accepted + a
    return counts, accepted / max(drafted, 1)


def test_the_race_draws_from_p_at_each_position_independently():
    """x at positions 5 and 6 of one seed: each follows p, and the pair follows p x p (independent positions)."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    pairs = torch.zeros(V * V)
    for seed in range(6000):
        a, b = race_index(p, seed, 5), race_index(p, seed, 6)
        pairs[a * V + b] += 1
    assert pairs.reshape(V, V)[4].sum() == 0 and pairs.reshape(V, V)[:, 4].sum() == 0, "a zero probability won"
    assert chi2_pvalue(pairs, (p[:, None] * p[None, :]).reshape(-1)) > 1e-3


def test_race_top_is_a_draw_without_replacement():
    q = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    counts = torch.zeros(V * V)
    for seed in range(6000):
        top = race_top(q, 2, seed, 3)
        assert top[0] == race_index(q, seed, 3)
        counts[top[0] * V + top[1]] += 1
    pairs = (q[:, None] * q[None, :] / (1 - q[:, None])).fill_diagonal_(0.0).reshape(-1)
    assert chi2_pvalue(counts, pairs) > 1e-3
    assert sorted(race_top(q, 9, 0, 0)) == [0, 1, 2, 3]  # no more tokens than q covers


@pytest.mark.parametrize("draft", ["coupled", "independent", "arbitrary"])
def test_seeded_speculation_follows_the_target_and_equals_plain_decoding(draft):
    """Every sample also equals plain seeded decoding of the same seed (checked inside `counts_of`)."""
    counts, rate = counts_of(draft, 8000)
    assert 0.05 < rate < 0.95, "drafts must be accepted sometimes and rejected sometimes for this to mean anything"
    pval = chi2_pvalue(counts, exact())
    assert pval > 1e-3, f"seeded speculative samples ({draft} drafts) do not follow the target (p = {pval:.2e})"


def test_coupled_drafts_are_accepted_more_often_than_independent_ones():
    """The coupling's point: a coupled draft matches the target's token with probability >= (1 - TV) / (1 + TV),
    an independent one with sum_x p(x) q(x)."""
    _, coupled_rate = counts_of("coupled", 1500, check_plain=False)
    _, independent_rate = counts_of("independent", 1500, check_plain=False)
    assert coupled_rate > independent_rate + 0.1, (coupled_rate, independent_rate)


def test_negative_control_noise_not_keyed_by_position_is_rejected(monkeypatch):
    """One noise vector for every position of a seed: the tokens of a sequence are no longer independent draws."""
    real = coupled.position_noise
    monkeypatch.setattr(coupled, "position_noise", lambda seed, position, vocab: real(seed, 0, vocab))
    counts, _ = counts_of("coupled", 4000)
    assert chi2_pvalue(counts, exact()) < 1e-3


def test_negative_control_a_biased_acceptance_is_rejected(monkeypatch):
    """Accepting a draft token the target gives >= 0.3 without its race (a typical-acceptance-like shortcut)."""
    import tests.test_seeded_sampling as me

    def biased(draft, p, seed, position):
        n = 0
        while n < len(draft) and (float(p[n][draft[n]]) >= 0.3 or draft[n] == race_index(p[n], seed, position + n)):
            n += 1
        return Verdict(n, list(draft[:n]) + [race_index(p[n], seed, position + n)])

    monkeypatch.setattr(me, "verify_seeded", biased)
    counts, _ = counts_of("coupled", 4000, check_plain=False)
    assert chi2_pvalue(counts, exact()) < 1e-3


def grown_tree(last: int, seed: int, pos: int):
    """A sampled EAGLE-2 growth from Q with coupled children (Gumbel top-2 of each expanded node) and its 3 best
    nodes, as the draft model and EAGLE-3 grow them for a seeded request."""
    tree = Growth(0, 1, origin=pos)
    sampler = DraftSampler(torch.Generator().manual_seed(seed), seed)
    tree.expand([-1], Q[last].log()[None], q=Q[last][None], sampler=sampler)
    front = tree.frontier()
    tree.expand(front, Q[[tree.token[i] for i in front]].log(), q=Q[[tree.token[i] for i in front]], sampler=sampler)
    return tree.best(3)


def test_seeded_tree_verification_follows_the_target_and_equals_plain_decoding():
    counts = torch.zeros(V**LENGTH)
    accepted = steps = 0
    g = torch.Generator().manual_seed(0)
    for seed in range(6000):
        out: list[int] = []
        while len(out) < LENGTH:
            last, pos = out[-1] if out else 0, BASE + len(out)
            tree = grown_tree(last, seed, pos)
            v = verify_tree_seeded(tree, P[[last] + list(tree.tokens)], seed, pos)
            out += v.tokens
            accepted, steps = accepted + v.accepted, steps + 1
        assert out[:LENGTH] == generate(seed, None, g)[0], f"seed {seed}: tree output differs from plain output"
        counts[index(out[:LENGTH])] += 1
    assert 0.3 < accepted / steps < 1.9
    assert chi2_pvalue(counts, exact()) > 1e-3


def test_verify_routes_seeded_exact_requests_to_the_race_and_others_to_leviathan():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=4)
    got = verify([1, 2], None, logits, seeded, None, position=10)
    assert got == verify_seeded([1, 2], torch.softmax(logits, -1), 4, 10)
    with pytest.raises(ValueError, match="position"):
        verify([1, 2], None, logits, seeded, None)
    unseeded = verify([1, 2], None, logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert unseeded.accepted <= 2 and len(unseeded.tokens) == unseeded.accepted + 1


def test_seeds_are_taken_modulo_2_64_and_positions_must_be_valid():
    p = torch.softmax(torch.randn(V), -1)
    assert all(race_index(p, s - 2**64, 3) == race_index(p, s, 3) for s in (2**64 - 1, 2**63, 2**64 - 7))
    with pytest.raises(ValueError, match="position"):
        coupled.position_noise(1, -1, V)
