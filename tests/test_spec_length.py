"""The speculation-length rule against its closed form."""

from __future__ import annotations

import math

from verispec.engine.scheduler import Candidate, GoodputPolicy, StaticPolicy
from verispec.spec_length import AcceptanceEstimator, CostTable, StepCosts, expected_tokens


def test_expected_tokens_closed_form():
    assert math.isclose(expected_tokens(0.5, 3), 1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0


def test_cost_table_interpolates_and_extrapolates():
    t = CostTable((1, 2, 4), (1.0, 1.5, 2.5))
    assert t(1) == 1.0 and t(3) == 2.0 and t(6) == 3.5


est_probe: dict = {}


def _step(policy, est, limit):
    """One single-request step as the engine runs it: choose k; a plain step may schedule a probe."""
    k = policy.draft_lengths([Candidate(limit, est, est_probe.pop(id(est), False))], 1)[0]
    if k == 0:
        est_probe[id(est)] = est.plain_step()
    return k


def test_turns_speculation_off_when_drafts_fail_and_back_on_when_they_match():
    costs = StepCosts(CostTable((1, 2, 9), (1.0, 1.3, 2.0)))  # verifying 9 tokens costs 2 plain steps
    policy = GoodputPolicy(costs)
    est = AcceptanceEstimator()
    assert _step(policy, est, 8) > 0  # the prior makes a first try worthwhile
    for _ in range(10):
        est.update(drafted=4, accepted=0, draft_s=0.0)
    picks = [_step(policy, est, 8) for _ in range(32)]
    assert picks.count(0) >= 28 and max(picks) <= 2  # plain, except for rare short probes
    for _ in range(20):
        est.update(drafted=8, accepted=8, draft_s=0.0)
    assert _step(policy, est, 8) == 8
    assert _step(policy, est, 3) == 3  # never more than the request has room for


def test_expensive_verification_needs_high_acceptance():
    steep = StepCosts(CostTable((1, 2, 9), (1.0, 2.0, 9.0)))  # every extra token costs a full step: never worth it
    est = AcceptanceEstimator(prior=0.9)
    assert _step(GoodputPolicy(steep), est, 8) == 0
    assert StaticPolicy(steep).draft_lengths([Candidate(5, est)], 1) == [5]
