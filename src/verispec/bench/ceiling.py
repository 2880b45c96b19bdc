"""How fast any drafter that copies from the context could make greedy decoding, from the target's own output.

A drafter that copies (n-gram / prompt lookup, suffix matching, trees of either) can only propose tokens that
already occur in the request's context: the prompt and the output so far. Given the output the target produces
alone, the most such a drafter can have accepted at position i is the longest run of the output from i that starts
at some earlier position of prompt + output (LZ77's match: the source may overlap the run, as a periodic copy
does), at most k tokens. Walking the output with that run as each step's accepted draft gives the copy ceiling's
steps; a scheduler that knew each run in advance would verify exactly it, so a step costs the forward of run + 1
tokens. No drafting time is charged. The end-to-end ceiling adds the time before the first token, which
speculation does not change: a prompt whose prefill takes most of a short request caps the request's speedup
however fast its decoding gets.

Pure arithmetic over token lists and measured seconds; `benchmarks/studies/copy_ceiling.py` runs it on Spec-Bench.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def copy_run(seq: Sequence[int], i: int, k: int) -> int:
    """The longest L <= k (and <= len(seq) - i) with seq[s : s + L] == seq[i : i + L] for some s < i."""
    best = 0
    end = len(seq)
    for s in range(i):
        n = 0
        while n < k and i + n < end and seq[s + n] == seq[i + n]:
            n += 1
        best = max(best, n)
        if best == k:
            break
    return best


def matched(draft: Sequence[int], seq: Sequence[int], i: int) -> int:
    """How many leading `draft` tokens equal seq[i:] (greedy verification's accepted count)."""
    return next((j for j, t in enumerate(draft) if i + j >= len(seq) or t != seq[i + j]), len(draft))


def drafter_run(drafter) -> Callable[[Sequence[int], int, int], int]:
    """A run function (as `copy_run`) of a drafter's own proposals: `drafter.propose(seq[:i], k)` matched
    against seq[i:]. One drafter per request: it keeps an index of the context it has seen."""
    return lambda seq, i, k: matched(drafter.propose(seq[:i], k).tokens, seq, i)


def lookup_run(seq: Sequence[int], i: int, k: int, n_max: int = 4, n_min: int = 1) -> int:
    """The longest run (as `copy_run`) among the continuations of every earlier occurrence of the longest tail
    n-gram that occurred before (n = n_max .. n_min, the occurrence ending before i): what prompt lookup reaches when
    it picks the best of its candidates, as a tree of all of them verified at once would."""
    end = len(seq)
    for n in range(n_max, n_min - 1, -1):
        if i < n + 1:
            continue
        tail = list(seq[i - n : i])
        starts = [s for s in range(i - n) if list(seq[s : s + n]) == tail]
        if starts:
            best = 0
            for s in starts:
                j = 0
                while j < k and i + j < end and seq[s + n + j] == seq[i + j]:
                    j += 1
                best = max(best, j)
            return best
    return 0


def copy_steps(prompt: Sequence[int], output: Sequence[int], k: int,
               run: Callable[[Sequence[int], int, int], int] = copy_run) -> list[int]:
    """The accepted draft length of each step when every step's draft is `run`'s (the copy ceiling's by default;
    the step commits run + 1 tokens; the last step may commit fewer where the output ends)."""
    seq = list(prompt) + list(output)
    i, runs = len(prompt), []
    while i < len(seq):
        run_len = run(seq, i, min(k, len(seq) - i - 1))
        runs.append(run_len)
        i += run_len + 1
    return runs


def decode_ceiling(runs: Sequence[int], step_s: Callable[[int], float]) -> float:
    """Plain decoding's time over the steps' time, for the tokens `runs` commit: plain spends step_s(1) a token,
    a step of run r verifies r + 1 tokens in step_s(r + 1) and commits r + 1."""
    tokens = sum(r + 1 for r in runs)
    return tokens * step_s(1) / sum(step_s(r + 1) for r in runs)


def end_to_end_ceiling(first_token_s: float, decode_s: float, speedup: float) -> float:
    """A request's plain time over its time when decoding runs `speedup` times faster and the time to the first
    token stays (math.inf for speedup gives the ceiling of any drafter)."""
    return (first_token_s + decode_s) / (first_token_s + decode_s / speedup)
