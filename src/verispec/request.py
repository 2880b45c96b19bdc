"""Per-request state: tokens, counters and timings, with the invariants asserted."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from verispec.sampling import SamplingParams

_ids = itertools.count()


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # first token time - request start
    e2e_s: float = 0.0  # last token time - request start
    prefill_s: float = 0.0
    steps: int = 0  # decode forwards after the prefill

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
            "steps": self.steps,
            "tok_per_s": round(self.tok_per_s, 3),
            "decode_tok_per_s": round(self.decode_tok_per_s, 3),
        }


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    # tokens whose KV is committed in the cache; the last sampled token is not yet in it
    num_computed: int = 0
    finish_reason: str | None = None  # "stop" | "length"
    start_time: float = field(default_factory=time.perf_counter)
    stats: RequestStats = field(default_factory=RequestStats)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.stats.prompt_tokens = len(self.prompt_ids)

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

    def append(self, tokens: list[int], eos_ids: frozenset[int]) -> list[int]:
        """Append sampled tokens, stopping at EOS / stop tokens / max_tokens. Returns the tokens kept."""
        kept: list[int] = []
        for t in tokens:
            kept.append(t)
            self.output_ids.append(t)
            if not self.params.ignore_eos and (t in eos_ids or t in self.params.stop_token_ids):
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
