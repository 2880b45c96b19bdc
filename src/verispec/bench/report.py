"""Benchmark reports: raw JSON, CSV, a Markdown summary that states the three conditions, PNG plots, and one
self-contained HTML page holding all of it (plots inlined as base64, tables as HTML).

A report is a title, its conditions (concurrency, metric, baseline: docs/measuring.md's three), summary tables (lists of
row dicts with the same keys), the raw per-request records, and matplotlib figures.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

CONDITIONS = ("concurrency", "metric", "baseline")


@dataclass
class Table:
    title: str
    rows: list[dict[str, Any]]
    note: str = ""


@dataclass
class Report:
    title: str
    conditions: dict[str, str]  # must name concurrency, metric and baseline
    tables: list[Table] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)  # every raw per-request record
    figures: dict[str, Any] = field(default_factory=dict)  # file stem -> matplotlib Figure
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        missing = [c for c in CONDITIONS if not self.conditions.get(c)]
        if missing:
            raise ValueError(f"a report must state its {', '.join(missing)} (docs/measuring.md's three conditions)")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no data."""
    v = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def median(xs: Sequence[float]) -> float:
    v = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(v) if v else float("nan")


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def markdown_table(t: Table) -> str:
    if not t.rows:
        return f"### {t.title}\n\n(no rows)\n"
    keys = list(t.rows[0])
    lines = [f"### {t.title}", ""]
    if t.note:
        lines += [t.note, ""]
    lines.append("| " + " | ".join(keys) + " |")
    lines.append("|" + "---|" * len(keys))
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in t.rows]
    return "\n".join(lines) + "\n"


def markdown(rep: Report) -> str:
    parts = [f"# {rep.title}", ""]
    parts += [f"- **{k}**: {v}" for k, v in rep.conditions.items()]
    parts += [""] + [f"> {n}" for n in rep.notes] + ([""] if rep.notes else [])
    parts += [markdown_table(t) for t in rep.tables]
    parts += [f"![{stem}]({stem}.png)" for stem in rep.figures]
    return "\n".join(parts) + "\n"


def _html_table(t: Table) -> str:
    if not t.rows:
        return f"<h3>{html.escape(t.title)}</h3><p>(no rows)</p>"
    keys = list(t.rows[0])
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r.get(k, '')))}</td>" for k in keys) + "</tr>"
                   for r in t.rows)
    note = f"<p>{html.escape(t.note)}</p>" if t.note else ""
    return f"<h3>{html.escape(t.title)}</h3>{note}<table><tr>{head}</tr>{body}</table>"


def html_page(rep: Report, pngs: dict[str, bytes]) -> str:
    conds = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in rep.conditions.items())
    notes = "".join(f"<blockquote>{html.escape(n)}</blockquote>" for n in rep.notes)
    tables = "".join(_html_table(t) for t in rep.tables)
    imgs = "".join(f'<figure><img alt="{html.escape(s)}" src="data:image/png;base64,{base64.b64encode(b).decode()}">'
                   f"<figcaption>{html.escape(s)}</figcaption></figure>" for s, b in pngs.items())
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:right}th{background:#f3f3f3}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(rep.title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(rep.title)}</h1><ul>{conds}</ul>{notes}"
            f"{tables}{imgs}</body></html>")


def write_report(rep: Report, out_dir: str | Path, stem: str = "report") -> dict[str, Path]:
    """Write <stem>.json, <stem>.csv (the raw records), <stem>.md, one PNG per figure and <stem>.html."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    paths["json"] = out / f"{stem}.json"
    paths["json"].write_text(json.dumps({"title": rep.title, "conditions": rep.conditions, "notes": rep.notes,
                                         "tables": [{"title": t.title, "note": t.note, "rows": t.rows}
                                                    for t in rep.tables],
                                         "records": rep.records}, indent=1, default=str))
    paths["csv"] = out / f"{stem}.csv"
    keys: list[str] = []
    for r in rep.records:
        keys += [k for k in r if k not in keys]
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rep.records:
            w.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in r.items()})
    pngs: dict[str, bytes] = {}
    for name, fig in rep.figures.items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        pngs[name] = buf.getvalue()
        paths[name] = out / f"{name}.png"
        paths[name].write_bytes(pngs[name])
    paths["md"] = out / f"{stem}.md"
    paths["md"].write_text(markdown(rep))
    paths["html"] = out / f"{stem}.html"
    paths["html"].write_text(html_page(rep, pngs))
    return paths
