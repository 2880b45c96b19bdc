"""The engine: continuous batching with speculative decoding of many requests in one target forward per step.

Each step:
  1. admit waiting requests while a cache slot is free (one slot per running request, max_model_len long);
  2. give every decoding request one token of the block (its pending last token), then prefill chunks of the
     requests still prefilling, under the step's token budget (chunked prefill);
  3. the policy sets draft lengths; drafters propose; the policy sets how much of each draft to verify;
  4. ONE target forward over the ragged block of every request ([last, x_1..x_l] per decoding request);
  5. per request: verify, commit the KV of every accepted position, roll back the rest, emit tokens.
Requests join and leave at every step. With a single request this is plain or speculative single-stream
decoding: the same code, so every path samples from the same processed distribution.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from verispec.drafters import DrafterFactory
from verispec.drafters.base import EMPTY, Draft, Drafter, needs_features
from verispec.drafters.features import select
from verispec.engine.scheduler import Candidate, StaticPolicy
from verispec.state.kv_cache import KVCache
from verispec.models.llama import LlamaModel, Segment
from verispec.state.request import Request
from verispec.execution.sampling import target_probs
from verispec.engine.costs import AcceptanceEstimator
from verispec.execution.verify import EXACT, AcceptanceConfig, verify_greedy, verify_sampled

TokenCallback = Callable[[Request, list[int]], None]
StateCheck = Callable[[Request, "Drafter | None"], None]


class RequestTooLong(ValueError):
    """prompt + max_tokens can never fit in the context."""


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8  # requests decoding at once (= cache slots)
    max_num_batched_tokens: int = 512  # tokens in one forward: decode blocks + prefill chunks
    num_speculative_tokens: int = 4  # K, the most draft tokens per request and step

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")


@dataclass
class _Live:
    """Engine-side state of one admitted request."""

    req: Request
    drafter: Drafter | None
    estimator: AcceptanceEstimator
    generator: torch.Generator | None
    on_tokens: TokenCallback | None
    probe: bool = False
    aborted: bool = False

    @property
    def prefilled(self) -> bool:
        return self.req.num_computed >= len(self.req.prompt_ids) - 1


@dataclass
class SpecCounters:
    """Engine-wide speculative counters (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        drafters: DrafterFactory,
        policy: StaticPolicy,
        eos_ids: frozenset[int],
        config: EngineConfig = EngineConfig(),
        rule: AcceptanceConfig = EXACT,
        check_state: StateCheck | None = None,
    ) -> None:
        assert len(cache.slots) >= config.max_num_seqs, "the cache needs one slot per running request"
        self.model, self.cache, self.drafters, self.policy = model, cache, drafters, policy
        self.eos_ids, self.config, self.rule, self.check_state = eos_ids, config, rule, check_state
        self.waiting: deque[tuple[Request, TokenCallback | None]] = deque()
        self.running: list[_Live] = []
        self.counters = SpecCounters()
        self.num_finished = 0

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, req: Request, on_tokens: TokenCallback | None = None) -> None:
        self.check_fits(req)
        self.waiting.append((req, on_tokens))

    def check_fits(self, req: Request) -> None:
        total = len(req.prompt_ids) + req.params.max_tokens
        if total > self.cache.max_len:
            raise RequestTooLong(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) = {total} exceeds "
                f"the context of {self.cache.max_len} tokens; shorten the prompt or lower max_tokens"
            )

    def abort(self, request_id: str) -> bool:
        """Finish a request with reason "abort"; its slot is freed at the next step. False if unknown."""
        for i, (req, cb) in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
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
        return self.kv_tokens() / (self.cache.max_len * len(self.cache.slots))

    def run_to_completion(self) -> None:
        while self.has_work():
            self.step()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> None:
        t_sched = time.perf_counter()
        self._reap()
        self._admit()
        if not self.running:
            return
        budget = self.config.max_num_batched_tokens
        decoding = [lv for lv in self.running if lv.prefilled]
        budget -= len(decoding)
        prefill: list[tuple[_Live, int]] = []
        for lv in self.running:
            if lv.prefilled or budget <= 0:
                continue
            n = min(len(lv.req.prompt_ids) - 1 - lv.req.num_computed, budget)
            prefill.append((lv, n))
            budget -= n
        base = len(decoding) + sum(n for _, n in prefill)

        # speculation: lengths before drafting, drafts, lengths to verify (all before the target sees them)
        spec = [lv for lv in decoding if lv.drafter is not None and lv.req.output_ids]
        drafts: dict[int, Draft] = {}
        draft_time: dict[int, float] = {}
        proposed: set[int] = set()  # requests whose drafter proposed tokens (it must hear the verdict)
        if spec:
            cands = [Candidate(self._limit(lv), lv.estimator, lv.probe) for lv in spec]
            want = self.policy.draft_lengths(cands, base)
            props = []
            for lv, k in zip(spec, want):
                t = time.perf_counter()
                d = lv.drafter.propose(lv.req.all_ids, k) if k > 0 else EMPTY  # type: ignore[union-attr]
                draft_time[id(lv)] = time.perf_counter() - t
                if d.tokens:
                    proposed.add(id(lv))
                props.append(Draft(d.tokens[:k], None if d.probs is None else d.probs[:k],
                                   None if d.confidence is None else d.confidence[:k]))
            keep = self.policy.verify_lengths(cands, props, base)
            budget_left = budget
            for lv, d, n in zip(spec, props, keep):
                n = max(0, min(n, budget_left))
                budget_left -= n
                drafts[id(lv)] = Draft(d.tokens[:n], None if d.probs is None else d.probs[:n])
        t_forward = time.perf_counter()

        # one forward over every block
        ids: list[int] = []
        segments: list[Segment] = []
        logits_rows: list[int] = []
        for lv in decoding:
            lv.req.check(self.cache.length(lv.req.slot))  # type: ignore[arg-type]
            d = drafts.get(id(lv), EMPTY)
            last = lv.req.all_ids[lv.req.num_computed]
            block = [last] + d.tokens
            logits_rows.extend(range(len(ids), len(ids) + len(block)))
            segments.append(Segment(lv.req.slot, lv.req.num_computed, len(block)))  # type: ignore[arg-type]
            ids.extend(block)
        for lv, n in prefill:
            start = lv.req.num_computed
            segments.append(Segment(lv.req.slot, start, n))  # type: ignore[arg-type]
            ids.extend(lv.req.prompt_ids[start : start + n])
        layers = self.drafters.feature_layers  # target states the (learned) drafters read; () for the others
        out = self.model(torch.tensor(ids, device=self.model.device), segments, self.cache,
                         logits_indices=logits_rows, capture_layers=layers)
        t_verify = time.perf_counter()
        sched_s = t_forward - t_sched - sum(draft_time.values())

        off = len(logits_rows)  # prefill rows follow the decode blocks in the flat batch
        for lv, n in prefill:
            self.cache.commit(lv.req.slot, n)  # type: ignore[arg-type]
            lv.req.num_computed += n
            if needs_features(lv.drafter):
                lv.drafter.add_features(select(out.hidden, layers, slice(off, off + n)))  # type: ignore[union-attr]
            off += n
            if lv.prefilled:
                lv.req.stats.prefill_s = t_verify - lv.req.start_time
        row = 0
        for lv in decoding:
            d = drafts.get(id(lv), EMPTY)
            g = len(d.tokens)
            logits = out.logits[row : row + g + 1]  # [g + 1, V]
            feats = select(out.hidden, layers, slice(row, row + g + 1)) if needs_features(lv.drafter) else None
            row += g + 1
            t0 = time.perf_counter()
            self._accept(lv, d, logits, id(lv) in proposed, draft_s=draft_time.get(id(lv), 0.0),
                         verify_s=t_verify - t_forward, sched_s=sched_s, t0=t0, feats=feats)
        self._reap()

    def _limit(self, lv: _Live) -> int:
        r = lv.req
        left = r.params.max_tokens - len(r.output_ids) - 1
        room = self.cache.max_len - r.num_computed - 1
        return max(0, min(self.config.num_speculative_tokens, left, room))

    def _accept(self, lv: _Live, d: Draft, logits: torch.Tensor, proposed: bool, *, draft_s: float, verify_s: float,
                sched_s: float, t0: float, feats: torch.Tensor | None = None) -> None:
        req, g = lv.req, len(d.tokens)
        x = torch.tensor(d.tokens, dtype=torch.long)
        if req.params.greedy:
            verdict = verify_greedy(x, logits)
        else:
            p = target_probs(logits, req.params.temperature, req.params.top_k, req.params.top_p)  # [g + 1, V]
            verdict = verify_sampled(x, d.probs, p, lv.generator, self.rule)  # type: ignore[arg-type]
        self.cache.commit(req.slot, verdict.accepted + 1)  # type: ignore[arg-type]
        req.num_computed += verdict.accepted + 1
        if lv.drafter is not None and proposed:  # even when none of the draft was verified
            lv.drafter.observe(verdict.accepted)
        if feats is not None:  # the committed block positions: the pending token and the accepted drafts
            lv.drafter.add_features(feats[: verdict.accepted + 1])  # type: ignore[union-attr]
        first = not req.output_ids
        kept = req.append(verdict.tokens, self.eos_ids)
        if lv.drafter is not None and not first:
            if g:
                lv.estimator.update(g, verdict.accepted, draft_s)
                lv.probe = False
            else:
                lv.probe = lv.estimator.plain_step()
        if not first:  # the first step finishes the prefill; it is not a decode step
            req.spec.record(g, verdict.accepted, draft_s=draft_s, verify_s=verify_s, sched_s=sched_s,
                            state_s=time.perf_counter() - t0)
            self.counters.record(g, verdict.accepted)
        if lv.on_tokens is not None and kept:
            lv.on_tokens(req, kept)
        if self.check_state is not None and not req.finished:
            self.check_state(req, lv.drafter)

    # ---- admission and release ------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req, cb = self.waiting.popleft()
            p = req.params
            req.spec.lossy = self.rule.lossy and not p.greedy
            drafter = None
            try:
                req.slot = self.cache.allocate()
                drafter = self.drafters.new(p, len(req.prompt_ids))
            except BaseException:
                if req.slot is not None:
                    self.cache.free(req.slot)
                    req.slot = None
                self.waiting.appendleft((req, cb))
                raise
            gen = None if p.greedy else p.make_generator(self.model.device)
            self.running.append(_Live(req, drafter, AcceptanceEstimator(), gen, cb))

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

    def _release(self, lv: _Live) -> None:
        if lv.drafter is not None:
            lv.drafter.release()
        if lv.req.slot is not None:
            self.cache.free(lv.req.slot)
        self.num_finished += 1

    def fail_all(self, message: str) -> list[Request]:
        """After an engine error: finish every request with the error, free everything; returns them."""
        failed = [lv.req for lv in self.running] + [r for r, _ in self.waiting]
        for lv in self.running:
            lv.req.finish_reason = "error"
            try:
                self._release(lv)
            except Exception:  # noqa: BLE001 - keep freeing the others
                pass
            if lv.on_tokens is not None:
                lv.on_tokens(lv.req, [])
        for req, cb in self.waiting:
            req.finish_reason = "error"
            if cb is not None:
                cb(req, [])
        self.running, self.waiting = [], deque()
        for i in range(len(self.cache.slots)):
            self.cache.free(i)
        return failed
