"""The speculation-length rule against its closed form."""

from __future__ import annotations

import math
import statistics
import random
from dataclasses import dataclass

import pytest

from verispec.drafters.base import Draft
from verispec.engine.acceptance import AcceptanceEstimator, expected_tokens
from verispec.engine.costs import CostTable, MeasuredStepCosts, StepCosts
from verispec.engine.draft_timing import DraftTiming
from verispec.engine.scheduler import Candidate, DSparkPolicy, GoodputPolicy, StaticPolicy


def test_expected_tokens_closed_form():
    assert math.isclose(expected_tokens(0.5, 3), 1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0


def test_cost_table_interpolates_and_extrapolates():
    t = CostTable((1, 2, 4), (1.0, 1.5, 2.5))
    assert t(1) == 1.0 and t(3) == 2.0 and t(6) == 3.5


@dataclass
class OneRequest:
    """A single request as the engine steps it: its estimator, and whether a probe is due."""

    est: AcceptanceEstimator
    probe: bool = False

    def step(self, policy, limit: int) -> int:
        k = policy.draft_lengths([Candidate(limit, self.est, self.probe)], 1)[0]
        self.probe = self.est.plain_step() if k == 0 else False
        return k


def test_turns_speculation_off_when_drafts_fail_and_back_on_when_they_match():
    costs = StepCosts(CostTable((1, 2, 9), (1.0, 1.3, 2.0)))  # verifying 9 tokens costs 2 plain steps
    policy = GoodputPolicy(costs)
    req = OneRequest(AcceptanceEstimator())
    est = req.est
    assert req.step(policy, 8) > 0  # the prior makes a first try worthwhile
    for _ in range(10):
        est.update(drafted=4, accepted=0)
    picks = [req.step(policy, 8) for _ in range(32)]
    assert picks.count(0) >= 28 and max(picks) <= 2  # plain, except for rare short probes
    for _ in range(20):
        est.update(drafted=8, accepted=8)
    assert req.step(policy, 8) == 8
    assert req.step(policy, 3) == 3  # never more than the request has room for


def test_expensive_verification_needs_high_acceptance():
    steep = StepCosts(CostTable((1, 2, 9), (1.0, 2.0, 9.0)))  # every extra token costs a full step: never worth it
    est = AcceptanceEstimator(prior=0.9)
    assert OneRequest(est).step(GoodputPolicy(steep), 8) == 0
    assert StaticPolicy(steep).draft_lengths([Candidate(5, est)], 1) == [5]


# ---- the profile corrected by measured forwards ------------------------------------------------------------------

def test_measured_costs_interpolate_extrapolate_and_clamp():
    prior = StepCosts(CostTable((1, 128), (1.0, 128.0)))  # 1 s per token
    m = MeasuredStepCosts(prior)
    assert m(40, 4) == prior(40, 4)  # nothing measured: the profile
    m.observe(32, 4, 64.0)  # one point: the profile's shape through it (x2)
    assert math.isclose(m(48, 4), 96.0) and m(40, 1) == 40.0  # another segment count: still the profile
    for _ in range(20):
        m.observe(48, 4, 80.0)
    assert math.isclose(m(40, 4), 72.0, rel_tol=1e-3)  # between 32 -> 64 and 48 -> 80: 1 s per token
    assert math.isclose(m(64, 4), 96.0, rel_tol=1e-3) and math.isclose(m(16, 4), 48.0, rel_tol=1e-3)  # slope beyond
    for _ in range(m.stale_after):  # 32 tokens not run in stale_after forwards of 4 sequences: forgotten
        m.observe(48, 4, 80.0)
    assert 32 not in m.points[4] and math.isclose(m(40, 4), 80.0 * 40 / 48)  # the profile's shape through 48
    stalled = MeasuredStepCosts(prior)
    stalled.observe(8, 1, 8.0)
    stalled.observe(8, 1, 8000.0)  # one forward stalled 1000x: the lower median of the two
    assert stalled(8, 1) == 8.0
    for _ in range(3):
        stalled.observe(8, 1, 9.0)
    stalled.observe(8, 1, 8000.0)  # counted as 5x the estimate at most, and the median of 8, 40, 9, 9, 9, 40: 9
    assert stalled(8, 1) == 9.0


def test_measured_costs_move_only_when_a_median_moves_beyond_the_tolerance():
    """Forwards whose median moves by under 1% leave the estimates (and `version`, which the policies' memos key
    on) as they were; a move beyond 1% is taken whole, and so is a drift that adds up past it. Each value is
    observed a window's worth of times, so the median becomes it."""
    prior = StepCosts(CostTable((1, 128), (1.0, 128.0)))
    m = MeasuredStepCosts(prior)

    def settle(sec: float) -> None:
        for _ in range(m.window):
            m.observe(1, 1, sec)

    settle(4.0)
    v = m.version
    for sec in (4.02, 3.97, 4.039):  # within 1% of 4.0 each: no change
        settle(sec)
        assert m(1, 1) == 4.0 and m.version == v
    settle(4.05)  # 1.25% above the kept 4.0: taken
    assert m(1, 1) == 4.05 and m.version > v
    for sec in (4.06, 4.07, 4.08):  # 0.25% steps: 4.08 is 0.74% above 4.05, still inside
        settle(sec)
    assert m(1, 1) == 4.05
    settle(4.1)  # 1.2% above 4.05
    assert m(1, 1) == 4.1


def test_measured_costs_are_the_least_squares_line_and_never_fall():
    prior = StepCosts(CostTable((1, 32, 48, 64), (1.0, 32.0, 48.0, 64.0)))
    m = MeasuredStepCosts(prior, window=1)
    pts = {20: 30.0, 32: 96.0, 48: 48.0, 56: 100.0}  # a noisy cheap 48
    for t, sec in pts.items():
        m.observe(t, 4, sec)
    slope, intercept = statistics.linear_regression(list(pts), list(pts.values()))
    assert all(math.isclose(m(t, 4), intercept + slope * t) for t in (10, 33, 48, 70))
    costs = [m(n, 4) for n in range(1, 80)]
    assert all(a <= b for a, b in zip(costs, costs[1:]))
    falling = MeasuredStepCosts(prior, window=1)
    falling.observe(10, 2, 50.0)
    falling.observe(20, 2, 40.0)  # measured cheaper at more tokens: never falling, and rising at least at half the
    # profile's 1 s per token, through the measured mean (15 tokens, 45 s)
    assert math.isclose(falling(10, 2), 42.5) and math.isclose(falling(30, 2), 52.5)
    assert all(a < b for a, b in zip([falling(n, 2) for n in range(1, 40)], [falling(n, 2) for n in range(2, 41)]))


def test_well_measured_points_bound_the_line_where_small_blocks_cost_the_same():
    """A forward bound by reading the weights: 2 tokens cost what 1 does, then the cost rises. The least-squares
    line through tokens 1..9 puts 1 token below its measured time (and so the step from 1 to 3 tokens above it);
    a token count measured min_count times bounds the estimate from below, carried forward at the least slope."""
    prior = StepCosts(CostTable((1, 9), (7.8, 15.1)))
    measured = {1: 7.4, 2: 7.5, 3: 8.6, 4: 9.0, 9: 13.9}

    def fed(times: int) -> MeasuredStepCosts:
        m = MeasuredStepCosts(prior, window=1, min_count=4)
        for t, sec in measured.items():
            for _ in range(times):
                m.observe(t, 1, sec)
        return m

    slope, intercept = statistics.linear_regression(list(measured), list(measured.values()))
    least = 0.5 * (15.1 - 7.8) / 8  # half the profile's seconds per token over the measured range
    assert slope > least and intercept + slope < 7.4  # the line alone underrates the single token
    m = fed(4)
    assert math.isclose(m(1), 7.4) and math.isclose(m(3), 8.6) and math.isclose(m(9), 13.9)
    assert math.isclose(m(2), 7.4 + least)  # 7.5 measured, but never less than the least slope above 1 token
    # the line above a well-measured point: its median, but never less than the least slope above 3 tokens
    assert intercept + 4 * slope > 9.0 and math.isclose(m(4), 8.6 + least)
    assert math.isclose(m(5), intercept + 5 * slope)  # the line between well-measured points (below 9's 13.9)
    assert math.isclose(m(3) - m(1), 1.2) and intercept + 3 * slope - (intercept + slope) > 1.6  # the line: 1.7
    costs = [m(n) for n in range(1, 40)]
    assert all(b - a >= least - 1e-12 for a, b in zip(costs, costs[1:]))
    seldom = fed(3)  # below min_count: only the line
    assert all(math.isclose(seldom(n), intercept + slope * n) for n in range(1, 12))


def test_a_dear_first_draft_row_is_not_averaged_into_the_single_token():
    """The first draft row costs 2 s more than one token, each further row 0.2 s (a forward of several rows runs
    another kernel body than one of a single row). The least-squares line through tokens 1..5 puts one token at
    10.72 s instead of 10, so the first row looked 1.28 s dear instead of 2 and dspark verified a draft whose first
    token survives 20% of the time: 1.2 tokens for 10 + 1.5 x 1.28 s beat 1 token for 10.72 s, where the measured
    costs say 1.2 tokens for 13 s against 1 for 10. Well-measured token counts are their own medians."""
    prior = StepCosts(CostTable((1, 5), (10.0, 11.0)))
    measured = {1: 10.0, 2: 12.0, 3: 12.2, 4: 12.4, 5: 12.6}
    m = MeasuredStepCosts(prior, window=4, min_count=4)
    for _ in range(4):
        for t, sec in measured.items():
            m.observe(t, 1, sec)
    slope, intercept = statistics.linear_regression(list(measured), list(measured.values()))
    assert intercept + slope > 10.7  # the line alone
    assert [m(t) for t in measured] == pytest.approx(list(measured.values()))
    draft = Draft([5], confidence=[0.2])
    assert DSparkPolicy(m).verify_lengths([Candidate(4, AcceptanceEstimator())], [draft], 1) == [0]
    assert DSparkPolicy(m).verify_lengths([Candidate(4, AcceptanceEstimator())], [Draft([5], confidence=[0.4])],
                                          1) == [1]  # 1.4 tokens for 13 s beat 1 for 10


def test_one_cheap_step_does_not_make_extra_tokens_look_free():
    """A batch of 8 decodes at 8 tokens for a while (20 s each: 2.5 s per token, as profiled); one step with a draft
    (9 tokens) happens to take 19 s. The least-squares line alone would make every extra token free (slope 0); the
    estimate keeps half the profile's cost per token, so a draft surviving 45% of the time does not look like it
    pays."""
    prior = StepCosts(CostTable((1, 8, 16), (2.5, 20.0, 40.0)))

    def measured(min_slope: float) -> MeasuredStepCosts:
        m = MeasuredStepCosts(prior, min_slope=min_slope)
        for _ in range(30):
            m.observe(8, 8, 20.0)
        m.observe(9, 8, 19.0)
        return m

    m = measured(0.5)
    extra = m(9, 8) - m(8, 8)
    assert math.isclose(extra, 0.5 * 2.5)
    policy = DSparkPolicy(m, margin=0.0)
    cands = [Candidate(1, AcceptanceEstimator(prior=0.45), confidences=False) for _ in range(8)]
    # (8 + 0.45) / (20 + 1.25) < 8 / 20: nothing admitted (the line alone: (8 + 0.45) / 20, everything admitted)
    assert policy.draft_lengths(cands, 8) == [0] * 8
    assert DSparkPolicy(measured(0.0), margin=0.0).draft_lengths(cands, 8) == [1] * 8


def test_a_profile_that_underrates_verification_stops_misleading_dspark():
    """The profile says extra tokens are nearly free; every forward really costs 1 per token. DSpark verifies drafts
    at first, measures those forwards (their lengths vary from step to step, as drafts do), and stops: the measured
    costs say drafts that survive 60% of the time do not pay."""
    R = 16
    prior = StepCosts(CostTable((1, 16, 32, 64, 128), (16.0, 16.0, 17.0, 18.0, 20.0)))  # flat: drafts look free
    policy = DSparkPolicy(MeasuredStepCosts(prior))
    cands = [Candidate(4, AcceptanceEstimator(prior=0.6), confidences=False) for _ in range(R)]
    drafts = [[Draft([1, 2, 3, 4][: (r + i) % 5]) for r in range(R)] for i in range(5)]
    assert sum(policy.verify_lengths(cands, drafts[0], R)) > 0
    for i in range(40):
        tokens = R + sum(policy.verify_lengths(cands, drafts[i % 5], R))
        policy.observe_step(tokens, R, float(tokens))  # seconds = tokens
    assert all(policy.verify_lengths(cands, d, R) == [0] * R for d in drafts)
    assert policy.draft_lengths(cands, R) == [0] * R


def test_nearby_sequence_counts_share_the_measured_cost_per_token():
    """A busy batch: 12 sequences measured at five token counts, 1 s per token; 15 sequences at two token counts
    close together whose noise says extra tokens are nearly free (16 -> 14.6 s, 17 -> 14.7 s); 16 sequences at one.
    The slope of 15 and 16 is the pooled least-squares slope of the counts within 0.75x of them (closed form below),
    not 15's own pair floored at half the profile's 0.6 s per token, so a draft row surviving 60% of the time does not
    look like it pays at 15 sequences (a draft row then costs more than the 0.88 s of an average decode row; with the
    floor's 0.3 s it looked like it did). A count far away (4) keeps its own line."""
    prior = StepCosts(CostTable((1, 128), (0.6, 76.8)))  # 0.6 s per token
    m = MeasuredStepCosts(prior, window=1)
    twelve = {12: 12.0, 13: 13.0, 14: 14.0, 15: 15.0, 16: 16.0}
    fifteen = {16: 14.6, 17: 14.7}
    for t, sec in twelve.items():
        m.observe(t, 12, sec)
    for t, sec in fifteen.items():
        m.observe(t, 15, sec)
    m.observe(16, 16, 16.0)
    m.observe(4, 4, 4.0)
    m.observe(6, 4, 4.2)  # 0.1 s per token: below half the profile's (0.3), so the floor

    def centred(pts: dict[int, float]) -> tuple[float, float]:  # sum (t - mean)(v - mean), sum (t - mean)^2
        mt, mv = statistics.fmean(pts), statistics.fmean(pts.values())
        return sum((t - mt) * (v - mv) for t, v in pts.items()), sum((t - mt) ** 2 for t in pts)

    (a, b), (c, d) = centred(twelve), centred(fifteen)
    pooled = (a + c) / (b + d)  # (10 + 0.05) / (10 + 0.5)
    assert math.isclose(pooled, 10.05 / 10.5)
    assert math.isclose(m(17, 15) - m(16, 15), pooled)
    assert math.isclose(m(17, 16) - m(16, 16), pooled) and math.isclose(m(16, 16), 16.0)  # one point: through it
    assert math.isclose(m(14, 12) - m(13, 12), pooled)  # 12 shares 15's slope too (15 is within 12 / 0.75)
    assert math.isclose(m(7, 4) - m(6, 4), 0.3)  # 4: its own pair, floored at half the profile's slope
    policy = DSparkPolicy(m, margin=0.0)
    cands = [Candidate(1, AcceptanceEstimator(prior=0.6), confidences=False) for _ in range(15)]
    assert policy.draft_lengths(cands, 15) == [0] * 15


def test_probes_back_off_until_speculation_resumes():
    """Probe gaps double after each probe (8, 16, 32, 64, 64), whether it matched or not, and drop back to 8 once the
    policy drafts by itself (an ordinary draft, accepted or not)."""
    est = AcceptanceEstimator()

    def next_gap() -> int:
        n = 1
        while not est.plain_step():
            n += 1
        return n

    gaps = []
    for _ in range(5):
        gaps.append(next_gap())
        est.update(drafted=2, accepted=0)
    assert gaps == [8, 16, 32, 64, 64]
    est = AcceptanceEstimator()
    for want in (8, 16, 32):
        assert next_gap() == want
        est.update(drafted=2, accepted=2)  # the probe matched, but the policy stays off: the next wait doubles
    assert next_gap() == 64
    est.update(drafted=2, accepted=1)  # this probe matched
    est.update(drafted=4, accepted=0)  # and the policy drafted by itself (a failed ordinary draft): back to 8
    assert next_gap() == 8


def test_drafting_time_is_per_proposed_token_verified_or_not():
    """...from a request's second proposal on: its first also catches the drafter up on the whole prompt."""
    est = AcceptanceEstimator()
    est.observe_draft(4, 0.5)
    assert est.draft_cost_per_token == 0.0 and est.proposals_timed == 1
    est.observe_draft(4, 0.008)  # 4 proposed, whatever was verified of them
    assert est.draft_cost_per_token == pytest.approx(0.002)
    est.observe_draft(2, 0.008)
    assert est.draft_cost_per_token == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)
    est.observe_draft(0, 1.0)  # nothing proposed: nothing learnt
    assert est.draft_cost_per_token == pytest.approx(0.8 * 0.002 + 0.2 * 0.004)


