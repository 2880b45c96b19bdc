"""`verispec bench single`: single-stream speculative decoding, every chosen method against plain decoding.

Conditions (docs/measuring.md): concurrency 1; metric = output tok/s of one stream (whole request, prefill included),
with TTFT, E2E, tau, per-position acceptance and the step-time split; baseline = speculation off (method none),
same target, dtype and prompts, in the same run. Methods run interleaved (the order rotates per prompt and
repeat), and every ratio is method tok/s / plain tok/s on the same prompt and repeat. Identity compares each
greedy output with plain's: exact-match rate, first divergence (with the target's top-1/top-2 margin there),
and the common-prefix percentage. Memory: the process's peak RSS, and the drafter's own share (a draft model's
weights and KV; Python structures of model-free drafters, traced in a separate, untimed pass).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tracemalloc
from collections import defaultdict
from typing import Any

from tqdm.auto import tqdm

from verispec.bench.load import MachineLoad
from verispec.bench.report import Report, Table, median, write_report
from verispec.bench.spec_bench import Run, load_spec_bench, spec_bench_rows
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.check.identity import common_prefix_fraction, compare_greedy
from verispec.config import LEARNED_METHODS, MODEL_FREE_METHODS
from verispec.models.hub import DEFAULT_MODEL

SPLIT = ("draft_s", "forward_s", "verify_s", "sched_s", "state_s")


def method_spec(name: str, k: int) -> dict[str, Any] | None:
    """'none', 'ngram', 'suffix', 'draft_model:PATH' or 'eagle3|dflash|dspark[:PATH_OR_NAME]' -> a
    speculative_config (a learned method without a path: the shipped drafter trained for the target);
    'ngram+M' / 'suffix+M': the model drafter M behind that model-free one (`hybrid`)."""
    free, plus, model = name.partition("+")
    if plus and free in MODEL_FREE_METHODS:
        spec = method_spec(model, k)
        if spec is None or spec["method"] in MODEL_FREE_METHODS:
            raise ValueError(f"{name!r}: a model-free drafter goes first of a model drafter, not of {model!r}")
        return {**spec, "hybrid": free}
    if name == "none":
        return None
    if name in MODEL_FREE_METHODS:
        return {"method": name, "num_speculative_tokens": k}
    if name.startswith("draft_model:"):
        return {"method": "draft_model", "model": name.split(":", 1)[1], "num_speculative_tokens": min(k, 4)}
    method, _, path = name.partition(":")
    if method in LEARNED_METHODS:
        return {"method": method, "num_speculative_tokens": k, **({"model": path} if path else {})}
    learned = "|".join(LEARNED_METHODS)
    raise ValueError(f"unknown method {name!r}: use {', '.join(MODEL_FREE_METHODS)}, draft_model:PATH or "
                     f"{learned}[:PATH]")


def drafter_bytes(llm) -> int:
    """Memory a draft model holds of its own (weights + KV cache); 0 for model-free drafters."""
    f = llm.drafters
    if f.draft_model is None:
        return 0
    weights = sum(p.numel() * p.element_size() for p in f.draft_model.parameters())
    kv = sum(t.numel() * t.element_size() for t in f.draft_cache.k + f.draft_cache.v)
    return weights + kv


def traced_peak(llm, ids, params) -> int:
    """Peak Python-heap bytes during one request (a model-free drafter's tries and indexes live there)."""
    tracemalloc.start()
    try:
        llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def method_engines(base, methods, k: int) -> dict[str, Any]:
    """Plain decoding ("none") and each method over `base`'s weights, their step costs profiled before timing."""
    engines = {"none": base.with_speculation(None)}
    for m in methods:
        engines[m] = base.with_speculation(method_spec(m, k))
    for e in engines.values():
        if e.spec.method != "none":
            _ = e.costs  # profile once, before anything is timed
    return engines


def drafter_memory(base, engines: dict[str, Any], first, max_tokens: int) -> dict[str, int]:
    """Each method's own bytes, in an untimed pass over the workload prompt `first`: a draft model's weights and KV,
    else the Python heap a request traces beyond plain decoding's."""
    from verispec import SamplingParams

    ids = base.tokenizer(base.apply_chat_template(list(first.messages)), add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=min(first.max_tokens, max_tokens))
    mem = {}
    for name, e in engines.items():
        e.drafters.reset_shared()
        mem[name] = traced_peak(e, ids, params) if e.drafters.draft_model is None else drafter_bytes(e)
    plain_traced = mem["none"]
    return {n: (b - plain_traced if engines[n].drafters.draft_model is None else b) for n, b in mem.items()}


def run_single(model: str = DEFAULT_MODEL, dtype: str = "auto", methods=MODEL_FREE_METHODS,
               workloads=WORKLOADS, limit: int = 2, repeats: int = 1, max_tokens: int = 96, k: int = 8,
               device: str = "cpu", progress: bool = True, llm=None, quantization: str | None = None,
               invariant: bool | None = None, spec_bench: str | None = None) -> Report:
    """Every method against plain decoding on the workloads (or, with `spec_bench`, a Spec-Bench question file's
    first `limit` questions per category, each category a workload, and Spec-Bench's tables added)."""
    from verispec import LLM, SamplingParams

    # dtype="auto" picks the path for the engine's blocks with k drafts: the first method's configuration
    first_spec = method_spec(methods[0], k) if methods else None
    base = llm or LLM(model, dtype=dtype, device=device, max_model_len=2048, max_num_seqs=1, progress=progress,
                      quantization=quantization, speculative_config=first_spec, invariant=invariant)
    engines = method_engines(base, methods, k)
    sets = (load_spec_bench(spec_bench, limit) if spec_bench else
            {str(w): load_workload(w, limit=limit) for w in workloads})
    records: list[dict[str, Any]] = []
    total = sum(len(p) for p in sets.values()) * repeats * len(engines)
    bar = tqdm(total=total, desc="bench single", disable=not progress, file=sys.stderr)
    load = MachineLoad().start()
    for wl, prompts in sets.items():
        for r in range(repeats):
            for e in engines.values():  # a repeat must not find its own earlier output in the suffix cache
                e.drafters.reset_shared()
            for i, wp in enumerate(prompts):
                ids = base.tokenizer(base.apply_chat_template(list(wp.messages)), add_special_tokens=False)["input_ids"]
                params = SamplingParams(temperature=0, max_tokens=min(wp.max_tokens, max_tokens))
                names = list(engines)
                shift = (r * len(prompts) + i) % len(names)
                got = {}
                for name in names[shift:] + names[:shift]:
                    got[name] = engines[name].generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                    bar.update()
                records += [_record(base, wl, wp.id, r, name, names.index(name), ids, out, got["none"])
                            for name, out in got.items()]
    load.stop()
    bar.close()
    if load.share is not None and load.share.disturbed:
        print(f"verispec bench single: {load.describe()}", file=sys.stderr)
    mem = drafter_memory(base, engines, next(iter(sets.values()))[0], max_tokens)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rep = build_report(records, engines, mem, rss, path=base.path_choice, model=model, repeats=repeats,
                       limit=limit)
    rep.notes.append(load.describe())
    if spec_bench:
        rep.tables += spec_bench_tables(records)
    return rep


def _record(base, wl: str, prompt_id: str, repeat: int, name: str, order: int, ids: list[int], out, plain
            ) -> dict[str, Any]:
    """One method's run of one prompt against plain decoding's run of it: speed, acceptance, the time split and
    where its greedy output parted from plain's (None: identical)."""
    div = None if name == "none" else compare_greedy(base.model, ids, plain.token_ids, out.token_ids)
    s = out.stats
    return {
        "workload": wl, "prompt_id": prompt_id, "repeat": repeat, "method": name, "order": order,
        "prompt_tokens": len(ids), "output_tokens": s["output_tokens"], "ttft_s": s["ttft_s"],
        "e2e_s": s["e2e_s"], "tok_per_s": s["tok_per_s"],
        "ratio": s["tok_per_s"] / plain.stats["tok_per_s"] if plain.stats["tok_per_s"] else 0.0,
        "tau": s["mean_acceptance_length"] if name != "none" else 1.0,
        "acceptance_rate": s["acceptance_rate"],
        "per_position_acceptance": s["per_position_acceptance"],
        **{kk: s[kk] for kk in SPLIT},
        "identical": div is None, "near_tie": bool(div and div.near_tie),
        "first_divergence": None if div is None else div.position,
        "divergence": None if div is None else str(div),
        "common_prefix_pct": 100 * common_prefix_fraction(plain.token_ids, out.token_ids),
    }


def spec_bench_tables(records) -> list[Table]:
    """Spec-Bench's two tables per method (per category; per task, with Overall) from the records' ratios."""
    tables = []
    for m in dict.fromkeys(x["method"] for x in records if x["method"] != "none"):
        runs = [Run(x["workload"], x["ratio"], x["tau"], x["identical"]) for x in records if x["method"] == m]
        cats, tasks = spec_bench_rows(runs)
        tables += [Table(f"Spec-Bench per category: {m}", cats), Table(f"Spec-Bench per task: {m}", tasks)]
    return tables


def build_report(records, engines, mem, rss, *, path, model, repeats, limit) -> Report:
    by = defaultdict(list)
    for x in records:
        by[(x["workload"], x["method"])].append(x)
    rows = []
    for (wl, name), xs in by.items():
        ratios = [x["ratio"] for x in xs]
        split = {kk: sum(x[kk] for x in xs) for kk in SPLIT}
        tot = sum(split.values()) or 1.0
        npos = max((len(x["per_position_acceptance"]) for x in xs), default=0)
        pos = [median([x["per_position_acceptance"][j] for x in xs if len(x["per_position_acceptance"]) > j])
               for j in range(min(npos, 4))]
        rows.append({
            "workload": wl, "method": name, "tok/s": median([x["tok_per_s"] for x in xs]),
            "speedup (min..max)": f"x{median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})",
            "TTFT s": median([x["ttft_s"] for x in xs]), "E2E s": median([x["e2e_s"] for x in xs]),
            "tau": median([x["tau"] for x in xs]),
            "accept@1..4": " ".join(f"{p:.2f}" for p in pos) or "-",
            "draft/forward/verify/sched/state %": " / ".join(f"{100 * split[kk] / tot:.0f}" for kk in SPLIT),
            "exact match": f"{100 * sum(x['identical'] for x in xs) / len(xs):.0f}%",
            "near-tie": sum(x["near_tie"] for x in xs),
            "common prefix %": median([x["common_prefix_pct"] for x in xs]),
            "drafter MiB": mem.get(name, 0) / 2**20,
        })
    notes = [f"process peak RSS {rss / 2**20:.0f} MiB (target weights, KV cache and every drafter together)"]
    bugs = [x for x in records if not x["identical"] and not x["near_tie"]]
    if bugs:
        notes.append(f"{len(bugs)} divergences that are NOT near-ties: " + "; ".join(
            f"{x['method']} on {x['prompt_id']}: {x['divergence']}" for x in bugs[:5]))
    rep = Report(
        title=f"Single-stream speculative decoding: {model}, path {path.path.name}",
        conditions={
            "concurrency": "1 (one request at a time, in process)",
            "metric": "output tok/s of one stream, prefill included (median over prompts and repeats); TTFT, E2E, "
                      "tau = tokens per target forward",
            "baseline": "speculation off (method none), same target, weight path and prompts, interleaved in the same "
                        "run",
            "path": path.describe(),
            "setup": f"greedy, {limit} prompt(s) per workload, {repeats} repeat(s), methods "
                     f"{', '.join(n for n in engines if n != 'none')}",
        },
        tables=[Table("Per workload and method", rows)],
        records=records,
        notes=notes,
    )
    rep.figures = figures(rows, records)
    return rep


def figures(rows, records) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(r["workload"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "none"]
    figs = {}
    for key, label, stem in (("tau", "tau (tokens per target forward)", "tau_per_workload"),
                             ("speedup", "speedup vs plain (median)", "speedup_per_workload")):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        w = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            vals = []
            for wl in wls:
                xs = [x for x in records if x["workload"] == wl and x["method"] == m]
                vals.append(median([x["tau"] if key == "tau" else x["ratio"] for x in xs]))
            ax.bar([j + i * w for j in range(len(wls))], vals, w, label=m)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([j + w * (len(methods) - 1) / 2 for j in range(len(wls))], wls, fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        figs[stem] = fig
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(dict.fromkeys(r["method"] for r in rows))
    bottom = [0.0] * len(names)
    for kk in SPLIT:
        vals = [sum(x[kk] for x in records if x["method"] == n) for n in names]
        ax.bar(names, vals, bottom=bottom, label=kk.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds, all prompts and repeats")
    ax.set_title("step-time split", fontsize=9)
    ax.legend(fontsize=8)
    figs["step_time_split"] = fig
    return figs


def add_single_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="ngram,suffix",
                   help="comma list: ngram, suffix, draft_model:PATH, eagle3|dflash|dspark[:PATH] (without a "
                        "path: the shipped drafter for --model)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="shipped names or .jsonl paths, comma list")
    p.add_argument("--limit", type=int, default=2, help="prompts per workload (with --spec-bench: per category)")
    p.add_argument("--spec-bench", default=None, metavar="QUESTION_JSONL",
                   help="Spec-Bench's data/spec_bench/question.jsonl (fetch it yourself): its 13 categories as the "
                        "workloads (first turns), reported per category and per task as Spec-Bench's tables")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=8)
    p.add_argument("--out", default="verispec-bench", help="directory for the JSON, CSV, Markdown, PNG and HTML report")


def run_single_cli(args: argparse.Namespace) -> int:
    rep = run_single(model=args.model, dtype=args.dtype,
                     methods=[m for m in args.methods.split(",") if m], workloads=args.workloads.split(","),
                     limit=args.limit, repeats=args.repeats, max_tokens=args.max_tokens,
                     k=args.num_speculative_tokens, device=args.device or "cpu", quantization=args.quantization,
                     invariant=args.invariant, spec_bench=args.spec_bench)
    paths = write_report(rep, args.out)
    from verispec.bench.report import markdown_table

    for table in rep.tables:
        print(markdown_table(table))
    print("\n".join(f"> {n}" for n in rep.notes))
    print(f"report: {paths['html']}  (also {paths['md'].name}, {paths['json'].name}, {paths['csv'].name}, PNGs)")
    return 0
