"""Stop strings (OpenAI's `stop`), matched on the decoded output text, across token and commit boundaries.

Pure text logic, no torch and no model: a `StopMatcher` is given a request's output token ids after every commit
(one token, or several when drafts were accepted) and a detokenize function (the same one that makes the final
text, so the cut falls at the same character). The output ends at the shortest prefix of its text that contains a
stop string: the result does not depend on how the tokens were split into commits. `partial_stop_len` says how
much of a streamed text's tail must wait because it could still become a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from verispec.state.request import Request

Detokenize = Callable[[list[int]], str]

__all__ = ["Detokenize", "StopMatch", "StopMatcher", "first_stop", "partial_stop_len"]


@dataclass(frozen=True)
class StopMatch:
    keep_tokens: int  # output tokens to keep: up to and including the one in which the stop string completes
    text: str  # the output text cut at the stop string (with it when include_stop_str_in_output)
    stop: str  # the stop string that matched


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The stop string that completes first in `text` (occurrences starting at `start` or later): (its start
    index, it); on a tie of ends the longer one. None when no stop string occurs."""
    best: tuple[int, int, str] | None = None  # (end, -length, stop)
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
            best = (i + len(s), -len(s), s)
    return None if best is None else (best[0] - len(best[2]), best[2])


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string: the part of a streamed text
    that could still turn out to be the start of a stop string, so must not be sent yet."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):  # the usual case: the text only grew
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class StopMatcher:
    """One request's stop strings, checked incrementally over its decoded output."""

    def __init__(self, stops: Sequence[str], include_in_output: bool, detokenize: Detokenize) -> None:
        assert stops and all(stops), "stop strings are non-empty"
        self.stops, self.include, self.detokenize = tuple(stops), include_in_output, detokenize
        self.longest = max(len(s) for s in self.stops)
        self.text = ""  # the decoded output at the last check

    def update(self, ids: list[int], num_new: int) -> StopMatch | None:
        """`ids`: the whole output so far, its last `num_new` tokens new since the last call. The first stop string
        in the text, if any, with the tokens and text to keep; None otherwise."""
        text = self.detokenize(ids)
        # text the previous check saw unchanged held no whole stop string: a new one ends past it, so starts at most
        # longest - 1 characters before (it may straddle the previous commit)
        start = max(0, _common_prefix(self.text, text) - (self.longest - 1))
        self.text = text
        hit = first_stop(text, self.stops, start)
        if hit is None:
            return None
        pos, stop = hit
        end = pos + len(stop)
        keep = self._tokens_through(ids, end, len(ids) - num_new)
        return StopMatch(keep, text[:end] if self.include else text[:pos], stop)

    def apply(self, req: "Request", kept: list[int]) -> list[int]:
        """After `kept` tokens were appended to the request's output: a stop string in the text, possibly ending
        inside this step's accepted block, ends the output with the token that completes it (usage counts up to
        there) and its text at the stop. Returns the tokens kept now."""
        m = self.update(req.output_ids, len(kept))
        if m is None:
            return kept
        dropped = req.truncate_output(m.keep_tokens)
        req.finish_reason, req.stop_reason, req.stop_text = "stop", m.stop, m.text
        req.stats.stop_trimmed_tokens += len(dropped)
        return kept[: len(kept) - len(dropped)]

    def _tokens_through(self, ids: list[int], end: int, before: int) -> int:
        """The fewest tokens (more than `before`, the ones already checked) whose text holds text[:end]."""
        want = self.text[:end]
        for n in range(before + 1, len(ids)):
            if self.detokenize(ids[:n]).startswith(want):
                return n
        return len(ids)
