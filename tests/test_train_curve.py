"""The learning-curve extrapolation of a trained drafter (train/curve.py) and its section in the model card.

References are independent of the code: numpy's polyfit for the least-squares line, the closed form
exp((target - a) / b) for where a known line reaches a target, and hand-built training logs in the trainers'
formats."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from verispec.cli import main
from verispec.train.card import CURVE_HEADING, CURVE_PNG, add_curve_section
from verispec.train.curve import curve_points, extrapolate, fit_log


def dflash_log(taus: list[float], every: int = 50, train_tokens: int = 100_000, wall: float = 3000.0) -> dict:
    steps = every * (len(taus) - 1)
    return {"method": "dflash", "steps": steps, "train_tokens": train_tokens, "wall_seconds": wall,
            "heldout": [{"step": every * i, "acc": 0.0, "tau": t - 1.0} for i, t in enumerate(taus)]}


def test_fit_matches_numpy_polyfit_on_the_tail():
    rng = np.random.default_rng(0)
    xs = np.geomspace(1e3, 1e6, 12)
    ys = 1.1 + 0.07 * np.log(xs) + rng.normal(0, 0.01, xs.size)
    ys[:4] -= 0.3  # a warm-up dip the tail fit must leave out
    fit = fit_log(list(zip(xs.tolist(), ys.tolist())), tail=0.5)
    b, a = np.polyfit(np.log(xs[6:]), ys[6:], 1)
    assert fit.n == 6 and fit.lo == pytest.approx(xs[6]) and fit.hi == pytest.approx(xs[-1])
    assert fit.a == pytest.approx(a, rel=1e-9) and fit.b == pytest.approx(b, rel=1e-9)
    resid = ys[6:] - (a + b * np.log(xs[6:]))
    assert fit.rmse == pytest.approx(float(np.sqrt(np.mean(resid ** 2))), rel=1e-9)


def test_exact_line_reaches_the_target_where_the_closed_form_says():
    a, b = 0.4, 0.1
    pts = [(x, a + b * math.log(x)) for x in (1e4, 2e4, 4e4, 8e4)]
    fit = fit_log(pts, tail=1.0)
    assert fit.positions_for(2.5) == pytest.approx(math.exp((2.5 - a) / b), rel=1e-9)
    assert fit.per_doubling == pytest.approx(b * math.log(2))


def test_offset_shifts_the_positions_the_line_is_fitted_on():
    a, b, off = 0.2, 0.05, 5e4
    pts = [(x, a + b * math.log(off + x)) for x in (1e4, 2e4, 3e4, 4e4)]
    fit = fit_log(pts, offset=off, tail=1.0)
    assert (fit.a, fit.b) == (pytest.approx(a), pytest.approx(b))
    assert fit.lo == pytest.approx(off + 1e4)


def test_a_flat_or_falling_tail_reaches_nothing():
    log = dflash_log([1.1, 1.2, 1.3, 1.3, 1.29, 1.28])
    ex = extrapolate(log, "dflash")
    assert ex.fit.b < 0 and ex.positions is None and ex.seconds is None
    assert "does not rise" in ex.sentence()


def test_compute_and_data_at_the_runs_own_rates():
    taus = [1.0 + 0.05 * math.log(50 * i * 400) for i in range(1, 9)]
    log = dflash_log([1.0] + taus, train_tokens=160_000, wall=4000.0)  # 400 positions per step
    ex = extrapolate(log, "dflash", target=3.0, data_tokens=40_000)  # 4 passes over the data
    need = math.exp((3.0 - 1.0) / 0.05)
    assert ex.positions == pytest.approx(need, rel=1e-6)
    assert ex.seconds == pytest.approx(need * 4000.0 / 160_000, rel=1e-6)
    assert ex.data_tokens == pytest.approx(need / 4, rel=1e-6)
    assert ex.reached == pytest.approx(taus[-1])


def test_curve_points_read_each_trainers_log():
    e = {"method": "eagle3", "updates": 100, "train_tokens": 50_000,
         "heldout_curve": [{"step": 0, "conditional_tau_estimate": 1.4}, {"step": 40, "conditional_tau_estimate": 1.5}]}
    assert curve_points(e, "eagle3") == [(0.0, 1.4), (20_000.0, 1.5)]
    d = dflash_log([1.2, 1.3], every=50, train_tokens=1000)
    assert curve_points(d, "dflash") == [(0.0, pytest.approx(1.2)), (1000.0, pytest.approx(1.3))]
    with pytest.raises(ValueError, match="train_tokens"):
        curve_points({"steps": 10, "heldout": []}, "dspark")
    with pytest.raises(ValueError, match="method"):
        curve_points(d, "ngram")


def test_card_section_with_plot_replaced_not_repeated(tmp_path, capsys):
    taus = [1.0 + 0.04 * math.log(100 * i) for i in range(1, 8)]
    (tmp_path / "train_log.json").write_text(json.dumps(dflash_log([1.0] + taus, every=1, train_tokens=700)))
    (tmp_path / "README.md").write_text("# card\n\n## Measured\n\nfigures\n\n## Notes\n\n- a note\n")
    add_curve_section(tmp_path, "dflash", target=1.5)
    assert main(["train", "curve", str(tmp_path), "--target", "1.4", "--note", "second fit"]) == 0
    assert "reaching 1.4" in capsys.readouterr().out
    card = (tmp_path / "README.md").read_text()
    assert card.count(CURVE_HEADING) == 1 and "reaching 1.4" in card and "reaching 1.5" not in card
    assert card.index("## Measured") < card.index(CURVE_HEADING) < card.index("## Notes")
    assert "second fit" in card and "- a note" in card and "figures" in card
    assert (tmp_path / CURVE_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
