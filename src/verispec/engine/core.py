"""The engine: continuous batching with speculative decoding of many requests in one target forward per step.

`Engine.step` runs named stages:
  1. admit     - preempt the newest requests while the next step's KV blocks would not fit; waiting requests
                 take a sequence in the paged cache while their blocks fit (past their prefix-cache hits);
  2. plan      - one token for every decoding request (its pending last token), then prefill chunks of the
                 requests still prefilling, under the step's token budget (chunked prefill) -> a `StepPlan`;
  3. draft     - the policy sets draft lengths, drafters propose, the policy sets how much of each to verify;
  4. forward   - ONE target forward over the ragged batch of every request's block (the model runner);
  5. prefill   - commit the prefill chunks' KV;
  6. verify    - per decoding request: the verification rule, commit the KV of every accepted position
                 (the rest rolls back), drafter feedback, emit tokens.
Requests join and leave at every step. With a single request this is plain or speculative single-stream
decoding: the same code, so every path samples from the same processed distribution.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from verispec.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_SPECULATIVE_TOKENS
from verispec.drafters import DrafterFactory
from verispec.drafters.base import Drafter, needs_features
from verispec.engine.admission import RequestTooLong, admission_blocks, check_room, step_blocks
from verispec.engine.acceptance import PROBE_SHARE, AcceptanceEstimator
from verispec.engine.counters import SpecCounters, StepClock, StepTiming
from verispec.engine import constrain
from verispec.engine.draft_timing import DraftTiming
from verispec.engine.prefix import PrefixSharing
from verispec.engine.plan import LiveRequest, StepPlan, TokenCallback, drafter_traits, model_side, plan_step
from verispec.engine.scheduler import Candidate, Policy
from verispec.engine.stops import Detokenize, StopMatcher
from verispec.execution.hidden_states import check_layers, record_hidden_states, record_layers
from verispec.sampling.logprobs import record_logprobs
from verispec.sampling.processor import ProcessorFactory, needs_processor
from verispec.execution.runner import BatchOutput, Block, ModelRunner
from verispec.execution.tree_verify import verify_tree
from verispec.execution.thread_governor import ThreadGovernor
from verispec.execution.verify import EXACT, AcceptanceConfig, Verdict, verify
from verispec.models.llama import LlamaModel
from verispec.models.tree import TreeDraft
from verispec.state.paged_kv import PagedKVCache
from verispec.state.request import Request

__all__ = ["Engine", "EngineConfig", "RequestTooLong", "SpecCounters", "TokenCallback"]

log = logging.getLogger(__name__)

StateCheck = Callable[[Request, "Drafter | None"], None]


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # requests decoding at once (= cache slots)
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # tokens in one forward: decode blocks + prefill chunks
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS  # K, the most draft tokens per request and step
    draft_tree: bool | str = False  # drafters that can propose trees of K nodes (depth <= K) do; "auto": per step
    probe_share: float = PROBE_SHARE  # a dear drafter's probes: at most this share of the plain steps' time
    adaptive_threads: int = 0  # > 0: up to this many CPU threads, the count per step measured (thread_governor.py)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        cache: PagedKVCache,
        drafters: DrafterFactory,
        policy: Policy,
        eos_ids: frozenset[int],
        config: EngineConfig = EngineConfig(),
        rule: AcceptanceConfig = EXACT,
        check_state: StateCheck | None = None,
        detokenize: Detokenize | None = None,  # output ids -> text, for stop strings (as the final text decodes)
        processors: ProcessorFactory | None = None,  # structured outputs and sampling controls (engine/constrain.py)
    ) -> None:
        self.processors = processors
        assert len(cache.slots) >= config.max_num_seqs, "the cache needs one slot per running request"
        self.detokenize = detokenize
        self.model, self.cache, self.drafters, self.policy = model, cache, drafters, policy
        self.eos_ids, self.config, self.rule, self.check_state = eos_ids, config, rule, check_state
        governor = ThreadGovernor(config.adaptive_threads) if config.adaptive_threads > 0 else None
        self.runner = ModelRunner(model, cache, drafters.feature_layers, governor)
        self.prefix = PrefixSharing(cache, drafters.feature_layers)
        self.waiting: deque[tuple[Request, TokenCallback | None]] = deque()
        self.running: list[LiveRequest] = []
        self.counters = SpecCounters()
        self.clock = StepClock()
        self.num_finished = 0
        self.num_preemptions = 0
        self._preempted: dict[str, LiveRequest] = {}  # request id -> its state while it waits to be readmitted
        # the drafter's time per proposal as the latest request to measure it left it: a new request starts from
        # it (unknown, its first draft would be priced as free and take the whole limit)
        self._draft_timing = DraftTiming()
        self._model_timing = DraftTiming()  # a hybrid drafter's model side's

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, req: Request, on_tokens: TokenCallback | None = None) -> None:
        self.check_fits(req)
        self.waiting.append((req, on_tokens))

    def check_fits(self, req: Request) -> None:
        """Raise ValueError for a request this engine can never run: too long, or stop strings without a tokenizer."""
        if req.params.stop and self.detokenize is None:
            raise ValueError("stop strings need the model's tokenizer to decode the output, and this engine has none "
                             "(a checkpoint without tokenizer files); use stop_token_ids instead")
        check_layers(req, self.model.cfg.num_layers)
        if needs_processor(req.params):
            if self.processors is None:
                raise ValueError("structured outputs and sampling controls need an engine built with processors")
            self.processors.validate(req.params)
        check_room(req, self.cache)

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason "abort"; its slot is freed at the next step. False if unknown."""
        for i, (req, cb) in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                self._preempted.pop(request_id, None)
                req.finish_reason = "abort"
                self.num_finished += 1
                if cb is not None:
                    cb(req, [])
                return True
        for live in self.running:
            if live.req.request_id == request_id:
                live.aborted = True
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_tokens(self) -> int:
        return sum(self.cache.length(live.req.slot) for live in self.running if live.req.slot is not None)

    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (cached prefix blocks, free to evict, not counted)."""
        return self.cache.pool.num_used / self.cache.pool.num_blocks

    def run_to_completion(self) -> None:
        while self.has_work():
            self.step()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> None:
        t_start = time.perf_counter()
        self._reap()
        self._admit()
        if not self.running:
            return
        plan = plan_step(self.running, self.config.max_num_batched_tokens)
        self._draft(plan)
        t_forward = time.perf_counter()
        blocks = self._blocks(plan)
        recorded = record_layers([lv.req for lv in plan.decode] + [c.live.req for c in plan.prefill])
        out = self.runner.run(blocks, recorded)
        t_out = time.perf_counter()
        draft_s = sum(lv.draft_s for lv in plan.decode)
        timing = StepTiming(sched_s=t_forward - t_start - draft_s, forward_s=t_out - t_forward)
        rows = sum(len(b.tokens) for b in blocks)
        if not plan.prefill:  # what the policies ask the costs about: decode rows and their drafts alone
            self.policy.observe_step(rows, len(blocks), timing.forward_s)
        self._commit_prefill(plan, out)
        for i, lv in enumerate(plan.decode):
            try:
                self._verify_and_commit(lv, out, i, timing)
            except AssertionError:  # a broken invariant (or the state oracle): the engine's state is suspect
                raise
            except Exception as exc:  # noqa: BLE001 - only this request fails; the batch goes on
                self._fail_request(lv, exc)
        self._reap()
        self.clock.record(rows, schedule=max(0.0, timing.sched_s), draft=draft_s, forward=timing.forward_s,
                          commit=time.perf_counter() - t_out)

    def _fail_request(self, lv: LiveRequest, exc: Exception) -> None:
        """Verifying or committing one request failed (e.g. its sampling): it alone finishes with "error" and the
        message, and the step's `_reap` releases it as on abort (slot, KV, drafter). Only a failure of the shared
        forward, or a broken invariant, fails every request (the caller's `fail_all`)."""
        log.warning("request %s failed while verifying: %s: %s", lv.req.request_id, type(exc).__name__, exc,
                    exc_info=exc)
        lv.req.finish_reason, lv.req.error = "error", f"{type(exc).__name__}: {exc}"
        if lv.on_tokens is not None:
            lv.on_tokens(lv.req, [])

    def _draft(self, plan: StepPlan) -> None:
        """Policy lengths before drafting, the drafters' proposals, the policy's cut before verification; then, for
        hybrid drafters whose model-free draft the policy cut to nothing, the same for their model drafters (each
        side with its own estimate; the second stage weighs its drafts against the decode rows as the first does)."""
        for lv in plan.decode:
            lv.clear_draft()
            lv.model_free_side()
        spec = plan.speculating
        if not spec:
            return
        budget = self._draft_stage(spec, plan.base_tokens, plan.draft_budget)
        second = [lv for lv in spec if lv.other is not None and not lv.draft.tokens and lv.drafter is not None]
        if second:
            for lv in second:
                lv.switch_side()
            self._draft_stage(second, plan.base_tokens, budget)

    def _draft_stage(self, spec: list[LiveRequest], base_tokens: int, budget: int) -> int:
        """One drafting stage over `spec` with `budget` draft tokens left in the step; returns what is left."""
        limits = [self._limit(lv) for lv in spec]
        if self.config.draft_tree == "auto":
            for lv, k in zip(spec, limits):
                lv.choose_shape(k, lambda n: self.policy.step_seconds(base_tokens + n, base_tokens))
        cands = [Candidate(k, lv.shape_estimator, lv.probe, lv.confidences and not lv.tree_now, lv.one_pass,
                           lv.stops_early and not lv.tree_now) for lv, k in zip(spec, limits)]
        lengths, floors = self.policy.draft_lengths(cands, base_tokens), self.policy.survival_floors(cands, base_tokens)
        proposals = [constrain.propose(lv, k, f, lim) for lv, k, f, lim in zip(spec, lengths, floors, limits)]
        if not any(d.tokens for d in proposals):  # speculation off this step: nothing for the policy to cut
            return budget
        keep = self.policy.verify_lengths(cands, proposals, base_tokens)
        for lv, d, n in zip(spec, proposals, keep):
            n = max(0, min(n, budget))
            budget -= n
            lv.draft = d.head(n)
            lv.shadow = d.tokens[0] if d.tokens and not n else None  # drafted, none verified (see `_account`)
        return budget

    def _limit(self, lv: LiveRequest) -> int:
        r = lv.req
        left = r.params.max_tokens - len(r.output_ids) - 1
        room = self.cache.max_len - r.num_computed - 1
        return max(0, min(self.config.num_speculative_tokens, left, room))

    def _blocks(self, plan: StepPlan) -> list[Block]:
        """The flat batch: each decoding request's [pending last token, draft...], then the prefill chunks."""
        blocks = []
        for lv in plan.decode:
            r, slot = lv.req, lv.req.slot
            assert slot is not None
            r.check(self.cache.length(slot))
            blocks.append(Block(slot, r.num_computed, [r.all_ids[r.num_computed]] + lv.draft.tokens, logits=True,
                                tree=lv.draft.parents if lv.draft.tokens else None))
        for c in plan.prefill:
            r, slot, start = c.live.req, c.live.req.slot, c.live.req.num_computed
            assert slot is not None
            # the prompt (and, recomputing after a preemption, the output so far)
            blocks.append(Block(slot, start, r.all_ids[start : start + c.length], logits=False))
        return blocks

    def _commit_prefill(self, plan: StepPlan, out: BatchOutput) -> None:
        done = time.perf_counter()
        for i, c in enumerate(plan.prefill, start=len(plan.decode)):
            lv = c.live
            self.cache.commit(lv.req.slot, c.length)  # type: ignore[arg-type]
            self.prefix.keep(lv.req, out, i, c.length)
            lv.req.num_computed += c.length
            if needs_features(lv.drafter):
                lv.drafter.add_features(out.features(i))  # type: ignore[union-attr]
            record_hidden_states(lv.req, out, i)
            if lv.prefilled:
                lv.req.stats.prefill_s = done - lv.req.start_time

    def _verify_and_commit(self, lv: LiveRequest, out: BatchOutput, block: int, timing: StepTiming) -> None:
        """Decode block `block` of the batch belongs to `lv`: verify its draft, keep the accepted positions."""
        d = lv.draft
        t_verify = time.perf_counter()
        rows = None  # a tree's: the block rows of the root and the accepted path (KV kept, logits emitted from)
        position = len(lv.req.all_ids)  # of the token the block's first row predicts (seeded noise is keyed by it)
        logits = constrain.process(lv, out.logits(block))  # the grammar's mask and the controls, row by row
        if d.parents is not None and d.tokens:
            tv = verify_tree(TreeDraft(tuple(d.tokens), d.parents, d.probs), logits, lv.req.params,
                             lv.generator, position)
            verdict, rows = Verdict(tv.accepted, tv.tokens), [0] + [1 + n for n in tv.path]
        else:
            verdict = verify(d.tokens, d.probs, logits, lv.req.params, lv.generator, self.rule, position)
        t_state = time.perf_counter()
        self._commit(lv, verdict, out, block, rows)
        first = not lv.req.output_ids
        kept = lv.req.append(verdict.tokens, self.eos_ids)
        constrain.commit(lv, kept)
        record_logprobs(lv.req, out, block, kept, rows)  # only when the request asked for logprobs
        if lv.stops is not None and kept:
            kept = lv.stops.apply(lv.req, kept)
        if not first:  # the first step finishes the prefill; it is not a decode step
            self._account(lv, verdict, timing, verify_s=t_state - t_verify, state_s=time.perf_counter() - t_state)
        if lv.on_tokens is not None and kept:
            lv.on_tokens(lv.req, kept)
        if self.check_state is not None and not lv.req.finished:
            self.check_state(lv.req, lv.drafter)
            constrain.check_state(lv, self.processors)

    def _commit(self, lv: LiveRequest, verdict: Verdict, out: BatchOutput, block: int,
                rows: list[int] | None = None) -> None:
        """KV of the pending token and the accepted drafts (a tree's accepted `rows`, moved into place); the drafter
        hears the verdict, then gets features."""
        n = verdict.accepted + 1
        if rows is None:
            self.cache.commit(lv.req.slot, n)  # type: ignore[arg-type]
        else:
            self.cache.commit_rows(lv.req.slot, rows)  # type: ignore[arg-type]
        self.prefix.keep(lv.req, out, block, n, rows)
        lv.req.num_computed += n
        if lv.proposed:  # even when none of the draft was verified
            lv.drafter.observe(verdict.accepted)  # type: ignore[union-attr]
        if needs_features(lv.drafter):
            lv.drafter.add_features(out.features(block, n, rows))  # type: ignore[union-attr]
        record_hidden_states(lv.req, out, block, n, rows)

    def _account(self, lv: LiveRequest, verdict: Verdict, timing: StepTiming, *, verify_s: float,
                 state_s: float) -> None:
        """The acceptance estimate, the probe schedule, per-request and engine-wide counters."""
        g = len(lv.draft.tokens)
        if constrain.learns(lv):
            lv.learn(verdict.accepted, verdict.tokens[0], timing.forward_s, lv.forced_tail)
        lv.req.spec.record(g, verdict.accepted, draft_s=lv.draft_s, forward_s=timing.forward_s, verify_s=verify_s,
                           sched_s=timing.sched_s, state_s=state_s)
        lv.req.spec.record_drift(verdict.relaxed, verdict.tv_sum, verdict.tv_positions)
        if lv.on_model:  # a hybrid's model side drafted this step (the rest of its drafts are the model-free side's)
            lv.req.spec.record_model_side(g, verdict.accepted)
        self.counters.record(g, verdict.accepted)

    # ---- admission and release ------------------------------------------------------------------
    def _admit(self) -> None:
        """Preempt the newest running requests while their next step's KV blocks would not fit; then admit waiting
        requests, first come first served, while theirs fit too (engine/admission.py)."""
        while len(self.running) > 1 and self._step_blocks() > self.cache.pool.num_free:
            self._preempt(self.running[-1])
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req, cb = self.waiting[0]
            hits = self.prefix.hits(req)
            if self.prefix.pending(req, len(hits), self.running):
                return  # a running request is computing blocks this one shares: wait until they are cached
            need = admission_blocks(req, self.cache, hits, self.config.num_speculative_tokens)
            if self.running and self._step_blocks() + need > self.cache.pool.num_free:
                return
            self.waiting.popleft()
            self._start(req, cb, hits)

    def _step_blocks(self) -> int:
        return step_blocks(self.running, self.cache, self.config.max_num_batched_tokens, self._limit)

    def _start(self, req: Request, cb: TokenCallback | None, hits: list[int]) -> None:
        """Give the request its sequence in the cache (starting past its prefix hits) and a new drafter; a
        preempted request gets its own engine state back (sampling generator, estimator, stop matcher)."""
        p = req.params
        req.spec.lossy = self.rule.lossy and not p.greedy
        drafter = None
        queried = len(req.prompt_ids) if self.prefix.shares(req) else 0
        try:
            req.slot = self.cache.allocate(req.prompt_ids, hits, queried)
            req.num_computed = self.cache.length(req.slot)
            drafter = self.drafters.new(p, len(req.prompt_ids))
            self.prefix.feed(drafter, req, hits)
        except BaseException:
            if req.slot is not None:
                self.cache.free(req.slot)
                req.slot, req.num_computed = None, 0
            self.waiting.appendleft((req, cb))
            raise
        live = self._preempted.pop(req.request_id, None)
        if live is not None:
            live.model_free_side()
            live.drafter = drafter
            for est in (live.estimator, *([live.other.estimator] if live.other else [])):
                est.proposals_timed = 0  # the new drafter's first proposal catches up on everything again
            live.clear_draft()
        else:
            gen = None if p.greedy else p.make_generator(self.model.device)
            est = AcceptanceEstimator(timing=self._draft_timing.copy(), probe_share=self.config.probe_share)
            live = LiveRequest(req, drafter, est, gen, cb, tree_now=self.config.draft_tree is True,
                               **drafter_traits(drafter),
                               other=model_side(drafter, self._model_timing, self.config.probe_share))
            req.spec.hybrid = live.other is not None
            req.stats.queue_s = time.perf_counter() - req.start_time
            if self.processors is not None:
                live.proc = self.processors.new(p, req.prompt_ids)
            if p.stop:  # check_fits saw to a detokenize
                live.stops = StopMatcher(p.stop, p.include_stop_str_in_output, self.detokenize)  # type: ignore
        self.running.append(live)

    def _preempt(self, lv: LiveRequest) -> None:
        """Out of KV blocks: free the request's blocks and drafter and put it back at the front of the queue; when
        readmitted it recomputes its prompt and output so far (a new drafter) and goes on."""
        self.running.remove(lv)
        if lv.drafter is not None:
            lv.drafter.release()
            lv.drafter = None
        self.cache.free(lv.req.slot)  # type: ignore[arg-type]
        lv.req.slot, lv.req.num_computed = None, 0
        lv.req.hidden_rows.clear()  # the recomputation records them again
        self._preempted[lv.req.request_id] = lv
        self.waiting.appendleft((lv.req, lv.on_tokens))
        self.num_preemptions += 1

    def _reap(self) -> None:
        """Release finished and aborted requests: slot, KV and drafter state, all at once."""
        still = []
        for lv in self.running:
            if lv.aborted and not lv.req.finished:
                lv.req.finish_reason = "abort"
                if lv.on_tokens is not None:
                    lv.on_tokens(lv.req, [])
            if lv.req.finished:
                self._release(lv)
            else:
                still.append(lv)
        self.running = still

    def _release(self, lv: LiveRequest) -> None:
        lv.model_free_side()
        drafted = lv.drafter is not None
        self._draft_timing = self._draft_timing.handed_on(lv.estimator.timing, lv.estimator.proposals_timed, drafted)
        if lv.other is not None:
            est = lv.other.estimator
            self._model_timing = self._model_timing.handed_on(est.timing, est.proposals_timed, drafted)
        if lv.drafter is not None:
            lv.drafter.release(lv.req.all_ids)  # the whole stream: steps without a draft called no drafter
        if lv.req.slot is not None:
            self.prefix.finish(lv.req)
            self.cache.free(lv.req.slot)
        self.num_finished += 1

    def fail_all(self, message: str) -> list[Request]:
        """After an engine error: finish every request with `message` as its error, free everything."""
        failed = [lv.req for lv in self.running] + [r for r, _ in self.waiting]
        for lv in self.running:
            lv.req.finish_reason, lv.req.error = "error", message
            try:
                self._release(lv)
            except Exception:  # noqa: BLE001 - keep freeing the others
                pass
            if lv.on_tokens is not None:
                lv.on_tokens(lv.req, [])
        for req, cb in self.waiting:
            req.finish_reason, req.error = "error", message
            if cb is not None:
                cb(req, [])
        self.running, self.waiting = [], deque()
        self._preempted.clear()
        for i in range(len(self.cache.slots)):
            self.cache.free(i)
        return failed
