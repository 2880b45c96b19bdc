"""Verification of a draft against the target, as pure functions (Leviathan et al. 2023; Chen et al. 2023).

Notation: the drafter proposed x_1..x_g, drawn from q_1..q_g (or deterministically: q = one-hot). One target
forward over [last, x_1..x_g] gives p_1..p_{g+1}: p_k is the target's processed distribution for the token at
draft position k, p_{g+1} the one after the whole draft.

  accepted  - the draft tokens kept, always a prefix x_1..x_n;
  recovered - at the first rejection (position n+1), a token drawn from the residual norm(max(0, p - q));
  bonus     - when all g are accepted, a token drawn from p_{g+1}.
Every verdict therefore emits n + 1 tokens. The exact rules keep the target's output distribution; the relaxed
ones (`threshold`, `typical`) do not, and every result made with them is labelled lossy.

Two exact rules. A seeded request (under the exact rule) is verified by the race (`verify_seeded`): the target's
token at each position is argmax p / E over that position's noise (sampling/coupled.py), a draft token is accepted
iff it equals it, and the first one that does not is replaced by it; the output is then the same whatever was
drafted (seeded speculative output == seeded plain output). An unseeded request keeps Leviathan / Chen
(`verify_sampled`, acceptance 1 - TV(p, q) for a draft drawn from q), as do the relaxed rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verispec.execution.drift import lossy_drift
from verispec.sampling import SamplingParams, argmax_rows, sample_index, target_probs
from verispec.sampling.coupled import race_index


@dataclass(frozen=True)
class Verdict:
    accepted: int  # n, the number of draft tokens kept
    tokens: list[int]  # x_1..x_n followed by the recovered or bonus token: n + 1 tokens
    # measured for the relaxed rules only (execution/drift.py): accepted draft tokens the exact test rejected, and
    # the summed total-variation distance to p over the verified positions 1..min(n + 1, g)
    relaxed: int = 0
    tv_sum: float = 0.0
    tv_positions: int = 0


@dataclass(frozen=True)
class AcceptanceConfig:
    """How to accept draft tokens when sampling. `exact` is the lossless rule and the default."""

    rule: str = "exact"  # exact | threshold | typical
    threshold_single: float = 1.0  # threshold: accept when p(x) >= this ...
    threshold_acc: float = 1.0  # ... or when u <= p(x) / threshold_acc
    typical_epsilon: float = 0.3  # typical: accept when p(x) > min(epsilon, delta * exp(-H(p)))
    typical_delta: float = 0.09

    def __post_init__(self) -> None:
        if self.rule not in ("exact", "threshold", "typical"):
            raise ValueError(f"acceptance rule {self.rule!r}: use exact, threshold or typical")
        if not (0 < self.threshold_single <= 1 and 0 < self.threshold_acc <= 1):
            raise ValueError("threshold_single and threshold_acc must be in (0, 1]")

    @property
    def lossy(self) -> bool:
        if self.rule == "threshold":
            return self.threshold_single < 1 or self.threshold_acc < 1
        return self.rule == "typical"


EXACT = AcceptanceConfig()


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """draft: [g]; target_logits: [g + 1, V]. Accept while x_k == argmax p_k; then append argmax."""
    best = argmax_rows(target_logits)  # [g + 1]
    d = draft.tolist()
    n = 0
    while n < len(d) and d[n] == best[n]:
        n += 1
    return Verdict(n, d[:n] + [best[n]])


def verify_sampled(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
    rule: AcceptanceConfig = EXACT,
) -> Verdict:
    """draft: [g]; q: [g, V] draft distributions or None (one-hot); p: [g + 1, V] target distributions.

    Uses g uniforms and one categorical draw from the request's generator, so results are reproducible per seed.
    """
    g = draft.shape[0]
    idx = torch.arange(g, device=p.device)
    p_x = p[idx, draft]  # [g] p_k(x_k)
    q_x = torch.ones_like(p_x) if q is None else q[idx, draft]  # [g] q_k(x_k)
    u = torch.rand(g, generator=generator, device=p.device)  # [g]
    if rule.rule == "exact":
        ok = u * q_x <= p_x  # accept with probability min(1, p/q); q_x > 0 since x was drawn from q
    elif rule.rule == "threshold":
        ok = (p_x >= rule.threshold_single) | (u * q_x <= p_x / rule.threshold_acc)
    else:  # typical acceptance (Medusa)
        entropy = -(p[:g] * p[:g].clamp_min(1e-30).log()).sum(-1)  # [g]
        ok = p_x > torch.minimum(torch.full_like(entropy, rule.typical_epsilon), rule.typical_delta * (-entropy).exp())
    rejected = (~ok).nonzero()
    n = int(rejected[0, 0]) if rejected.numel() else g
    if n == g:
        last = p[g]  # bonus
    elif rule.rule == "exact" or rule.rule == "threshold":
        last = residual(p[n], None if q is None else q[n], int(draft[n]))
    else:
        last = p[n]
    extra = sample_index(last, generator)
    if rule.rule == "exact":
        return Verdict(n, draft[:n].tolist() + [extra])
    drift = lossy_drift(draft, q, p[:g], ok, u * q_x <= p_x, n, rule)  # consumes no randomness
    return Verdict(n, draft[:n].tolist() + [extra], *drift)


def verify_seeded(draft: Sequence[int], p: torch.Tensor, seed: int, position: int) -> Verdict:
    """draft: [g]; p: [g + 1, V] target distributions, row k for absolute position `position` + k. Accept while the
    draft token is the race token of its position; then emit the race token of the first position not accepted.
    Draws only the noise of the positions it reads (n + 1), each keyed by (seed, position), never by the draft."""
    d = list(draft)
    n = 0
    while True:
        x = race_index(p[n], seed, position + n)
        if n == len(d) or d[n] != x:
            return Verdict(n, d[:n] + [x])
        n += 1


def residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """p, q: [V] -> norm(max(0, p - q)); with q one-hot at x: p with x removed, renormalised."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    # total == 0 only when p <= q everywhere, i.e. p == q: then rejection had probability 0; p is the safe answer
    return r / total if total > 0 else p


def verify(
    draft: Sequence[int],
    q: torch.Tensor | None,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    rule: AcceptanceConfig = EXACT,
    position: int | None = None,
) -> Verdict:
    """One request's verdict. draft: [g]; q: [g, V] or None; logits: [g + 1, V] the target's raw logits; position:
    the absolute position (index in prompt + output) of the token logits row 0 predicts.

    Greedy compares with the argmax of the raw logits; sampling builds the request's processed distribution
    (the same `target_probs` plain decoding samples from): a seeded request under an exact rule by the race
    (`verify_seeded`), otherwise by `rule` with the request's generator.
    """
    x = torch.tensor(list(draft), dtype=torch.long)  # [g]
    if params.greedy:
        return verify_greedy(x, logits)
    p = target_probs(logits, params.temperature, params.top_k, params.top_p)  # [g + 1, V]
    if params.seed is not None and not rule.lossy:  # the threshold rule at 1 is the exact rule
        if position is None:
            raise ValueError("a seeded request's verdict needs the position of the token it samples")
        return verify_seeded(draft, p, params.seed, position)
    assert generator is not None, "a sampled request has its own generator"
    return verify_sampled(x, q, p, generator, rule)
