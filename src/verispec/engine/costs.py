"""What speculation costs and how well it does: step-cost tables and per-request acceptance estimates.

Pure arithmetic over numbers: no torch, no model. The tables are measured by engine/profile.py.

The scheduling policies (engine/scheduler.py) turn these into a number of draft tokens per request and step:
E[tokens committed | k] = (1 - a^(k+1)) / (1 - a) for an acceptance estimate a (docs/methods.md sections 1 and 8).
A short probe every few plain steps keeps the estimate alive, so a request whose drafts start matching again
gets speculation back.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from verispec.engine.draft_timing import DraftTiming


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


def expected_tokens(a: float, k: int) -> float:
    """E[tokens per step] with k drafts accepted i.i.d. with probability a (bonus included)."""
    if a >= 1.0:
        return k + 1.0
    return (1 - a ** (k + 1)) / (1 - a)


# the default `probe_share`, 2% of the plain steps' time (a smaller share saved drafting time without a gain in
# speed: docs/results/drafters.md, "Probes at 0.5%")
PROBE_SHARE = 0.02
REFUSED_PROBE_DECAY = 0.5  # what a due probe that was not drafted leaves of the drafting time that priced it out


@dataclass
class AcceptanceEstimator:
    """Per request: online estimates of how drafts survive, and when to probe again after plain steps.

    accept_rate - acceptance per drafted position (i.i.d. model: position j survives with accept_rate ** j);
    pos_rates   - acceptance at position j given that position j - 1 survived (for survival without confidences).
    """

    prior: float = 0.6  # acceptance assumed before any evidence
    decay: float = 0.8  # weight of the old estimate at each observed position
    probe_every: int = 8  # after this many plain steps, try a short draft again
    probe_len: int = 2
    max_probe_every: int = 64  # a probe that finds nothing doubles the wait before the next, up to this
    # probes of a drafter whose proposal is dear come no more often than its drafting time stays within this share of
    # the plain steps between them (a block drafter's pass that costs most of a step: dozens of plain steps apart)
    probe_share: float = PROBE_SHARE
    # the drafter's measured time per proposal (the engine seeds it with an earlier request's measurement)
    timing: DraftTiming = field(default_factory=DraftTiming)
    proposals_timed: int = field(default=0, init=False)  # proposals with tokens this request has made
    accept_rate: float = field(init=False)
    pos_rates: list[float] = field(default_factory=list, init=False)
    _plain_steps: int = field(default=0, init=False)
    _probe_gap: int = field(default=0, init=False)  # plain steps before the next probe
    _probing: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.accept_rate = self.prior
        self._probe_gap = self.probe_every

    def iid_survival(self, n: int) -> list[float]:
        """[n] P(positions 1..j all accepted) under the i.i.d. estimate."""
        return [self.accept_rate ** (j + 1) for j in range(n)]

    def position_survival(self, n: int) -> list[float]:
        """[n] P(positions 1..j all accepted) from the per-position conditional estimates."""
        out, s = [], 1.0
        for j in range(n):
            s *= self.pos_rates[j] if j < len(self.pos_rates) else self.accept_rate
            out.append(s)
        return out

    def plain_step(self, step_s: float = 0.0) -> bool:
        """Note a step without speculation (its forward took `step_s` seconds, 0: not known); True when a probe is
        due: after the back-off's number of plain steps, and no sooner than the measured drafting time of one
        proposal is `probe_share` of the plain steps' time since the last.
        A probe that came due and was not drafted (the policy found even a good draft not worth its measured drafting
        time) halves that time (`REFUSED_PROBE_DECAY`): drafting timed on a busy machine would otherwise price every
        later probe out for the rest of the request, with nothing drafted to time it again."""
        if self._probing:  # the last due probe was refused: no draft was verified since it came due
            self._probing = False
            self.timing = self.timing.decayed(REFUSED_PROBE_DECAY)
        self._plain_steps += 1
        gap = self._probe_gap
        if step_s > 0 and self.draft_cost_per_proposal > 0 and self.probe_share > 0:
            gap = max(gap, math.ceil(self.draft_cost_per_proposal / (self.probe_share * step_s)))
        if self._plain_steps >= gap:
            self._plain_steps, self._probing = 0, True
            return True
        return False

    def observe_draft(self, tokens: int, draft_s: float) -> None:
        """The drafter proposed `tokens` tokens in `draft_s` seconds (verified or not): its cost per drafted token
        and per proposal (what a block drafter's one pass costs, however many of its tokens were asked for).
        A request's first proposal is not taken as the rate: it also catches the drafter up on the whole prompt (a
        suffix trie, an n-gram index, a draft model's or DFlash's context K/V), a one-off many times a proposal's
        cost that, averaged in, held speculation off for the request and, seeded into the next, for good."""
        if tokens <= 0:
            return
        self.proposals_timed += 1
        if self.proposals_timed > 1:
            self.timing.observe(tokens, draft_s)

    @property
    def draft_cost_per_token(self) -> float:
        """Seconds per drafted token (EMA of a proposal's time over its tokens); 0 while never measured."""
        return self.timing.per_token

    @draft_cost_per_token.setter
    def draft_cost_per_token(self, seconds: float) -> None:
        """A cost given, not measured: n tokens cost n x `seconds` (the fitted line is dropped)."""
        self.timing.per_token, self.timing.moments = seconds, None

    @property
    def draft_cost_per_proposal(self) -> float:
        """Seconds per proposal (EMA), what a block drafter's one pass costs however many tokens were asked for."""
        return self.timing.per_proposal

    @draft_cost_per_proposal.setter
    def draft_cost_per_proposal(self, seconds: float) -> None:
        self.timing.per_proposal = seconds

    def draft_cost(self, tokens: int) -> float:
        """Seconds to draft `tokens` tokens in one proposal (`DraftTiming.cost`)."""
        return self.timing.cost(tokens)

    def update(self, drafted: int, accepted: int) -> None:
        """`drafted` draft tokens were verified and `accepted` of them accepted (drafting time comes separately,
        through `observe_draft`: a draft may be cut before verification)."""
        if drafted == 0:
            return
        self._plain_steps = 0
        # back off after every probe, found something or not: the wait returns to probe_every only once the policy
        # speculates again by itself. A probe whose matches leave speculation off has cost a longer step (on a busy
        # batch, every request's) and bought nothing (docs/results/cost_model.md)
        if self._probing:
            self._probe_gap = min(2 * self._probe_gap, self.max_probe_every)
            self._probing = False
        else:
            self._probe_gap = self.probe_every
        # acceptance per drafted position, counting the positions after a rejection as unobserved
        observed = min(drafted, accepted + 1)
        w = self.decay ** observed
        self.accept_rate = w * self.accept_rate + (1 - w) * accepted / observed
        while len(self.pos_rates) < observed:
            self.pos_rates.append(self.accept_rate if not self.pos_rates else self.pos_rates[-1])
        for j in range(observed):
            self.pos_rates[j] = self.decay * self.pos_rates[j] + (1 - self.decay) * (j < accepted)


SHAPE_MEASURED = 3  # steps of each shape before "auto" compares what the shapes did, not its estimates


@dataclass
class ShapeRecord:
    """What one draft shape's steps did in a request, every step it was chosen (a step whose draft the policy cut
    to nothing counts too: one token, no rows): EMAs of the tokens the step committed (1 + accepted), the draft rows
    it verified and the seconds its drafter spent, and how many steps there were."""

    tokens: float = 0.0
    rows: float = 0.0
    draft_s: float = 0.0
    steps: int = 0
    weight: float = 0.25  # the newest step's

    def observe(self, rows: int, accepted: int, draft_s: float) -> None:
        w = self.weight if self.steps else 1.0
        self.tokens = (1 - w) * self.tokens + w * (1 + accepted)
        self.rows = (1 - w) * self.rows + w * rows
        self.draft_s = (1 - w) * self.draft_s + w * draft_s
        self.steps += 1

    def rate(self, step_s: Callable[[int], float]) -> float:
        """Committed tokens per second: a step's tokens over its forward at its rows (interpolated between whole
        rows) plus its drafting."""
        lo = int(self.rows)
        forward = step_s(lo) + (self.rows - lo) * (step_s(lo + 1) - step_s(lo))
        return self.tokens / (forward + self.draft_s)


def prefer_tree(chain: AcceptanceEstimator, tree: AcceptanceEstimator, k: int, step_s: Callable[[int], float],
                chain_len: int | None = None, measured: tuple[ShapeRecord, ShapeRecord] | None = None) -> bool:
    """The draft shape of one request at up to k draft positions ("draft_tree": "auto"): True for a tree.

    Once each shape has SHAPE_MEASURED steps in `measured` (chain, tree), the shape whose steps committed more
    tokens per second wins: their measured tokens per step over the step's time at their measured rows plus their
    measured drafting time per step (what the estimates below model, with the policy's cuts, steps it drafted
    nothing in and a drafter's own stops included). Before that, from the estimates: a tree puts its k nodes into
    the step's forward; a chain its `chain_len` tokens (k where None; fewer for a drafter that stops its own
    drafts where its confidence falls: what its proposals have measured). `step_s(n)` is the step's time with n
    draft rows of this request. The shapes
    differ in the tokens a step is expected to commit, 1 + sum over depths j of P(depth j is reached) (each
    shape's own online estimate, `position_survival`, up to its rows), in the rows verified and in drafting time,
    what each shape's measured proposals say its tokens cost. A tie keeps the chain.
    """
    if measured is not None and min(r.steps for r in measured) >= SHAPE_MEASURED:
        done_chain, done_tree = measured
        return done_tree.rate(step_s) > done_chain.rate(step_s)
    n_chain = k if chain_len is None else max(1, min(k, chain_len))

    def rate(e: AcceptanceEstimator, n: int) -> float:
        return (1 + sum(e.position_survival(n))) / (step_s(n) + e.draft_cost(n))

    return rate(tree, k) > rate(chain, n_chain)