def test_probes_of_a_dear_drafter_wait_until_its_drafting_is_a_small_share_of_the_plain_steps():
    """A probe is due after the back-off's plain steps (8 first), and for a drafter whose proposal costs 11 ms against
    8 ms forwards, at the default share of 2%, no sooner than 0.011 / (0.02 x 0.008) = 68.75 -> 69 plain steps; a proposal of
    0.1 ms changes nothing (0.1 / 0.16 -> 1 step), and neither does an unknown step time."""
    def first_due(est: AcceptanceEstimator, step_s: float) -> int:
        return next(i for i in range(1, 1000) if est.plain_step(step_s))

    dear, cheap, untimed = AcceptanceEstimator(), AcceptanceEstimator(), AcceptanceEstimator()
    dear.draft_cost_per_proposal, cheap.draft_cost_per_proposal = 0.011, 0.0001
    assert first_due(dear, 0.008) == 69
    assert first_due(cheap, 0.008) == 8
    assert first_due(untimed, 0.008) == 8
    assert first_due(AcceptanceEstimator(timing=DraftTiming(per_proposal=0.011)), 0.0) == 8
    # a share of 0.5%: 0.011 / (0.005 x 0.008) = 275 plain steps; the cheap drafter still every 8
    dear, cheap = AcceptanceEstimator(probe_share=0.005), AcceptanceEstimator(probe_share=0.005)
    dear.draft_cost_per_proposal, cheap.draft_cost_per_proposal = 0.011, 0.0001
    assert (first_due(dear, 0.008), first_due(cheap, 0.008)) == (275, 8)


