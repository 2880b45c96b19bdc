"""The audit report in the bench format (bench/report.py): JSON with every raw record, CSV, Markdown stating the three
conditions, a PNG of the paired delta per domain with its 95% interval, and one HTML page."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from verispec.audit.stats import pair_up, per_domain
from verispec.bench.report import Report, Table, write_report

SUMMARY_COLUMNS = (
    ("domain", "domain"), ("temperature", "T"), ("pairs", "pairs"), ("reference_mean", "reference"),
    ("candidate_mean", "candidate"), ("delta", "delta"), ("ci", "95% CI"), ("wins", "wins"), ("losses", "losses"),
    ("ties", "ties"), ("sign_p", "sign p"), ("exact_match_pct", "exact %"), ("common_prefix_pct", "prefix %"),
    ("first_divergence_median", "1st div tok"), ("near_ties", "near-ties"), ("errors", "errors"),
)


def summary_rows(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s in summaries:
        ci = "-" if math.isnan(s["ci_low"]) else f"[{s['ci_low']:+.3f}, {s['ci_high']:+.3f}]"
        full = {**s, "ci": ci, "delta": s["delta"] if math.isnan(s["delta"]) else f"{s['delta']:+.3f}",
                "sign_p": f"{s['sign_p']:.3g}",
                "first_divergence_median": "-" if s["first_divergence_median"] is None else s["first_divergence_median"]}
        rows.append({label: full[key] for key, label in SUMMARY_COLUMNS})
    return rows


def verdicts(summaries: Sequence[dict[str, Any]], alpha: float = 0.05) -> list[str]:
    """One line per (domain, temperature) whose delta is significant by the sign test and outside its interval."""
    out = []
    for s in summaries:
        if s["domain"] == "all" or s["pairs"] == 0:
            continue
        if s["sign_p"] < alpha and not s["ci_low"] <= 0 <= s["ci_high"]:
            word = "WORSE" if s["delta"] < 0 else "better"
            out.append(f"{s['domain']} at T={s['temperature']:g}: candidate {word} (delta {s['delta']:+.3f}, "
                       f"95% CI [{s['ci_low']:+.3f}, {s['ci_high']:+.3f}], sign test p={s['sign_p']:.2g})")
    return out


def build_report(records: list[dict[str, Any]], *, candidate: str, reference: str, concurrency: str,
                 n_resamples: int = 2000, seed: int = 0, setup: str = "") -> tuple[Report, list[dict[str, Any]]]:
    """The report and the per-(domain, temperature) summaries it shows."""
    summaries = per_domain(pair_up(records), n_resamples, seed)
    notes = verdicts(summaries) or ["no domain differs significantly (sign test p >= 0.05 or the 95% interval "
                                    "contains 0)"]
    errors = [r for r in records if r["error"]]
    if errors:
        notes.append(f"{len(errors)} record(s) failed (request or grader error; their pairs are left out), e.g. "
                     f"{errors[0]['side']} {errors[0]['item_id']}: {errors[0]['error'][:160]}")
    if any(r.get("lossy") for r in records):
        notes.append("a side used a LOSSY acceptance rule: its outputs do not follow the target's distribution")
    rep = Report(
        title=f"Quality audit: {candidate} vs {reference}",
        conditions={
            "concurrency": concurrency,
            "metric": "per-domain grader score in [0, 1] (offline graders, verispec.audit.graders); paired delta = "
                      f"candidate - reference per (item, temperature, sample) with a percentile bootstrap 95% "
                      f"interval ({n_resamples} resamples, seed {seed}); wins / losses / ties with a two-sided exact "
                      "sign test (ties dropped); exact match of the texts; character common-prefix %; first "
                      "divergent token (with the target's top-1/top-2 margin where both sides run in process)",
            "baseline": f"reference = {reference}; candidate = {candidate}; same chat messages, max_tokens, "
                        "temperatures and per-(item, sample) seeds on both sides",
            **({"setup": setup} if setup else {}),
        },
        tables=[Table("Per domain and temperature", summary_rows(summaries),
                      note="delta > 0: the candidate scores higher. 'all' pools every domain at that temperature.")],
        records=records,
        notes=notes,
    )
    rep.figures = {"delta_per_domain": delta_figure(summaries)}
    return rep, summaries


def delta_figure(summaries: Sequence[dict[str, Any]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({s["temperature"] for s in summaries})
    doms = list(dict.fromkeys(s["domain"] for s in summaries))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(doms) + 2), 3.5))
    w = 0.8 / max(1, len(temps))
    for i, t in enumerate(temps):
        xs, ys, lo, hi = [], [], [], []
        for j, d in enumerate(doms):
            s = next((x for x in summaries if x["domain"] == d and x["temperature"] == t), None)
            if s is None or s["pairs"] == 0:
                continue
            xs.append(j + (i - (len(temps) - 1) / 2) * w)
            ys.append(s["delta"])
            lo.append(s["delta"] - s["ci_low"])
            hi.append(s["ci_high"] - s["delta"])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=4, label=f"T={t:g}")
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(doms)), doms, fontsize=8)
    ax.set_ylabel("score delta (candidate - reference)")
    ax.set_title("paired delta per domain, 95% bootstrap interval", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def write_audit_report(rep: Report, out_dir: str | Path) -> dict[str, Path]:
    return write_report(rep, out_dir, stem="audit")
