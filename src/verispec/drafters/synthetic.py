"""Synthetic acceptance, a benchmark-only mode (method `synthetic`, as llama.cpp's `--spec-synth-len`): drafts
that the target accepts at a set mean length, so the speculative engine's speed at tau 2, 3 or 4 can be measured
on models whose drafts would never be accepted (random weights in the shapes of real models).

The drafter copies the target's own greedy continuation, recorded when the same prompt finished before in this
LLM (`SyntheticReference`, fed by every finished stream through `release`): the first run of a prompt drafts
nothing (plain decoding), later runs propose the recorded next tokens. Each step draws how many of them to copy
with a fixed conditional acceptance p per position (position i survives with p^i), p chosen so that the expected
tokens per verification step, the bonus token included, is the set tau; the draws invert that distribution at a
golden-ratio sequence of points instead of independent uniforms, so the mean lands on tau within about 1 / steps
rather than 1 / sqrt(steps) (a short benchmark run gets the tau it asked for); the first token past that is replaced
by a token the target does not pick, and the draft is filled to k with the recorded tokens after it, so every
step verifies k positions as a real drafter's chain would.

Verification is real: the target's forward checks every drafted token and the output is the target's own. It is
labelled lossy all the same (the drafter sees the answer; its drafting costs nothing; tau is set, not earned), so
`SpeculativeConfig` refuses it without `benchmark_only=True` and the CLI's generate and serve refuse it always.
Greedy decoding only: at temperature > 0 the recorded continuation is one sample and the measured tau falls.
"""

from __future__ import annotations

import math
from typing import Sequence

from verispec.drafters.base import EMPTY, Draft

_GOLDEN = (math.sqrt(5) - 1) / 2
LABEL = "lossy benchmark mode: drafts copied from the target's earlier output at a set acceptance"


def conditional_acceptance(tau: float, k: int) -> float:
    """p such that 1 + p + p^2 + ... + p^k = tau: the per-position conditional acceptance of a k-token chain whose
    expected tokens per verification step is tau (1 <= tau <= k + 1)."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"synthetic tau must be within [1, {k + 1}] for k = {k}, got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the sum grows monotonically in p
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(1, k + 1)) < tau - 1 else (lo, mid)
    return (lo + hi) / 2


class SyntheticReference:
    """The finished streams (prompt and output) of this LLM's requests, by prompt: the continuation a later
    request of the same prompt copies from. The longest stream of a prompt is kept."""

    def __init__(self) -> None:
        self.streams: dict[tuple[int, ...], list[int]] = {}

    def record(self, prompt_len: int, tokens: Sequence[int]) -> None:
        key = tuple(tokens[:prompt_len])
        if len(tokens) > len(self.streams.get(key, ())):
            self.streams[key] = list(tokens)

    def stream(self, prompt: Sequence[int]) -> list[int] | None:
        return self.streams.get(tuple(prompt))


class SyntheticDrafter:
    """One request's synthetic drafts (see the module docstring)."""

    name = "synthetic"
    gives_confidence = False

    def __init__(self, reference: SyntheticReference, tau: float, k: int, vocab_size: int, prompt_len: int,
                 seed: int = 0) -> None:
        self.reference = reference
        self.p = conditional_acceptance(tau, k)
        self.vocab_size = vocab_size
        self.prompt_len = prompt_len
        self.u = math.fmod(0.5 + seed * _GOLDEN, 1.0)  # where the request's sequence of draws starts

    def propose(self, context: Sequence[int], k: int) -> Draft:
        stream = self.reference.stream(context[: self.prompt_len])
        n = len(context)
        if stream is None or len(stream) <= n or stream[self.prompt_len:n] != list(context[self.prompt_len:]):
            return EMPTY  # no recorded continuation of this context (the first run of a prompt)
        ahead = stream[n : n + k]
        self.u = math.fmod(self.u + _GOLDEN, 1.0)
        copied = min(len(ahead), sum(1 for i in range(1, len(ahead) + 1) if self.u < self.p ** i))
        tokens = list(ahead)
        if copied < len(ahead):
            tokens[copied] = (ahead[copied] + 1) % self.vocab_size  # not the target's greedy token
        return Draft(tokens)

    def observe(self, accepted: int) -> None:
        pass

    def release(self, tokens: Sequence[int] | None = None) -> None:
        if tokens is not None:
            self.reference.record(self.prompt_len, tokens)