@pytest.mark.parametrize("a,b", [(1.5e-4, 0.0), (0.0, 2.5e-3), (3e-3, 1e-3)])
def test_draft_timing_recovers_the_line_of_proposals_that_lie_on_one(a, b):
    """Proposals of 1..8 tokens timed exactly a + b n (a per-call drafter, an autoregressive head, a mix): the
    weighted least-squares line is that line whatever the weights, so cost(n) is a + b n; s / n per token is not
    (it overcharged a per-call drafter's block of 8 by up to 8x)."""
    rng = random.Random(0)
    t = DraftTiming()
    for _ in range(40):
        n = rng.randint(1, 8)
        t.observe(n, a + b * n)
    fa, fb = t.line()
    assert fa == pytest.approx(a, abs=1e-12) and fb == pytest.approx(b, abs=1e-12)
    for n in (1, 4, 8, 11):
        assert t.cost(n) == pytest.approx(a + b * n)
    assert t.cost(0) == 0.0


def test_draft_timing_without_spread_charges_per_token_and_never_below_zero():
    """One length only: no slope can be fitted, so n tokens cost n x the measured seconds per token (exact at that
    length); a line whose fit would give a negative per-call time is clamped to the origin (a = 0, b = E[s] / E[n])."""
    t = DraftTiming()
    for _ in range(10):
        t.observe(4, 0.004)
    assert t.line() == (0.0, pytest.approx(0.001)) and t.cost(4) == pytest.approx(0.004)
    steep = DraftTiming()
    for n in (1, 8) * 10:
        steep.observe(n, 0.0 if n == 1 else 0.016)  # least squares: slope 0.016 / 7 > E[s] / E[n]
    a, b = steep.line()
    mn, ms = steep.moments[0], steep.moments[1]
    assert a == pytest.approx(0.0, abs=1e-15) and b == pytest.approx(ms / mn)


