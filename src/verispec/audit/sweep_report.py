"""The sweep's report in the bench format (bench/report.py): JSON with every raw record and run, CSV, Markdown with
the three conditions, a PNG of tau, quality delta and TV against the value, and one HTML page."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from verispec.audit.report import summary_rows
from verispec.bench.report import Report, Table, write_report


def _f(x: Any, spec: str) -> Any:
    if x is None:
        return "n/a"  # not measured (an endpoint: no p and q per position; no spec-decode /metrics)
    return "-" if isinstance(x, float) and math.isnan(x) else format(x, spec)


def value_table_rows(rows: Sequence[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        out.append({
            param: "1 (exact, reference)" if r["value"] is None else f"{r['value']:g}", "T": r["temperature"],
            "tau": _f(r["tau"], ".3f"), "tok/s": _f(r["tok_per_s"], ".1f"),
            "relaxed % of accepted": _f(None if r["relaxed_share"] is None else 100 * r["relaxed_share"], ".2f"),
            "TV mean": "0 (exact rule)" if r["value"] is None and r["tv_positions"] is not None
            else _f(r["tv_mean"], ".4f"),
            "TV positions": "n/a" if r["tv_positions"] is None else r["tv_positions"], "mean score": _f(r["mean_score"], ".3f"),
            "delta": _f(r["delta"], "+.3f"), "95% CI": "-" if math.isnan(r["ci_low"]) else
            f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]", "exact %": _f(r["exact_match_pct"], ".1f"),
            "byte-identical": "yes" if r["identical"] else "no",
        })
    return out


def sweep_notes(rows: Sequence[dict[str, Any]], param: str) -> list[str]:
    notes = []
    greedy = [r for r in rows if r["temperature"] == 0 and r["value"] is not None]
    if greedy:
        same = all(r["identical"] for r in greedy)
        notes.append(f"T=0: every value {'is' if same else 'is NOT'} byte-identical to strict verification "
                     f"({'as greedy verification ignores the rule' if same else 'a bug: greedy must ignore it'})")
    if rows and all(r["tv_positions"] is None for r in rows):
        notes.append("relaxed % and TV: n/a, in-process only (they need the target's p and the drafter's q at every "
                     "verified position, which a server does not return)")
        if all(r["tau"] is None for r in rows):
            notes.append("tau: n/a, the endpoints' /metrics expose no spec-decode counters or gauges")
    for t in sorted({r["temperature"] for r in rows if r["temperature"] > 0}):
        hot = sorted((r for r in rows if r["temperature"] == t and r["value"] is not None
                      and r["tv_positions"] is not None), key=lambda r: -r["value"])
        tvs = [r["tv_mean"] or 0.0 for r in hot]
        if len(tvs) > 1:
            mono = all(b >= a for a, b in zip(tvs, tvs[1:]))
            trend = (" (no drift beyond float error: the rule never let a draft-favoured token through)"
                     if max(tvs) < 1e-6 else
                     " (grows as the value falls)" if mono else " (not monotone in the value)")
            notes.append(f"T={t:g}: TV to the target " + ", ".join(f"{param}={r['value']:g}: {tv:.4f}"
                                                                  for r, tv in zip(hot, tvs)) + trend)
    notes.append("values below 1 are LOSSY: their sampled outputs do not follow the target's distribution")
    return notes


def build_sweep_report(records: list[dict[str, Any]], runs: list[dict[str, Any]], rows: list[dict[str, Any]],
                       domains: list[dict[str, Any]], *, rule: str, param: str, reference: str, concurrency: str,
                       n_resamples: int = 2000, seed: int = 0, setup: str = "", metric: str | None = None,
                       baseline: str | None = None) -> Report:
    """`metric` / `baseline` replace the in-process wording (the endpoint sweep, audit/sweep_endpoint.py)."""
    dom_rows = [{param: f"{d['value']:g}", **row} for d, row in zip(domains, summary_rows(domains))]
    rep = Report(
        title=f"Acceptance sweep: rule {rule}, {param} against strict verification",
        conditions={
            "concurrency": concurrency,
            "metric": metric or (
                "tau = 1 + accepted / steps; tok/s = output tokens / wall time of the value's batched run; "
                "relaxed % = accepted draft tokens the exact test rejected on the same uniform, over accepted "
                "draft tokens; TV = mean over verified positions of 1/2 sum |applied - p| "
                "(execution/drift.py); quality = per-domain grader score, paired delta value - exact per "
                f"(item, temperature, sample), bootstrap 95% interval ({n_resamples} resamples, seed {seed})"),
            "baseline": baseline or f"{reference}: the same method, drafter, scheduler and weights with the exact "
                                    "rule, same items, temperatures and per-(item, sample) seeds",
            **({"setup": setup} if setup else {}),
        },
        tables=[Table("Per value and temperature", value_table_rows(rows, param),
                      note="delta and exact % against the reference (all domains pooled)"),
                Table("Quality delta per domain", dom_rows, note="delta > 0: the value scores higher than exact")],
        records=records + [{"side": "run", **r} for r in runs],
        notes=sweep_notes(rows, param),
    )
    rep.figures = {"sweep_tau_delta": sweep_figure(rows, param)}
    return rep


def sweep_figure(rows: Sequence[dict[str, Any]], param: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = float("nan")
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for t in sorted({r["temperature"] for r in rows}):
        at_t = [r for r in rows if r["temperature"] == t]
        if any(r["value"] == 1.0 for r in at_t):  # the exact threshold stands for the reference at 1.0
            at_t = [r for r in at_t if r["value"] is not None]
        mine = sorted(at_t, key=lambda r: 1.0 if r["value"] is None else r["value"])
        xs = [1.0 if r["value"] is None else r["value"] for r in mine]
        axes[0].plot(xs, [nan if r["tau"] is None else r["tau"] for r in mine], "o-", label=f"T={t:g}")
        lo = [r["delta"] - r["ci_low"] for r in mine]
        hi = [r["ci_high"] - r["delta"] for r in mine]
        axes[1].errorbar(xs, [r["delta"] for r in mine], yerr=[lo, hi], fmt="o-", capsize=3, label=f"T={t:g}")
        axes[2].plot(xs, [nan if r["tv_positions"] is None else 0.0 if r["value"] is None else (r["tv_mean"] or 0.0)
                          for r in mine], "o-", label=f"T={t:g}")  # NaN: not measured (an endpoint), not drawn
    for ax, ylabel in zip(axes, ("tau (mean acceptance length)", "quality delta vs exact (all domains)",
                                 "TV(applied, target) per position")):
        ax.set_xlabel(param)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.invert_xaxis()
        ax.legend(fontsize=8)
    axes[1].axhline(0.0, color="gray", lw=0.8)
    fig.suptitle("acceptance sweep (1.0 = strict verification)", fontsize=9)
    fig.tight_layout()
    return fig


def write_sweep_report(rep: Report, out_dir: str | Path) -> dict[str, Path]:
    return write_report(rep, out_dir, stem="sweep")


def publish_sweep_report(rep: Report, out_dir: str | Path) -> int:
    """Write the report; print its per-value table and notes, and where the files are (stderr). Returns 0."""
    import sys

    from verispec.bench.report import markdown_table

    paths = write_sweep_report(rep, out_dir)
    print(markdown_table(rep.tables[0]))
    print("\n".join(f"> {n}" for n in rep.notes))
    print(f"report: {paths['html']}  (also {paths['md'].name}, {paths['json'].name}, {paths['csv'].name}, "
          "sweep_tau_delta.png)", file=sys.stderr)
    return 0
