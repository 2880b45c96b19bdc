"""Speculation policies against brute force and hand-computed closed forms."""

from __future__ import annotations

import itertools
import random

import pytest

from verispec.drafters.base import Draft
from verispec.engine.scheduler import Candidate, DSparkPolicy, GoodputPolicy, StaticPolicy, admit_prefixes, make_policy
from verispec.engine.acceptance import AcceptanceEstimator
from verispec.engine.costs import CostTable, MeasuredStepCosts, StepCosts


def theta(lengths, survivals, costs, base):
    """Expected committed tokens per second of a step with these draft lengths (written out directly): `base`
    decoding requests, each committing its pending token, the speculating ones their surviving drafts too."""
    gained = sum(sum(s[:n]) for s, n in zip(survivals, lengths))
    return (base + gained) / costs(base + sum(lengths), base)


def decreasing(rng, n):
    out, s = [], 1.0
    for _ in range(n):
        s *= rng.uniform(0.05, 1.0)
        out.append(s)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_goodput_admission_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    R = rng.randint(1, 3)
    survivals = [decreasing(rng, rng.randint(0, 4)) for _ in range(R)]
    sizes = (1, 2, 4, 8, 16)
    per_tok = rng.uniform(0.01, 0.5)
    costs = StepCosts(CostTable(sizes, tuple(1.0 + per_tok * (n - 1) ** rng.uniform(0.6, 1.4) for n in sizes)),
                      per_segment=rng.uniform(0, 0.1))
    base = R + rng.randint(0, 3)
    got = admit_prefixes(survivals, costs, base)
    best = max(theta(ls, survivals, costs, base) for ls in itertools.product(*[range(len(s) + 1) for s in survivals]))
    assert theta(got, survivals, costs, base) == pytest.approx(best, rel=1e-12)


def test_dspark_stops_at_the_first_drop():
    # two requests; every verified token costs 0.1 of a one-token step
    costs = StepCosts(CostTable((1, 100), (1.0, 1.0 + 0.1 * 99)))
    survivals = [[0.9, 0.72, 0.07, 0.06], [0.5, 0.05]]
    # order by survival: (0,0) .9, (0,1) .72, (1,0) .5, (0,2) .07, (0,3) .06, (1,1) .05
    # Theta: B=2: 2/1.1; +.9 -> 2.9/1.2; +.72 -> 3.62/1.3; +.5 -> 4.12/1.4; +.07 -> 4.19/1.5 drops: stop
    assert admit_prefixes(survivals, costs, 2, stop_at_first_drop=True) == [2, 1]
    # the same numbers through the policy, confidences as per-position survival factors
    drafts = [Draft([1, 2, 3, 4], confidence=[0.9, 0.8, 0.07 / 0.72, 0.06 / 0.07]), Draft([5, 6], confidence=[0.5, 0.1])]
    cands = [Candidate(4, AcceptanceEstimator()), Candidate(2, AcceptanceEstimator())]
    policy = DSparkPolicy(costs)
    assert policy.draft_lengths(cands, 2) == [4, 2]  # DSpark drafts the whole block, then trims
    assert policy.verify_lengths(cands, drafts, 2) == [2, 1]


def test_first_drop_differs_from_the_global_argmax():
    # a dip then a rise: SmartSpec's full scan takes the later optimum, DSpark's early stop does not
    costs = StepCosts(CostTable((1, 2, 3, 4), (1.0, 1.0, 1.5, 1.5)))  # Theta: 1.95, 1.9, 2.47
    survivals = [[0.95, 0.9, 0.85]]
    assert admit_prefixes(survivals, costs, 1, stop_at_first_drop=True) == [1]
    assert admit_prefixes(survivals, costs, 1) == [3]


