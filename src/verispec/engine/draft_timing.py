"""What a drafter's proposals cost: seconds per proposal against the tokens proposed, measured online.

A drafter's time is partly per call (prompt lookup's index walk, a suffix trie's match, catching up on the tokens
committed since its last proposal; a block drafter's one pass) and partly per token (an autoregressive head's
steps). Charging a call's whole time per token overcharged the first kind by the tokens it could have proposed:
a suffix proposal of one token at 0.15 ms priced a block of eight at 1.2 ms, and kept speculation off where it
paid. `DraftTiming` keeps exponentially weighted moments of (tokens n, seconds s) per proposal and prices n tokens
by the least-squares line s = a + b n where the proposals' lengths varied, else by n x seconds per token.

Pure arithmetic: no torch, no clock (the engine times the calls).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MIN_SPREAD = 0.5  # variance of the proposals' lengths (tokens^2) below which no slope is fitted
SPIKE = 4.0  # a proposal counts for at most this many times what the estimate says it costs
IDLE_DECAY = 0.8  # what a request that measured nothing leaves of the estimate it started from


@dataclass
class DraftTiming:
    """Measured drafting time. per_token: EMA of s / n; per_proposal: EMA of s; moments: EMAs of (n, s, n^2, n s),
    None until a proposal is timed (or when per_token was set by hand). `weight`: the newest proposal's weight."""

    per_token: float = 0.0
    per_proposal: float = 0.0
    moments: tuple[float, float, float, float] | None = None
    weight: float = 0.2

    def __post_init__(self) -> None:
        assert self.per_token >= 0 and self.per_proposal >= 0 and 0 < self.weight <= 1, self

    def observe(self, tokens: int, seconds: float) -> None:
        """One proposal of `tokens` (> 0) tokens took `seconds`, counted as at most SPIKE x the larger of the
        estimate's cost for it and the mean proposal's: a pause that has nothing to do with drafting (a garbage
        collection in a drafter that allocates, the machine busy) would otherwise price drafting out, and with it
        the probes that could measure again."""
        assert tokens > 0 and seconds >= 0, (tokens, seconds)
        if self.per_token > 0:
            seconds = min(seconds, SPIKE * max(self.cost(tokens), self.per_proposal))
        w = self.weight
        per_tok = seconds / tokens
        self.per_token = (1 - w) * self.per_token + w * per_tok if self.per_token else per_tok
        self.per_proposal = (1 - w) * self.per_proposal + w * seconds if self.per_proposal else seconds
        new = (float(tokens), seconds, float(tokens * tokens), tokens * seconds)
        old = self.moments
        self.moments = new if old is None else tuple((1 - w) * m + w * x for m, x in zip(old, new))  # type: ignore

    def line(self) -> tuple[float, float]:
        """(a, b): seconds per call and per token. The least-squares slope, clamped to [0, E[s] / E[n]] so that
        a >= 0, where the lengths varied (variance >= MIN_SPREAD); else (0, per_token)."""
        if self.moments is None:
            return 0.0, self.per_token
        mn, ms, mnn, mns = self.moments
        spread = mnn - mn * mn
        if spread < MIN_SPREAD or mn <= 0:
            return 0.0, self.per_token
        b = min(max((mns - mn * ms) / spread, 0.0), ms / mn)
        return ms - b * mn, b

    def cost(self, tokens: int) -> float:
        """Seconds to propose `tokens` tokens (0 for none)."""
        if tokens <= 0:
            return 0.0
        a, b = self.line()
        return a + b * tokens

    def copy(self) -> "DraftTiming":
        return replace(self)

    def decayed(self, factor: float = IDLE_DECAY) -> "DraftTiming":
        """Every time scaled by `factor`: an estimate nothing measured for a while counts for less, so that one
        that has grown stale and dear (measured on a busy machine) lets the drafter be tried and timed again."""
        m = self.moments
        return replace(self, per_token=self.per_token * factor, per_proposal=self.per_proposal * factor,
                       moments=None if m is None else (m[0], m[1] * factor, m[2], m[3] * factor))

    def handed_on(self, measured: "DraftTiming", proposals: int, drafted: bool) -> "DraftTiming":
        """What the next request starts from, after one that started from this estimate and then `measured` its
        own over `proposals` timed proposals: that measurement where it timed two or more (its first proposal
        catches up and is not one), else this estimate, decayed where it had a drafter that measured nothing."""
        if proposals >= 2:
            return measured.copy()
        return self.decayed() if drafted else self
