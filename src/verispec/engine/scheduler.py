"""Speculation policies: how many draft tokens each running request proposes and how many get verified.

A policy decides and never touches tensors. Each step, in two calls:
  draft_lengths(cands)          -> how many tokens to ask each request's drafter for (before drafting);
  verify_lengths(cands, drafts) -> how many of each draft go into the batched target forward (after drafting,
                                   before verification: only pre-verification information is used, so the
                                   choice cannot bias the output distribution).

  static  - every request drafts and verifies K tokens (its limit permitting).
  goodput - SmartSpec (docs/methods.md section 8): choose per-request lengths that maximise expected committed
            tokens per second of the batched step, from the profiled step-cost table and each request's
            acceptance estimate; 0 where speculation does not pay.
  dspark  - the DSpark prefix scheduler (docs/methods.md section 6): draft K, then admit (request, position) pairs
            by survival (product of per-position confidences, from the drafter or an online estimator) and keep
            the prefix of that ordering with the highest Theta = (R + sum a) * SPS(B). DSpark stops at Theta's
            first drop instead (`first_drop=True`); where the first verified token costs more than the next ones
            (as on a CPU, docs/results/cost_model.md), that stops before drafts that pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from verispec.engine.acceptance import AcceptanceEstimator

from verispec.engine.costs import MeasuredStepCosts, StepCosts


@dataclass(frozen=True)
class Candidate:
    """One running request that decodes this step."""

    limit: int  # most draft tokens it may take (max K, tokens left - 1, cache room)
    estimator: AcceptanceEstimator
    probe: bool = False  # the estimator asks for a short probe this step
    confidences: bool = True  # its drafter may give per-position confidences (False once a draft came without)
    one_pass: bool = False  # its drafter drafts any number of tokens in one pass (a block drafter: DFlash, DSpark)
    stops_early: bool = False  # its drafter drafts token by token and stops below a survival floor (EAGLE-3)


class Proposal(Protocol):
    """What a policy reads of a draft (drafters' `Draft` has it): its tokens and optional confidences."""

    tokens: list[int]  # [g]
    confidence: list[float] | None  # [g] P(position i survives), or None


class Policy(Protocol):
    """A speculation policy: two decisions per step, from numbers only."""

    name: str

    def draft_lengths(self, cands: Sequence[Candidate], base_tokens: int) -> list[int]:
        """Tokens to ask each candidate's drafter for, before drafting."""
        ...

    def survival_floors(self, cands: Sequence[Candidate], base_tokens: int) -> list[float]:
        """Per candidate, the survival below which a drafter that stops early stops drafting (0: draft the length)."""
        ...

    def verify_lengths(self, cands: Sequence[Candidate], drafts: Sequence[Proposal], base_tokens: int) -> list[int]:
        """How many of each draft go into the target forward, after drafting and before verification."""
        ...

    def observe_step(self, tokens: int, segments: int, seconds: float) -> None:
        """The step's forward as measured: `tokens` tokens over `segments` sequences took `seconds`."""
        ...

    def step_seconds(self, tokens: int, segments: int) -> float:
        """The cost model's time of a forward over `tokens` rows of `segments` sequences."""
        ...


def admit_prefixes(
    survivals: Sequence[Sequence[float]],
    costs: StepCosts,
    base_tokens: int,
    extra_cost: Sequence[Sequence[float]] | None = None,
    stop_at_first_drop: bool = False,
    margin: float = 0.0,
) -> list[int]:
    """Draft lengths l_r maximising Theta = (B + sum of admitted survivals) / step time.

    survivals[r][j]: P(draft positions 1..j+1 of request r all accepted), non-increasing in j.
    base_tokens: B, the decode rows of the step (one per decoding request, speculating or not; at least R): each
    commits its pending token, and the step's forward runs over B sequences.
    extra_cost[r][j]: seconds that admitting position j of request r adds to the step in drafting (`drafting_costs`);
    absent: nothing (already drafted).
    margin: the verification cost the drafts add to the step is weighed (1 + margin) times over: a draft must be
    expected to beat its measured cost by that factor (0: risk-neutral, the expected-value optimum).
    Pairs are admitted in order of falling survival, so each request's admitted set is a prefix.
    With stop_at_first_drop (DSpark) admission ends at the first pair that lowers Theta; otherwise the best
    prefix of the whole ordering is kept (SmartSpec's argmax).
    """
    R = len(survivals)
    extra = extra_cost or [[0.0] * len(surv) for surv in survivals]
    pairs = sorted((-s, r, j) for r, surv in enumerate(survivals) for j, s in enumerate(surv))
    lengths = [0] * R
    best_lengths = list(lengths)
    gained, tokens, drafting = 0.0, max(base_tokens, R), 0.0
    B = tokens
    base = costs(tokens, B) if R else 0.0
    best = prev = B / base if R else 0.0
    for neg_s, r, j in pairs:
        if j != lengths[r]:  # only extend a prefix (equal survivals sort by position)
            continue
        lengths[r] += 1
        gained += -neg_s
        tokens += 1
        drafting += extra[r][j]
        theta = (B + gained) / (base + (1 + margin) * (costs(tokens, B) - base) + drafting)
        if stop_at_first_drop and theta < prev:
            lengths[r] -= 1
            return lengths
        prev = theta
        if theta > best:
            best, best_lengths = theta, list(lengths)
    return lengths if stop_at_first_drop else best_lengths


def drafting_costs(c: Candidate, whole_blocks: bool) -> list[float]:
    """[c.limit] seconds that admitting each draft position of `c` adds in drafting. A drafter that drafts in one
    pass (a block drafter: its measured seconds per proposal) and, with `whole_blocks`, a drafter with confidences
    (it drafts its whole block once any of it is admitted; the confidences then decide what is verified: what a
    proposal of `limit` tokens costs) cost that block on the first admitted position and nothing after; any other
    drafter drafts what is admitted, or stops itself (`stops_early`): position j adds cost(j) - cost(j - 1) (its
    per-call time on the first)."""
    est = c.estimator
    if c.limit and (c.one_pass or (whole_blocks and c.confidences and not c.stops_early)):
        block = est.draft_cost_per_proposal if c.one_pass else est.draft_cost(c.limit)
        return [block] + [0.0] * (c.limit - 1)
    per_call, per_token = est.timing.line()  # cost(j) = per_call + per_token x j, fitted once for all positions
    return [per_call + per_token] + [per_token] * (c.limit - 1) if c.limit else []


RISK_MARGIN = 0.5  # how much more than its measured cost a draft must be expected to return (see admit_prefixes)


class _CostAware:
    """A policy over a cost model. `margin` > 0 makes it risk-averse: the step costs are measured on a noisy machine
    and a request's survival is estimated from a few positions, so a draft that only breaks even in expectation
    loses to speculation off about half the time; at a saturated batch, where every draft is marginal, such drafts
    are what made dspark slower than off. Where drafts clearly pay (an idle batch, a good drafter) the margin
    changes little."""

    def __init__(self, costs: StepCosts | MeasuredStepCosts, margin: float = RISK_MARGIN) -> None:
        self.costs = costs
        self.margin = margin
        self._pays: dict[tuple, bool] = {}  # nothing_pays by (limit, rows, margin), for the costs' `version`
        self._pays_version = -1

    def draft_lengths(self, cands: Sequence[Candidate], base_tokens: int) -> list[int]:
        return [c.limit for c in cands]  # every candidate drafts its limit

    def verify_lengths(self, cands: Sequence[Candidate], drafts: Sequence[Proposal], base_tokens: int) -> list[int]:
        return [len(d.tokens) for d in drafts]  # everything drafted is verified

    def observe_step(self, tokens: int, segments: int, seconds: float) -> None:
        observe = getattr(self.costs, "observe", None)  # MeasuredStepCosts corrects its profile; a plain table not
        if observe is not None:
            observe(tokens, segments, seconds)

    def step_seconds(self, tokens: int, segments: int) -> float:
        return self.costs(tokens, segments)

    def survival_floors(self, cands: Sequence[Candidate], base_tokens: int) -> list[float]:
        return [0.0] * len(cands)  # drafters draft the lengths asked for

    def nothing_pays(self, cands: Sequence[Candidate], base_tokens: int) -> bool:
        """True where no block of up to the largest limit would pay even if it were sure to survive: each of its
        tokens adds one committed token for its cost to the step (weighed with the margin). At a saturated batch
        (one more row costs about what a row does) this skips drafting and the admissions
        over every (request, position) pair, whose cost was all speculation did there (nothing drafted leaves the
        verify-time admission no pairs, and one given sure drafts admits none of them). Tokens of several requests
        together are not tried: that they could pay where one request's block cannot needs a cost curve that
        falls per token as blocks grow past a request's limit."""
        k = max((c.limit for c in cands), default=0)
        B = max(base_tokens, len(cands))
        version = getattr(self.costs, "version", 0)  # a fixed table has none: it never changes
        if version != self._pays_version:
            self._pays.clear()
            self._pays_version = version
        key = (k, B, self.margin)
        got = self._pays.get(key)
        if got is None:  # asked every step with the same few answers: cached per version of the costs
            base = self.costs(B, B)
            got = self._pays[key] = all(
                (B + j) * base <= B * (base + (1 + self.margin) * (self.costs(B + j, B) - base))
                for j in range(1, k + 1))
        return got


class StaticPolicy(_CostAware):
    name = "static"


PROBE_SURVIVAL = 0.9  # what a due probe is assumed to achieve per position when its cost is weighed


def _with_probes(cands: Sequence[Candidate], survivals: list[list[float]]) -> list[list[float]]:
    """A due probe enters the admission with optimistic survival for its first positions: it is verified where
    even drafts that good would pay for themselves (an idle batch), and skipped where they would not (a
    saturated one), so probing never costs more than it could gain."""
    out = []
    for c, surv in zip(cands, survivals):
        if c.probe:
            n = min(c.estimator.probe_len, len(surv))
            surv = [max(s, PROBE_SURVIVAL ** (j + 1)) for j, s in enumerate(surv[:n])] + surv[n:]
        out.append(surv)
    return out


class GoodputPolicy(_CostAware):
    name = "goodput"

    def draft_lengths(self, cands: Sequence[Candidate], base_tokens: int) -> list[int]:
        if self.nothing_pays(cands, base_tokens):
            return [0] * len(cands)
        survivals = _with_probes(cands, [c.estimator.iid_survival(c.limit) for c in cands])
        extra = [drafting_costs(c, whole_blocks=False) for c in cands]
        return admit_prefixes(survivals, self.costs, base_tokens, extra, margin=self.margin)


# a draft block costing at most this share of the step is drafted whatever the estimate: a model-free proposal costs
# a small fraction of a step, and a bar set too low gates such drafters on the estimate alone, which verifies too
# little (how 10% was chosen: docs/results/cost_model.md)
FREE_DRAFT_SHARE = 0.10
# drafters that stop early draft every step while the first tokens of all of them together (at their per-token
# time) cost at most this share of the step (the floor ends each chain where it stops paying, so a first token is
# the most a step can waste). Chosen by replaying EAGLE-3's drafts with measured step costs: docs/results/cost_model.md
EARLY_STOP_SHARE = 0.25


class DSparkPolicy(_CostAware):
    name = "dspark"

    def __init__(self, costs: StepCosts | MeasuredStepCosts, margin: float = RISK_MARGIN,
                 first_drop: bool = False) -> None:
        super().__init__(costs, margin)
        self.first_drop = first_drop

    def draft_lengths(self, cands: Sequence[Candidate], base_tokens: int) -> list[int]:
        """Before drafting, survival can only come from the online estimate (and a due probe), with the drafting
        time counted: where that admission takes nothing, nothing is drafted, since drafting it would be wasted
        work (at a saturated batch every token; with a learned drafter, one drafter run per step that costs about a
        target step). Where it takes some, a drafter with confidences drafts its whole block (its confidences then
        decide), one without drafts what the admission took. Drafters with confidences whose whole blocks together
        cost next to nothing (prompt lookup: microseconds against a step of milliseconds) draft them every step:
        the estimate cannot veto a draft its confidences may find worth verifying, and drafting it wastes nothing.
        The share is the batch's, not each request's: sixteen requests each drafting 5% of a step would be 80%.
        Where no draft could pay even if sure to survive (`nothing_pays`), nothing is drafted.
        Drafters that stop early (`survival_floors`) draft every step while their first tokens together cost at most
        EARLY_STOP_SHARE of the step: the estimate learns from verified positions, which their confidences choose,
        and gated on it they drafted too rarely (docs/results/cost_model.md).
        A drafter with confidences whose drafting time was never measured drafts its block until it is (its first
        proposal with tokens): otherwise, where the estimate alone says no (a busy batch), it would never draft,
        never be timed, and never be found free."""
        if self.nothing_pays(cands, base_tokens):
            return [0] * len(cands)
        extra = [drafting_costs(c, whole_blocks=True) for c in cands]
        step = self.costs(base_tokens, base_tokens)
        blocks = [sum(e) for c, e in zip(cands, extra) if c.confidences and c.limit and not c.stops_early]  # seconds
        free = sum(blocks) <= FREE_DRAFT_SHARE * step
        # a first token at the drafter's per-token time: its per-call time is mostly catching up on the positions
        # committed since its last proposal, work that skipping a step defers rather than saves
        early = sum(c.estimator.timing.line()[1] for c in cands if c.stops_early and c.limit) <= EARLY_STOP_SHARE * step
        drafts = [c.confidences and (not c.estimator.draft_cost_per_token or (early if c.stops_early else free))
                  for c in cands]  # whole blocks (a drafter that stops early: up to its floor)
        if all(d or not c.limit for d, c in zip(drafts, cands)):  # the admission could change nothing
            return [c.limit for c in cands]
        survivals = _with_probes(cands, [c.estimator.position_survival(c.limit) for c in cands])
        admitted = admit_prefixes(survivals, self.costs, base_tokens, extra, stop_at_first_drop=self.first_drop,
                                  margin=self.margin)
        return [c.limit if d or (n and c.confidences) else n for c, d, n in zip(cands, drafts, admitted)]

    def survival_floors(self, cands: Sequence[Candidate], base_tokens: int) -> list[float]:
        """For a drafter that stops early: the survival at which one more drafted position stops paying for itself
        at the step's plain rate Theta_0 = B / T(B) (committed tokens per second): s >= Theta_0 x (its drafting
        time per token + (1 + margin) x the verification time a draft row adds, averaged over the limit). A
        position whose survival is below that lowers Theta below speculation off's; Theta_0 is Theta's floor, so
        this drafts at least what the verify-time admission (`verify_lengths`, on the confidences) can take."""
        B = max(base_tokens, len(cands))
        base = self.costs(B, B)
        floors = []
        for c in cands:
            if not (c.stops_early and c.limit):
                floors.append(0.0)
                continue
            per_row = (self.costs(B + c.limit, B) - base) / c.limit
            floors.append(B / base * (c.estimator.timing.line()[1] + (1 + self.margin) * per_row))
        return floors

    def verify_lengths(self, cands: Sequence[Candidate], drafts: Sequence[Proposal], base_tokens: int) -> list[int]:
        survivals = []
        for c, d in zip(cands, drafts):
            g = len(d.tokens)
            if d.confidence is not None:
                surv, s = [], 1.0
                for conf in d.confidence:
                    s *= conf
                    surv.append(s)
                survivals.append(surv)
            else:
                survivals.append(c.estimator.position_survival(g))
        lengths = admit_prefixes(_with_probes(cands, survivals), self.costs, base_tokens,
                                 stop_at_first_drop=self.first_drop, margin=self.margin)
        return [min(n, len(d.tokens)) for n, d in zip(lengths, drafts)]


POLICIES: dict[str, Callable[[StepCosts | MeasuredStepCosts], Policy]] = {
    "static": StaticPolicy,
    "goodput": GoodputPolicy,
    "dspark": DSparkPolicy,
}


def make_policy(name: str, costs: StepCosts | MeasuredStepCosts) -> Policy:
    try:
        return POLICIES[name](costs)
    except KeyError:
        raise ValueError(f"scheduler {name!r} is not one of {sorted(POLICIES)}") from None
