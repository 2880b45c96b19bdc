"""What a drafter's acceptance would have to be for speculation to reach a speed goal, pure arithmetic.

A greedy chain drafter verified at draft length k commits tau(k) = 1 + s_1 + ... + s_k tokens per step, where s_j
is the share of steps whose draft survives to position j (a K-token run's per-position acceptance; its first k
positions are what a k-token run drafts). With the measured costs of one stream (the prefill, a plain decode
step, the target's forward over m rows, the rest of a speculative step as a line in k) a request of n output
tokens takes P + n x plain plain, against P + n x step(k) / tau(k) speculating, so the speed ratio is known for
every k. A better drafter is modelled as the same one with each position's conditional miss rate (1 - s_j /
s_(j-1)) scaled by a factor lam in [0, 1] (lam = 1: today's drafter, lam = 0: every draft survives); the smallest
improvement that reaches the goal is the largest lam that does, found by bisection (the ratio falls as lam
grows, at every k). Its tau at the run's K is the figure a learning curve can be asked about (train/curve.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StreamCosts:
    """Seconds of one stream at concurrency 1, measured: `prefill` (to the first token), `plain` (a plain decode
    step), `forward[m - 1]` (the target forward of a speculative step over m rows, m = 1..K + 1), and the rest of
    a speculative step (drafting, verification, commit) as `rest + rest_per_token x k`; `tokens`: output tokens
    per request after the first."""

    prefill: float
    plain: float
    forward: tuple[float, ...]
    rest: float
    rest_per_token: float
    tokens: float

    def __post_init__(self) -> None:
        assert self.plain > 0 and self.tokens > 0 and self.forward, "a plain step, tokens and forward costs"
        assert all(f > 0 for f in self.forward) and self.prefill >= 0

    @property
    def max_k(self) -> int:
        return len(self.forward) - 1

    def step(self, k: int) -> float:
        """Seconds of a speculative step drafting k tokens (1 <= k <= max_k)."""
        assert 1 <= k <= self.max_k, f"k = {k} outside 1..{self.max_k}"
        return self.forward[k] + max(0.0, self.rest + self.rest_per_token * k)


def tau(survival: Sequence[float], k: int) -> float:
    """Tokens per verification step drafting k: 1 + s_1 + ... + s_k."""
    assert 0 <= k <= len(survival)
    return 1.0 + sum(survival[:k])


def speedup(survival: Sequence[float], costs: StreamCosts, k: int) -> float:
    """Output tok/s of a request (prefill included) drafting k every step, over plain decoding's."""
    n = costs.tokens
    return (costs.prefill + n * costs.plain) / (costs.prefill + n * costs.step(k) / tau(survival, k))


def best(survival: Sequence[float], costs: StreamCosts) -> tuple[int, float]:
    """(k, speedup) of the fastest draft length up to min(len(survival), max_k)."""
    ks = range(1, min(len(survival), costs.max_k) + 1)
    return max(((k, speedup(survival, costs, k)) for k in ks), key=lambda kv: kv[1])


def shrink_misses(survival: Sequence[float], lam: float) -> list[float]:
    """The survival of a drafter whose conditional miss rate at every position is lam times this one's (a
    position never reached counts as a certain miss)."""
    assert 0.0 <= lam <= 1.0
    out, prev, cur = [], 1.0, 1.0
    for s in survival:
        alpha = s / prev if prev > 0 else 0.0
        prev = s
        cur *= 1.0 - lam * (1.0 - min(1.0, alpha))
        out.append(cur)
    return out


@dataclass(frozen=True)
class SpeedGoal:
    """What reaching `goal` would take: today's best (k, ratio); `lam` (None: not even drafts that always survive
    reach it at these costs; 1.0: reached already) and, where reachable, the k and the tau at the run's K (all
    positions) of the least improved drafter that does."""

    goal: float
    now_k: int
    now_ratio: float
    tau_now: float
    lam: float | None
    k: int | None
    tau_needed: float | None

    @property
    def reached(self) -> bool:
        return self.now_ratio >= self.goal


def speed_goal(survival: Sequence[float], costs: StreamCosts, goal: float = 1.5, tol: float = 1e-4) -> SpeedGoal:
    """The least improvement (largest lam) of this drafter at which its best k reaches `goal`."""
    k0, r0 = best(survival, costs)
    now = tau(survival, len(survival))
    if r0 >= goal:
        return SpeedGoal(goal, k0, r0, now, 1.0, k0, now)
    if best(shrink_misses(survival, 0.0), costs)[1] < goal:
        return SpeedGoal(goal, k0, r0, now, None, None, None)
    lo, hi = 0.0, 1.0  # best(lo) >= goal > best(hi)
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if best(shrink_misses(survival, mid), costs)[1] >= goal:
            lo = mid
        else:
            hi = mid
    better = shrink_misses(survival, lo)
    return SpeedGoal(goal, k0, r0, now, lo, best(better, costs)[0], tau(better, len(better)))