def test_speculation_turns_off_when_the_batch_saturates():
    # verifying costs as much per token as decoding: no acceptance below 1 can pay for a draft
    linear = StepCosts(CostTable((1, 64), (1.0, 64.0)))
    cands = [Candidate(4, AcceptanceEstimator(prior=0.8)) for _ in range(16)]
    assert GoodputPolicy(linear).draft_lengths(cands, 16) == [0] * 16
    drafts = [Draft([1, 2, 3, 4], confidence=[0.8] * 4)] * 16
    assert DSparkPolicy(linear).verify_lengths(cands, drafts, 16) == [0] * 16
    # nor is a due probe: even drafts that survive 90% of the time would not pay for their verification
    probing = [Candidate(4, AcceptanceEstimator(prior=0.1), probe=True) for _ in range(16)]
    assert GoodputPolicy(linear).draft_lengths(probing, 16) == [0] * 16
    assert DSparkPolicy(linear).verify_lengths(probing, drafts, 16) == [0] * 16
    # on a flat cost table every draft token is worth verifying
    assert GoodputPolicy(StepCosts.flat()).draft_lengths(cands, 16) == [4] * 16


def test_the_saturation_check_follows_the_measured_costs():
    """`nothing_pays` is kept per (limit, rows) between steps; measured forwards that change the costs change it."""
    flat = StepCosts(CostTable((1, 64), (1.0, 1.0)))  # the profile: extra rows free
    measured = MeasuredStepCosts(flat, window=1)
    policy = DSparkPolicy(measured)
    cands = [Candidate(4, AcceptanceEstimator(prior=0.8)) for _ in range(4)]
    assert not policy.nothing_pays(cands, 4)
    for tokens in range(4, 9):  # the machine says otherwise: every row costs what a row does
        measured.observe(tokens, 4, float(tokens))
    assert policy.nothing_pays(cands, 4)
    assert policy.draft_lengths(cands, 4) == [0] * 4


def test_dspark_without_confidences_uses_the_online_estimates():
    costs = StepCosts(CostTable((1, 100), (1.0, 1.0 + 0.05 * 99)))
    good, bad = AcceptanceEstimator(), AcceptanceEstimator()
    for _ in range(30):
        good.update(drafted=4, accepted=4)
        bad.update(drafted=4, accepted=0)
    cands = [Candidate(4, good), Candidate(4, bad)]
    assert DSparkPolicy(costs).verify_lengths(cands, [Draft([1, 2, 3, 4])] * 2, 2) == [4, 0]
    # a due probe still verifies a short draft of the failing request, so its estimate can recover
    probing = [Candidate(4, good), Candidate(4, bad, probe=True)]
    assert DSparkPolicy(costs).verify_lengths(probing, [Draft([1, 2, 3, 4])] * 2, 2) == [4, 2]


