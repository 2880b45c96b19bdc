"""Paired statistics of an audit: candidate against reference on the same items, samples and seeds.

The unit is a pair: one item, one temperature, one sample (seed), graded on both sides. Per domain and temperature:
mean score of each side; the paired delta (candidate - reference) with a percentile bootstrap 95% interval over
pairs (seeded); wins / losses / ties with the two-sided exact sign test (binomial, p = 1/2, ties dropped);
exact-match rate of the texts; character-level common-prefix percentage; the first divergent token index.
Pairs where either side failed (a request error) are counted and left out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Sequence

import numpy as np

PAIR_KEY = ("item_id", "temperature", "sample")


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test: P(a result at least as unbalanced as wins : losses) under Binomial(n, 1/2)."""
    if wins < 0 or losses < 0:
        raise ValueError("wins and losses must be >= 0")
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1))  # P(X <= k) * 2^n
    return min(1.0, 2 * tail / 2**n)


def bootstrap_ci(deltas: Sequence[float], n_resamples: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `deltas` (resampling pairs with replacement)."""
    d = np.asarray(deltas, dtype=np.float64)
    if d.size == 0:
        return (math.nan, math.nan)
    if np.all(d == d[0]):
        return (float(d[0]), float(d[0]))  # every resample has the same mean
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_resamples, d.size))  # [R, n]
    means = d[idx].mean(axis=1)  # [R]
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return (float(lo), float(hi))


def common_prefix_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def common_prefix_pct(a: str, b: str) -> float:
    """Characters both texts share from the start, as % of the longer one (100 for two empty texts)."""
    longest = max(len(a), len(b))
    return 100.0 if longest == 0 else 100.0 * common_prefix_chars(a, b) / longest


def first_divergence(a: Sequence[int] | None, b: Sequence[int] | None) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix); None if equal or unknown."""
    if a is None or b is None:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def pair_up(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Join the candidate's and the reference's record of each (item, temperature, sample) into one pair."""
    sides: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        key = tuple(r[k] for k in PAIR_KEY)
        if r["side"] in sides[key]:
            raise ValueError(f"two {r['side']} records for {dict(zip(PAIR_KEY, key))}")
        sides[key][r["side"]] = r
    pairs = []
    for key, s in sides.items():
        if set(s) != {"candidate", "reference"}:
            raise ValueError(f"{dict(zip(PAIR_KEY, key))} lacks a side: has {sorted(s)}")
        c, r = s["candidate"], s["reference"]
        pairs.append({
            "item_id": c["item_id"], "domain": c["domain"], "temperature": c["temperature"], "sample": c["sample"],
            "candidate": c["score"], "reference": r["score"], "delta": c["score"] - r["score"],
            "candidate_passed": c["passed"], "reference_passed": r["passed"],
            "error": bool(c.get("error") or r.get("error")),
            "exact": c["text"] == r["text"] and (c.get("token_ids") is None or r.get("token_ids") is None
                                                 or c["token_ids"] == r["token_ids"]),
            "common_prefix_pct": common_prefix_pct(c["text"], r["text"]),
            "first_divergence": first_divergence(r.get("token_ids"), c.get("token_ids")),
            "margin": c.get("margin"), "near_tie": c.get("near_tie"),
        })
    return pairs


def summarize(pairs: Sequence[dict[str, Any]], n_resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """The paired figures of one group of pairs (e.g. one domain at one temperature)."""
    ok = [p for p in pairs if not p["error"]]
    deltas = [p["delta"] for p in ok]
    wins = sum(d > 0 for d in deltas)
    losses = sum(d < 0 for d in deltas)
    lo, hi = bootstrap_ci(deltas, n_resamples, seed)
    divs = [p["first_divergence"] for p in ok if p["first_divergence"] is not None]
    mean = (lambda xs: float(np.mean(xs)) if len(xs) else math.nan)
    return {
        "pairs": len(ok), "errors": len(pairs) - len(ok),
        "candidate_mean": mean([p["candidate"] for p in ok]), "reference_mean": mean([p["reference"] for p in ok]),
        "delta": mean(deltas), "ci_low": lo, "ci_high": hi,
        "wins": wins, "losses": losses, "ties": len(deltas) - wins - losses, "sign_p": sign_test_p(wins, losses),
        "candidate_pass_rate": mean([float(p["candidate_passed"]) for p in ok]),
        "reference_pass_rate": mean([float(p["reference_passed"]) for p in ok]),
        "exact_match_pct": 100 * mean([float(p["exact"]) for p in ok]) if ok else math.nan,
        "common_prefix_pct": mean([p["common_prefix_pct"] for p in ok]),
        "first_divergence_median": float(np.median(divs)) if divs else None,
        "near_ties": sum(bool(p["near_tie"]) for p in ok),
        "margins_measured": sum(p["margin"] is not None for p in ok),
    }


def per_domain(pairs: Sequence[dict[str, Any]], n_resamples: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """One summary per (domain, temperature), then one over all domains per temperature ("all")."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for p in pairs:
        groups[(p["domain"], p["temperature"])].append(p)
        groups[("all", p["temperature"])].append(p)
    order = sorted(groups, key=lambda k: (k[1], k[0] == "all", k[0]))
    return [{"domain": d, "temperature": t, **summarize(groups[(d, t)], n_resamples, seed)} for d, t in order]
