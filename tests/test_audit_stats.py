"""The audit's paired statistics against independent references: scipy's exact binomial test and hand-computed
binomial sums (sign test), known synthetic shifts (bootstrap interval), hand-made strings (exact match, common
prefix, first divergence)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from verispec.audit.stats import (bootstrap_ci, common_prefix_pct, first_divergence, pair_up, per_domain,
                                  sign_test_p, summarize)


@pytest.mark.parametrize("wins,losses,expected", [
    (0, 0, 1.0),
    (5, 0, 2 / 32),  # both tails: all wins or all losses
    (6, 0, 2 / 64),
    (0, 6, 2 / 64),
    (8, 2, 2 * (1 + 10 + 45) / 1024),
    (3, 3, 1.0),
    (1, 0, 1.0),
])
def test_sign_test_hand_computed(wins: int, losses: int, expected: float) -> None:
    assert sign_test_p(wins, losses) == pytest.approx(expected, rel=1e-12)


def test_sign_test_matches_scipy_binomtest() -> None:
    from scipy.stats import binomtest

    for wins in range(0, 31, 3):
        for losses in range(0, 31, 4):
            if wins + losses == 0:
                continue
            ref = binomtest(wins, wins + losses, 0.5, alternative="two-sided").pvalue
            assert sign_test_p(wins, losses) == pytest.approx(ref, rel=1e-9, abs=1e-15), (wins, losses)


def test_sign_test_rejects_negative_counts() -> None:
    with pytest.raises(ValueError):
        sign_test_p(-1, 3)


def test_bootstrap_interval_covers_a_known_shift() -> None:
    """Coverage over many synthetic data sets with a known mean shift is near the nominal 95%."""
    shift, covered, excluded_zero = 0.3, 0, 0
    for k in range(100):
        d = shift + np.random.default_rng(1000 + k).normal(0.0, 0.5, size=60)
        lo, hi = bootstrap_ci(d, n_resamples=500, seed=k)
        assert lo < d.mean() < hi
        covered += lo <= shift <= hi
        excluded_zero += lo > 0
    assert 85 <= covered <= 100, covered
    assert excluded_zero >= 95  # a shift of 0.3 with sd 0.5 and n = 60 is 4.6 standard errors


def test_bootstrap_is_seeded_and_exact_for_equal_deltas() -> None:
    d = [0.1, -0.2, 0.5, 0.0, 0.3, 0.3, -0.1]
    assert bootstrap_ci(d, seed=3) == bootstrap_ci(d, seed=3)
    assert bootstrap_ci([0.25] * 40) == (0.25, 0.25)
    assert bootstrap_ci([0.0] * 5) == (0.0, 0.0)
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def test_common_prefix_and_first_divergence_on_hand_made_strings() -> None:
    assert common_prefix_pct("hello world", "hello there") == pytest.approx(100 * 6 / 11)
    assert common_prefix_pct("abc", "abc") == 100.0
    assert common_prefix_pct("", "") == 100.0
    assert common_prefix_pct("abc", "") == 0.0
    assert common_prefix_pct("abcd", "ab") == 50.0
    assert common_prefix_pct("xbc", "abc") == 0.0
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence(None, [1]) is None


def rec(item: str, side: str, score: float, text: str, domain: str = "creative", t: float = 0.0, sample: int = 0,
        error: str | None = None, ids=None) -> dict:
    return {"item_id": item, "domain": domain, "side": side, "temperature": t, "sample": sample, "score": score,
            "passed": score >= 0.5, "text": text, "token_ids": ids, "error": error, "margin": None, "near_tie": None}


def test_pairs_and_summary_by_hand() -> None:
    records = [
        rec("a", "reference", 1.0, "same"), rec("a", "candidate", 1.0, "same"),  # tie, exact
        rec("b", "reference", 1.0, "abcd"), rec("b", "candidate", 0.5, "abXY"),  # loss, prefix 50%
        rec("c", "reference", 0.0, "q"), rec("c", "candidate", 1.0, "r"),  # win, prefix 0%
        rec("d", "reference", 0.0, "z"), rec("d", "candidate", 0.0, "", error="http_500: boom"),  # left out
    ]
    pairs = pair_up(records)
    assert len(pairs) == 4
    s = summarize(pairs, n_resamples=200)
    assert (s["pairs"], s["errors"], s["wins"], s["losses"], s["ties"]) == (3, 1, 1, 1, 1)
    assert s["candidate_mean"] == pytest.approx(2.5 / 3) and s["reference_mean"] == pytest.approx(2 / 3)
    assert s["delta"] == pytest.approx(0.5 / 3)
    assert s["exact_match_pct"] == pytest.approx(100 / 3)
    assert s["common_prefix_pct"] == pytest.approx((100 + 50 + 0) / 3)
    assert s["sign_p"] == 1.0
    assert s["ci_low"] <= s["delta"] <= s["ci_high"]


def test_per_domain_groups_and_pools() -> None:
    records = []
    for i in range(4):
        for dom in ("creative", "coding"):
            records.append(rec(f"{dom}{i}", "reference", 1.0, "x", domain=dom, t=1.0))
            records.append(rec(f"{dom}{i}", "candidate", 0.0 if dom == "coding" else 1.0, "y", domain=dom, t=1.0))
    rows = {r["domain"]: r for r in per_domain(pair_up(records), n_resamples=200)}
    assert set(rows) == {"creative", "coding", "all"}
    assert rows["coding"]["losses"] == 4 and rows["coding"]["delta"] == -1.0
    assert rows["coding"]["ci_low"] == rows["coding"]["ci_high"] == -1.0
    assert rows["creative"]["ties"] == 4 and rows["creative"]["sign_p"] == 1.0
    assert rows["all"]["pairs"] == 8 and rows["all"]["delta"] == -0.5


def test_pair_up_refuses_a_missing_or_doubled_side() -> None:
    with pytest.raises(ValueError, match="lacks a side"):
        pair_up([rec("a", "reference", 1.0, "x")])
    with pytest.raises(ValueError, match="two reference"):
        pair_up([rec("a", "reference", 1.0, "x"), rec("a", "reference", 1.0, "x")])