def test_a_per_call_drafter_is_charged_its_call_for_a_block_not_its_call_per_token():
    """A suffix-like drafter: 0.15 ms a call whatever it proposes, proposals of 1-8 tokens seen. Its block of 8 is
    charged 0.15 ms (before: 8 x its mean seconds per token, several times that); drafting what is admitted, the
    first position carries the call and the others nothing."""
    from verispec.engine.scheduler import drafting_costs

    est = AcceptanceEstimator()
    est.observe_draft(8, 0.01)  # the first proposal: catching up on the prompt, not the rate
    for n in [1, 2, 8, 1, 3, 8, 2, 1, 5, 8] * 3:
        est.observe_draft(n, 1.5e-4)
    cand = Candidate(8, est)
    assert drafting_costs(cand, whole_blocks=True)[0] == pytest.approx(1.5e-4)
    assert est.draft_cost_per_token * 8 > 3 * 1.5e-4  # what the block was charged before
    per_position = drafting_costs(cand, whole_blocks=False)
    assert per_position[0] == pytest.approx(1.5e-4) and max(per_position[1:]) == pytest.approx(0.0, abs=1e-12)


def test_a_pause_counts_for_a_bounded_spike_and_a_real_slowdown_is_followed():
    """Steady proposals of 4 tokens at 4 ms, then one that took 400 ms (a pause, not drafting): it counts as
    SPIKE x 4 ms, so the estimate moves to 0.8 x 4 + 0.2 x 16 = 6.4 ms and not to 83 ms (which priced drafting out
    for good: no draft, no probe, nothing to measure again). Proposals that really take 3x as long (within the
    bound) move it there."""
    from verispec.engine.draft_timing import SPIKE

    t = DraftTiming()
    for _ in range(10):
        t.observe(4, 0.004)
    t.observe(4, 0.4)
    assert t.cost(4) == pytest.approx(0.8 * 0.004 + 0.2 * SPIKE * 0.004)
    for _ in range(30):
        t.observe(4, 0.012)
    assert t.cost(4) == pytest.approx(0.012, rel=1e-3)


def test_a_decayed_estimate_prices_every_length_by_the_factor():
    t = DraftTiming()
    for n, s in [(1, 0.002), (3, 0.004), (8, 0.0095), (2, 0.003), (5, 0.0065)]:
        t.observe(n, s)
    d = t.decayed(0.5)
    for n in (1, 2, 4, 8, 16):
        assert d.cost(n) == pytest.approx(0.5 * t.cost(n))
    assert d.per_proposal == pytest.approx(0.5 * t.per_proposal) and t.cost(4) > 0  # t itself unchanged
