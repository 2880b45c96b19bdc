"""What one engine step will do, decided before any tensor is touched.

`plan_step` splits the step's token budget: one token for every decoding request (its pending last token),
then prefill chunks for the requests still prefilling, in admission order (chunked prefill). Drafts come
after, from what is left (`StepPlan.draft_budget`). Each running request's engine-side state, including the
draft it carries into this step's forward, lives on its `LiveRequest`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from verispec.drafters.base import EMPTY, Draft
from verispec.drafters.hybrid import HybridDrafter
from verispec.engine.acceptance import AcceptanceEstimator, ShapeRecord, prefer_tree
from verispec.engine.draft_timing import DraftTiming
from verispec.state.request import Request

if TYPE_CHECKING:
    import torch

    from verispec.drafters.base import Drafter
    from verispec.engine.stops import StopMatcher
    from verispec.sampling.processor import RequestProcessor

log = logging.getLogger(__name__)

TokenCallback = Callable[[Request, list[int]], None]
SHAPE_RETRY_EVERY = 8  # with "draft_tree": "auto", every 8th speculating step drafts the shape not preferred


@dataclass
class Side:
    """One side of a hybrid drafter (drafters/hybrid.py) while the other drafts: its acceptance estimate, probe
    schedule and traits, kept aside."""

    estimator: AcceptanceEstimator
    probe: bool = False
    confidences: bool = True
    one_pass: bool = False
    stops_early: bool = False


def drafter_traits(drafter: "Drafter | None") -> dict[str, bool]:
    """What the policies read of a drafter (drafters/base.py), as `Side` / `LiveRequest` fields: whether it may give
    confidences, drafts in one pass, stops early."""
    return {"confidences": getattr(drafter, "gives_confidence", True),
            "one_pass": getattr(drafter, "drafts_in_one_pass", False),
            "stops_early": getattr(drafter, "stops_early", False)}


def model_side(drafter: "Drafter | None", timing: DraftTiming, probe_share: float) -> Side | None:
    """A hybrid drafter's model side: its own estimate, seeded with `timing`, the last finished request's model
    drafting time (the model-free side's would price a model's pass as microseconds); None for other drafters."""
    if not isinstance(drafter, HybridDrafter):
        return None
    est = AcceptanceEstimator(timing=timing.copy(), probe_share=probe_share)
    return Side(est, **drafter_traits(drafter.model))


@dataclass
class LiveRequest:
    """Engine-side state of one admitted request, including this step's draft."""

    req: Request
    drafter: "Drafter | None"
    estimator: AcceptanceEstimator
    generator: "torch.Generator | None"
    on_tokens: TokenCallback | None
    probe: bool = False  # the estimator asked for a short probe this step
    confidences: bool = True  # its drafter may give per-position confidences (False: it says it never does, or a
    # draft came without)
    one_pass: bool = False  # its drafter drafts any number of tokens in one pass (`drafts_in_one_pass`)
    stops_early: bool = False  # its drafter stops where its confidences' product falls below a floor (`stops_early`)
    aborted: bool = False
    # this step's speculation, reset by `clear_draft` at the start of every step
    draft: Draft = EMPTY  # the part of the proposal that goes into the forward
    draft_s: float = 0.0  # seconds its drafter spent proposing
    proposed_tokens: int = 0  # tokens its drafter proposed (up to k; its drafting time is per proposed token)
    shadow: int | None = None  # the first drafted token when the policy verified none of the draft
    stops: "StopMatcher | None" = None  # the request's stop strings, checked on its text after every commit
    # draft shape: a tree this step (always with "draft_tree": true); with "auto", trees keep their own estimate
    tree_now: bool = False
    tree_estimator: AcceptanceEstimator | None = None
    shape_steps: int = 0  # steps in a row in the preferred shape (the other is retried every SHAPE_RETRY_EVERY)
    # what the request's chain and tree steps did ("auto" compares them once both are measured)
    shape_records: tuple[ShapeRecord, ShapeRecord] = field(default_factory=lambda: (ShapeRecord(), ShapeRecord()))
    # a hybrid drafter's side not drafting now (its model drafter, or while that drafts its model-free one): the
    # engine's second drafting stage switches to it where the policy verified none of the model-free draft
    other: Side | None = None
    on_model: bool = False  # switched to the hybrid's model drafter for this step
    # structured outputs / sampling controls (sampling/processor.py, engine/constrain.py): its processor, and how
    # many of this step's draft tokens the grammar forced before the drafter's chain and after it
    proc: "RequestProcessor | None" = None
    forced: int = 0
    forced_tail: int = 0

    @property
    def prefilled(self) -> bool:
        # every token but the last computed (after a preemption: the prompt and the output so far)
        return self.req.num_computed >= len(self.req.prompt_ids) + len(self.req.output_ids) - 1

    @property
    def speculates(self) -> bool:
        """Decoding, has a drafter, and is past its first token (the first step finishes the prefill)."""
        return self.drafter is not None and self.prefilled and bool(self.req.output_ids)

    @property
    def shape_estimator(self) -> AcceptanceEstimator:
        """The acceptance estimate of this step's draft shape (chains and the switch "draft_tree": true share one)."""
        return self.tree_estimator if self.tree_now and self.tree_estimator is not None else self.estimator

    def choose_shape(self, k: int, step_s: Callable[[int], float]) -> None:
        """"draft_tree": "auto": this step's shape by `prefer_tree` (`step_s(n)`: the step's seconds with n draft
        rows of this request), except that every SHAPE_RETRY_EVERY-th step takes the other one, so that its estimate
        follows the request (a shape never tried would keep its prior). A chain is priced at the mean length of its
        measured proposals (a drafter that stops itself, or finds nothing more, proposes fewer than k)."""
        if self.tree_estimator is None:  # its drafting time starts from the chains' (unknown would be free)
            self.tree_estimator = AcceptanceEstimator(timing=self.estimator.timing.copy(),
                                                        probe_share=self.estimator.probe_share)
        moments = self.estimator.timing.moments
        chain_len = None if moments is None else round(moments[0])
        best = prefer_tree(self.estimator, self.tree_estimator, k, step_s, chain_len, self.shape_records)
        self.shape_steps += 1
        if self.shape_steps >= SHAPE_RETRY_EVERY:
            best, self.shape_steps = not best, 0
        self.tree_now = best

    def propose(self, k: int, floor: float = 0.0, after: Sequence[int] = ()) -> Draft:
        """Ask the request's drafter for up to k tokens (a tree in tree steps), timing it; the proposal is cut to k.
        floor: the survival below which a drafter that `stops_early` stops (0: it drafts k). after: tokens certain
        to follow the output (the grammar's forced ones), which the drafter continues (chains of a drafter that
        `reads_context_only`).
        A drafter that raises is dropped (`drop_drafter`) and EMPTY returned; a broken invariant propagates."""
        if k <= 0:
            return EMPTY
        t = time.perf_counter()
        try:
            if self.tree_now and hasattr(self.drafter, "propose_tree"):
                tree = self.drafter.propose_tree(self.req.all_ids, k, k)  # type: ignore[union-attr]
                d = Draft(list(tree.tokens), tree.probs, parents=tree.parents)
            else:
                context = self.req.all_ids + list(after) if after else self.req.all_ids
                if floor > 0 and self.stops_early:
                    d = self.drafter.propose(context, k, min_survival=floor)  # type: ignore[call-arg]
                else:
                    d = self.drafter.propose(context, k)  # type: ignore[union-attr]
        except AssertionError:  # a broken invariant: the engine's state is suspect
            raise
        except Exception as exc:  # noqa: BLE001 - only this request's drafter failed: it decodes on without one
            self.drop_drafter(exc)
            return EMPTY
        self.draft_s = time.perf_counter() - t
        self.proposed_tokens = min(len(d.tokens), k)
        if d.tokens and d.parents is None:  # a chain's: trees carry none, and say nothing of the chains'
            self.confidences = d.confidence is not None
        return d.head(k)

    def drop_drafter(self, exc: Exception) -> None:
        """The drafter raised while proposing: the request goes on as plain decoding (the output is the target's
        either way), the drafter is released, and the error is kept in the request's stats and logged."""
        log.warning("drafter of request %s failed, decoding on without speculation: %s: %s", self.req.request_id,
                    type(exc).__name__, exc, exc_info=exc)
        self.req.stats.drafter_error = f"{type(exc).__name__}: {exc}"
        drafter, self.drafter = self.drafter, None
        try:
            drafter.release()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - already failed; nothing more to free
            log.debug("release of a failed drafter raised", exc_info=True)

    def clear_draft(self) -> None:
        self.draft, self.draft_s, self.proposed_tokens, self.shadow = EMPTY, 0.0, 0, None

    def switch_side(self) -> None:
        """A hybrid drafter's other side drafts from now on (this step's model-free draft, cut to nothing, is
        forgotten): its estimate, probes and traits swap with the ones in use, and the drafter proposes from it."""
        assert self.other is not None, "only a hybrid drafter has two sides"
        mine = Side(self.estimator, self.probe, self.confidences, self.one_pass, self.stops_early)
        o = self.other
        self.estimator, self.probe, self.confidences, self.one_pass = o.estimator, o.probe, o.confidences, o.one_pass
        self.stops_early = o.stops_early
        self.other, self.on_model = mine, not self.on_model
        if self.drafter is not None:
            self.drafter.use_model = self.on_model  # type: ignore[attr-defined]
        self.clear_draft()

    def model_free_side(self) -> None:
        """Back to the hybrid's model-free side (each step starts there)."""
        if self.on_model:
            self.switch_side()

    @property
    def proposed(self) -> bool:
        """The drafter proposed tokens, so it must hear the verdict (even if none was verified)."""
        return self.proposed_tokens > 0

    def learn(self, accepted: int, committed: int, step_s: float = 0.0, tail: int = 0) -> None:
        """After verification, for a request with a drafter: its drafting time, the acceptance estimate of this
        step's draft shape, and the probe schedule. committed: the token the target committed at the draft's first
        position; step_s: the step's forward time; tail: draft tokens after the drafter's (a grammar's forced
        ones), which say nothing of it."""
        g = len(self.draft.tokens) - tail
        accepted = min(accepted, g)
        if self.tree_estimator is not None:  # "draft_tree": "auto" (`choose_shape`) compares the shapes' records
            self.shape_records[self.tree_now].observe(g, accepted if g else 0, self.draft_s)
        if self.proposed:
            self.shape_estimator.observe_draft(self.proposed_tokens, self.draft_s)
        if g:
            self.shape_estimator.update(g, accepted)
            self.probe = False
        elif self.shadow is not None:
            # drafted but none of it verified (the drafter's own confidences said no): whether its first token is
            # the one the target committed there is still seen, and counts as one verified position, so an estimate
            # drafting never proves wrong cannot keep a drafter running every step for nothing (for sampled
            # requests a match understates acceptance: the estimate errs toward not drafting)
            self.shape_estimator.update(1, int(committed == self.shadow))
            self.probe = False
        else:
            self.probe = self.estimator.plain_step(step_s)


