"""The narrow drafter protocol: propose a draft for one request, then hear how much of it survived.

A drafter is created per request by `DrafterFactory.new(params, prompt_len)` (drafters/__init__.py), from what
the factory shares across requests (a draft model and its KV cache, the suffix cache), and sees only token ids and
its own config.
  propose(context, k)  -> Draft: up to k tokens that should follow `context` (the committed tokens plus the
                          pending last token); optional q (the draft distributions the tokens were sampled from)
                          and optional per-position confidences.
  observe(accepted)    -> feedback after verification: how many of the proposed tokens the target accepted.
  release(tokens)      -> once, when the request ends (tokens: its whole stream) or leaves the drafter (None):
                          free per-request resources (KV slots).
A drafter that never gives confidences says so with `gives_confidence = False` (absent: it may give them); the
`dspark` policy then drafts, from a request's first step on, only what the online estimate would verify.
A drafter whose proposal is one pass whatever k (a block drafter) says so with `drafts_in_one_pass = True`
(absent: False, its drafting time grows with k); the policies then charge its pass to the first drafted token.
A drafter that drafts token by token with confidences and can stop itself says so with `stops_early = True`
(absent: False); it then also takes propose(context, k, min_survival=s) and stops after the first token at which
the product of its confidences falls below s (the `dspark` policy sets s where one more token stops paying).
Drafters with state of their own (a draft model's KV cache) keep it consistent in observe(), and may offer
  check_own_state(tokens) -> state oracle (`--check-state`): tokens = the committed tokens; recompute the
                          drafter's own state from scratch and raise AssertionError (check.state.StateMismatch)
                          if it disagrees.

Learned drafters (EAGLE-3, DFlash, DSpark) also read the target's hidden states: a `FeatureDrafter` names the
target layers it needs, and the engine hands it the features of every committed position, once, in order:
  add_features(feats)  -> the next n committed positions' features, [n, len(feature_layers) * d]: prefill chunks
                          as they run, then after each verification the accepted block positions (pending last token
                          + accepted drafts), always AFTER observe(). The token just sampled (the bonus) has no
                          features yet, so before every propose(context, k) the drafter holds features for exactly
                          len(context) - 1 positions.
  check_state(ref, tokens) -> state oracle: ref = features recomputed from scratch for all committed positions,
                          tokens = the committed tokens; raise AssertionError if the drafter's own state
                          (context KV, lengths) disagrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Draft:
    tokens: list[int]  # [g], g <= k; may be empty (no proposal this step)
    probs: torch.Tensor | None = None  # [g, V] q_i, the distribution token i was drawn from; None = deterministic
    confidence: list[float] | None = None  # [g] estimated probability that position i survives verification
    parents: tuple[int, ...] | None = None  # [g] a draft tree's parent links (models/tree.py), None for a chain

    def __post_init__(self) -> None:
        g = len(self.tokens)
        if self.probs is not None:
            assert self.probs.dim() == 2 and self.probs.shape[0] == g, "probs must be [g, V]"
        if self.confidence is not None:
            assert len(self.confidence) == g, "one confidence per draft token"
        if self.parents is not None:
            assert len(self.parents) == g, "one parent per tree node"

    def head(self, n: int) -> "Draft":
        """The first n tokens with what goes with them (a tree's nodes are listed parents first, so its first n are
        a tree of their own)."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n],
                     None if self.confidence is None else self.confidence[:n],
                     None if self.parents is None else self.parents[:n])


EMPTY = Draft(tokens=[])


def drafted_confidence(logits: torch.Tensor, index: int, q: torch.Tensor | None) -> float:
    """A token-by-token drafter's confidence in the token it drafted (EAGLE-2's acceptance proxy): q of it where it
    was sampled from q, else its softmax probability under `logits` ([V]; greedy drafts take the top-1)."""
    if q is not None:
        return float(q[index])
    return float(torch.softmax(logits.float(), -1)[index])


def greedy_pick(logits: torch.Tensor) -> tuple[int, float]:
    """[V] -> (the index of the largest logit, the first of equals; its softmax probability): a greedy drafter's
    token and its confidence (`drafted_confidence`) in two passes over the row (a CPU float32 row through numpy:
    a drafter picks once per drafted token, and separate argmax, max and softmax calls cost ~50 us a token there)."""
    if logits.device.type == "cpu" and logits.dtype is torch.float32 and not logits.requires_grad:
        a = logits.numpy()
        j = int(a.argmax())
        return j, float(1.0 / np.exp(a - a[j]).sum())
    j = int(logits.argmax())
    return j, drafted_confidence(logits, j, None)


class Drafter(Protocol):
    name: str
    # optional: False where propose() never fills Draft.confidence (read with getattr(drafter, ..., True))
    gives_confidence: bool
    # optional: True where one propose() call costs one pass whatever k (read with getattr(drafter, ..., False))
    drafts_in_one_pass: bool
    # optional: True where propose() also takes min_survival (read with getattr(drafter, ..., False))
    stops_early: bool
    # optional: True where propose() reads nothing but the context it is given (no features, no cache of its own
    # drafts), so it may continue tokens certain to follow the output, such as a grammar's forced ones
    # (read with getattr(drafter, ..., False))
    reads_context_only: bool

    def propose(self, context: Sequence[int], k: int) -> Draft: ...

    def observe(self, accepted: int) -> None: ...

    def release(self, tokens: Sequence[int] | None = None) -> None:
        """Free per-request resources (KV slots); called once, when the request ends or leaves this drafter.
        `tokens`: its whole stream (prompt and output) when it finished, which may run past the last context
        proposed for (steps without a draft call no drafter). None when it did not finish with this drafter
        (preempted: a new drafter hands the whole stream on later; the drafter failed): add nothing to state
        shared with other requests."""
        ...


class FeatureDrafter(Drafter, Protocol):
    feature_layers: tuple[int, ...]  # hidden states ENTERING these target layers; index L = final pre-norm output

    def add_features(self, feats: torch.Tensor) -> None:
        """feats: [n, len(feature_layers) d] of the next committed positions; may be a view of the step's capture
        buffer, so a drafter keeps it through `features.own`."""
        ...

    def check_state(self, ref: torch.Tensor, tokens: Sequence[int]) -> None: ...


def needs_features(drafter: object) -> bool:
    return bool(getattr(drafter, "feature_layers", ()))
