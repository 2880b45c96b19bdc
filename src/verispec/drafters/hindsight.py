"""Confidences for model-free drafts, calibrated in hindsight: P(position j survives | positions before it did).

A prompt-lookup draft copies what followed an earlier occurrence of the context's tail, so its positions survive
together, and how long the matched tail was says much about whether they survive at all (on the default model's
shipped workloads, position 1 of a 1-token match survives 17-40% of the time, of a 4-token match 82-91%). An online
estimate from verification alone learns only the positions the scheduler chose to verify; this one scores every
draft against the tokens the request actually committed, whatever was verified.

For a draft of point masses the target accepts a token exactly when its own token there equals it (greedy: the
argmax; sampled: the standard rule accepts x with probability p(x), and a rejection samples from a residual without
x), so comparing a draft with the request's later output gives each position's verification outcome, censored only
where the request ended first.

  SurvivalTable   - counts of positions reached and survived, per (key, position), with a prior and a horizon; the
                    engine's drafter factory shares one across requests.
  HindsightScorer - per request: pending drafts, scored as the committed tokens arrive; confidences from the shared
                    table shrunk toward the request's own counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence


@dataclass
class SurvivalTable:
    """Per (key, position j >= 1): how many drafts reached position j (positions 1..j-1 survived) and how many of
    those survived it, as exponentially forgotten counts (at most `horizon` per cell: the recent past counts most).

    Invariant: 0 <= survived <= reached <= horizon in every cell."""

    prior: float = 0.5  # the conditional survival assumed for a cell never reached
    prior_weight: float = 2.0  # in pseudo-observations
    horizon: float = 512.0
    reached: dict[tuple[Hashable, int], float] = field(default_factory=dict)
    survived: dict[tuple[Hashable, int], float] = field(default_factory=dict)

    def rate(self, key: Hashable, j: int, prior: float | None = None) -> float:
        """P(position j survives | positions 1..j-1 did), for drafts of this key; `prior` in place of the table's."""
        n = self.reached.get((key, j), 0.0)
        p = self.prior if prior is None else prior
        return (self.survived.get((key, j), 0.0) + p * self.prior_weight) / (n + self.prior_weight)

    def add(self, key: Hashable, survived: int, failed: bool) -> None:
        """One draft's outcome: positions 1..`survived` survived; position survived + 1 was reached and failed
        when `failed` (otherwise the draft ended, or its outcome is unknown beyond that)."""
        for j in range(1, survived + 1 + int(failed)):
            cell = (key, j)
            n = self.reached.get(cell, 0.0) + 1.0
            s = self.survived.get(cell, 0.0) + float(j <= survived)
            if n > self.horizon:  # forget: scale the cell back to the horizon
                s, n = s * self.horizon / n, self.horizon
            self.reached[cell], self.survived[cell] = n, s
            assert 0.0 <= s <= n <= self.horizon


REQUEST_WEIGHT = 16.0  # pseudo-observations the shared rate counts for against the request's own


@dataclass
class _Pending:
    start: int  # index in the request's token stream of the draft's first token
    key: Hashable
    tokens: list[int]


class HindsightScorer:
    """One request's drafts: confidences when proposed, outcomes once the committed tokens cover them."""

    def __init__(self, shared: SurvivalTable) -> None:
        self.shared = shared
        self.own = SurvivalTable(prior_weight=REQUEST_WEIGHT)  # the request's counts, the shared rate its prior
        self.pending: list[_Pending] = []

    def confidence(self, key: Hashable, g: int) -> list[float]:
        """[g] conditional survival of positions 1..g: the shared rate, moved toward the request's own counts as
        they accumulate (weight REQUEST_WEIGHT for the shared one)."""
        return [self.own.rate(key, j, prior=self.shared.rate(key, j)) for j in range(1, g + 1)]

    def proposed(self, start: int, key: Hashable, tokens: Sequence[int]) -> None:
        """A draft of `tokens` meant for positions start, start + 1, ... of the request's token stream."""
        if tokens:
            self.pending.append(_Pending(start, key, [int(t) for t in tokens]))

    def forget(self) -> None:
        """Drop the pending drafts unscored (the token stream they were meant for was replaced)."""
        self.pending.clear()

    def score(self, stream: Sequence[int], final: bool = False) -> None:
        """Score the pending drafts `stream` (the committed tokens so far) decides: a position that differs, or the
        whole draft covered. With `final` (the request ended) the rest are scored as far as the stream reaches."""
        keep = []
        for p in self.pending:
            n = 0
            while n < len(p.tokens) and p.start + n < len(stream) and int(stream[p.start + n]) == p.tokens[n]:
                n += 1
            failed = n < len(p.tokens) and p.start + n < len(stream)
            if failed or n == len(p.tokens) or final:
                for table in (self.shared, self.own):
                    table.add(p.key, n, failed)
            else:
                keep.append(p)
        self.pending = keep
