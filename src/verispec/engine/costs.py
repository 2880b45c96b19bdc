"""What a verification step costs: tables of seconds by the tokens (and requests) a forward verifies, fixed or
measured as the engine runs; how well drafts do is engine/acceptance.py's.

Pure arithmetic over numbers: no torch, no model. The tables are measured by engine/profile.py; the scheduling
policies (engine/scheduler.py) weigh them against the acceptance estimates.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field



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


@dataclass(frozen=True)
class StepCosts:
    """Seconds per batched target forward: a table over batched tokens plus a cost per extra sequence in it."""

    table: CostTable
    per_segment: float = 0.0

    def __call__(self, tokens: int, segments: int = 1) -> float:
        return self.table(tokens) + max(0, segments - 1) * self.per_segment

    @classmethod
    def flat(cls) -> "StepCosts":
        return cls(CostTable.flat())


class _Line:
    """Seconds against tokens for one sequence count: the least-squares line (intercept + slope x tokens, at least
    `floor`), at most every well-measured point (tokens p, seconds v) at or beyond the tokens asked for (v for
    tokens <= p), then at least every well-measured point carried forward from p at the least slope `floor_slope`
    (v + floor_slope x (tokens - p) for tokens >= p). So a well-measured token count's estimate is its own median
    unless a smaller well-measured count carried forward says more; non-decreasing in tokens."""

    def __init__(self, intercept: float, slope: float, floor: float, floor_slope: float,
                 points: list[tuple[int, float]]) -> None:
        self.intercept, self.slope, self.floor, self.floor_slope = intercept, slope, floor, floor_slope
        self.tokens = [t for t, _ in points]  # ascending
        self.lift: list[float] = []  # [i] max over points 0..i of v - floor_slope x p
        best = -math.inf
        for t, v in points:
            best = max(best, v - floor_slope * t)
            self.lift.append(best)
        self.cap: list[float] = []  # [i] min over points i.. of v
        low = math.inf
        for _, v in reversed(points):
            low = min(low, v)
            self.cap.append(low)
        self.cap.reverse()

    def __call__(self, tokens: int) -> float:
        value = max(self.intercept + self.slope * tokens, self.floor)
        j = bisect_left(self.tokens, tokens)
        if j < len(self.cap):
            value = min(value, self.cap[j])
        i = bisect_right(self.tokens, tokens)
        return max(value, self.lift[i - 1] + self.floor_slope * tokens) if i else value


# sequence counts within this ratio of each other share the measured cost per token (MeasuredStepCosts)
NEIGHBOURS = 0.75


@dataclass
class MeasuredStepCosts:
    """The profiled step costs corrected by the engine's own forwards. Per number of sequences in the forward, each
    token count the engine ran keeps the median (the lower one of an even count) of its last `window` measured
    seconds: a stalled forward does not move it, where an exponential average moved by a fifth of the stall and
    kept it while the policy, believing that token count dear, stopped running it. Once two or more token counts
    are measured, a query reads the least-squares line through them, its slope at least `min_slope` times the
    profile's over the same token counts (costs never fall as tokens grow, and one noisy step at a token count
    measured once cannot make extra tokens look free: at a busy batch that made drafts look like they paid until
    the next measurements said otherwise); with one, the profile's shape through it; with none, the profile. A
    profile taken while the machine was busy, or at other contexts and batch shapes than the ones served, stops
    misleading the policy after a few steps: the token counts where verification was underrated are the ones the
    policy runs, so over-speculation corrects itself.

    A line is the wrong shape where the real curve is flat for small blocks and then rises (a forward bound by
    reading the weights): a line through many token counts then underrates the single token and overrates the
    first extra ones, which keeps drafts that pay out of the step (measured: docs/results/cost_model.md). So a
    token count measured at least `min_count` times also bounds the estimate from below
    where it is measured and beyond, rising from it at the line's least slope: the estimate is the larger of the
    line and every such point carried forward. It never falls as tokens grow, never rises by less than that least
    slope per token, and a count measured once or twice (a lucky step) still only moves the line.
    The opposite shape, where the first draft row costs more than the next ones (a forward of one row and one of
    several run different kernel bodies), bent the line the other way: through one token and several, it put the
    single token above its measured time, and every draft looked cheaper by that much beside it (n-gram drafts
    that did not pay were verified on open-ended text, issue 65). So such a point also bounds the estimate from
    above where it is measured and below: a well-measured token count is estimated at its own median (unless a
    smaller one carried forward says more), the line filling in between and beyond them.

    The line's slope (seconds per token) is shared by nearby sequence counts (within `NEIGHBOURS` of each other):
    the least-squares slope within each of them, pooled (each count's points about their own mean). An extra row
    costs about the same whether 14 or 15 sequences are in the forward, but a busy batch's sequence count moves
    every few steps, so each count alone is measured at one or two token counts close together, and a slope fitted
    to such a pair alone falls to the least slope and makes draft rows look cheap (what that did:
    docs/results/cost_model.md). With one token count measured, its line is the pooled slope through it where
    nearby counts give one (the profile's shape through it where none do).

    A token count's estimate lasts only while it is run: one not measured in the last `stale_after` forwards of its
    sequence count is forgotten (its samples too), and the count's estimate falls back on the ones still run and the
    profile's shape. A busy spell otherwise switched speculation off for good: its dear measurements of the draft
    rows' token counts stayed while only the plain token count, no longer run with drafts, was measured again
    once the load had gone, so extra rows looked dearer and dearer beside it and nothing was ever drafted to measure
    them anew (issue 67)."""

    prior: StepCosts
    window: int = 9  # measured forwards per token count whose median is its estimate
    clamp: tuple[float, float] = (0.2, 5.0)  # one forward counts within these multiples of the current estimate
    min_slope: float = 0.5  # the fitted line's cost per token is at least this fraction of the profile's
    min_count: int = 4  # forwards at one token count before its median bounds the estimate on its own
    # a point moves the estimates only when its median moved by more than this share of it: the median moves by a
    # hair on most steps, and each move refits the line and empties the memos (and the policies' memos keyed on
    # `version`), work spent on changes far inside the noise
    tolerance: float = 0.01
    stale_after: int = 24  # forwards of its sequence count after which an unmeasured token count is forgotten
    points: dict[int, dict[int, float]] = field(default_factory=dict)  # segments -> tokens -> estimated seconds
    samples: dict[int, dict[int, deque[float]]] = field(default_factory=dict)  # segments -> tokens -> last seconds
    # segments -> the fitted line, None below two measured token counts
    _lines: dict[int, _Line | None] = field(default_factory=dict, init=False)
    # segments -> tokens -> the estimate as last computed: the policies ask for the same few token counts every step,
    # and the answers change only with the points (dropped with the line)
    _memo: dict[int, dict[int, float]] = field(default_factory=dict, init=False)
    version: int = field(default=0, init=False)  # counts the changes of the estimates (memos of callers key on it)
    # segments -> forwards measured; segments -> tokens -> that count when this token count was last measured
    _forwards: dict[int, int] = field(default_factory=dict, init=False)
    _last_seen: dict[int, dict[int, int]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        # a token count is well measured once min_count of its forwards are in its window
        self.window = max(self.window, self.min_count)

    def observe(self, tokens: int, segments: int, seconds: float) -> None:
        """One measured forward of `tokens` tokens over `segments` sequences."""
        if tokens < 1 or segments < 1 or seconds <= 0:
            return
        self._forget_stale(segments, tokens)
        pts = self.points.setdefault(segments, {})
        old = pts.get(tokens)
        ref = old if old is not None else self(tokens, segments)
        lo, hi = self.clamp
        x = min(hi * ref, max(lo * ref, seconds))  # a stall (or a lucky step) counts only so far
        last = self.samples.setdefault(segments, {}).setdefault(tokens, deque(maxlen=self.window))
        last.append(x)
        median = statistics.median_low(last)
        # the line changes only with a point's value (beyond the tolerance) or when a count becomes well measured, so
        # it is refitted then, not after every forward
        if old is None or abs(median - old) > self.tolerance * old or len(last) == self.min_count:
            pts[tokens] = median
            self._lines.clear()  # nearby sequence counts share this one's slope
            self._memo.clear()
            self.version += 1

    def _forget_stale(self, segments: int, tokens: int) -> None:
        """Count one forward of `segments` sequences at `tokens` tokens, and forget the token counts of that sequence
        count not measured in its last `stale_after` forwards (scanned every eighth forward: a few dict entries)."""
        n = self._forwards[segments] = self._forwards.get(segments, 0) + 1
        last = self._last_seen.setdefault(segments, {})
        last[tokens] = n
        if n % 8:
            return
        stale = [t for t, seen in last.items() if n - seen > self.stale_after]
        if not stale:
            return
        pts, samples = self.points.get(segments, {}), self.samples.get(segments, {})
        for t in stale:
            del last[t]
            pts.pop(t, None)
            samples.pop(t, None)
        self._lines.clear()
        self._memo.clear()
        self.version += 1

    def _pooled_slope(self, segments: int) -> float | None:
        """The least-squares seconds per token within each sequence count near `segments` (NEIGHBOURS), pooled:
        sum of (t - mean t)(v - mean v) over sum of (t - mean t)^2, each count about its own means. None where no
        nearby count has two token counts."""
        sxy = sxx = 0.0
        for s, pts in self.points.items():
            if len(pts) < 2 or not NEIGHBOURS * segments <= s <= segments / NEIGHBOURS:
                continue
            mt, mv = sum(pts) / len(pts), sum(pts.values()) / len(pts)
            sxy += sum((t - mt) * (v - mv) for t, v in pts.items())
            sxx += sum((t - mt) ** 2 for t in pts)
        return sxy / sxx if sxx else None

    def _line(self, segments: int) -> _Line | None:
        """The fitted line of seconds against tokens over the measured token counts and the well-measured points
        that bound it, once per change (the policy queries it for every admitted draft token); None with no token
        count measured, or one and no nearby sequence count's slope."""
        if segments not in self._lines:
            pts = self.points.get(segments) or {}
            pooled = self._pooled_slope(segments) if pts else None
            line = None
            if pooled is not None:
                n = len(pts)
                mt, mv = sum(pts) / n, sum(pts.values()) / n
                lo, hi = min(pts), max(max(pts), min(pts) + 1)  # one token count: the profile's slope from it
                floor_b = max(0.0, self.min_slope * (self.prior(hi, segments) - self.prior(lo, segments)) / (hi - lo))
                b = max(floor_b, pooled)
                seen = self.samples[segments]  # a window never shorter than min_count (__post_init__)
                line = _Line(mv - b * mt, b, 0.1 * min(pts.values()), floor_b,
                             sorted((t, v) for t, v in pts.items() if len(seen[t]) >= self.min_count))
            self._lines[segments] = line
        return self._lines[segments]

    def __call__(self, tokens: int, segments: int = 1) -> float:
        memo = self._memo.setdefault(segments, {})
        got = memo.get(tokens)
        if got is None:
            got = memo[tokens] = self._estimate(tokens, segments)
        return got

    def _estimate(self, tokens: int, segments: int) -> float:
        pts = self.points.get(segments)
        if not pts:
            return self.prior(tokens, segments)
        line = self._line(segments)
        if line is None:  # one measured token count: the profile's shape through it
            (t0, v0), = pts.items()
            return v0 * self.prior(tokens, segments) / self.prior(t0, segments)
        return line(tokens)


def step_sizes(max_tokens: int, cap: int = 128) -> tuple[int, ...]:
    """Block sizes worth profiling up to max_tokens: dense where steps are short, sparser above; beyond `cap` the
    table extrapolates linearly (large blocks are compute-bound, so their cost grows linearly)."""
    grid = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128)
    top = min(max_tokens, cap)
    return tuple(sorted({s for s in grid if s < top} | {top}))
