"""How far an acceptance rule moves the next-token distribution away from the target's: pure functions, no state.

A rule accepts the draft token x (drawn from q) with probability a(x) and otherwise resamples from a residual r, so
the token it emits at a verified position follows the applied distribution

    applied(y) = q(y) a(y) + (1 - sum_z q(z) a(z)) r(y).

The exact rule (a = min(1, p/q), r = norm(max(0, p - q))) gives applied = p; the lossy relaxations of
execution/verify.py do not, and `position_tv` measures by how much: the total-variation distance
TV = 1/2 sum_y |applied(y) - p(y)| at each position. A deterministic drafter is q = one-hot(x).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Rule(Protocol):  # execution/verify.AcceptanceConfig (not imported: verify imports this module)
    rule: str  # exact | threshold | typical
    threshold_single: float
    threshold_acc: float
    typical_epsilon: float
    typical_delta: float


def acceptance_probs(p: torch.Tensor, q: torch.Tensor, rule: "Rule") -> torch.Tensor:
    """p, q: [..., V] -> a: [..., V], the probability that `rule` accepts draft token y (where q(y) > 0)."""
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.ones_like(p))  # [..., V] p/q (1 off q's support)
    if rule.rule == "exact":
        return ratio.clamp(max=1.0)
    if rule.rule == "threshold":  # accept when p(x) >= t_single, or when u <= p(x) / (t_acc q(x))
        return torch.where(p >= rule.threshold_single, torch.ones_like(p), (ratio / rule.threshold_acc).clamp(max=1.0))
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1, keepdim=True)  # [..., 1] typical: p(x) > min(eps, d e^-H)
    bar = torch.minimum(torch.full_like(entropy, rule.typical_epsilon), rule.typical_delta * (-entropy).exp())
    return (p > bar).to(p.dtype)  # [..., V]


def residual_dist(p: torch.Tensor, q: torch.Tensor, rule: "Rule") -> torch.Tensor:
    """p, q: [..., V] -> r: [..., V], what `rule` samples after a rejection (verify.residual; typical: p itself)."""
    if rule.rule == "typical":
        return p
    r = (p - q).clamp_min(0.0)  # [..., V]
    total = r.sum(-1, keepdim=True)  # [..., 1]
    return torch.where(total > 0, r / total.clamp_min(1e-300), p)  # total 0 only when p == q: never rejected


def applied_distribution(p: torch.Tensor, q: torch.Tensor, rule: "Rule") -> torch.Tensor:
    """p, q: [..., V] -> [..., V]: q a + (1 - sum q a) r, the distribution of the token `rule` emits."""
    qa = q * acceptance_probs(p, q, rule)  # [..., V]
    return qa + (1.0 - qa.sum(-1, keepdim=True)) * residual_dist(p, q, rule)


def tv_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b: [..., V] distributions -> [...]: 1/2 sum |a - b|."""
    return 0.5 * (a - b).abs().sum(-1)


def position_tv(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor,
                rule: "Rule") -> torch.Tensor:
    """p: [m, V] target distributions; q: [m, V] draft distributions or None (a deterministic drafter: one-hot at
    draft); draft: [m] -> [m] float64 TV between the applied distribution and p at each verified position."""
    if q is None:
        return one_hot_tv(p, draft, rule)
    return tv_distance(applied_distribution(p.double(), q.double(), rule), p.double())


def one_hot_tv(p: torch.Tensor, draft: torch.Tensor, rule: "Rule") -> torch.Tensor:
    """p: [m, V]; draft: [m] -> [m] float64: position_tv for q = one-hot(x) in O(1) per position. applied =
    a delta_x + (1 - a) r with r = p without x, renormalised, so TV = |a - p(x)|; typical resamples from r = p,
    so TV = a (1 - p(x))."""
    idx = torch.arange(p.shape[0], device=p.device)
    px = p[idx, draft].double()  # [m]
    if rule.rule == "typical":  # its test needs the row's entropy
        a = acceptance_probs(p.double(), p.double(), rule)[idx, draft]  # [m] (q does not enter it)
        return a * (1.0 - px)
    a = acceptance_probs(px[:, None], torch.ones_like(px)[:, None], rule)[:, 0]  # [m] q(x) = 1
    return (a - px).abs()


def lossy_drift(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, ok: torch.Tensor,
                exact_ok: torch.Tensor, n: int, rule: "Rule") -> tuple[int, float, int]:
    """One verdict's cost of a relaxed rule. draft: [g]; q: [g, V] or None; p: [g, V]; ok / exact_ok: [g] the rule's
    and the exact rule's test on the same uniforms; n accepted. Returns (relaxed: accepted draft tokens that the
    exact test rejected, the sum of per-position TV over the verified positions 1..min(n + 1, g), their number)."""
    g = draft.shape[0]
    relaxed = int((ok[:n] & ~exact_ok[:n]).sum())
    m = min(n + 1, g)
    if m == 0:
        return relaxed, 0.0, 0
    tv = position_tv(p[:m], None if q is None else q[:m], draft[:m], rule)  # [m]
    return relaxed, float(tv.sum()), m