def test_dspark_drafts_no_more_than_the_estimate_would_verify():
    """Without confidences the verify-time admission reads the online estimate, which drafting does not change: the
    draft length is that admission's, computed before drafting (a saturated batch drafts nothing)."""
    costs = StepCosts(CostTable((1, 100), (1.0, 1.0 + 0.05 * 99)))
    good, bad = AcceptanceEstimator(), AcceptanceEstimator()
    for _ in range(30):
        good.update(drafted=4, accepted=4)
        bad.update(drafted=4, accepted=0)
    cands = [Candidate(4, good, confidences=False), Candidate(4, bad, confidences=False)]
    policy = DSparkPolicy(costs)
    drafts = [Draft([1, 2, 3, 4])] * 2
    assert policy.draft_lengths(cands, 2) == policy.verify_lengths(cands, drafts, 2) == [4, 0]
    linear = StepCosts(CostTable((1, 64), (1.0, 64.0)))
    assert DSparkPolicy(linear).draft_lengths([Candidate(4, good, confidences=False)] * 16, 16) == [0] * 16
    # a due probe is drafted where it would pay, and a drafter with confidences still drafts its whole block
    probing = [Candidate(4, good, confidences=False), Candidate(4, bad, probe=True, confidences=False)]
    assert policy.draft_lengths(probing, 2) == [4, 2]
    timed = AcceptanceEstimator(prior=0.0)
    timed.observe_draft(4, 9.0)  # a request's first proposal (the drafter catching up on the prompt): not the rate
    timed.observe_draft(4, 0.4)  # 0.1 s per token: a block costs 40% of a 1 s step, far from free
    assert DSparkPolicy(linear).draft_lengths([Candidate(4, timed), Candidate(4, bad, confidences=False)], 2) == [0, 0]
    # one with confidences whose drafting was never timed drafts its block, so that it is timed
    assert policy.draft_lengths([Candidate(4, bad), Candidate(4, bad, confidences=False)], 2) == [4, 0]
    # but not where no draft could pay even if sure to survive (each row costs what a row does): nothing is drafted,
    # probes included, and nothing verified
    saturated = [Candidate(4, bad), Candidate(4, bad, probe=True, confidences=False), Candidate(4, good)]
    assert DSparkPolicy(linear).draft_lengths(saturated, 3) == [0, 0, 0]
    assert DSparkPolicy(linear).verify_lengths(saturated, [Draft([1, 2], confidence=[1.0, 1.0])] * 3, 3) == [0] * 3
    assert GoodputPolicy(linear).draft_lengths(saturated, 3) == [0, 0, 0]


def test_dspark_drafts_a_confident_drafters_block_only_where_the_estimate_admits_it():
    """A drafter with confidences drafts its whole block where the online estimate, drafting time counted, admits
    any of it (its confidences then decide), a due probe included; nothing where the estimate cannot pay, and
    nothing where drafting alone costs more than the tokens it could add (a learned drafter on a CPU)."""
    costs = StepCosts(CostTable((1, 100), (1.0, 1.0 + 0.05 * 99)))
    good, bad, slow = AcceptanceEstimator(), AcceptanceEstimator(), AcceptanceEstimator()
    for _ in range(30):
        good.update(drafted=4, accepted=4)
        slow.update(drafted=4, accepted=4)
        bad.update(drafted=4, accepted=0)
    for e in (good, bad):
        e.observe_draft(4, 9.0)  # the first proposal catches up on the prompt: not taken as the rate
        e.observe_draft(4, 0.08)  # timed: 0.02 s per token, a block 8% of a step (two blocks: more than 10%)
    policy = DSparkPolicy(costs)
    assert policy.draft_lengths([Candidate(4, good), Candidate(4, bad)], 2) == [4, 0]
    assert policy.draft_lengths([Candidate(4, bad, probe=True)], 1) == [4]
    slow.observe_draft(4, 4.0)  # one step's time per drafted token: (1 + 1) / (1 + 1.5 * 0.05 + 1) < 1 / 1
    for _ in range(30):
        slow.observe_draft(4, 4.0)
    assert policy.draft_lengths([Candidate(4, slow)], 1) == [0]
    assert policy.draft_lengths([Candidate(4, good)], 1) == [4]


def test_static_and_unknown_names():
    cands = [Candidate(3, AcceptanceEstimator()), Candidate(0, AcceptanceEstimator())]
    p = StaticPolicy(StepCosts.flat())
    assert p.draft_lengths(cands, 2) == [3, 0]
    assert p.verify_lengths(cands, [Draft([1, 2]), Draft([])], 2) == [2, 0]
    with pytest.raises(ValueError, match="not one of"):
        make_policy("fastest", StepCosts.flat())


