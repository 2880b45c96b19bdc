"""Prompt lookup decoding: propose what followed the most recent earlier occurrence of the context's tail.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens of the context are looked up among
the n-grams that END STRICTLY BEFORE the end of the context (so the tail never matches itself; an occurrence may
overlap the tail), the most recent such occurrence wins, and the up to k tokens that followed it are proposed.
Where they run into the end of the context the copy goes on with its own period (the draft's tokens continue it:
a context that repeats every p tokens is guessed to keep repeating; vLLM's prompt lookup stops there instead).
Longer n-grams are preferred; no match gives an empty draft.

`ngram_propose` is the plain O(len(context) * n) reference; `NgramDrafter` keeps an n-gram -> last start index
updated as the context grows, so one step costs O(n_max^2 + k) amortised. A chain comes with per-position
confidences: the survival of drafts from matches of the same length, scored in hindsight (drafters/hindsight.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from verispec.drafters.base import EMPTY, Draft
from verispec.drafters.hindsight import HindsightScorer, SurvivalTable
from verispec.models.tree import TreeDraft


@dataclass(frozen=True)
class NgramConfig:
    """vLLM's names: the longest and the shortest n-gram of the context's tail to look up."""

    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min ({self.prompt_lookup_min})"
            )


def periodic_copy(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens copied from tokens[start:], continued past the end with period len(tokens) - start: position j
    reads tokens[start + j] while that exists, else the copy's own token j - period (start < len(tokens))."""
    length = len(tokens)
    out = [int(t) for t in tokens[start : start + k]]
    period = length - start
    for j in range(len(out), k):
        out.append(out[j - period])
    return out


