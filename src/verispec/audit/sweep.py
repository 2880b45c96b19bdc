"""`verispec audit sweep`: one lossy acceptance rule at several values, each against strict verification.

The reference is the same method and drafter with the exact rule (lossless). Each value runs the same jobs (items,
temperatures, per-(item, sample) seeds) with `rule=threshold` and the swept parameter at that value; value 1.0 is
the exact rule written as a threshold, so it must reproduce the reference token for token. Per (value,
temperature) the sweep reports tau, output tok/s of the batched run, the share of accepted draft tokens that the
exact test would have rejected (`num_relaxed_accepted_tokens`), the mean per-position total-variation distance
between the distribution the rule applied and the target's (execution/drift.py), and the paired quality delta per
domain against the reference (audit/stats.py). At temperature 0 verification is greedy and ignores the rule, so
every value gives the reference's bytes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from verispec.audit.items import AuditItem
from verispec.audit.runner import EngineSide, Grader, add_margins, build_engine_sides, check_items, make_jobs, record
from verispec.audit.spec import AUDIT_MAX_NUM_SEQS, EngineSpec
from verispec.audit.stats import pair_up, per_domain, summarize

SWEEP_RULES = ("threshold",)
PARAMS = ("threshold_acc", "threshold_single", "both")  # which AcceptanceConfig field(s) the value sets


def parse_values(text: str) -> list[float]:
    """`1.0,0.8,0.6` -> distinct values in (0, 1], highest first."""
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--values takes comma-separated numbers in (0, 1], e.g. 1.0,0.8,0.6; got {text!r}") from None
    if not vals or any(not 0 < v <= 1 for v in vals):
        raise ValueError(f"--values needs numbers in (0, 1] (1.0 = strict verification), got {text!r}")
    return sorted(set(vals), reverse=True)


def value_spec(base: EngineSpec, rule: str, param: str, value: float) -> EngineSpec:
    """The base (exact) spec with `rule` and the swept parameter(s) at `value`."""
    if rule not in SWEEP_RULES:
        raise ValueError(f"--rule {rule!r}: the sweep supports {', '.join(SWEEP_RULES)}")
    if param not in PARAMS:
        raise ValueError(f"--param {param!r} is not one of {', '.join(PARAMS)}")
    fields = {"threshold_acc": value} if param == "threshold_acc" else {"threshold_single": value}
    if param == "both":
        fields["threshold_acc"] = value
    return dataclasses.replace(base, rule=rule, label=f"{rule} {param}={value:g}", **fields)


def build_sweep_sides(base: EngineSpec, rule: str, param: str, values: Sequence[float], model: str,
                      device: str | None = None, max_model_len: int | None = None,
                      max_num_seqs: int = AUDIT_MAX_NUM_SEQS,
                      progress: bool = True) -> tuple[EngineSide, dict[float, EngineSide]]:
    """The exact-rule reference and one side per value, all over one loaded target."""
    if base.method == "none":
        raise ValueError("the sweep needs a speculative method (--method ngram, suffix, draft_model, ...)")
    if base.rule != "exact":
        raise ValueError("the sweep's base spec must use the exact rule: the values set the relaxed one")
    ref = dataclasses.replace(base, label=base.label or f"{base.describe()}, exact rule (reference)")
    specs = [ref] + [value_spec(base, rule, param, v) for v in values]
    sides = build_engine_sides(specs, model, device, max_model_len, max_num_seqs, progress)
    return sides[0], dict(zip(values, sides[1:]))


def _timed(side: EngineSide, jobs: list, progress: bool, desc: str) -> tuple[list, float]:
    t0 = time.perf_counter()
    gens = side.generate(jobs, progress, desc)
    return gens, time.perf_counter() - t0


def run_sweep(items: Sequence[AuditItem], reference: EngineSide, candidates: dict[float, EngineSide],
              temperatures: Sequence[float] = (0.0, 1.0), samples: int = 1, seed: int = 0,
              max_tokens: int | None = None, grader: Grader | None = None,
              progress: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(records, runs): one graded record per (side, value, item, temperature, sample), reference records with
    value None; one run per (value or reference, temperature) with its wall time and output tokens (tok/s).
    Per temperature the reference runs first, then the values in order (not interleaved)."""
    if grader is None:
        from verispec.audit.graders import grade as grader
    if not items:
        raise ValueError("no audit items")
    check_items(items, grader)
    records: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    outer = tqdm(total=len(temperatures) * (1 + len(candidates)), desc="audit sweep", disable=not progress,
                 file=sys.stderr)
    for t in temperatures:
        jobs = make_jobs(items, [t], samples, seed, max_tokens)
        ref_gens, wall = _timed(reference, jobs, progress, f"T={t:g} exact (reference)")
        runs.append(_run(None, t, wall, ref_gens))
        records += [{**record("reference", j, g, grader, reference.describe()), "value": None}
                    for j, g in zip(jobs, ref_gens)]
        outer.update()
        for v, side in candidates.items():
            gens, wall = _timed(side, jobs, progress, f"T={t:g} {side.spec.label or side.describe()}")
            runs.append(_run(v, t, wall, gens))
            cand = [{**record("candidate", j, g, grader, side.describe()), "value": v} for j, g in zip(jobs, gens)]
            add_margins(cand, ref_gens, gens, reference, side)
            records += cand
            outer.update()
    outer.close()
    return records, runs