def test_margin_weighs_the_added_cost_of_drafts():
    """One decoding request, a one-token draft with survival s, verifying it adds c of a one-token step: Theta rises
    from 1 / 1 to (1 + s) / (1 + (1 + m) c), so the draft is admitted exactly when s > (1 + m) c."""
    c = 0.2
    costs = StepCosts(CostTable((1, 2), (1.0, 1.0 + c)))
    for m in (0.0, 0.5, 1.0):
        for s in (0.15, 0.25, 0.35, 0.45):
            want = [1] if s > (1 + m) * c else [0]
            assert admit_prefixes([[s]], costs, 1, stop_at_first_drop=True, margin=m) == want, (m, s)
            assert admit_prefixes([[s]], costs, 1, margin=m) == want, (m, s)
    # the policies are risk-averse by default: a draft that only breaks even in expectation is not verified
    est = AcceptanceEstimator()
    cands = [Candidate(1, est)]
    assert DSparkPolicy(costs).verify_lengths(cands, [Draft([1], confidence=[0.25])], 1) == [0]
    assert DSparkPolicy(costs, margin=0.0).verify_lengths(cands, [Draft([1], confidence=[0.25])], 1) == [1]


def test_dspark_keeps_the_best_prefix_and_first_drop_is_dspark_s_early_stop():
    # the dip-then-rise costs above, through the policy: the default keeps the best prefix of the ordering (Theta
    # 1.95, 1.9, 2.47 for 1, 2, 3 tokens), DSpark's own rule stops at the first drop
    costs = StepCosts(CostTable((1, 2, 3, 4), (1.0, 1.0, 1.5, 1.5)))
    cands, drafts = [Candidate(3, AcceptanceEstimator())], [Draft([1, 2, 3], confidence=[0.95, 0.9 / 0.95, 0.85 / 0.9])]
    assert DSparkPolicy(costs, margin=0.0).verify_lengths(cands, drafts, 1) == [3]
    assert DSparkPolicy(costs, margin=0.0, first_drop=True).verify_lengths(cands, drafts, 1) == [1]


def test_dspark_drafts_a_confident_block_that_costs_next_to_nothing_whatever_the_estimate():
    """A drafter with confidences whose whole block costs at most FREE_DRAFT_SHARE of the step drafts it even where
    the online estimate would verify nothing (its confidences decide after drafting); a dearer one does not, and
    one without confidences drafts only what the estimate admits."""
    from verispec.engine.scheduler import FREE_DRAFT_SHARE

    costs = StepCosts(CostTable((1, 2, 9), (1.0, 1.3, 2.0)))  # a draft token costs 0.3 of a step: p = 0.1 never pays
    bad = AcceptanceEstimator(prior=0.1)
    policy = DSparkPolicy(costs)
    assert policy.draft_lengths([Candidate(8, bad)], 1) == [8]  # never timed: it drafts, and is timed
    cheap, dear = AcceptanceEstimator(prior=0.1), AcceptanceEstimator(prior=0.1)
    cheap.draft_cost_per_token = 0.9 * FREE_DRAFT_SHARE / 8  # seconds, against a 1-second step
    dear.draft_cost_per_token = 1.1 * FREE_DRAFT_SHARE / 8
    assert policy.draft_lengths([Candidate(8, cheap)], 1) == [8]
    assert policy.draft_lengths([Candidate(8, dear)], 1) == [0]
    assert policy.draft_lengths([Candidate(8, cheap, confidences=False)], 1) == [0]
    # the share is the batch's: two such blocks together cost 1.8 times it (and a step over 2 rows costs 1.3)
    assert policy.draft_lengths([Candidate(8, cheap), Candidate(8, cheap)], 2) == [0, 0]
    tiny = AcceptanceEstimator(prior=0.1)
    tiny.draft_cost_per_token = 0.1 * FREE_DRAFT_SHARE / 8
    assert policy.draft_lengths([Candidate(8, cheap), Candidate(8, tiny)], 2) == [8, 8]  # 0.05 s of a 1.3 s step
    # beside a drafter without confidences the admission still runs for it, and the free blocks are still drafted
    assert policy.draft_lengths([Candidate(8, tiny), Candidate(8, bad, confidences=False)], 2) == [8, 0]


