"""The narrow drafter protocol: propose a draft for one request, then hear how much of it survived.

A drafter is created per request (`Drafter.for_request`) or shared, and sees only token ids and its own config.
  propose(context, k)  -> Draft: up to k tokens that should follow `context` (the committed tokens plus the
                          pending last token); optional q (the draft distributions the tokens were sampled from)
                          and optional per-position confidences.
  observe(accepted)    -> feedback after verification: how many of the proposed tokens the target accepted.
Drafters with state of their own (a draft model's KV cache) keep it consistent in observe().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class Draft:
    tokens: list[int]  # [g], g <= k; may be empty (no proposal this step)
    probs: torch.Tensor | None = None  # [g, V] q_i, the distribution token i was drawn from; None = deterministic
    confidence: list[float] | None = None  # [g] estimated probability that position i survives verification

    def __post_init__(self) -> None:
        g = len(self.tokens)
        if self.probs is not None:
            assert self.probs.dim() == 2 and self.probs.shape[0] == g, "probs must be [g, V]"
        if self.confidence is not None:
            assert len(self.confidence) == g, "one confidence per draft token"


EMPTY = Draft(tokens=[])


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int) -> Draft: ...

    def observe(self, accepted: int) -> None: ...

    def release(self) -> None:
        """Free per-request resources (KV slots); called once when the request ends."""
        ...
