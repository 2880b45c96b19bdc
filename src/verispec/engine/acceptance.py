"""How well a request's drafts do: per-request acceptance estimates, probes after plain steps, and the choice
between a chain and a tree by what each shape committed.

Pure arithmetic over numbers: no torch, no model. The scheduling policies (engine/scheduler.py) turn these into a
number of draft tokens per request and step: E[tokens committed | k] = (1 - a^(k+1)) / (1 - a) for an acceptance
estimate a (docs/methods.md sections 1 and 8), against the step costs of engine/costs.py. A short probe every few
plain steps keeps the estimate alive, so a request whose drafts start matching again gets speculation back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from verispec.engine.draft_timing import DraftTiming


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