@dataclass(frozen=True)
class PrefillChunk:
    live: LiveRequest
    length: int  # prompt tokens of this request computed in this step


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[LiveRequest, ...]  # one block each: [pending last token, draft...]
    prefill: tuple[PrefillChunk, ...]  # after the decode blocks in the flat batch
    draft_budget: int  # tokens of the step's budget left for drafts

    @property
    def base_tokens(self) -> int:
        """What the policies weigh drafts against: the decode rows alone, one per decoding request. A prefill chunk
        in the same forward is work of its own: counted in, it would make every draft token look nearly free next to
        it and be verified even where, on a compute-bound machine, it costs more than it could gain."""
        return len(self.decode)

    @property
    def speculating(self) -> list[LiveRequest]:
        return [lv for lv in self.decode if lv.speculates]


def plan_step(running: Sequence[LiveRequest], max_tokens: int) -> StepPlan:
    """Budget `max_tokens` for one step: decode tokens first, then prefill chunks in order."""
    decode = tuple(lv for lv in running if lv.prefilled)
    budget = max_tokens - len(decode)
    prefill = []
    for lv in running:
        if lv.prefilled or budget <= 0:
            continue
        n = min(len(lv.req.prompt_ids) + len(lv.req.output_ids) - 1 - lv.req.num_computed, budget)
        prefill.append(PrefillChunk(lv, n))
        budget -= n
    return StepPlan(decode, tuple(prefill), budget)
