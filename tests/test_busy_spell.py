"""Speculation comes back after a busy spell (issue 67): step and drafting times measured while other processes
loaded the machine must not keep the dspark policy from drafting once the load is gone. Pure: the policy and its
cost model driven by injected step times, as the engine drives them (engine/core.py's draft, forward, learn)."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.engine.acceptance import AcceptanceEstimator

from verispec.engine.costs import CostTable, MeasuredStepCosts, StepCosts
from verispec.engine.draft_timing import DraftTiming
from verispec.engine.scheduler import Candidate, DSparkPolicy

MS = 1e-3
PROFILE = StepCosts(CostTable((1, 2, 3, 4, 5), tuple(MS * (10 + 0.5 * (t - 1)) for t in range(1, 6))))


@dataclass
class Proposal:
    tokens: list[int]
    confidence: list[float] | None


def quiet(rows: int) -> float:
    """The idle machine: a forward of `rows` rows (one stream) costs 10 ms and 0.5 ms per extra row."""
    return MS * (10 + 0.5 * (rows - 1))


def busy(rows: int) -> float:
    """Other processes on both cores: every forward twice as slow, and each draft row as dear as the forward."""
    return 2 * quiet(1) * rows


class Stream:
    """One request decoding under the dspark policy, its drafter a prompt lookup whose drafts match (confidence and
    outcome 0.9 a position, every drafted token accepted), its forwards and drafting timed by the given clocks."""

    def __init__(self, policy: DSparkPolicy, confidences: bool = True) -> None:
        self.policy, self.confidences = policy, confidences
        self.est = AcceptanceEstimator(timing=DraftTiming())
        self.probe = False

    def step(self, forward, draft_s: float) -> int:
        """One engine step; returns the draft tokens verified."""
        c = Candidate(4, self.est, self.probe, self.confidences)
        k = self.policy.draft_lengths([c], 1)[0]
        d = Proposal([7] * k, [0.9] * k if self.confidences else None)
        n = self.policy.verify_lengths([c], [d], 1)[0] if k else 0
        seconds = forward(1 + n)
        self.policy.observe_step(1 + n, 1, seconds)
        if k:
            self.est.observe_draft(k, draft_s)
        if n:
            self.est.update(n, n)
            self.probe = False
        else:
            self.probe = self.est.plain_step(seconds)
        return n


def run_spell(policy: DSparkPolicy, confidences: bool = True, busy_steps: int = 200,
              after: int = 200) -> tuple[list[int], list[int], list[int]]:
    """Draft tokens verified per step: before (quiet), during (busy) and after the busy spell (quiet again)."""
    s = Stream(policy, confidences)
    before = [s.step(quiet, 0.05 * MS) for _ in range(50)]
    during = []
    for _ in range(busy_steps):
        for rows in range(1, 6):  # the spell's forwards at every block size (other requests', a stream's probes)
            policy.observe_step(rows, 1, busy(rows))
        during.append(s.step(busy, 2 * MS))
    return before, during, [s.step(quiet, 0.05 * MS) for _ in range(after)]


def first_speculating(steps: list[int]) -> int | None:
    return next((i for i, n in enumerate(steps) if n), None)


def test_speculation_resumes_within_64_steps_of_a_busy_spell():
    before, during, after = run_spell(DSparkPolicy(MeasuredStepCosts(PROFILE)))
    assert all(before[10:]), "the quiet machine speculates"
    assert not any(during[-50:]), "the busy spell switched speculation off (the situation of issue 67)"
    resumed = first_speculating(after)
    assert resumed is not None and resumed < 64, resumed
    assert sum(map(bool, after[64:])) >= 0.9 * len(after[64:]), "and it stays on"


def test_without_forgetting_stale_step_times_speculation_stayed_off():
    """What the bound guards against: dear draft-row measurements kept for good (never stale) leave the extra rows
    looking dear beside a plain token count measured anew, and nothing is drafted again."""
    _, during, after = run_spell(DSparkPolicy(MeasuredStepCosts(PROFILE, stale_after=10**9)))
    assert not any(during[-50:]) and not any(after)


def test_a_drafter_without_confidences_resumes_too():
    """Drafted only where the online estimate admits it: its drafting time, measured dear in the spell, is halved by
    every due probe that it priced out, until a probe is drafted and timed again."""
    _, during, after = run_spell(DSparkPolicy(MeasuredStepCosts(PROFILE)), confidences=False)
    assert not any(during[-50:])
    resumed = first_speculating(after)
    assert resumed is not None and resumed < 64, resumed


def test_a_refused_probe_halves_the_drafting_time_that_priced_it_out():
    est = AcceptanceEstimator(probe_every=2, timing=DraftTiming(per_token=4 * MS, per_proposal=8 * MS))
    assert not est.plain_step() and est.plain_step()  # a probe is due
    assert est.draft_cost(2) == 8 * MS
    assert not est.plain_step()  # ... and was not drafted
    assert est.draft_cost(2) == 4 * MS
    assert est.plain_step()  # due again
    est.update(drafted=2, accepted=1)  # drafted: the measured time stands
    est.plain_step()
    assert est.draft_cost(2) == 4 * MS
