"""What `verispec bench sweep` reports: per-level summary rows (throughput, latency percentiles, goodput, errors,
tau), identity against the reference level and the baseline, ratios against the baseline, and the report itself
(conditions, tables, figures)."""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter
from typing import Any, Sequence

from verispec.bench.report import Report, Table, median, percentile
from verispec.bench.sweep_types import Level, LevelResult
from verispec.engine.counters import PHASES

PCTS = (50, 95, 99)


# ---- summaries ---------------------------------------------------------------------------------------------
def meets_slo(rec: Any, slo_ttft: float | None, slo_tpot: float | None, slo_e2e: float | None) -> bool:
    """A completed request within every SLO given (TPOT is not defined for one output token: no constraint)."""
    if not rec.ok:
        return False
    if slo_ttft is not None and not rec.ttft_s <= slo_ttft:
        return False
    if slo_tpot is not None and not math.isnan(rec.tpot_s) and not rec.tpot_s <= slo_tpot:
        return False
    if slo_e2e is not None and not rec.e2e_s <= slo_e2e:
        return False
    return True


def summarize(res: LevelResult, slo: tuple[float | None, float | None, float | None] = (None, None, None)
              ) -> dict[str, Any]:
    """One summary row: throughput over the level's wall time, latency percentiles over completed requests
    (per-token ITL and raw gaps pooled over every gap of every completed request), errors by class, spec and
    identity."""
    recs = res.records
    ok = [r for r in recs if r.ok]
    dur = res.duration_s
    row: dict[str, Any] = {
        "endpoint": res.endpoint, "level": res.level.name, "repeat": res.repeat + 1,
        "sent": len(recs), "completed": len(ok), "errors": len(recs) - len(ok),
        "errors_by_class": " ".join(f"{k}={v}" for k, v in sorted(Counter(r.error_class for r in recs
                                                                            if not r.ok).items())) or "-",
        "max_in_flight": res.max_in_flight, "duration_s": dur,
        "req_per_s": len(ok) / dur if dur > 0 else float("nan"),
        "out_tok_per_s": sum(r.n_out for r in ok) / dur if dur > 0 else float("nan"),
        "goodput_req_per_s": sum(meets_slo(r, *slo) for r in recs) / dur if dur > 0 else float("nan"),
    }
    series = {
        "ttft_ms": [r.ttft_s * 1e3 for r in ok],
        "tpot_ms": [r.tpot_s * 1e3 for r in ok],
        "itl_ms": [x * 1e3 for r in ok for x in r.itl_s],
        "gap_ms": [x * 1e3 for r in ok for x in r.chunk_gaps_s],
        "e2e_s": [r.e2e_s for r in ok],
        "headers_ms": [r.headers_s * 1e3 for r in ok],
    }
    for name, xs in series.items():
        base, unit = name.rsplit("_", 1)
        for q in PCTS:
            row[f"{base}_p{q}_{unit}"] = percentile(xs, q)
    s = res.spec
    row.update({"tau": s.get("tau", float("nan")), "acceptance_rate": s.get("acceptance_rate", float("nan")),
                "drafts": s.get("drafts", float("nan")), "draft_tokens": s.get("draft_tokens", float("nan")),
                "accepted": s.get("accepted", float("nan")),
                "queue_mean_ms": s.get("queue_mean_s", float("nan")) * 1e3})
    for key in ("engine_steps", "rows_per_step", "step_ms", *(f"step_{p}_ms" for p in PHASES), "prefix_hit_rate"):
        row[key] = s.get(key, float("nan"))
    compared = [r for r in ok if r.identical is not None]
    row["identity"] = sum(r.identical for r in compared) / len(compared) if compared else float("nan")
    row["identity_n"] = len(compared)
    divs = [r.first_divergence for r in compared if not r.identical and r.first_divergence is not None]
    row["first_divergence_min"] = min(divs) if divs else "-"
    base_cmp = [r for r in ok if r.identical_to_baseline is not None]
    if base_cmp:
        row["identity_vs_baseline"] = sum(r.identical_to_baseline for r in base_cmp) / len(base_cmp)
    return row


