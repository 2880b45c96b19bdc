"""train/speed_target.py against closed forms: a geometric drafter's tau, the speed ratio of linear step costs, the
least improvement found by bisection against a brute-force scan of the closed form; and the card's sections."""

from __future__ import annotations

import pytest

from verispec.train.card import SPEED_HEADING, put_section
from verispec.train.speed_target import StreamCosts, best, shrink_misses, speed_goal, speedup, tau


def geometric(alpha: float, n: int = 7) -> list[float]:
    return [alpha ** j for j in range(1, n + 1)]


def linear_costs(per_row: float = 0.1, rest: float = 0.0, prefill: float = 0.0, k: int = 7) -> StreamCosts:
    """plain step 1, forward over m rows 1 + per_row (m - 1), the rest of a step `rest`."""
    return StreamCosts(prefill=prefill, plain=1.0, forward=tuple(1.0 + per_row * m for m in range(k + 1)),
                       rest=rest, rest_per_token=0.0, tokens=100.0)


def closed_form_ratio(alpha: float, k: int, per_row: float) -> float:
    return (1 - alpha ** (k + 1)) / (1 - alpha) / (1 + per_row * k)


def test_tau_of_a_geometric_drafter_is_the_closed_form():
    for alpha in (0.0, 0.3, 0.75, 0.99):
        for k in range(8):
            assert tau(geometric(alpha), k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_speedup_of_linear_costs_and_the_best_k():
    c = linear_costs(0.1)
    for k in range(1, 8):
        assert speedup(geometric(0.6), c, k) == pytest.approx(closed_form_ratio(0.6, k, 0.1))
    k, r = best(geometric(0.6), c)
    assert r == pytest.approx(max(closed_form_ratio(0.6, j, 0.1) for j in range(1, 8)))
    assert r == pytest.approx(closed_form_ratio(0.6, k, 0.1))
    # a prefill as long as the whole decode halves the gain: (P + n) / (P + n / r)
    slow = linear_costs(0.1, prefill=100.0)
    assert speedup(geometric(0.6), slow, 3) == pytest.approx(200 / (100 + 100 / closed_form_ratio(0.6, 3, 0.1)))


def test_shrinking_misses_scales_each_conditional_miss_rate():
    assert shrink_misses(geometric(0.6), 1.0) == pytest.approx(geometric(0.6))
    assert shrink_misses(geometric(0.6), 0.5) == pytest.approx(geometric(0.8))
    assert shrink_misses(geometric(0.6), 0.0) == pytest.approx([1.0] * 7)
    # uneven positions, and a position never reached (0 / 0) taken as a certain miss
    assert shrink_misses([0.5, 0.4, 0.0, 0.0], 0.5) == pytest.approx([0.75, 0.75 * 0.9, 0.75 * 0.9 * 0.5,
                                                                        0.75 * 0.9 * 0.5 * 0.5])


def test_least_improvement_matches_a_brute_force_scan():
    per_row, alpha = 0.1, 0.5
    c = linear_costs(per_row)
    g = speed_goal(geometric(alpha), c, goal=1.5)
    assert not g.reached and g.lam is not None and g.now_ratio < 1.5
    # the smallest alpha whose best k reaches 1.5, on a fine grid of the closed form
    grid = [alpha + i * 1e-5 for i in range(int((1 - alpha) / 1e-5))]
    need = next(a for a in grid if max(closed_form_ratio(a, k, per_row) for k in range(1, 8)) >= 1.5)
    assert 1 - g.lam * (1 - alpha) == pytest.approx(need, abs=2e-4)
    assert g.tau_needed == pytest.approx(tau(geometric(need), 7), abs=2e-3)
    assert max(closed_form_ratio(need, k, per_row) for k in range(1, 8)) == pytest.approx(
        closed_form_ratio(need, g.k, per_row), abs=1e-3)


def test_reached_and_unreachable_goals():
    assert speed_goal(geometric(0.9), linear_costs(0.05), goal=1.5).reached
    g = speed_goal(geometric(0.9), linear_costs(0.05), goal=1.5)
    assert g.lam == 1.0 and g.tau_needed == g.tau_now
    # each row costs a whole step and drafting costs more: not even certain drafts pay
    g = speed_goal(geometric(0.9), linear_costs(1.0, rest=0.5), goal=1.5)
    assert g.lam is None and g.k is None and g.tau_needed is None


def test_costs_refuse_nonsense():
    with pytest.raises(AssertionError):
        StreamCosts(prefill=0.0, plain=0.0, forward=(1.0,), rest=0.0, rest_per_token=0.0, tokens=1.0)
    with pytest.raises(AssertionError):
        linear_costs().step(8)


def test_section_put_before_notes_and_replaced_not_repeated(tmp_path):
    card = tmp_path / "README.md"
    card.write_text("# card\n\n## Measured\n\nfigures\n\n## Learning curve\n\ncurve\n\n## Notes\n\n- a note\n")
    put_section(card, SPEED_HEADING, f"{SPEED_HEADING}\n\nfirst")
    put_section(card, SPEED_HEADING, f"{SPEED_HEADING}\n\nsecond\n")
    text = card.read_text()
    assert text.count(SPEED_HEADING) == 1 and "second" in text and "first" not in text
    assert text.index("## Learning curve") < text.index(SPEED_HEADING) < text.index("## Notes")
    assert "curve" in text and "- a note" in text and "figures" in text
    bare = tmp_path / "bare.md"
    bare.write_text("# card\n")
    put_section(bare, SPEED_HEADING, f"{SPEED_HEADING}\n\nx")
    assert bare.read_text() == f"# card\n\n{SPEED_HEADING}\n\nx\n\n"
    with pytest.raises(AssertionError):
        put_section(bare, SPEED_HEADING, "no heading")
