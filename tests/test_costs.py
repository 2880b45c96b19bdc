"""The speculation-length rule against its closed form."""

from __future__ import annotations

import math
from dataclasses import dataclass

from verispec.engine.scheduler import Candidate, GoodputPolicy, StaticPolicy
from verispec.engine.costs import AcceptanceEstimator, CostTable, StepCosts, expected_tokens


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
        est.update(drafted=4, accepted=0, draft_s=0.0)
    picks = [req.step(policy, 8) for _ in range(32)]
    assert picks.count(0) >= 28 and max(picks) <= 2  # plain, except for rare short probes
    for _ in range(20):
        est.update(drafted=8, accepted=8, draft_s=0.0)
    assert req.step(policy, 8) == 8
    assert req.step(policy, 3) == 3  # never more than the request has room for


def test_expensive_verification_needs_high_acceptance():
    steep = StepCosts(CostTable((1, 2, 9), (1.0, 2.0, 9.0)))  # every extra token costs a full step: never worth it
    est = AcceptanceEstimator(prior=0.9)
    assert OneRequest(est).step(GoodputPolicy(steep), 8) == 0
    assert StaticPolicy(steep).draft_lengths([Candidate(5, est)], 1) == [5]