def ngram_propose(context: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Reference prompt lookup: k tokens following the most recent earlier occurrence of the tail.

    Tries n = n_max .. n_min; for each, scans start positions i = L-n-1 down to 0 (an occurrence starting at
    i ends at i+n <= L-1, strictly before the tail's end) and returns context[i+n : i+n+k] for the first hit,
    continued periodically (`periodic_copy`) where it reaches the end of the context.
    """
    toks = [int(t) for t in context]
    length = len(toks)
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if length < n + 1:
            continue
        tail = toks[length - n :]
        for i in range(length - n - 1, -1, -1):
            if toks[i : i + n] == tail:
                return periodic_copy(toks, i + n, k)
    return []


OCCURRENCES = 32  # a tree reads at most this many earlier occurrences of the tail per n-gram length
GRAM_WEIGHT = 4.0  # an occurrence of a tail n-gram weighs GRAM_WEIGHT ** n: longer matches count for more


def continuation_tree(continuations: Iterable[tuple[int, Sequence[int]]], budget: int) -> TreeDraft:
    """The first continuation (the chain), then the `budget` heaviest other prefixes of the (n, continuation)
    pairs, as a trie. Every pair adds GRAM_WEIGHT ** n to each prefix of its continuation, so a prefix weighs at
    least as much as any of its extensions and, ties going to the shorter then the first seen, the chosen set holds
    every chosen node's ancestors (a tree, expanded where the occurrences agree most: EAGLE-2's rule, with
    agreement for the draft probability). Nodes are listed by depth, then first seen; siblings are distinct, so
    verification treats them as point masses."""
    weight: dict[tuple[int, ...], float] = {}
    for i, (n, cont) in enumerate(continuations):
        for j in range(1, len(cont) + 1):
            key = tuple(cont[:j])
            # the first continuation is the chain drafter's proposal: kept whole, so a tree never loses to it
            weight[key] = math.inf if i == 0 else weight.get(key, 0.0) + GRAM_WEIGHT ** n  # first-seen order
    seen = {key: i for i, key in enumerate(weight)}
    chosen = sorted(weight, key=lambda key: (-weight[key], len(key), seen[key]))[: max(budget, 0)]
    chosen.sort(key=lambda key: (len(key), seen[key]))
    node = {key: i for i, key in enumerate(chosen)}
    return TreeDraft(tuple(key[-1] for key in chosen), tuple(node.get(key[:-1], -1) for key in chosen))


def ngram_tree(context: Sequence[int], budget: int, depth: int, n_max: int, n_min: int) -> TreeDraft:
    """Reference tree lookup: the continuations (`depth` tokens, periodic past the end) of the OCCURRENCES most
    recent earlier occurrences of the tail, for n = n_max .. n_min, weighed into a tree of at most `budget` nodes."""
    toks = [int(t) for t in context]
    length = len(toks)
    conts = []
    for n in range(n_max, n_min - 1, -1):
        if length < n + 1 or depth <= 0:
            continue
        tail = toks[length - n :]
        starts = [i for i in range(length - n - 1, -1, -1) if toks[i : i + n] == tail][:OCCURRENCES]
        conts += [(n, periodic_copy(toks, i + n, depth)) for i in starts]
    return continuation_tree(conts, budget)


class NgramDrafter:
    """Per request; deterministic (probs=None). A chain's confidence[j] is P(position j survives | the positions
    before it did) for drafts whose match had the same tail length, from `survival` (shared across requests by
    the drafter factory) and this request's own drafts, every one scored against the tokens committed after it.

    Index invariant: `_starts` maps every n-gram (n_min <= n <= n_max) that ends at an exclusive position
    e <= `_done` to its starts, oldest first (the chain reads the latest, a tree the recent ones), and
    `_done == len(_tokens) - 1` after `_sync`, so a lookup of the tail never returns the tail itself and always
    has at least one following token.
    """

    name = "ngram"
    gives_confidence = True
    reads_context_only = True

    def __init__(self, config: NgramConfig | None = None, survival: SurvivalTable | None = None) -> None:
        self.config = config or NgramConfig()
        self.hindsight = HindsightScorer(survival if survival is not None else SurvivalTable())
        self._reset()

    def _reset(self) -> None:
        self._tokens: list[int] = []
        self._starts: dict[tuple[int, ...], list[int]] = {}
        self._done = 0

    def _sync(self, context: Sequence[int]) -> None:
        """Append the tokens of `context` not seen yet and index the n-grams that now end before its last token."""
        n = len(self._tokens)
        if len(context) < n or (n and int(context[n - 1]) != self._tokens[-1]):
            self._reset()  # not an extension of what we saw (should not happen within one request): start over
            self.hindsight.forget()
            n = 0
        self._tokens.extend(int(t) for t in context[n:])
        if self.hindsight.pending and len(self._tokens) > n:
            self.hindsight.score(self._tokens)
        toks, starts = self._tokens, self._starts
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        for end in range(self._done + 1, len(toks)):
            for size in range(lo, min(hi, end) + 1):
                starts.setdefault(tuple(toks[end - size : end]), []).append(end - size)
        self._done = max(self._done, len(toks) - 1)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """k tokens continuing `context`; EMPTY when no n-gram of the tail occurred before."""
        self._sync(context)
        if k <= 0:
            return EMPTY
        for gram in self._tail_grams():
            starts = self._starts.get(gram)
            if starts:
                start = starts[-1] + len(gram)
                tokens = periodic_copy(self._tokens, start, k)
                self.hindsight.proposed(len(self._tokens), len(gram), tokens)
                return Draft(tokens=tokens, confidence=self.hindsight.confidence(len(gram), len(tokens)))
        return EMPTY

    def _tail_grams(self) -> list[tuple[int, ...]]:
        """The context's tail n-grams, longest first (n = prompt_lookup_max .. prompt_lookup_min, where the
        context is longer than n)."""
        toks, length = self._tokens, len(self._tokens)
        return [tuple(toks[length - n :]) for n in range(self.config.prompt_lookup_max,
                                                          self.config.prompt_lookup_min - 1, -1) if length >= n + 1]

    def propose_tree(self, context: Sequence[int], budget: int, depth: int) -> TreeDraft:
        """`ngram_tree` from the index: the recent earlier occurrences' continuations, weighed into `budget` nodes."""
        self._sync(context)
        toks = self._tokens
        conts = [(len(g), periodic_copy(toks, start + len(g), depth)) for g in self._tail_grams() if depth > 0
                 for start in reversed(self._starts.get(g, [])[-OCCURRENCES:])]
        return continuation_tree(conts, budget)

    def observe(self, accepted: int) -> None:
        """Stateless between steps: the accepted tokens arrive with the next context."""

    def release(self, tokens: Sequence[int] | None = None) -> None:
        """Score what the request's final tokens decide of its last drafts (None: it did not finish here, so they
        stay unscored), then drop the per-request index."""
        if tokens is None:
            self.hindsight.forget()
        else:
            self.hindsight.score(tokens, final=True)
        self._reset()
