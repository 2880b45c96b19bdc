"""Per-request state: tokens, counters and timings, with the invariants asserted."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from verispec.sampling import SamplingParams

if TYPE_CHECKING:
    from verispec.sampling.logprobs import TokenLogprobs

_ids = itertools.count()


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # first token time - request start
    e2e_s: float = 0.0  # last token time - request start
    prefill_s: float = 0.0
    stop_trimmed_tokens: int = 0  # tokens sampled or accepted past the point where a stop string ended the text
    queue_s: float | None = None  # request start -> first admission into the running batch (None: never admitted)
    drafter_error: str | None = None  # its drafter raised while proposing; it then decoded on without one

    @property
    def tok_per_s(self) -> float:
        """Output tokens per second over the whole request (prefill included)."""
        return self.output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        """Tokens after the first, per second after the first: the steady decode rate."""
        dt = self.e2e_s - self.ttft_s
        return (self.output_tokens - 1) / dt if self.output_tokens > 1 and dt > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_s": round(self.ttft_s, 6),
            "e2e_s": round(self.e2e_s, 6),
            "prefill_s": round(self.prefill_s, 6),
            "tok_per_s": round(self.tok_per_s, 3),
            "decode_tok_per_s": round(self.decode_tok_per_s, 3),
            "stop_trimmed_tokens": self.stop_trimmed_tokens,
            "queue_s": None if self.queue_s is None else round(self.queue_s, 6),
            "drafter_error": self.drafter_error,
        }


@dataclass
class SpecStats:
    """Per-step accounting of the decode loop (steps after the first token)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [position] steps whose draft reached this position
    accepted_at: list[int] = field(default_factory=list)  # [position] steps that accepted this position
    # where the step's time went, summed over steps (each request is charged the whole shared forward)
    draft_s: float = 0.0  # its drafter proposing
    forward_s: float = 0.0  # the batched target forward that verified its block
    verify_s: float = 0.0  # the verification rule on its block (greedy compare / rejection sampling)
    sched_s: float = 0.0  # planning the step and the policy's decisions
    state_s: float = 0.0  # committing KV, drafter feedback, appending tokens
    lossy: bool = False
    # a relaxed acceptance rule's drift (execution/drift.py; the exact rule measures none): accepted draft tokens the
    # exact test would have rejected, summed per-position total-variation distance to the target, positions measured
    relaxed: int = 0
    tv_sum: float = 0.0
    tv_positions: int = 0
    # a hybrid drafter's model side (drafters/hybrid.py): its draft tokens verified and accepted (in the stats only
    # where the request drafts with a hybrid)
    hybrid: bool = False
    model_drafted: int = 0
    model_accepted: int = 0

    def record(self, drafted: int, accepted: int, *, draft_s: float, forward_s: float, verify_s: float,
               sched_s: float, state_s: float) -> None:
        assert 0 <= accepted <= drafted
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted
        self.draft_s += draft_s
        self.forward_s += forward_s
        self.verify_s += verify_s
        self.sched_s += sched_s
        self.state_s += state_s

    def record_model_side(self, drafted: int, accepted: int) -> None:
        """A hybrid drafter's model side drafted this step's `drafted` verified tokens, `accepted` of them kept."""
        assert self.hybrid and 0 <= accepted <= drafted
        self.model_drafted += drafted
        self.model_accepted += accepted

    def record_drift(self, relaxed: int, tv_sum: float, positions: int) -> None:
        assert 0 <= relaxed and 0 <= positions and tv_sum >= -1e-9
        self.relaxed += relaxed
        self.tv_sum += tv_sum
        self.tv_positions += positions
        assert self.relaxed <= self.accepted

    @property
    def mean_acceptance_length(self) -> float:
        """tau = 1 + accepted draft tokens / verification steps (the bonus or recovered token included)."""
        return 1 + self.accepted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "num_draft_tokens": self.drafted,
            "num_accepted_tokens": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "per_position_acceptance": [round(a / d, 4) for a, d in zip(self.accepted_at, self.drafted_at)],
            "draft_s": round(self.draft_s, 6),
            "forward_s": round(self.forward_s, 6),
            "verify_s": round(self.verify_s, 6),
            "sched_s": round(self.sched_s, 6),
            "state_s": round(self.state_s, 6),
            "lossy": self.lossy,
            "num_relaxed_accepted_tokens": self.relaxed,
            "tv_mean": self.tv_sum / self.tv_positions if self.tv_positions else None,
            "tv_positions": self.tv_positions,
        } | ({"hybrid_model_draft_tokens": self.model_drafted, "hybrid_model_accepted_tokens": self.model_accepted}
             if self.hybrid else {})


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    # tokens whose KV is committed in the cache; the last sampled token is not yet in it
    num_computed: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" (aborted) | "error" (failed: see `error`)
    start_time: float = field(default_factory=time.perf_counter)
    stats: RequestStats = field(default_factory=RequestStats)
    spec: SpecStats = field(default_factory=SpecStats)
    error: str | None = None  # why the request failed, with finish_reason "error"
    stop_reason: str | None = None  # the stop string that ended the output (finish_reason "stop")
    stop_text: str | None = None  # the output text cut at that stop string (decoding output_ids runs past it)
    # per output token when params.logprobs is set (sampling/logprobs.py), aligned with output_ids
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with params.return_hidden_states: the recorded states of the committed positions in order, one
    # [n, len(layers) d] tensor per commit (layers concatenated in ascending order); cleared on preemption
    hidden_rows: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.stats.prompt_tokens = len(self.prompt_ids)
        # built once: `append` checks every generated token against it in O(1)
        self.stop_ids = frozenset(self.params.stop_token_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def check(self, cache_length: int) -> None:
        """Invariants between this request and its KV cache slot."""
        assert self.num_computed == cache_length, f"{self.request_id}: computed {self.num_computed} != cache {cache_length}"
        assert self.num_computed <= len(self.all_ids), "KV exists for tokens the request does not have"
        assert len(self.output_ids) <= self.params.max_tokens
        assert not self.output_logprobs or len(self.output_logprobs) == len(self.output_ids), "logprobs misaligned"

    def truncate_output(self, n: int) -> list[int]:
        """Keep the first n output tokens (a stop string ended the text inside a commit); returns those dropped.
        Anything kept per output token beside `output_ids` is cut here too."""
        assert 0 <= n <= len(self.output_ids), f"{self.request_id}: cannot keep {n} of {len(self.output_ids)} tokens"
        dropped = self.output_ids[n:]
        del self.output_ids[n:]
        del self.output_logprobs[n:]
        self.stats.output_tokens = n
        return dropped

    def append(self, tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
        """Append sampled tokens, stopping at EOS / stop tokens / max_tokens. Returns the tokens kept."""
        kept: list[int] = []
        for t in tokens:
            kept.append(t)
            self.output_ids.append(t)
            if not self.params.ignore_eos and (t in eos_ids or t in self.stop_ids):
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        now = time.perf_counter()
        if kept and self.stats.output_tokens == 0:
            self.stats.ttft_s = now - self.start_time
        self.stats.output_tokens = len(self.output_ids)
        self.stats.e2e_s = now - self.start_time
        return kept
