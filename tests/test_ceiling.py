"""The copy ceiling (bench/ceiling.py) against brute force, closed forms, and the shipped copying drafters."""

from __future__ import annotations

import math
import random

import pytest

from verispec.bench.ceiling import (copy_run, copy_steps, decode_ceiling, drafter_run, end_to_end_ceiling,
                                    lookup_run)
from verispec.drafters.ngram import NgramDrafter


def matched(draft: list[int], target: list[int]) -> int:
    """How many leading draft tokens the target's own tokens equal (greedy verification's accepted count)."""
    return next((j for j, (a, b) in enumerate(zip(draft, target)) if a != b), min(len(draft), len(target)))


def brute_run(seq: list[int], i: int, k: int) -> int:
    """The longest L <= k whose run seq[i:i+L] equals a window starting before i, by trying every L and s."""
    best = 0
    for length in range(1, min(k, len(seq) - i) + 1):
        if any(seq[s : s + length] == seq[i : i + length] for s in range(i)):
            best = length
    return best


def test_copy_run_equals_brute_force_including_overlapping_sources() -> None:
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
        i, k = rng.randrange(len(seq)), rng.randrange(0, 9)
        assert copy_run(seq, i, k) == brute_run(seq, i, k)
    # a period-2 tail copies from a source that overlaps the run itself: a b a b a b ... from i = 2
    assert copy_run([7, 8, 7, 8, 7, 8, 7], 2, 8) == 5


def test_copy_steps_walk_commits_the_whole_output_with_runs_at_most_k() -> None:
    prompt, output = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 9, 1, 2]
    runs = copy_steps(prompt, output, k=4)
    assert sum(r + 1 for r in runs) == len(output)
    assert runs == [4, 0, 1]  # 1 2 3 4 copied, 5 the target's | 9 never occurred | 1 copied, 2 the target's
    assert all(r <= 2 for r in copy_steps(prompt, output, k=2))


@pytest.mark.parametrize("seed", range(6))
def test_no_copying_drafter_needs_fewer_steps_than_the_ceiling(seed: int) -> None:
    """The n-gram drafter, every draft verified, against the same output: its drafts are copies of the context
    (periodic where they run past its end), so it never commits in fewer steps than the ceiling walk."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(2, 7))] for _ in range(6)]
    prompt = [t for _ in range(8) for t in rng.choice(phrases)]
    output = [t for _ in range(12) for t in (rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(50)])]
    k = 4
    drafter, i, steps = NgramDrafter(), 0, 0
    while i < len(output):
        run = matched(drafter.propose(prompt + output[:i], k).tokens, output[i : len(output) - 1])
        i, steps = i + run + 1, steps + 1
    assert steps >= len(copy_steps(prompt, output, k))
    assert len(copy_steps(prompt, output, k, drafter_run(NgramDrafter()))) == steps  # the studies' walk of it


def test_decode_and_end_to_end_ceilings_follow_their_closed_forms() -> None:
    runs = [3, 0, 1, 2]  # 10 tokens in 4 steps
    assert decode_ceiling(runs, lambda n: 1.0) == pytest.approx(10 / 4)  # flat step costs: the ceiling is tau
    linear = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    assert decode_ceiling(runs, linear) == pytest.approx(10 * 1.0 / (1.3 + 1.0 + 1.1 + 1.2))
    assert end_to_end_ceiling(0.6, 0.4, math.inf) == pytest.approx(1 / 0.6)
    assert end_to_end_ceiling(0.5, 0.5, 2.0) == pytest.approx(1.0 / 0.75)
    assert end_to_end_ceiling(0.0, 1.0, 1.7) == pytest.approx(1.7)


def test_best_lookup_candidate_lies_between_the_drafter_and_the_copy_ceiling() -> None:
    """At every position: the shipped n-gram drafter's accepted run <= the best candidate of its lookup <= the
    copy ceiling's run."""
    rng = random.Random(7)
    for _ in range(40):
        seq = [rng.randrange(4) for _ in range(rng.randrange(6, 40))]
        for i in range(2, len(seq)):
            drafter_run = matched(NgramDrafter().propose(seq[:i], 5).tokens, seq[i:])
            assert drafter_run <= lookup_run(seq, i, 5) <= copy_run(seq, i, 5)
    assert lookup_run([1, 2, 9, 1, 2, 8, 1, 2, 8], 8, 3) == 1  # "1 2" occurred twice before: "9" and "8" follow
