"""Confidence calibration for DSpark: expected calibration error and sequential per-position temperature scaling.

DSpark's scheduler reads the survival probability of draft position k as the cumulative product
a_k = prod_{i<=k} sigmoid(l_i / T_i) of the per-position confidences. Temperatures are fitted in order k = 1..g:
T_1..T_{k-1} fixed, T_k is the grid value minimising the ECE of a_k against the observed survival of position k.
"""

from __future__ import annotations

import torch

DEFAULT_GRID = tuple(float(t) for t in torch.logspace(-1.0, 1.0, 41).tolist()) + (1.0,)


def ece(probs: torch.Tensor, outcomes: torch.Tensor, bins: int = 10) -> float:
    """Expected calibration error: sum_b (n_b / N) |mean(probs in b) - mean(outcomes in b)|.

    probs, outcomes: [N] (outcomes 0/1 or soft). Bins are equal-width on [0, 1]; p = 1 falls in the last bin.
    """
    p = probs.detach().double().flatten()
    y = outcomes.detach().double().flatten()
    if p.numel() == 0:
        return 0.0
    idx = (p * bins).long().clamp(0, bins - 1)  # [N]
    sum_p = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, p)
    sum_y = torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, y)
    return float((sum_p - sum_y).abs().sum() / p.numel())  # n_b/N * |sum_p/n_b - sum_y/n_b|


def cumulative_survival(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """logits: [N, g] raw confidence logits, temps: [g] -> a: [N, g], a_k = prod_{i<=k} sigmoid(l_i / T_i)."""
    return torch.sigmoid(logits.double() / temps.double()).cumprod(dim=1)


def per_position_ece(logits: torch.Tensor, survival: torch.Tensor, valid: torch.Tensor, temps: torch.Tensor,
                     bins: int = 10) -> list[float]:
    """ECE of a_k against survival [N, g] at each position k, over the rows valid [N, g] there."""
    a = cumulative_survival(logits, temps)
    return [ece(a[valid[:, k], k], survival[valid[:, k], k], bins) for k in range(logits.shape[1])]


def fit_position_temperatures(logits: torch.Tensor, survival: torch.Tensor, valid: torch.Tensor,
                              grid: tuple[float, ...] = DEFAULT_GRID, bins: int = 10) -> list[float]:
    """Sequential temperature scaling. logits, survival (0/1), valid (bool): [N, g]. Returns T_1..T_g.

    The grid contains 1.0, so position 1's ECE never gets worse than uncalibrated; positions with no valid rows
    keep T = 1.
    """
    g = logits.shape[1]
    temps: list[float] = []
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)  # prod_{i<k} sigmoid(l_i / T_i), [N]
    for k in range(g):
        rows = valid[:, k]
        best_t, best = 1.0, float("inf")
        if rows.any():
            for t in sorted(set(grid)):
                e = ece(prefix[rows] * torch.sigmoid(logits[rows, k].double() / t), survival[rows, k], bins)
                if e < best - 1e-12 or (abs(e - best) <= 1e-12 and abs(t - 1.0) < abs(best_t - 1.0)):
                    best_t, best = t, e
        temps.append(best_t)
        prefix = prefix * torch.sigmoid(logits[:, k].double() / best_t)
    return temps