def first_divergence(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first element where a and b differ (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _output(rec: Any) -> tuple[str, Sequence[Any]]:
    return ("tokens", rec.token_ids) if rec.token_ids is not None else ("chars", rec.text)


def mark_identity(results: Sequence[LevelResult], ref: Level, baseline: Sequence[LevelResult] = ()) -> None:
    """Compare every completed request with the same prompt's first completed output at the reference level of
    the same endpoint (repeat 1), and, with a baseline, with the baseline's reference output. Token ids where
    both sides have them, else text (first divergence then counts characters)."""

    def refs(rs: Sequence[LevelResult]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for res in rs:
            if res.level == ref and res.repeat == 0:
                for r in res.records:
                    if r.ok:
                        out.setdefault(r.prompt_id, r)
        return out

    own, base = refs(results), refs(baseline)
    for res in results:
        for r in res.records:
            if not r.ok:
                continue
            for table, attr in ((own, "identical"), (base, "identical_to_baseline")):
                other = table.get(r.prompt_id)
                if other is None:
                    continue
                (ua, a), (ub, b) = _output(r), _output(other)
                if ua != ub:
                    a, b = r.text, other.text
                div = first_divergence(a, b)
                setattr(r, attr, div is None)
                if attr == "identical":
                    r.first_divergence = div


def same_work(s: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Whether two verispec servers did the same work on a level: the same steps, rows per step within 1%. None
    where either has no step clock. Where they did, speculation changed nothing there and the throughput ratio is
    the spread between the two server processes (on a shared 2-core machine about 10% either way)."""
    steps, rows = (s.get("engine_steps"), b.get("engine_steps")), (s.get("rows_per_step"), b.get("rows_per_step"))
    if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in (*steps, *rows)):
        return None
    return steps[0] == steps[1] and abs(rows[0] - rows[1]) <= 0.01 * max(rows)


def ratio_rows(spec: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level: spec / baseline for throughputs, baseline / spec for latencies (so > 1 means speculation
    helps), as the median and min..max over repeats of per-repeat ratios; `same_work`: yes where every repeat's
    two servers ran the same steps (`same_work`), no where one did not, - without step clocks."""
    keys = [("out_tok_per_s", False), ("req_per_s", False), ("goodput_req_per_s", False),
            ("tpot_p50_ms", True), ("ttft_p50_ms", True), ("e2e_p50_s", True), ("itl_p50_ms", True),
            ("engine_steps", True), ("step_ms", True)]  # verispec's step clock: what speculation saves, what it costs
    by_level: dict[str, dict[int, tuple[dict, dict]]] = {}
    for s in spec:
        by_level.setdefault(s["level"], {})[s["repeat"]] = (s, {})
    for b in base:
        if b["repeat"] in by_level.get(b["level"], {}):
            by_level[b["level"]][b["repeat"]] = (by_level[b["level"]][b["repeat"]][0], b)
    rows = []
    for level, reps in by_level.items():
        row: dict[str, Any] = {"level": level, "repeats": len(reps)}
        for key, inverse in keys:
            rs = []
            for s, b in reps.values():
                if not b:
                    continue
                num, den = (b.get(key), s.get(key)) if inverse else (s.get(key), b.get(key))
                if num is not None and den and not math.isnan(num) and not math.isnan(den):
                    rs.append(num / den)
            name = key.replace("_per_s", "")
            name = ("speedup_" + name) if inverse else ("ratio_" + name)
            row[name] = statistics.median(rs) if rs else float("nan")
            if len(reps) > 1:
                row[name + "_range"] = f"{min(rs):.3g}..{max(rs):.3g}" if len(rs) > 1 else "-"
        same = [same_work(s, b) for s, b in reps.values() if b]
        row["same_work"] = "-" if not same or None in same else ("yes" if all(same) else "no")
        s0, _ = next(iter(reps.values()))
        row["tau"] = s0.get("tau", float("nan"))
        row["identity_vs_baseline"] = s0.get("identity_vs_baseline", float("nan"))
        rows.append(row)
    return rows


# ---- figures ------------------------------------------------------------------------------------------------
def _median_rows(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    out: dict[tuple[str, str], dict[str, float]] = {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["endpoint"], r["level"]), []).append(r)
    for k, rs in groups.items():
        out[k] = {key: median([r[key] for r in rs if isinstance(r[key], (int, float))])
                  for key in ("out_tok_per_s", "tpot_p50_ms", "e2e_p50_s", "tau")}
    return out


def figures(rows: Sequence[dict[str, Any]], levels: Sequence[Level], endpoints: Sequence[str]) -> dict[str, Any]:
    from matplotlib.figure import Figure

    med = _median_rows(rows)
    figs: dict[str, Any] = {}
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    for ax, xkey, xlabel in ((axes[0], "tpot_p50_ms", "P50 TPOT (ms)"), (axes[1], "e2e_p50_s", "P50 E2E (s)")):
        for ep in endpoints:
            for mode, marker in (("concurrency", "o-"), ("rate", "s--")):
                names = [lv.name for lv in levels if lv.mode == mode and (ep, lv.name) in med]
                pts = [(med[(ep, n)][xkey], med[(ep, n)]["out_tok_per_s"], n) for n in names]
                pts = [p for p in pts if not (math.isnan(p[0]) or math.isnan(p[1]))]
                if not pts:
                    continue
                label = f"{ep} ({'closed loop' if mode == 'concurrency' else 'Poisson'})"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, label=label)
                for x, y, name in pts:
                    ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("aggregate output tok/s")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.suptitle("Throughput against latency, one line per endpoint")
    figs["throughput_latency"] = fig

    fig = Figure(figsize=(8, 3.8))
    ax = fig.subplots()
    names = [lv.name for lv in levels]
    width = 0.8 / max(1, len(endpoints))
    for j, ep in enumerate(endpoints):
        taus = [med.get((ep, n), {}).get("tau", float("nan")) for n in names]
        xs = [i + (j - (len(endpoints) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [0 if math.isnan(t) else t for t in taus], width, label=ep)
        for x, t in zip(xs, taus):
            ax.annotate("n/a" if math.isnan(t) else f"{t:.2f}", (x, 0 if math.isnan(t) else t), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("tau = 1 + accepted / drafts")
    ax.set_title("Mean acceptance length per level (server /metrics deltas)")
    ax.legend(fontsize=8)
    figs["tau"] = fig
    return figs


def engine_config_notes(results: dict[str, list[LevelResult]]) -> list[str]:
    """One note per endpoint that exports verispec's engine_config_info: the weight path it ran, on which CPU."""
    seen: dict[str, dict[str, str]] = {}
    for r in (r for rs in results.values() for r in rs):
        if r.spec.get("engine_config"):
            seen.setdefault(r.endpoint, r.spec["engine_config"])
    return [f"Engine {label}: weight path {c.get('path', '?')} (dtype {c.get('dtype', '?')}, quantization "
            f"{c.get('quantization', '?')}, chosen by {c.get('path_chosen_by', '?')}) on {c.get('device', '?')}, CPU "
            f"{c.get('cpu', '?')} [{c.get('cpu_flags', '')}] capability {c.get('cpu_capability', '?')}"
            for label, c in seen.items()]


def build_report(args: argparse.Namespace, levels: Sequence[Level], ref: Level, clients: Sequence[Any],
                 results: dict[str, list[LevelResult]], pool: Sequence[Any]) -> Report:
    slo = (args.slo_ttft, args.slo_tpot, args.slo_e2e)
    rows = [summarize(res, slo) for rs in results.values() for res in rs]
    records = [r.as_dict() for rs in results.values() for res in rs for r in res.records]
    title = "Serving sweep: " + " vs ".join(c.label for c in clients)
    return Report(title, _conditions(args, levels, ref, clients), _tables(rows, results, clients), records,
                  figures(rows, levels, [c.label for c in clients]),
                  _notes(args, results, ref, clients, pool, slo))


def _conditions(args: argparse.Namespace, levels: Sequence[Level], ref: Level, clients: Sequence[Any]) -> dict:
    """docs/measuring.md's three conditions of a sweep: concurrency (and the levels' bounds), metric, baseline."""
    closed = [lv for lv in levels if lv.mode == "concurrency"]
    rates = [lv for lv in levels if lv.mode == "rate"]
    conc = []
    if closed:
        conc.append("closed loop at concurrency " + ", ".join(str(int(lv.value)) for lv in closed)
                    + " (C clients; each sends its next request when its previous one ends)")
    if rates:
        conc.append("open loop, Poisson arrivals at " + ", ".join(f"{lv.value:g}" for lv in rates)
                    + f" req/s (seed {args.seed} + level index; requests are sent on time whatever is in flight)")
    bounds = (f"Every level at most {', '.join(sorted({str(lv.requests) for lv in levels}))} requests and "
              f"{args.max_seconds_per_level:g} s of sending, then {args.grace_seconds:g} s of grace; requests "
              "cancelled then count as errors of class 'timeout'")
    metric = ("aggregate output tok/s = output tokens of completed requests / level wall time (first send to last "
              "end); request/s = completed requests / wall time; goodput = completed requests within every SLO "
              "given / wall time; P50/P95/P99 of TTFT (first output chunk - send), TPOT ((E2E - TTFT) / (N_out - 1), "
              "N_out > 1), per-token ITL (inter-chunk gap / tokens in the chunk, one value per token), raw "
              "inter-chunk gap, E2E (last output chunk - send) and time to response headers, over completed "
              "requests, measured by this client; tau = 1 + accepted / drafts and acceptance rate = accepted / "
              "drafted from the server's /metrics before and after the level")
    if len(clients) > 1:
        baseline = (f"{clients[1].label} = {clients[1].base} (model {clients[1].model!r}), meant to be the same "
                    f"target with speculation off; same prompts, same run, levels interleaved (A B, then B A); "
                    "ratios at every level")
    else:
        baseline = ("none: one endpoint only, no speculation-off comparison; identity is against this endpoint's "
                    f"own {ref.name} output")
    return {"concurrency": "; ".join(conc) + f". {bounds}.", "metric": metric, "baseline": baseline}


def _notes(args: argparse.Namespace, results: dict[str, list[LevelResult]], ref: Level, clients: Sequence[Any],
           pool: Sequence[Any], slo: tuple) -> list[str]:
    """What the report's reader needs to read the tables: engines, endpoints, prompts, SLOs, definitions."""
    slo_txt = ", ".join(f"{k} <= {v:g} s" for k, v in zip(("TTFT", "TPOT", "E2E"), slo) if v is not None)
    return [*engine_config_notes(results),
        "Endpoints: " + "; ".join(f"{c.label} = {c.base} (model {c.model!r}, {args.api} API, token counts from "
                                  f"{c.caps.token_source}{': ' + c.caps.note if c.caps.note else ''})"
                                  for c in clients),
        f"Prompts: {len(pool)} from {args.workloads or 'every shipped workload'}, mixed round-robin; request i of "
        f"every level sends prompt i mod {len(pool)}; max_tokens {args.max_tokens or 'per prompt'}; temperature "
        f"{args.temperature:g}{'; ignore_eos' if args.ignore_eos else ''}.",
        "Goodput SLOs: " + (slo_txt if slo_txt else "none given, so goodput = request/s") + ".",
        (f"Warm-up: {args.warmup_requests} requests per endpoint before the first level, not measured."
         if args.warmup_requests else "Warm-up: none (the first level of a fresh server includes its cold start)."),
        f"Identity: share of completed requests whose output equals the same prompt's output at {ref.name} "
        "(repeat 1) of the same endpoint; compared as token ids where the server returns them, else as text "
        "(first divergence then in characters). At temperature > 0 it measures nothing.",
        "Token counts: 'token_ids' = ids returned per chunk (exact); 'continuous_usage' = per-chunk usage (exact); "
        "'usage_total' = exact total from the usage chunk, split evenly over chunks for ITL; 'chunks' = one token "
        "per chunk (an undercount where chunks carry several tokens). Never re-tokenised.",
        "Per-position acceptance = accepted at position i / drafts (vLLM's convention). SGLang exports gauges "
        "(sglang:spec_accept_length / sglang:spec_accept_rate), not counters: its tau is the value at the level's "
        "end, not a delta.",
        "Queueing: queue_mean_ms is the server's own mean time from arrival to admission into the running batch, "
        "over the requests admitted during the level (the delta of verispec:/vllm:request_queue_time_seconds); "
        "NaN where the server exports no such histogram. Time to response headers is what a client sees of it: "
        "servers that send headers before scheduling (verispec, vLLM) make it an upper bound on admission.",
        "Step clock (verispec servers): engine_steps, rows_per_step (rows fed to the target forward) and step_ms, "
        "the mean wall time of a step, in all and by phase (schedule: admission, planning, policy; draft; forward; "
        "commit: verification, KV, tokens out), from the deltas of verispec:engine_steps / "
        "engine_forward_tokens / engine_step_seconds over the level. Two servers doing the same work per step "
        "should match here; where they do not, the phase says where.",
        "Prefix cache: prefix_hit_rate = prompt tokens found cached / prompt tokens looked up over the level (the "
        "deltas of verispec:/vllm:prefix_cache_hits and prefix_cache_queries); NaN where the server exports "
        "neither. Levels after the first find what earlier levels cached unless the sweep ran with "
        "--reset-prefix-cache.",
    ]


def _tables(rows: list[dict], results: dict[str, list[LevelResult]], clients: Sequence[Any]) -> list[Table]:
    """Throughput, latency, the ratios against the baseline (if any) and per-position acceptance (if any)."""
    lat_keys = [k for k in rows[0] if any(k.endswith(f"_p{q}_{u}") for q in PCTS for u in ("ms", "s"))] if rows else []
    tables = [Table("Throughput, errors, speculation and identity per endpoint and level",
                    [{k: v for k, v in r.items() if k not in lat_keys} for r in rows],
                    "req_per_s, out_tok_per_s and goodput over the level's wall time; tau, acceptance_rate, drafts, "
                    "draft_tokens and accepted are /metrics deltas over the level."),
              Table("Latency percentiles per endpoint and level",
                    [{"endpoint": r["endpoint"], "level": r["level"], "repeat": r["repeat"],
                      **{k: r[k] for k in lat_keys}} for r in rows],
                    "Over completed requests (per-token ITL and raw gaps: over every gap of them); ms unless the "
                    "column says s.")]
    if len(clients) > 1:
        spec_rows = [r for r in rows if r["endpoint"] == clients[0].label]
        base_rows = [r for r in rows if r["endpoint"] == clients[1].label]
        tables.append(Table(f"{clients[0].label} against {clients[1].label}, per level",
                            ratio_rows(spec_rows, base_rows),
                            "ratio_* = method / baseline (throughput), speedup_* = baseline / method (latency): "
                            "> 1 means speculation helps. Median over repeats, min..max when more than one. "
                            "Against verispec servers, speedup_engine_steps (baseline steps / method steps: the "
                            "steps speculation saved) times speedup_step_ms (baseline ms per step / method's: what "
                            "its steps cost, including any difference between the two server processes) is about "
                            "ratio_out_tok when the levels' wall time is their steps. same_work = yes where in "
                            "every repeat both ran the same steps with the same rows per step: there speculation "
                            "changed no step, and the ratios measure the two server processes, not the method."))
    pos_rows = _position_rows(results)
    if pos_rows:
        tables.append(Table("Per-position acceptance", pos_rows,
                            "pos<i> = draft tokens accepted at position i / drafts; accepted_pos<i> = the count "
                            "(/metrics deltas over the level)."))
    return tables


def _position_rows(results: dict[str, list[LevelResult]]) -> list[dict]:
    """One row per level run whose server reported per-position acceptance."""
    rows = []
    width = max((len(res.spec.get("per_pos_accepted") or []) for rs in results.values() for res in rs), default=0)
    for rs in results.values():
        for res in rs:
            acc, cnt = res.spec.get("per_pos_acceptance") or [], res.spec.get("per_pos_accepted") or []
            if acc:
                rows.append({"endpoint": res.endpoint, "level": res.level.name, "repeat": res.repeat + 1,
                             "drafts": res.spec["drafts"],
                             **{f"pos{i}": acc[i] if i < len(acc) else 0.0 for i in range(width)},
                             **{f"accepted_pos{i}": cnt[i] if i < len(cnt) else 0.0 for i in range(width)}})
    return rows
