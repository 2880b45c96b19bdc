"""How many tokens to speculate for one request: a measured step-cost table and a goodput rule.

goodput(k) = E[tokens committed | k] / (cost of verifying k + 1 tokens + cost of drafting k), with
E[tokens | k] = (1 - a^(k+1)) / (1 - a) for a per-request acceptance estimate a (METHODS.md sections 1 and 8).
k = 0 is plain decoding, chosen where speculation does not pay; a short probe every few plain steps keeps the
estimate alive so that a request whose drafts start matching again gets speculation back.
"""

from __future__ import annotations

import statistics
import time
from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from verispec.models.llama import LlamaModel, Segment


@dataclass(frozen=True)
class CostTable:
    """Seconds per target forward as a function of the tokens in it (piecewise linear between samples)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n: int) -> float:
        i = bisect_left(self.sizes, n)
        if i < len(self.sizes) and self.sizes[i] == n:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.sizes):  # extrapolate with the last slope
            i -= 1
        (n0, n1), (t0, t1) = self.sizes[i - 1 : i + 1], self.seconds[i - 1 : i + 1]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    @classmethod
    def flat(cls) -> "CostTable":
        """Every block costs the same: a neutral table for tests and for drafters that must not adapt."""
        return cls((1, 2), (1.0, 1.0))


def profile_costs(model: LlamaModel, sizes=(1, 2, 3, 4, 6, 8, 12, 16), context: int = 128, repeats: int = 3) -> CostTable:
    """Time one forward of each block size after `context` committed tokens (median of repeats)."""
    cache = model.new_cache(context + max(sizes))
    slot = cache.allocate()
    ids = torch.arange(context + max(sizes), device=model.device) % model.cfg.vocab_size
    model(ids[:context], [Segment(slot, 0, context)], cache)
    cache.commit(slot, context)
    out = []
    for n in sizes:
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            model(ids[context : context + n], [Segment(slot, context, n)], cache, logits_indices=range(n))
            times.append(time.perf_counter() - t)
            cache.rollback(slot, context)
        out.append(statistics.median(times[1:]))
    return CostTable(tuple(sizes), tuple(out))


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per step] with k drafts accepted i.i.d. with probability a (bonus included)."""
    if a >= 1.0:
        return k + 1.0
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class SpecLengthController:
    """Per-request choice of k in 0..max_k from the cost table and an online acceptance estimate."""

    max_k: int
    costs: CostTable
    adaptive: bool = True
    prior: float = 0.6  # acceptance assumed before any evidence
    decay: float = 0.8  # weight of the old estimate at each step
    probe_every: int = 8  # after this many plain steps, try a short draft again
    draft_cost_per_token: float = 0.0  # seconds, measured online
    accept_rate: float = field(init=False)
    _plain_steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.accept_rate = self.prior

    def choose(self, limit: int) -> int:
        """k for the next step, at most `limit` (tokens left to generate minus one, cache room)."""
        top = max(0, min(self.max_k, limit))
        if not self.adaptive or top == 0:
            return top
        best_k, best = 0, 1.0 / self.costs(1)
        for k in range(1, top + 1):
            rate = expected_tokens(self.accept_rate, k) / (self.costs(k + 1) + k * self.draft_cost_per_token)
            if rate > best:
                best_k, best = k, rate
        if best_k == 0:
            self._plain_steps += 1
            if self._plain_steps >= self.probe_every:
                self._plain_steps = 0
                return min(2, top)
        return best_k

    def update(self, drafted: int, accepted: int, draft_s: float) -> None:
        if drafted == 0:
            return
        # acceptance per drafted position, counting the positions after a rejection as unobserved
        observed = min(drafted, accepted + 1)
        rate = accepted / observed
        w = self.decay ** observed
        self.accept_rate = w * self.accept_rate + (1 - w) * rate
        per_tok = draft_s / drafted
        self.draft_cost_per_token = 0.8 * self.draft_cost_per_token + 0.2 * per_tok if self.draft_cost_per_token else per_tok
