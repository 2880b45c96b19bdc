"""Verification rules against closed-form distributions."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import chi2_pvalue
from verispec.sampling import SamplingParams, sample_index, sample_rows, target_probs
from verispec.execution.verify import AcceptanceConfig, residual, verify_greedy, verify_sampled


def test_greedy_accepts_matching_prefix_then_corrects():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 7, 2, 9]):
        logits[i, t] = 5.0
    v = verify_greedy(torch.tensor([3, 7, 5]), logits)
    assert v.accepted == 2 and v.tokens == [3, 7, 2]
    v = verify_greedy(torch.tensor([3, 7, 2]), logits)
    assert v.accepted == 3 and v.tokens == [3, 7, 2, 9]  # bonus
    v = verify_greedy(torch.tensor([], dtype=torch.long), logits[:1])
    assert v.accepted == 0 and v.tokens == [3]


@pytest.mark.parametrize("deterministic", [True, False])
def test_first_emitted_token_follows_p(deterministic):
    """Whatever q is, the first emitted token is distributed as p_1 (Leviathan et al., Theorem 1)."""
    g = torch.Generator().manual_seed(0)
    V = 6
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)
    counts = torch.zeros(V)
    n = 20000
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=g) if not deterministic else torch.tensor([2])
        v = verify_sampled(x, None if deterministic else q, p, g)
        counts[v.tokens[0]] += 1
    assert chi2_pvalue(counts, p[0]) > 1e-3


def test_lossy_threshold_is_detected_and_labelled():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.3, 0.3, 0.4]])
    rule = AcceptanceConfig("threshold", threshold_single=0.25)
    assert rule.lossy and not AcceptanceConfig().lossy
    counts = torch.zeros(3)
    for _ in range(5000):  # a deterministic draft of token 1 (p = 0.3 >= 0.25) is always accepted
        counts[verify_sampled(torch.tensor([1]), None, p, g, rule).tokens[0]] += 1
    assert counts[1] == 5000 and chi2_pvalue(counts, p[0]) < 1e-3


def test_residual():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q, 1), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    assert torch.allclose(residual(p, p, 0), p)


def test_target_probs_top_k_top_p_closed_form():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(target_probs(logits, 1.0, top_k=2), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    # top-p 0.75: 0.4 + 0.3 < 0.75, so 0.2 is needed too
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.75), torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0]]))
    t = target_probs(logits, 0.5)
    expect = torch.tensor([0.16, 0.09, 0.04, 0.01])
    assert torch.allclose(t, (expect / expect.sum())[None])
    assert math.isclose(t.sum().item(), 1.0, rel_tol=1e-6)


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_argmax_rows_is_torchs_argmax_first_of_equals_included() -> None:
    from verispec.sampling import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 49152, generator=g)
    x[1, 7] = x[1, 9000] = x[1].max() + 1  # a tie: the first wins
    x[2, 123] = float("nan")  # NaN counts as the largest, as in torch
    x[3] = 0.0
    for t in (x, x[0], x.bfloat16(), x[:, :100].t()):  # float32 rows, one row, bf16 (torch's), a strided view
        assert argmax_rows(t) == t.argmax(-1).reshape(-1).tolist()
    assert argmax_rows(x)[1:4] == [7, 123, 0]


def test_sample_rows_follows_each_row_and_never_draws_a_zero():
    """The inverse-CDF sampler against closed-form distributions: several unnormalised rows with exact zeros
    (as top-k / top-p and the residual leave them), many draws each; plus per-seed reproducibility."""
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(3, 12, generator=g) * 5  # [3, 12], unnormalised on purpose
    probs[0, [0, 5, 11]] = 0.0  # zeros at both ends and inside
    probs[1, :6] = 0.0
    probs[2] = 0.0
    probs[2, 7] = 2.0  # a point mass
    n = 20000
    counts = torch.zeros(3, 12)
    for _ in range(n // 100):
        draws = torch.tensor([sample_rows(probs, g) for _ in range(100)])  # [100, 3]
        for r in range(3):
            counts[r] += torch.bincount(draws[:, r], minlength=12)
    assert counts[probs == 0].sum() == 0
    assert counts[2, 7] == n
    for r in range(2):
        nz = probs[r] > 0
        assert chi2_pvalue(counts[r][nz], probs[r][nz] / probs[r].sum()) > 1e-3
    one = [sample_index(probs[0], torch.Generator().manual_seed(9)) for _ in range(2)]
    assert one[0] == one[1]
    wide = torch.softmax(torch.randn(49152, generator=g) * 3, -1)  # the default model's vocabulary
    assert sample_index(wide, g) in range(49152)


def test_a_greedy_drafters_pick_is_the_first_top_logit_and_its_softmax_probability() -> None:
    """`greedy_pick` (the token a greedy token-by-token drafter drafts and its confidence) against torch's argmax
    and float64 softmax: rows with a clear winner, a tie (the first of equals, as torch's argmax), a flat row, huge
    logits that a naive exp overflows, and the torch path it takes for other dtypes."""
    from verispec.drafters.base import greedy_pick

    g = torch.Generator().manual_seed(4)
    tie = torch.randn(300, generator=g)
    tie[[17, 201]] = tie.max() + 1.0
    rows = [torch.randn(8192, generator=g) * 3, tie, torch.zeros(50), torch.randn(64, generator=g) * 1e4 + 1e30]
    for x in rows:
        j, conf = greedy_pick(x)
        assert j == int(torch.argmax(x))
        assert conf == pytest.approx(float(torch.softmax(x.double(), -1)[j]), rel=1e-5)
    assert greedy_pick(tie)[0] == 17 and greedy_pick(torch.zeros(50))[1] == pytest.approx(1 / 50)
    j, conf = greedy_pick(rows[0].bfloat16())
    assert j == int(torch.argmax(rows[0].bfloat16())) and 0 < conf <= 1
