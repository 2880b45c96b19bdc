"""A trained drafter's learning curve and what reaching a target would take, extrapolated from it.

The curve is the held-out tau estimate a training run logs (EAGLE-3: the independent-steps estimate per update;
DFlash / DSpark: 1 + the expected accepted positions before the first miss) against the positions trained so far.
Its tail is fitted as tau = a + b ln(positions), the usual shape of such curves once past warm-up, by least squares
over the last `tail` share of the points. Solving for a target gives the positions needed, and the run's own rate
(positions per second, positions per data token) turns that into compute and data. It is an extrapolation of a
short curve, stated as such: a flat or falling tail means this recipe does not get there at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

TARGETS = {"eagle3": 2.5, "dflash": 3.0, "dspark": 3.3}  # issue targets; DSpark: 1.1x DFlash's


@dataclass(frozen=True)
class LogFit:
    """tau = a + b ln(positions), fitted on `n` points with positions in [lo, hi]; rmse of the residuals."""

    a: float
    b: float
    lo: float
    hi: float
    n: int
    rmse: float

    def at(self, positions: float) -> float:
        return self.a + self.b * math.log(positions)

    @property
    def per_doubling(self) -> float:
        return self.b * math.log(2.0)

    def positions_for(self, target: float) -> float | None:
        """Positions at which the fitted line reaches `target`; None where the tail does not rise."""
        if self.b <= 0:
            return None
        return math.exp((target - self.a) / self.b)


def curve_points(log: dict, method: str) -> list[tuple[float, float]]:
    """[(positions trained in this run, held-out tau estimate)] from a training run's train_log.json."""
    if method == "eagle3":
        steps, rows = log.get("updates"), [(h["step"], h["conditional_tau_estimate"]) for h in log.get("heldout_curve", [])]
    elif method in ("dflash", "dspark"):
        steps, rows = log.get("steps"), [(h["step"], 1.0 + h["tau"]) for h in log.get("heldout", [])]
    else:
        raise ValueError(f"no learning curve for method {method!r} (eagle3, dflash, dspark)")
    if not log.get("train_tokens") or not steps:
        raise ValueError("the training log records no trained positions (train_tokens): a run older than the curve")
    per_step = log["train_tokens"] / steps
    return [(s * per_step, tau) for s, tau in rows]


def fit_log(points: list[tuple[float, float]], offset: float = 0.0, tail: float = 0.5) -> LogFit:
    """Least-squares tau = a + b ln(offset + positions) over the last `tail` share of the points (at least 3) with
    offset + positions > 0."""
    pts = [(offset + x, y) for x, y in points if offset + x > 0]
    pts = pts[-max(3, math.ceil(tail * len(pts))):]
    if len(pts) < 3:
        raise ValueError(f"{len(pts)} usable points: a curve needs at least 3")
    xs, ys = [math.log(x) for x, _ in pts], [y for _, y in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("every point at the same number of positions: no slope to fit")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    rmse = math.sqrt(sum((a + b * x - y) ** 2 for x, y in zip(xs, ys)) / len(xs))
    return LogFit(a, b, pts[0][0], pts[-1][0], len(pts), rmse)


def _sig(x: float) -> str:
    """Two significant digits: 170, 0.093, 7.2e7."""
    if x >= 1e6:
        m, e = f"{x:.1e}".split("e")
        return f"{m}e{int(e)}"
    return f"{float(f'{x:.2g}'):,g}"


@dataclass(frozen=True)
class Extrapolation:
    """What the fitted tail says about reaching `target`."""

    fit: LogFit
    target: float
    points: tuple[tuple[float, float], ...]  # the run's curve (curve_points)
    offset: float  # positions trained before the run, added to its own
    positions: float | None  # total positions (offset included) at which the fit reaches the target
    seconds: float | None  # at the run's training rate
    data_tokens: float | None  # at the run's positions per data token (its passes over the data)

    @property
    def reached(self) -> float:
        """The last logged estimate."""
        return self.points[-1][1]

    def sentence(self) -> str:
        f = self.fit
        head = (f"tau estimate {self.reached:.2f} at the end; the fitted tail (last {f.n} points, "
                f"{_sig(f.lo)}..{_sig(f.hi)} positions, rmse {f.rmse:.3f}) gains {f.per_doubling:+.3f} per doubling "
                "of training")
        if self.reached >= self.target:
            return head + f"; the target {self.target:g} is already reached."
        if self.positions is None:
            return head + f": it does not rise, so more of the same training does not reach {self.target:g}."
        return (head + f"; reaching {self.target:g} would take {self.cost()}, if the log-linear trend held that far "
                "(an extrapolation far beyond the measured range).")

    def cost(self) -> str:
        """'about N trained positions (H hours at this run's rate on this machine, D response tokens of data at its
        passes over the data)', as far as the run's log says; the positions must be known."""
        assert self.positions is not None, "the fit does not reach the target"
        out = f"about {_sig(self.positions)} trained positions"
        if self.seconds is not None:
            out += f" ({_sig(self.seconds / 3600)} hours at this run's rate on this machine"
            out += f", {_sig(self.data_tokens)} response tokens of data at its passes over the data)" \
                if self.data_tokens is not None else ")"
        return out


def extrapolate(log: dict, method: str, target: float | None = None, offset: float = 0.0,
                data_tokens: float | None = None, tail: float = 0.5) -> Extrapolation:
    """The run's curve, its fitted tail and the compute / data the target would take at the run's own rates.
    data_tokens: response tokens of the data the run trained on (positions per data token = its passes)."""
    target = TARGETS[method] if target is None else target
    pts = curve_points(log, method)
    fit = fit_log(pts, offset, tail)
    need = fit.positions_for(target)
    seconds = passes = None
    wall = log.get("wall_s", log.get("wall_seconds"))
    if need is not None and wall:
        seconds = need * float(wall) / log["train_tokens"]
    if need is not None and data_tokens:
        passes = log["train_tokens"] / data_tokens
    return Extrapolation(fit, target, tuple(pts), offset, need, seconds, None if passes is None else need / passes)


def plot_curve(ex: Extrapolation, method: str, path: str | Path) -> Path:
    """The logged curve, the fitted tail carried to the target, and the target line, as a PNG (log x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(ex.offset + x, y) for x, y in ex.points if ex.offset + x > 0]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label="held-out tau estimate")
    f = ex.fit
    end = min(ex.positions, f.hi * 1e6) if ex.positions is not None else f.hi * 10
    xs = [f.lo * (end / f.lo) ** (i / 40) for i in range(41)]
    ax.plot(xs, [f.at(x) for x in xs], "--", label=f"fit a + b ln(x), {f.per_doubling:+.3f} per doubling")
    ax.axhline(ex.target, color="grey", lw=0.8, label=f"target {ex.target:g}")
    ax.set_xscale("log")
    ax.set_xlabel("trained positions" + (" (offset: earlier training)" if ex.offset else " (this run)"))
    ax.set_ylabel("tau estimate (held-out)")
    ax.set_title(f"{method}: learning curve and its extrapolation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