def test_dspark_charges_a_confident_drafter_its_whole_block():
    """A drafter with confidences drafts its whole block once any of it is admitted, so admitting its first position
    costs the block. Closed form, margin 0.5, a step of 1 s over 1 token and 1.2 s over 8: a 7-token block costing
    0.9 s at survival 0.3 per position returns at most 1 + 0.43 tokens for 1 + 1.5 x 0.2 + 0.9 = 2.2 s (0.65 tokens
    per second against 1 plain), so nothing is drafted, though one position's share of it (0.13 s) would have
    admitted the first (1.3 tokens for 1.17 s); at 0.95 the block pays (6.73 tokens for 2.2 s) and is drafted whole.
    A drafter without confidences drafts what is admitted, at its per-token cost: the first position at 0.3."""
    from verispec.engine.scheduler import drafting_costs

    costs = StepCosts(CostTable((1, 8), (1.0, 1.2)))
    policy = DSparkPolicy(costs)
    poor, good = AcceptanceEstimator(prior=0.3), AcceptanceEstimator(prior=0.95)
    for est in (poor, good):
        est.draft_cost_per_token = 0.9 / 7
    assert drafting_costs(Candidate(7, poor), whole_blocks=True) == pytest.approx([0.9] + [0.0] * 6)
    assert drafting_costs(Candidate(7, poor), whole_blocks=False) == pytest.approx([0.9 / 7] * 7)
    assert policy.draft_lengths([Candidate(7, poor)], 1) == [0]
    assert policy.draft_lengths([Candidate(7, good)], 1) == [7]
    assert policy.draft_lengths([Candidate(7, poor, confidences=False)], 1) == [1]
    assert GoodputPolicy(costs).draft_lengths([Candidate(7, poor)], 1)[0] >= 1  # goodput drafts what it admits


def test_a_block_drafter_is_charged_its_pass_on_the_first_position():
    """DFlash drafts any number of tokens in one block forward: asked for one token it costs the pass. Same closed
    form as above: a 0.9 s pass at survival 0.3 returns at most 1.43 tokens for 2.2 s, so nothing is drafted, where
    a per-token charge (0.9 / 7 s) admitted one token, which cost the whole pass; at 0.95 all 7 are drafted. Both
    policies charge it so. The per-proposal cost is measured per call, whatever the number of tokens asked for."""
    from verispec.engine.scheduler import drafting_costs

    est = AcceptanceEstimator()
    est.observe_draft(7, 9.0)  # the first proposal (catching up on the prompt) is not the rate
    est.observe_draft(7, 0.7)
    est.observe_draft(1, 0.7)
    assert est.draft_cost_per_proposal == pytest.approx(0.7)
    assert est.draft_cost_per_token == pytest.approx(0.8 * 0.1 + 0.2 * 0.7)

    costs = StepCosts(CostTable((1, 8), (1.0, 1.2)))
    poor, good = AcceptanceEstimator(prior=0.3), AcceptanceEstimator(prior=0.95)
    for e in (poor, good):
        e.draft_cost_per_token, e.draft_cost_per_proposal = 0.9 / 7, 0.9
    block = Candidate(7, poor, confidences=False, one_pass=True)
    assert drafting_costs(block, whole_blocks=False) == pytest.approx([0.9] + [0.0] * 6)
    for policy in (DSparkPolicy(costs), GoodputPolicy(costs)):
        assert policy.draft_lengths([block], 1) == [0]
        assert policy.draft_lengths([Candidate(7, poor, confidences=False)], 1) == [1]  # per token: one admitted
        assert policy.draft_lengths([Candidate(7, good, confidences=False, one_pass=True)], 1) == [7]