def _run(value: float | None, t: float, wall: float, gens: list) -> dict[str, Any]:
    toks = sum(len(g.token_ids) if g.token_ids is not None else g.stats.get("completion_tokens") or 0 for g in gens)
    return {"value": value, "temperature": t, "wall_s": wall, "output_tokens": toks,
            "tok_per_s": toks / wall if wall > 0 else 0.0}


def _engine_sum(recs: Sequence[dict[str, Any]], key: str) -> float:
    return sum((r.get("engine") or {}).get(key) or 0 for r in recs)


def drift_of(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """tau, relaxed share and position-weighted mean TV over a group of in-process records."""
    steps, acc = _engine_sum(recs, "steps"), _engine_sum(recs, "num_accepted_tokens")
    relaxed, positions = _engine_sum(recs, "num_relaxed_accepted_tokens"), _engine_sum(recs, "tv_positions")
    tv = sum(((r.get("engine") or {}).get("tv_mean") or 0.0) * ((r.get("engine") or {}).get("tv_positions") or 0)
             for r in recs)
    return {"tau": 1 + acc / steps if steps else None, "accepted": int(acc), "relaxed": int(relaxed),
            "relaxed_share": relaxed / acc if acc else 0.0, "tv_mean": tv / positions if positions else None,
            "tv_positions": int(positions)}


def identical(refs: Sequence[dict[str, Any]], cands: Sequence[dict[str, Any]]) -> bool:
    """Every candidate record has its reference pair's exact token ids (where both sides report them) and text."""
    by_key = {(r["item_id"], r["temperature"], r["sample"]): r for r in refs}
    return all((r := by_key.get((c["item_id"], c["temperature"], c["sample"]))) is not None
               and (r["token_ids"] is None or c["token_ids"] is None or r["token_ids"] == c["token_ids"])
               and r["text"] == c["text"] for c in cands)


def sweep_rows(records: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]], n_resamples: int = 2000,
               seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per (value, temperature) rows incl. the reference, per (value, domain, temperature) paired summaries)."""
    refs = [r for r in records if r["side"] == "reference"]
    values = list(dict.fromkeys(r["value"] for r in records if r["side"] == "candidate"))
    rows, domains = [], []
    for run in runs:
        v, t = run["value"], run["temperature"]
        ref_t = [r for r in refs if r["temperature"] == t]
        mine = ref_t if v is None else [r for r in records if r["side"] == "candidate" and r["value"] == v
                                        and r["temperature"] == t]
        paired = summarize(pair_up(ref_t + ([] if v is None else mine)), n_resamples, seed) if v is not None else None
        rows.append({"value": v, "temperature": t, "tok_per_s": run["tok_per_s"], **drift_of(mine),
                     "identical": True if v is None else identical(ref_t, mine),
                     "delta": 0.0 if paired is None else paired["delta"],
                     "ci_low": 0.0 if paired is None else paired["ci_low"],
                     "ci_high": 0.0 if paired is None else paired["ci_high"],
                     "exact_match_pct": 100.0 if paired is None else paired["exact_match_pct"],
                     "mean_score": _mean([r["score"] for r in mine if not r["error"]]), "records": len(mine)})
    for v in values:
        cands = [r for r in records if r["side"] == "candidate" and r["value"] == v]
        domains += [{"value": v, **s} for s in per_domain(pair_up(refs + cands), n_resamples, seed)]
    return rows, domains



def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