def test_dspark_sets_a_survival_floor_where_one_more_drafted_token_stops_paying():
    """A drafter that stops early (EAGLE-3) drafts until its confidences' product falls below a floor: the survival
    at which a position returns what it costs at the plain rate. Closed form, margin 0.5, a step of 1 s over 1 token
    and 1.7 s over 8 (0.1 s per draft row), drafting 0.2 s per token: 1 / 1 x (0.2 + 1.5 x 0.1) = 0.35. With 2 decode
    rows (2 s over 2, 2.7 s over 9): 2 / 2 x (0.2 + 1.5 x 0.1) again; twice the drafting cost: 0.55. Candidates that
    do not stop early get 0 (their lengths decide), as do other policies; such a candidate is charged per drafted
    token, not its whole block (it stops where its block stops paying)."""
    from verispec.engine.scheduler import drafting_costs

    costs = StepCosts(CostTable((1, 8, 9), (1.0, 1.7, 1.8)))
    est, dear = AcceptanceEstimator(), AcceptanceEstimator()
    est.draft_cost_per_token, dear.draft_cost_per_token = 0.2, 0.4
    early = Candidate(7, est, stops_early=True)
    policy = DSparkPolicy(costs)
    assert policy.survival_floors([early], 1) == pytest.approx([0.35])
    assert policy.survival_floors([Candidate(7, dear, stops_early=True)], 1) == pytest.approx([0.55])
    assert policy.survival_floors([Candidate(0, est, stops_early=True)], 1) == [0.0]
    for other in (StaticPolicy(costs), GoodputPolicy(costs)):
        assert other.survival_floors([early], 1) == [0.0]
    assert drafting_costs(early, whole_blocks=True) == pytest.approx([0.2] * 7)
    assert drafting_costs(Candidate(7, est), whole_blocks=True) == pytest.approx([1.4] + [0.0] * 6)
    est2 = AcceptanceEstimator()
    est2.draft_cost_per_token = 0.2
    two = DSparkPolicy(StepCosts(CostTable((1, 2, 9), (1.0, 2.0, 2.7))))
    assert two.survival_floors([Candidate(7, est2, stops_early=True), Candidate(7, est2)], 2) == pytest.approx([0.35, 0])


def test_dspark_lets_drafters_that_stop_early_draft_while_their_first_tokens_are_cheap():
    """A drafter that stops early drafts every step (its limit, cut by its floor) while the first tokens of all such
    candidates cost at most EARLY_STOP_SHARE of the step, whatever the estimate says; above that share the estimate
    decides as for any drafter charged per token. Closed form, a 1-second step over 1 token (1.2 s over 8), margin
    0.5, estimate 0.1 per position: admitting the first position costs 1.5 x 0.2 / 7 s of verification plus its
    drafting, for 0.1 tokens against 1 plain token per second: never admitted. Two requests at 0.6 x the share each
    exceed the share together though each alone is under it."""
    from verispec.engine.scheduler import EARLY_STOP_SHARE

    costs = StepCosts(CostTable((1, 2, 8, 16), (1.0, 1.0, 1.2, 1.4)))
    policy = DSparkPolicy(costs)
    cheap, dear = AcceptanceEstimator(prior=0.1), AcceptanceEstimator(prior=0.1)
    cheap.draft_cost_per_token = 0.9 * EARLY_STOP_SHARE
    dear.draft_cost_per_token = 1.1 * EARLY_STOP_SHARE
    assert policy.draft_lengths([Candidate(7, cheap, stops_early=True)], 1) == [7]
    assert policy.draft_lengths([Candidate(7, dear, stops_early=True)], 1) == [0]
    assert policy.draft_lengths([Candidate(7, cheap)], 1) == [0]  # a drafter that does not stop early: the estimate
    pair = AcceptanceEstimator(prior=0.1)
    pair.draft_cost_per_token = 0.6 * EARLY_STOP_SHARE
    assert policy.draft_lengths([Candidate(7, pair, stops_early=True)] * 2, 2) == [0, 0]
    assert policy.draft_lengths([Candidate(7, pair, stops_early=True)], 1) == [7]
